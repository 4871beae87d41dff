"""`huorn simulate`: report files, output formats, and exit code 2 with the column named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from huorn.cli.main import app
from huorn.sim import shared_data

DATA = shared_data.shared_data_dir()
pytestmark = pytest.mark.skipif(not (DATA / "openb_pod_list_default.csv").exists(), reason="no shared trace")


def test_simulate_all_policies_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--policy", "all", "--seed", "2",
                                      "--output", str(out), "-o", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert set(report["policies"]) == {"fifo", "kueue", "pollux", "pollux-p-1", "pollux-p-1-fair",
                                       "pollux-arrival", "pollux-p-1-arrival", "pollux-p-1-fair-arrival",
                                       "huorn"}
    for metrics in report["policies"].values():
        assert metrics["jobs"] > 0
        assert 0 <= metrics["inference_slo_attainment"] <= 1
        assert metrics["jct_p50_s"] <= metrics["jct_p99_s"]
    compared = report["huorn_vs_baselines"]
    assert "mean_jct_reduction_vs_best" in compared
    best = compared["best_baseline_by_saturated_goodput"]
    assert best != "huorn" and compared["saturated_goodput_vs_best"] == pytest.approx(
        report["policies"]["huorn"]["goodput_saturated_gpu_equiv"]
        / max(m["goodput_saturated_gpu_equiv"] for n, m in report["policies"].items() if n != "huorn"))
    assert report["config"]["gpus"] == 16 and report["config"]["seed"] == 2  # what was measured
    for png in ("metrics.png", "timeline.png", "jct_cdf.png"):
        assert (out / png).stat().st_size > 1000
    printed = json.loads(result.stdout[result.stdout.index("{"):])
    assert printed["policies"]["huorn"]["jobs"] == report["policies"]["huorn"]["jobs"]


def test_malformed_trace_exits_2_naming_the_column(tmp_path: Path) -> None:
    bad = tmp_path / "pods.csv"
    bad.write_text("name,cpu_milli,num_gpu,creation_time,deletion_time\np,1000,1,0,10\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--gpus", "16", "--policy", "fifo",
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "qos" in result.output

    # A path longer than a terminal line: the error stays one line, whole, to copy or grep.
    deep = tmp_path / ("a-directory-with-a-long-name-" * 4)
    deep.mkdir()
    bad = deep / "pods.csv"
    bad.write_text("name,num_gpu,gpu_milli,qos,creation_time,deletion_time\np,one,1000,BE,0,10\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--gpus", "16", "--policy", "fifo",
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert f"error: {bad}:2: column 'num_gpu' must be a finite number, got 'one'\n" in result.output
    bad.write_text("name,num_gpu,gpu_milli,qos,creation_time,deletion_time\np,inf,1000,BE,0,10\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--gpus", "16", "--policy", "fifo",
                                      "--output", str(tmp_path / "o")])
    assert result.exit_code == 2 and "column 'num_gpu' must be a finite number, got 'inf'" in result.output


def test_unknown_policy_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--policy", "lottery", "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert "--policy 'lottery'" in result.output


def test_the_table_keeps_every_name_and_number_whole(tmp_path: Path) -> None:
    """A pipe gave rich 80 columns, and it cut metric names and numbers to "…"."""
    result = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--policy", "pollux-p-1-fair",
                                      "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())["policies"]["pollux-p-1-fair"]
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["METRIC", "POLLUX-P-1-FAIR"] and "…" not in result.stdout
    rows = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert rows["inference_slo_attainment"] == f"{report['inference_slo_attainment']:.4g}"
    assert rows["jct_p99_s"] == f"{report['jct_p99_s']:.4g}"


def test_yaml_output_and_single_policy(tmp_path: Path) -> None:
    import yaml

    args = ["simulate", "--gpus", "16", "--policy", "kueue", "--output", str(tmp_path), "-o", "yaml",
            "--qps-start", "beginning"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout[result.stdout.index("huorn_vs_baselines"):])
    assert list(doc["policies"]) == ["kueue"]
    assert doc["huorn_vs_baselines"] == {}  # nothing to compare without huorn


def test_stderr_not_a_terminal_gets_plain_lines_and_no_bar(tmp_path: Path) -> None:
    """Written through rich, a path holding `[bold]` lost it as markup and a long one was wrapped
    at 80 columns, and a redirected stderr got the bar's last frame."""
    out = tmp_path / ("sim[bold]x-" + "long" * 20)
    result = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--policy", "kueue", "--output", str(out),
                                      "-o", "json"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'report.json'} and plots in {out}\n" in result.stderr
    assert "━" not in result.stderr and "0:00:" not in result.stderr


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


def test_bad_flags_and_paths_are_named_before_the_run(tmp_path: Path) -> None:
    """SimConfig's own names (gpus, inference_share) are not the flags a user types; an --output
    that is a file raised only after every policy had run; a trace not in UTF-8 named no file."""
    pods = tmp_path / "pods.csv"
    header = "name,num_gpu,gpu_milli,qos,creation_time,deletion_time\n"
    pods.write_text(header + "".join(f"p{i},1,1000,BE,{60 * i},{60 * i + 3600}\n" for i in range(500)))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu\nn0,8\nn1,8\n")
    qps = tmp_path / "qps.csv"
    qps.write_text("timestamp_anon,value\n" + "".join(f"{300 * i},5\n" for i in range(10)))
    base = ["simulate", "--trace", str(pods), "--nodes", str(nodes), "--qps", str(qps), "--policy", "fifo",
            "--gpus", "16"]
    for extra, message in ((["--gpus", "-8"], "error: --gpus must be ≥ 8, got -8"),
                           (["--inference-share", "2"], "error: --inference-share must lie in (0, 1)"),
                           (["--qps-start", "end"], "error: --qps-start must be middle or beginning"),
                           (["--output", str(pods)], f"error: --output {pods}: is a file, not a directory"),
                           (["--trace", str(tmp_path)], f"error: --trace {tmp_path}: is a directory")):
        result = CliRunner().invoke(app, [*base, "--output", str(tmp_path / "out"), *extra])
        assert result.exit_code == 2 and message in result.stderr, (extra, result.stderr)
    result = CliRunner().invoke(app, [*base, "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"error: {qps}: 10 bins of request rate are too few" in result.stderr, result.stderr
    pods.write_bytes(header.encode() + b"p\xe9,1,1000,BE,0,10\n")
    result = CliRunner().invoke(app, [*base, "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and f"error: {pods}: not UTF-8 text" in result.stderr, result.stderr
    # refused before any policy's progress bar was drawn (one at 0 % used to stand above the error)
    assert result.stderr.startswith("error:"), result.stderr
    assert not (tmp_path / "out").exists()


def test_the_shared_data_directory_follows_huorn_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(shared_data.ENV, str(tmp_path))
    assert shared_data.shared_data_dir() == tmp_path
    monkeypatch.delenv(shared_data.ENV)
    assert (shared_data.shared_data_dir() / "openb_pod_list_default.csv").is_file()
