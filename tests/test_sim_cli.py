"""`huorn simulate`: report files, output formats, and exit code 2 with the column named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from huorn.cli.main import app

DATA = Path("/work/shared/data")
pytestmark = pytest.mark.skipif(not (DATA / "openb_pod_list_default.csv").exists(), reason="no shared trace")


def test_simulate_all_policies_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--policy", "all", "--seed", "2",
                                      "--output", str(out), "-o", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert set(report["policies"]) == {"fifo", "kueue", "pollux", "pollux-p-1", "pollux-p-1-fair", "huorn"}
    for metrics in report["policies"].values():
        assert metrics["jobs"] > 0
        assert 0 <= metrics["inference_slo_attainment"] <= 1
        assert metrics["jct_p50_s"] <= metrics["jct_p99_s"]
    assert "mean_jct_reduction_vs_best" in report["huorn_vs_baselines"]
    assert report["config"]["gpus"] == 16 and report["config"]["seed"] == 2  # what was measured
    for png in ("metrics.png", "timeline.png", "jct_cdf.png"):
        assert (out / png).stat().st_size > 1000
    printed = json.loads(result.stdout[result.stdout.index("{"):])
    assert printed["policies"]["huorn"]["jobs"] == report["policies"]["huorn"]["jobs"]


def test_malformed_trace_exits_2_naming_the_column(tmp_path: Path) -> None:
    bad = tmp_path / "pods.csv"
    bad.write_text("name,cpu_milli,num_gpu,qos,creation_time,deletion_time\np,1000,1,BE,0,10\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--gpus", "16", "--policy", "fifo",
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "gpu_milli" in result.output

    # A path longer than a terminal line: the error stays one line, whole, to copy or grep.
    deep = tmp_path / ("a-directory-with-a-long-name-" * 4)
    deep.mkdir()
    bad = deep / "pods.csv"
    bad.write_text("name,num_gpu,gpu_milli,qos,creation_time,deletion_time\np,one,1000,BE,0,10\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--gpus", "16", "--policy", "fifo",
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert f"error: {bad}:2: column 'num_gpu' must be a number, got 'one'\n" in result.output


def test_unknown_policy_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--policy", "lottery", "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert "--policy 'lottery'" in result.output


def test_yaml_output_and_single_policy(tmp_path: Path) -> None:
    import yaml

    args = ["simulate", "--gpus", "16", "--policy", "kueue", "--output", str(tmp_path), "-o", "yaml",
            "--qps-start", "beginning"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout[result.stdout.index("huorn_vs_baselines"):])
    assert list(doc["policies"]) == ["kueue"]
    assert doc["huorn_vs_baselines"] == {}  # nothing to compare without huorn


def test_job_lengths_can_be_declared_wrong_or_not_at_all(tmp_path: Path) -> None:
    """What Huorn's JCT terms read, made wrong or absent; the baselines read no declaration."""
    def run(*extra: str) -> dict:
        result = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--policy", "huorn", "--seed", "2",
                                          "--output", str(tmp_path), "-o", "json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout[result.stdout.index("{"):])["policies"]["huorn"]

    exact, unknown = run(), run("--undeclared-share", "1")
    assert json.loads((tmp_path / "report.json").read_text())["config"]["undeclared_share"] == 1.0
    assert exact["jobs"] == unknown["jobs"]
    assert exact["jct_mean_s"] != unknown["jct_mean_s"]
    for flag, value in (("--work-estimate-error", "-1"), ("--undeclared-share", "1.5")):
        args = ["simulate", "--policy", "huorn", flag, value, "--output", str(tmp_path)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and flag in result.output
