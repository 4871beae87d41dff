"""Files that others read while they may be rewritten are swapped in whole (huorn.api.files): a
write cut short keeps the previous file, and a reader never sees a part of the new one."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from huorn import graph
from huorn.api import files, manifests
from huorn.backends.local import report
from huorn.graph import model
from huorn.runtime import serve

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_graph() -> model.Graph:
    return graph.compile(manifests.load_manifest(QUICKSTART))


def half_then_disk_full(self: Path, data: str, *args: object, **kwargs: object) -> int:
    """Path.write_text on a disk that fills half way through."""
    with open(self, "w") as handle:
        handle.write(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_report_cut_short_keeps_the_previous_runs_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report.write_report(tmp_path, build_graph(), "finished")
    before = {name: (tmp_path / name).read_bytes() for name in ("graph.json", "graph.png", "report.md")}
    monkeypatch.setattr(Path, "write_text", half_then_disk_full)
    with pytest.raises(OSError, match="No space left"):
        report.write_report(tmp_path, build_graph(), "interrupted")
    monkeypatch.undo()

    def half_a_picture(g: model.Graph, path: Path) -> Path:
        path.write_bytes(b"\x89PNG\r\n")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report.render, "render_png", half_a_picture)
    with pytest.raises(OSError, match="No space left"):
        report.write_report(tmp_path, build_graph(), "interrupted")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no scratch left


def test_a_rewrite_through_a_link_or_into_a_pipe_keeps_the_link_and_the_pipe(tmp_path: Path) -> None:
    """Renaming over a symlink would replace the link, and over /dev/stdout the device."""
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    files.write_text_atomically(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    os.mkfifo(tmp_path / "pipe")
    reader = os.open(tmp_path / "pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        files.write_text_atomically(tmp_path / "pipe", "through")
        assert os.read(reader, 100) == b"through" and not (tmp_path / "pipe").is_file()
    finally:
        os.close(reader)


async def test_serve_json_is_never_seen_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huorn run reads serve.json as soon as it exists: a poll between the server's create and its
    write read half a document, and huorn run ended in a JSONDecodeError traceback."""

    def slow_write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            time.sleep(0.5)
            handle.write(data[len(data) // 2:])
        return len(data)

    monkeypatch.setattr(Path, "write_text", slow_write_text)
    cfg = serve.ServeConfig.model_validate({
        "jobName": "chat", "host": "127.0.0.1", "port": 0, "runDir": str(tmp_path / "run"),
        "spec": {"virtualCluster": "local", "model": {"checkpoint": str(tmp_path / "none")}}})
    target = tmp_path / "run" / "serve.json"
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if target.exists():
                seen.append(target.read_text())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    serving = asyncio.create_task(serve.run_until_signal(web.Application(), cfg, "serve.json",
                                                         {"quantization": "none"}, "testing"))
    listening = False
    try:
        deadline = time.monotonic() + 30
        while not seen or not seen[-1].endswith("}"):
            assert time.monotonic() < deadline and not serving.done()
            await asyncio.sleep(0.05)
        # this coroutine runs again only once the server awaits its stop, its handlers set
        listening = True
    finally:
        if listening:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler stops the server
        else:  # no handler of the loop's yet: SIGTERM would end the test run itself
            serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        stop.set()
        watcher.join()
    assert all("port" in json.loads(text) for text in seen), [text for text in seen if not text.endswith("}")]


def test_a_rewritten_file_keeps_its_mode(tmp_path: Path) -> None:
    """A rewrite in place keeps a file's permissions; the rename of a fresh scratch file had reset
    a private report to the umask's (found by review)."""
    from huorn.api import files

    report = tmp_path / "report.json"
    report.write_text("{}")
    report.chmod(0o600)
    files.write_text_atomically(report, '{"new": 1}')
    assert report.read_text() == '{"new": 1}' and (report.stat().st_mode & 0o777) == 0o600
