"""The three shipped corpora, gathered from what the Python installation already carries.

Each corpus is a deterministic, sorted list of documents, so two machines with the same
installation build byte-identical token files, and a document is never split between the
train and validation sets (the split is decided per document by a hash of its name).

- `code`: Python standard-library sources (tests and site-packages excluded: they would
  double-count vendored code and vary between machines more than the stdlib does).
- `general`: English prose: module, class and function docstrings of the stdlib (read with
  `ast`, never imported) plus .txt/.rst/.md files and license texts found in site-packages.
- `math`: generated arithmetic problems with their answers, from a fixed seed.
"""

from __future__ import annotations

import ast
import os
import random
import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path

CORPORA = ("code", "general", "math")
_PROSE_SUFFIXES = (".txt", ".rst", ".md")
_PROSE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "README")
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(directory) / f for f in sorted(files) if f.endswith(".py"))
    return found


def _site_packages() -> list[Path]:
    roots = [*site.getsitepackages(), site.getusersitepackages()]
    return [Path(r) for r in roots if Path(r).is_dir()]


def _looks_like_prose(text: str) -> bool:
    """Keep mostly-ASCII text with enough letters and spaces: drops tables, data and binaries."""
    if len(text) < 200:
        return False
    sample = text[:4000]
    letters = sum(c.isalpha() or c == " " for c in sample)
    ascii_chars = sum(c.isascii() for c in sample)
    return letters / len(sample) > 0.7 and ascii_chars / len(sample) > 0.97


def iter_code() -> Iterator[tuple[str, bytes]]:
    for path in _stdlib_sources():
        try:
            yield f"stdlib/{path.name}:{path.parent.name}", path.read_bytes()
        except OSError:
            continue


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    texts = (ast.get_docstring(n) for n in nodes)
    return [t for t in texts if t and len(t) > 80]


def iter_general() -> Iterator[tuple[str, bytes]]:
    seen: set[str] = set()  # a docstring repeated in another module (asyncio's) is kept once
    for path in _stdlib_sources():
        try:
            docs = _docstrings(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        docs = [d for d in docs if d not in seen]
        seen.update(docs)
        if docs:
            yield f"docstrings/{path.parent.name}/{path.name}", "\n\n".join(docs).encode("utf-8")
    for root in _site_packages():
        for directory, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for name in sorted(files):
                if not (name.endswith(_PROSE_SUFFIXES) or name.upper().startswith(_PROSE_NAMES)):
                    continue
                path = Path(directory) / name
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if _looks_like_prose(text):
                    yield f"site/{path.relative_to(root)}", text.encode("utf-8")


def _arithmetic_problem(rng: random.Random) -> str:
    kind = rng.choice(("add", "sub", "mul", "div", "chain", "square"))
    a, b, c = rng.randint(0, 999), rng.randint(0, 999), rng.randint(1, 99)
    if kind == "add":
        return f"Q: What is {a} + {b}?\nA: {a + b}\n"
    if kind == "sub":
        return f"Q: What is {a} - {b}?\nA: {a - b}\n"
    if kind == "mul":
        return f"Q: What is {a % 100} * {b % 100}?\nA: {(a % 100) * (b % 100)}\n"
    if kind == "div":
        return f"Q: What is {a * c} / {c}?\nA: {a}\n"
    if kind == "chain":
        return f"Q: Compute {a} + {b} - {c}.\nA: {a} + {b} = {a + b}; {a + b} - {c} = {a + b - c}.\n"
    return f"Q: What is the square of {c}?\nA: {c * c}\n"


def arithmetic_question(rng: random.Random, largest: int = 999) -> tuple[str, str]:
    """One question of the math corpus's kinds that have a one-number answer, and that answer:
    the prompts of RL's verifiable rewards (huorn.runtime.rl.tasks). `largest` bounds the
    operands, for easier questions than the corpus's."""
    kind = rng.choice(("add", "sub", "mul", "div", "square"))
    a, b, c = rng.randint(0, largest), rng.randint(0, largest), rng.randint(1, min(99, max(1, largest)))
    if kind == "add":
        return f"What is {a} + {b}?", str(a + b)
    if kind == "sub":
        return f"What is {a} - {b}?", str(a - b)
    if kind == "mul":
        return f"What is {a % 100} * {b % 100}?", str((a % 100) * (b % 100))
    if kind == "div":
        return f"What is {a * c} / {c}?", str(a)
    return f"What is the square of {c}?", str(c * c)


def iter_math(documents: int = 2000, problems_per_document: int = 64,
              seed: int = 0) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    for index in range(documents):
        text = "".join(_arithmetic_problem(rng) for _ in range(problems_per_document))
        yield f"math/{index:05d}", text.encode("utf-8")


def iter_documents(corpus: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every document of `corpus`, in a fixed order."""
    if corpus == "code":
        return iter_code()
    if corpus == "general":
        return iter_general()
    if corpus == "math":
        return iter_math()
    raise ValueError(f"data source {corpus!r} is not a shipped corpus; use one of {CORPORA} or set its path")
