"""Bad input to the CLI exits 2 naming the flag, file or field and the fix, before anything
starts or is written: found by a review that fed every command NaN, inf, stdin, lists and
directories that are not there."""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from huorn.cli import main
from huorn.sim import workload

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def _invoke(*args: str, stdin: str | None = None):
    return CliRunner().invoke(main.app, list(args), input=stdin)


def test_a_document_that_is_a_list_or_a_scalar_gets_only_the_mapping_error(tmp_path: Path) -> None:
    """A list was told its metadata.name was missing before it was told it was no mapping: the
    first line sent the user looking for a field such a document cannot hold."""
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "scalar.yaml").write_text("hello\n")
    for name in ("list.yaml", "scalar.yaml"):
        result = _invoke("validate", str(tmp_path / name))
        assert result.exit_code == 2
        assert result.stderr == (f"{tmp_path / name}: a manifest must be a mapping with apiVersion, kind, "
                                 "metadata and spec\n")


def test_run_refuses_time_flags_that_are_not_finite_before_anything_starts(tmp_path: Path) -> None:
    """--interval inf passed its minimum (inf ≥ 0.1), started the trainers and then overflowed
    sleep(), leaving a traceback and a half-written run directory; NaN passed every minimum."""
    run_dir = tmp_path / "run"
    for args, message in ((["--interval", "inf"], "--interval must lie in [0.1, 3600], got inf"),
                          (["--interval", "nan"], "--interval must lie in [0.1, 3600], got nan"),
                          (["--interval", "7200"], "--interval must lie in [0.1, 3600], got 7200"),
                          (["--stall-timeout", "nan"], "--stall-timeout must be a finite number ≥ 10, "
                                                       "got nan"),
                          (["--serve-seconds", "inf"], "--serve-seconds must be a finite number ≥ 1, "
                                                       "got inf")):
        result = _invoke("run", str(QUICKSTART), "--run-dir", str(run_dir), "--no-watch", *args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (args, result.output)
        assert result.stderr == f"error: {message}\n", (args, result.stderr)
    assert not run_dir.exists()


def _float_flags() -> list[tuple[str, str]]:
    """(command, flag) for every float option of every subcommand, read from the functions, so
    that a float flag added later is covered without being listed here."""
    found = []
    for command, (module, function, _) in sorted(main.COMMANDS.items()):
        callback = getattr(importlib.import_module(f"huorn.cli.{module}"), function)
        hints = typing.get_type_hints(callback)
        for name, parameter in inspect.signature(callback).parameters.items():
            if hints.get(name) in (float, float | None):
                found.append((command, parameter.default.param_decls[0]))
    return found


FLOAT_FLAGS = _float_flags()


@pytest.mark.parametrize(("command", "flag"), FLOAT_FLAGS, ids=[f"{c} {f}" for c, f in FLOAT_FLAGS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_flag_refuses_nan_and_infinity_naming_the_flag(
    command: str, flag: str, value: str, tmp_path: Path
) -> None:
    """NaN passes any check written as a comparison (nan <= 0 is False): simulate
    --work-estimate-error nan hung, forecast --requests-per-gpu nan printed nonsense with exit 0,
    operator --resync-seconds nan was taken. Infinity passed every minimum. Each is refused with
    exit 2 before the command does any work, and nothing is written."""
    assert len(FLOAT_FLAGS) >= 16  # the review's count: a search that finds none passes nothing
    steptimes = tmp_path / "steps.csv"
    steptimes.write_text("iteration,worker,time\n1,w0,1.0\n")
    qps = tmp_path / "qps.csv"
    qps.write_text("timestamp_anon,value\n" + "".join(f"{300 * i},5\n" for i in range(400)))
    out = tmp_path / "out"
    base = {"run": [str(QUICKSTART), "--run-dir", str(out), "--no-watch"],
            "operator": ["--kubeconfig", str(tmp_path / "no-kubeconfig")],
            "simulate": ["--output", str(out)],
            "detect": [str(steptimes)],
            "forecast": ["--qps", str(qps), "--requests-per-gpu", "2", "--output-dir", str(out)]}[command]
    result = _invoke(command, *base, flag, value)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith(f"error: {flag} must "), result.stderr
    assert result.stderr.splitlines()[0].endswith(f"got {value}") or f"got {value};" in result.stderr
    assert not out.exists()


def test_simulate_refuses_a_load_the_trace_cannot_offer_naming_the_most_it_can(tmp_path: Path) -> None:
    """Compressing arrivals offers more load only up to a bound; past it the bisection returned its
    upper end, so --load 50 ran at the trace's most while report.json said 50. The most it names
    is a load the trace does reach; the default load out of a small trace's reach is noted."""
    pods = tmp_path / "pods.csv"
    pods.write_text("name,num_gpu,gpu_milli,qos,creation_time,deletion_time\n"
                    + "".join(f"p{i},1,1000,BE,{60 * i},{60 * i + 3600}\n" for i in range(500)))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu\nn0,8\nn1,8\n")
    qps = tmp_path / "qps.csv"
    qps.write_text("timestamp_anon,value\n" + "".join(f"{300 * i},5\n" for i in range(10)))  # too few
    out = tmp_path / "out"
    args = ["simulate", "--trace", str(pods), "--nodes", str(nodes), "--qps", str(qps), "--gpus", "16",
            "--policy", "fifo", "--output", str(out)]
    result = _invoke(*args, "--load", "50")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    match = re.fullmatch(rf"error: --load 50: {re.escape(str(pods))} offers a training load of at most (\S+) "
                         r"on 8 training GPUs \(every arrival at once\); give --load (\S+) or less\n",
                         result.stderr)
    assert match and match[1] == match[2], result.stderr
    assert not out.exists()
    most = float(match[1])
    jobs = workload.load_jobs(pods, 16, 8, most, seed=0)
    window = max(j.arrival for j in jobs)
    offered = sum(min(j.duration, window - j.arrival) * j.requested_gpus for j in jobs) / (8 * window)
    assert offered == pytest.approx(most, rel=0.02)
    result = _invoke(*args)  # the default 0.8, then the QPS series is refused
    assert result.exit_code == 2
    assert result.stderr.startswith(f"note: {pods} offers a training load of at most {match[1]} on 8 "
                                    "training GPUs, less than the default --load 0.8; simulating at that\n")


def test_detect_reads_the_step_table_from_standard_input_given_a_dash(tmp_path: Path) -> None:
    """`huorn validate -`, `graph -` and `run -` read standard input, as kubectl's `-f -`; detect
    looked for a file named "-" and said it could not be read."""
    rows = "".join(f"{i},w{w},{2.0 if w == 2 and i > 20 else 1.0}\n" for i in range(1, 41) for w in range(4))
    table = tmp_path / "steps.csv"
    table.write_text("iteration,worker,time\n" + rows)
    from_file = _invoke("detect", str(table), "-o", "json")
    from_stdin = _invoke("detect", "-", "-o", "json", stdin=table.read_text())
    assert from_stdin.exit_code == 0, from_stdin.output
    assert from_stdin.stdout == from_file.stdout and '"worker": "w2"' in from_stdin.stdout
    result = _invoke("detect", "-", stdin="x,y\n")
    assert result.exit_code == 2 and result.stderr.startswith("error: -: missing column(s) 'iteration'")


def test_crds_check_names_a_directory_or_files_that_are_not_there_not_stale_ones(tmp_path: Path) -> None:
    """`huorn crds --check -d nope` said each of the four CRDs was "out of date": a mistyped
    directory read as a stale checkout. It is bad input (exit 2); a file that is not there is
    called missing, one that differs out of date (exit 1 both)."""
    result = _invoke("crds", "--check", "-d", str(tmp_path / "nope"))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    nope = tmp_path / "nope"
    assert result.stderr == (f"error: --output-dir {nope}: no such directory; give the directory that holds "
                             f"the CRDs, or run `huorn crds --output-dir {nope}` to write them\n")
    assert not nope.exists()
    crds = tmp_path / "crds"
    assert _invoke("crds", "-d", str(crds)).exit_code == 0
    (crds / "rljobs.huorn.io.yaml").unlink()
    (crds / "trainingjobs.huorn.io.yaml").write_text("edited by hand\n")
    result = _invoke("crds", "--check", "-d", str(crds))
    assert result.exit_code == 1
    assert sorted(result.stderr.splitlines()) == sorted([
        f"{crds / 'rljobs.huorn.io.yaml'}: missing",
        f"{crds / 'trainingjobs.huorn.io.yaml'}: out of date",
        f"{crds}: 1 missing, 1 out of date; run `huorn crds --output-dir {crds}`"])
