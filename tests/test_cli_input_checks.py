"""Bad input to the CLI exits 2 naming the flag, file or field and the fix, before anything
starts or is written: found by a review that fed every command NaN, inf, stdin, lists and
directories that are not there."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from huorn.cli import main

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
