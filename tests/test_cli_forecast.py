"""`huorn forecast`: the prediction board replayed over request-rate history, from a CSV in the
GenAI QPS format and from Prometheus (tests/prometheus_api.py), against persistence."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import prometheus_api
import pytest
from typer.testing import CliRunner

from huorn.cli import main

DAY = 86400.0


def diurnal(t: float) -> float:
    return 55.0 - 45.0 * math.cos(2 * math.pi * (t % DAY) / DAY)


def write_qps(path: Path, days: float, containers: int = 3) -> Path:
    """Each container reports its share of the rate every 5 minutes, as in the GenAI trace."""
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["timestamp_anon", "container_ip", "value"])
        for i in range(int(days * DAY / 300)):
            for c in range(containers):
                writer.writerow([i * 300 + 7 * c, c, diurnal(i * 300) / containers])
    return path


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main.app, ["forecast", *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_board_covers_far_more_of_the_next_need_than_persistence(tmp_path: Path) -> None:
    qps = write_qps(tmp_path / "qps.csv", days=3)
    out_dir = tmp_path / "out"
    code, out, err = run("--qps", str(qps), "--requests-per-gpu", "2", "-o", "json", "-d", str(out_dir))
    assert code == 0, err
    report = json.loads(out)
    assert report["bins_fitted"] == 432 and report["bins_replayed"] == 432 - 2
    board, persistence = report["summary"]["board"], report["summary"]["persistence"]
    # while the rate rises the next 10 minutes need more than the rate now: persistence is short
    # through much of the morning (77 % covered: GPUs are whole, so a slow ramp is partly
    # covered), the board almost never (99.8 %)
    assert persistence["coverage"] < 0.8 and board["coverage"] > 0.95
    assert board["short_gpu_hours"] < persistence["short_gpu_hours"] / 10
    assert board["mean_idle_gpus"] < 3  # of 32 on average: not by reserving the peak all day
    assert json.loads((tmp_path / "out" / "forecast.json").read_text()) == report
    rows = list(csv.DictReader((tmp_path / "out" / "forecast.csv").open()))
    assert len(rows) == report["bins_replayed"]
    assert sum(int(r["board_gpus"]) >= int(r["need_gpus"]) for r in rows) / len(rows) == board["coverage"]
    assert (tmp_path / "out" / "forecast.png").stat().st_size > 10_000
    code, table, _ = run("--qps", str(qps), "--requests-per-gpu", "2")
    assert code == 0 and "430 bins replayed after fitting on 432" in table and "persistence" in table


def test_dash_reads_the_history_from_standard_input(tmp_path: Path) -> None:
    """As validate, graph, run and detect read `-`; forecast said "cannot read -"."""
    qps = write_qps(tmp_path / "qps.csv", days=2)
    from_file = run("--qps", str(qps), "--requests-per-gpu", "2", "-o", "json")
    result = CliRunner().invoke(main.app, ["forecast", "--qps", "-", "--requests-per-gpu", "2", "-o", "json"],
                                input="\ufeff" + qps.read_text())
    assert from_file[0] == result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(from_file[1])
    bad = CliRunner().invoke(main.app, ["forecast", "--qps", "-", "--requests-per-gpu", "2"],
                             input="timestamp_anon,value\n0,x\n")
    assert bad.exit_code == 2 and "-:2: timestamp_anon and value must be numbers" in bad.stderr


def test_the_history_can_come_from_prometheus() -> None:
    with prometheus_api.serve() as prometheus:
        prometheus.rate = diurnal
        code, out, err = run("--prometheus", prometheus.url, "--query", "sum(rate(requests_total[5m]))",
                             "--history", "2d", "--requests-per-gpu", "2", "-o", "yaml")
        assert code == 0, err
        assert "bins_replayed: " in out and "coverage" in out
        (query,) = prometheus.queries
        assert query["query"] == "sum(rate(requests_total[5m]))" and query["step"] == "300"
        assert float(query["end"]) - float(query["start"]) == pytest.approx(2 * DAY, abs=300)
        assert abs(float(query["end"]) - time.time()) < 60
        prometheus.fail = (400, "parse error")
        code, _, err = run("--prometheus", prometheus.url, "--query", "sum(", "--requests-per-gpu", "2")
        assert code == 2 and "Prometheus answered 400 to --query: parse error" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--requests-per-gpu", "2"], "either as --qps FILE or as --prometheus URL --query PROMQL"),
    (["--prometheus", "http://p:9090", "--requests-per-gpu", "2"], "--prometheus needs --query"),
    (["--qps", "QPS", "--requests-per-gpu", "0"], "--requests-per-gpu must be a finite number > 0, got 0"),
    (["--qps", "QPS", "--requests-per-gpu", "2", "--quantile", "0.3"], "must lie in [0.5, 0.99], got 0.3"),
    (["--qps", "QPS", "--requests-per-gpu", "2", "--train-share", "1"], "--train-share must lie in (0, 1)"),
    (["--qps", "SHORT", "--requests-per-gpu", "2"], "needs at least 36 bins"),
    (["--qps", "BAD", "--requests-per-gpu", "2"], "timestamp_anon,value"),
    (["--qps", "MISSING", "--requests-per-gpu", "2"], "cannot read"),
    (["--prometheus", "http://p:9090", "--query", "q", "--history", "2w", "--requests-per-gpu", "2"],
     "--history=2w: use a duration such as 7d"),
])
def test_bad_input_exits_2_and_names_the_option(tmp_path: Path, args: list[str], message: str) -> None:
    files = {"QPS": write_qps(tmp_path / "qps.csv", days=1), "SHORT": write_qps(tmp_path / "short.csv", 0.1),
             "MISSING": tmp_path / "missing.csv"}
    (tmp_path / "bad.csv").write_text("time,qps\n1,2\n")
    files["BAD"] = tmp_path / "bad.csv"
    code, _, err = run(*[str(files.get(a, a)) for a in args])
    assert code == 2 and message in err, err


def test_files_and_output_directories_are_named_with_the_fix(tmp_path: Path) -> None:
    """A short history named neither --qps nor the fix, a file not in UTF-8 only the codec, and an
    --output-dir that is a file raised FileExistsError after the board had been fitted."""
    qps = write_qps(tmp_path / "qps.csv", days=1)
    short = write_qps(tmp_path / "short.csv", 0.1)
    code, _, err = run("--qps", str(short), "--requests-per-gpu", "2")
    assert code == 2 and err.startswith(f"error: --qps {short}: history has 28 bins;"), err
    assert err.rstrip().endswith("bins of 5 minutes; give a longer history")
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes(b"timestamp_anon,value\n0,caf\xe9\n")
    code, _, err = run("--qps", str(latin1), "--requests-per-gpu", "2")
    assert code == 2 and f"error: {latin1}: not UTF-8 text (invalid continuation byte); the QPS" in err
    for bad in (qps, qps / "out"):
        code, out, err = run("--qps", str(qps), "--requests-per-gpu", "2", "-d", str(bad))
        assert code == 2 and out == "" and f"error: --output-dir {bad}: " in err, err
        assert "give a directory you can write" in err


@pytest.mark.parametrize(("row", "message"), [
    # float() reads these: a nan rate gave nonsense GPU counts, and exit 0
    ("300,1,nan", "value is 'nan'; it must be a finite number"),
    ("inf,1,5", "timestamp_anon is 'inf'; it must be a finite number"),
    ("600,1,-3", "value is -3; a request rate must be ≥ 0"),
    # milliseconds among seconds, or a typo: np.bincount allocated a bin per 5 minutes up to it
    ("1e18,1,5", "timestamp_anon 1000000000000000000 lies 1.157e+13 days from timestamp_anon 0 (line 2)"),
])
def test_a_qps_file_with_a_value_that_is_no_rate_is_refused_at_its_line(
    tmp_path: Path, row: str, message: str
) -> None:
    qps = write_qps(tmp_path / "qps.csv", days=1)
    rows = qps.read_text().splitlines()
    rows.insert(100, row)  # file line 101
    qps.write_text("\n".join(rows) + "\n")
    code, out, err = run("--qps", str(qps), "--requests-per-gpu", "2")
    assert code == 2 and out == "" and f"error: {qps}:101: {message}" in err, err
