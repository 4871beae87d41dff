"""`huorn schedule` prints the executor's own tables (the same actions, peaks and makespan as
huorn.runtime.pipeline.schedules), draws them, and refuses bad flags with exit 2 naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from huorn.cli import main
from huorn.runtime.pipeline import schedules


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main.app, ["schedule", *args])
    return result.exit_code, result.output


def test_table_shows_each_stage_with_its_peak_and_the_makespan() -> None:
    code, out = invoke("--stages", "4", "--microbatches", "8", "--schedule", "kfkb", "-k", "2")
    assert code == 0, out
    table = schedules.build_schedule("kfkb", 4, 8, 2)
    peaks = schedules.count_in_flight(table)
    assert peaks == (8, 6, 4, 2)
    for stage, row in enumerate(table.table):
        assert f"stage {stage} (holds up to {peaks[stage]}): " + " ".join(map(str, row)) in out
    timeline = schedules.simulate_timeline(table)
    assert f"makespan {max(end for row in timeline for _, _, end in row):g} units" in out


def test_json_carries_the_table_and_the_lockstep_exchanges() -> None:
    code, out = invoke("-s", "2", "-m", "3", "--lockstep", "-o", "json")
    assert code == 0, out
    data = json.loads(out)
    assert data["table"] == [["F0", "F1", "B0", "F2", "B1", "B2"], ["F0", "B0", "F1", "B1", "F2", "B2"]]
    assert data["lockstepExchanges"][0][2] == ["send F1 → stage 1", "recv B0 ← stage 1"]
    assert data["peakInFlight"] == [2, 1]


def test_png_is_drawn_to_the_file(tmp_path: Path) -> None:
    target = tmp_path / "table.png"
    code, out = invoke("-s", "3", "-m", "6", "--schedule", "gpipe", "-o", "png", "--file", str(target))
    assert code == 0, out
    assert target.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("args", "message"), [
    (("--stages", "0"), "--stages must be >= 1"),
    (("--microbatches", "0"), "--microbatches must be >= 1"),
    (("--schedule", "zigzag"), "--schedule must be one of gpipe, 1f1b, kfkb"),
    (("-k", "3"), "--k applies to --schedule kfkb only"),
    (("-o", "png"), "-o png needs --file"),
    (("-s", "4", "-m", "16", "--schedule", "kfkb", "-k", "5", "--lockstep"), "cannot run in lockstep"),
])
def test_bad_flags_exit_2_naming_the_flag(args: tuple[str, ...], message: str) -> None:
    code, out = invoke(*args)
    assert code == 2
    assert message in out
