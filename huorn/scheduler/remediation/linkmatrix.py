"""Tell a bad node or NIC from a bad link with a per-connection latency matrix (C4).

Cell (i, j) is the latency of connection i → j (a probe or the same-volume collective traffic).
A bad NIC or node slows every connection it takes part in, so its whole row or column is slow;
a bad cable or switch port slows one connection only, a single cell (and its mirror when the
probe is a round trip). Judging cells against the healthy latency (the median of row medians)
with FALCON's 1.1× bound for equal-volume communication needs no per-cluster latency target;
on a shared host's loopback, where jitter alone reaches 2-4×, pass a looser ratio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class LinkFinding:
    kind: str  # node | link
    ranks: tuple[int, ...]  # (node,) or (i, j)
    ratio: float  # median latency of the bad cells over the median of all cells


def _check(matrix: Sequence[Sequence[float]]) -> np.ndarray:
    m = np.array(matrix, dtype=float)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 3:
        raise ValueError(f"latency matrix: need a square matrix of at least 3 ranks, got shape {m.shape}")
    np.fill_diagonal(m, np.nan)
    if np.any(m[~np.isnan(m)] <= 0):
        raise ValueError("latency matrix: latencies must be > 0 (use NaN for an unmeasured connection)")
    return m


def locate_bad_links(
    matrix: Sequence[Sequence[float]], ratio: float = 1.1, line_fraction: float = 0.5
) -> list[LinkFinding]:
    """Return bad nodes (rows/columns with ≥ line_fraction slow cells) and then the bad links
    that no bad node explains. NaN cells (the diagonal, unmeasured pairs) are ignored."""
    m = _check(matrix)
    # NB: with few ranks a bad node owns a large share of the cells (6 of 12 with 4 ranks), so
    # the median of all cells is not the healthy latency. A row's median is healthy unless the
    # row's own node is bad, so the median of row medians is.
    median = float(np.median(np.nanmedian(m, axis=1)))
    with np.errstate(invalid="ignore"):
        slow = m > ratio * median
    measured = ~np.isnan(m)
    findings: list[LinkFinding] = []
    bad_nodes: set[int] = set()
    for i in range(m.shape[0]):
        row = slow[i, :].sum() / max(measured[i, :].sum(), 1)
        col = slow[:, i].sum() / max(measured[:, i].sum(), 1)
        if max(row, col) >= line_fraction and slow[i, :].sum() + slow[:, i].sum() >= 2:
            bad_nodes.add(i)
            cells = np.concatenate([m[i, :][slow[i, :]], m[:, i][slow[:, i]]])
            findings.append(LinkFinding("node", (i,), float(np.median(cells)) / median))
    seen: set[tuple[int, int]] = set()
    for i, j in zip(*np.nonzero(slow), strict=True):
        link = (int(min(i, j)), int(max(i, j)))
        if i in bad_nodes or j in bad_nodes or link in seen:
            continue
        seen.add(link)
        findings.append(LinkFinding("link", link, float(m[i, j]) / median))
    return findings
