"""Fixtures shared by several test areas."""

from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# Property tests run beside other tests (scripts/test runs two workers), where a 200 ms deadline
# per example measures the neighbour's load, not the code.
settings.register_profile("huorn", deadline=None)
settings.load_profile("huorn")

PHASES = ("all", "parallel", "serial")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase", choices=PHASES, default="all",
        help="which tests to run: those safe to run beside others (parallel), those that measure "
             "wall-clock behaviour and must run alone (serial, marked `serial`), or all (default). "
             "scripts/test runs `-n 2 --phase parallel`, then `--phase serial`.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("--phase")
    if phase == "all":
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        serial = item.get_closest_marker("serial") is not None
        (keep if serial == (phase == "serial") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: on the loaded 2-core CI VM, two spin-waiting OpenMP threads make
    small models several times slower. Model tests opt in with `pytestmark`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
