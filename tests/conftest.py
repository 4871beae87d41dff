"""Fixtures shared by several test areas."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests run beside other tests (scripts/test runs two workers), where a 200 ms deadline
# per example measures the neighbour's load, not the code.
settings.register_profile("huorn", deadline=None)
settings.load_profile("huorn")

PHASES = ("all", "parallel", "serial", "alone")
# How a module shows it holds tests of the serial (or alone) part; those parts import no other module.
SERIAL_MARK = "pytest.mark.serial"
ALONE_MARK = "pytest.mark.alone"
MODULE_MARKS = {"serial": SERIAL_MARK, "alone": ALONE_MARK}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase", choices=PHASES, default="all",
        help="which tests to run: those safe to run beside others (parallel), those that measure "
             "wall-clock behaviour beside at most one other such test (serial, marked `serial`), "
             "those that must have the machine to themselves (alone, marked `alone`), or all "
             "(default). scripts/test runs `-n 3 --phase parallel`, `-n 2 --phase serial`, then "
             "`--phase alone`.")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The serial part skips importing the modules that hold no serial test: importing all of them
    (torch, kopf, Ray's client, assertion rewriting) took the serial part 8-14 s before its first
    test. Text, not import, decides, so the parallel part checks (below) that no serial test sits
    in a module without the mark's text, where the serial part would never see it."""
    mark = MODULE_MARKS.get(config.getoption("--phase"))
    if (mark is not None and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and mark not in collection_path.read_text(encoding="utf-8")):
        return True
    return None


def _phase_of(item: pytest.Item) -> str:
    if item.get_closest_marker("alone") is not None:
        return "alone"
    return "serial" if item.get_closest_marker("serial") is not None else "parallel"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("--phase")
    if phase == "all":
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        own = _phase_of(item)
        mark = MODULE_MARKS.get(own)
        if phase == "parallel" and mark is not None and mark not in item.path.read_text(encoding="utf-8"):
            raise pytest.UsageError(f"{item.nodeid} is marked {own} without the text {mark!r} in its "
                                    f"module, so `--phase {own}` would not collect it; mark it with "
                                    f"@{mark} or pytestmark = {mark}")
        (keep if own == phase else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: on the loaded 2-core CI VM, two spin-waiting OpenMP threads make
    small models several times slower. Model tests opt in with `pytestmark`."""
    import torch  # here, not at the top: the xdist controller, which runs no test, needs no torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
