"""Writing a file so that a reader sees the old content or the new, never a part of the new one.

Reports, CRDs and the files a supervisor polls (a server's `serve.json`) are read by other
processes, or by the user after a crash, while they may be rewritten: a plain `write_text`
truncates first, so a reader in between, or a Ctrl-C, a full disk or a crash mid-write, leaves an
empty or half file where the previous one was. Here the bytes go to a scratch file beside the
target and a rename swaps it in, which POSIX makes atomic. It lives at the bottom of the layers
(huorn.api) so that every part of Huorn, the runtime included, may use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a scratch path to write instead of `path`; on a clean exit it replaces `path`, on an
    exception it is removed and `path` keeps its previous content.

    The scratch path keeps `path`'s suffix; pictures are saved with an explicit format all the
    same, since matplotlib would add a suffix to a path without one and write elsewhere.
    A symlink is followed, so that the file it points to is replaced rather than the link. A path
    that exists but is no regular file (`/dev/stdout`, a FIFO) is written in place: renaming over
    it would replace the device or pipe itself."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        yield path
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.stem}.{os.getpid()}.tmp{target.suffix}")
    try:
        yield scratch
        with contextlib.suppress(FileNotFoundError):  # the file keeps its mode, as a rewrite would
            os.chmod(scratch, stat.S_IMODE(target.stat().st_mode))
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str, encoding: str = "utf-8") -> Path:
    """`path.write_text(text)`, except that no reader ever sees a part of `text`."""
    with replacing(path) as scratch:
        scratch.write_text(text, encoding=encoding)
    return path
