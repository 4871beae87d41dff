"""Build step: turn each corpus into `train.bin` / `val.bin` token files in a cache outside git.

    python -m huorn.runtime.data.build [--out DIR] [--corpus code --corpus math] [--max-mib 8]

The default directory is $HUORN_DATA_DIR, else ~/.cache/huorn/data. A build is idempotent (a
corpus whose meta.json records the same build parameters is left alone) and atomic: files are
written into a hidden temporary directory that is renamed into place only when complete, so a
killed build, or several trainer ranks building at once, never expose a half-written corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

from huorn.runtime.data import corpora

# 2: the split by what a document is (its stdlib file, else its bytes), byte-identical documents
# kept once (2026-12-07)
BUILD_VERSION = 2
DEFAULT_MAX_BYTES = 8 << 20
VALIDATION_PERCENT = 5
_SEPARATOR = b"\n\n"


def default_data_dir() -> Path:
    return Path(os.environ.get("HUORN_DATA_DIR") or Path.home() / ".cache" / "huorn" / "data")


# Families of near-copies that no per-document split keeps apart: the licences packages vendor
# (one Apache or MIT text with other names in it) and the standard library's generated codec
# tables (one table with other code points). They train, and are never held out.
_LICENCE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
_TRAIN_ONLY_STDLIB = ("encodings",)


def split_key(name: str, digest: bytes) -> bytes | None:
    """What decides a document's split: the standard-library file it comes from, which the code
    corpus holds whole and the general one as its docstrings, so that both corpora hold out the
    same files; any other document's bytes (`digest`, their SHA-256), so that copies fall on one
    side; None for a family of near-copies, which only trains. By name, a held-out general
    document was in code's training data verbatim, copies split apart, and 97 % of the windows
    DDK and D-CPT steer by (and a third of those the evaluation reads) were in the training data."""
    if name.startswith("stdlib/"):  # stdlib/<file>:<dir>
        file, _, directory = name.removeprefix("stdlib/").rpartition(":")
        return None if directory in _TRAIN_ONLY_STDLIB else f"stdlib:{directory}/{file}".encode()
    if name.startswith("docstrings/"):  # docstrings/<dir>/<file>
        directory, _, file = name.removeprefix("docstrings/").partition("/")
        return None if directory in _TRAIN_ONLY_STDLIB else f"stdlib:{directory}/{file}".encode()
    parts = name.split("/")
    if any(part.upper().startswith(_LICENCE_NAMES) or part.lower() == "licenses" for part in parts):
        return None
    return digest


def _is_validation(key: bytes | None) -> bool:
    """Per-document split by a stable hash, so adding files elsewhere never moves a document."""
    return key is not None and zlib.crc32(key) % 100 < VALIDATION_PERCENT


def _build_params(corpus: str, max_bytes: int) -> dict:
    return {"version": BUILD_VERSION, "corpus": corpus, "max_bytes": max_bytes,
            "validation_percent": VALIDATION_PERCENT}


def read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _write_corpus(corpus: str, max_bytes: int, target: Path) -> dict:
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    documents = {"train": 0, "val": 0}
    val_budget = max(max_bytes * VALIDATION_PERCENT // 100, 1 << 16)
    seen: set[bytes] = set()  # byte-identical documents are kept once
    for name, payload in corpora.iter_documents(corpus):
        digest = hashlib.sha256(payload).digest()
        if digest in seen:
            continue
        seen.add(digest)
        split = "val" if _is_validation(split_key(name, digest)) else "train"
        budget = val_budget if split == "val" else max_bytes
        if sizes[split] >= budget:
            if sizes["train"] >= max_bytes and sizes["val"] >= val_budget:
                break
            continue
        chunk = payload[: budget - sizes[split]] + _SEPARATOR
        parts[split].append(chunk)
        sizes[split] += len(chunk)
        documents[split] += 1
    meta = _build_params(corpus, max_bytes)
    for split, chunks in parts.items():
        data = b"".join(chunks)
        if len(data) < 1024:
            raise RuntimeError(f"corpus {corpus!r} found only {len(data)} bytes for its {split} split; "
                               "this Python installation carries too little text for it")
        (target / f"{split}.bin").write_bytes(data)
        meta[split] = {"tokens": len(data), "documents": documents[split],
                       "sha256": hashlib.sha256(data).hexdigest()}
    (target / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def ensure_corpus(corpus: str, data_dir: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Directory of a built corpus, building it first when missing or built with other parameters."""
    root = Path(data_dir) if data_dir else default_data_dir()
    target = root / corpus
    expected = _build_params(corpus, max_bytes)
    meta = read_meta(target)
    if meta is not None and all(meta.get(k) == v for k, v in expected.items()):
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{corpus}-", dir=root))
    scratch.chmod(0o755)  # mkdtemp makes it private; other users of a shared cache must read it
    try:
        _write_corpus(corpus, max_bytes, scratch)
        if target.exists():
            # NB: a stale build (other parameters) is moved aside first; os.rename cannot replace a
            # non-empty directory, and readers must never see a mix of old and new files.
            stale = Path(tempfile.mkdtemp(prefix=f".old-{corpus}-", dir=root))
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, stale / corpus)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(scratch, target)
        except OSError:
            # Another process renamed its identical build into place first: theirs is as good.
            if read_meta(target) is None:
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.data.build",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="cache directory (default $HUORN_DATA_DIR "
                        "or ~/.cache/huorn/data)")
    parser.add_argument("--corpus", action="append", choices=corpora.CORPORA, help="repeatable; default all")
    parser.add_argument("--max-mib", type=float, default=DEFAULT_MAX_BYTES / (1 << 20),
                        help="train-split size cap per corpus in MiB (default 8)")
    args = parser.parse_args(argv)
    if args.max_mib <= 0:
        parser.error("--max-mib must be positive, e.g. --max-mib 8")
    max_bytes = int(args.max_mib * (1 << 20))
    for corpus in args.corpus or corpora.CORPORA:
        path = ensure_corpus(corpus, args.out, max_bytes)
        meta = read_meta(path) or {}
        print(f"{corpus}: {path} train={meta['train']['tokens']} val={meta['val']['tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
