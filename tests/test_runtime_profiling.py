"""The serving replica's decode profile is written whole: its stop waits for the step under way."""

from __future__ import annotations

import pstats
import threading
import time
from pathlib import Path

from huorn.runtime import profiling


def last_call_of_the_step() -> None:
    pass


def test_the_profile_waits_for_the_step_the_decoding_thread_is_in(tmp_path: Path) -> None:
    """The replica's stop writes from the event loop while the decoding thread, told to stop,
    finishes its step: the step's last call (the batch's feed) was missing from the file."""
    profile = profiling.DecodeProfile(tmp_path)
    inside = threading.Event()

    def decode() -> None:
        with profile.decoding():
            inside.set()
            time.sleep(0.3)
            last_call_of_the_step()

    thread = threading.Thread(target=decode)
    thread.start()
    assert inside.wait(10)
    written = profile.write()
    thread.join()
    assert written is not None
    functions = {function for _, _, function in pstats.Stats(str(written)).stats}  # type: ignore[attr-defined]
    assert "last_call_of_the_step" in functions
