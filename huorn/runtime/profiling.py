"""A serving replica's decoding loop under cProfile, where `HUORN_SERVE_PROFILE` names a directory.

Between two decoding steps a replica spends time the device does not see: choosing tokens,
admitting, seating prefills, handing answers to the event loop. On a GPU whose steps replay as
CUDA graphs that time decides the throughput, and only a profile of the running replica, under a
real request stream, shows where it goes (vLLM's VLLM_TORCH_PROFILER_DIR serves the same need).
Off unless the variable is set: cProfile slows the code it watches.

The profile covers the decoding thread while it decodes (on Python 3.12 and later cProfile
watches every thread while it is on, so the event loop's work during decoding shows too); it is
written as `decode-<pid>.prof` when the replica stops, for `python -m pstats` or snakeviz.
"""

from __future__ import annotations

import cProfile
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "HUORN_SERVE_PROFILE"


class DecodeProfile:
    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = Path(directory) if directory else None
        self.profile = cProfile.Profile() if self.directory else None
        # held while the decoding thread decodes: the replica's stop writes the profile from the
        # event loop, and the thread, told to stop, may still be inside a step
        self._decoding = threading.Lock()

    @classmethod
    def from_env(cls) -> DecodeProfile:
        return cls(os.environ.get(ENV))

    @contextmanager
    def decoding(self) -> Iterator[None]:
        if self.profile is None:
            yield
            return
        with self._decoding:
            self.profile.enable()
            try:
                yield
            finally:
                self.profile.disable()

    def write(self) -> Path | None:
        """The profile so far, to the directory, once no step is under way (a step cut in two
        left its last calls out of the file); None when profiling is off."""
        if self.profile is None or self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"decode-{os.getpid()}.prof"
        with self._decoding:
            self.profile.dump_stats(path)
        return path
