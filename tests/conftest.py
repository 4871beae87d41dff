"""Fixtures shared by several test areas."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: on the loaded 2-core CI VM, two spin-waiting OpenMP threads make
    small models several times slower. Model tests opt in with `pytestmark`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
