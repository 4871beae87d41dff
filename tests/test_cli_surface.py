"""The CLI's surface is pinned: a command added by accident (or lost) fails here, as in
torchtitan. Listing help must stay cheap: it may not import torch, sklearn or kopf."""

import importlib
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from huorn.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

EXPECTED = {"crds", "detect", "forecast", "graph", "operator", "run", "schedule", "simulate", "validate"}


def test_command_list_is_pinned() -> None:
    assert set(main.COMMANDS) == EXPECTED
    result = CliRunner().invoke(main.app, ["--help"])
    assert result.exit_code == 0
    for name in EXPECTED:
        assert f"  {name} " in result.output


def test_every_command_resolves_to_a_callable_with_help() -> None:
    for name, (module_name, function_name, _) in main.COMMANDS.items():
        function = getattr(importlib.import_module(f"huorn.cli.{module_name}"), function_name)
        assert callable(function), name
        result = CliRunner().invoke(main.app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "Usage:" in result.output


def test_options_name_what_they_take_not_their_python_type() -> None:
    """kubectl's help says `--namespace NAMESPACE`, `--replicas N`; ours said `<list[str]>` and
    `<int range>`, the annotation of the function behind the flag."""
    for name in EXPECTED:
        output = CliRunner().invoke(main.app, [name, "--help"]).output
        options = [line for line in output.splitlines() if line.lstrip().startswith("-")]
        assert not [line for line in options if "range>" in line or "list[" in line], (name, options)


def test_unknown_command_exits_2() -> None:
    result = CliRunner().invoke(main.app, ["frobnicate"])
    assert result.exit_code == 2


def test_help_and_validate_do_not_import_heavy_libraries() -> None:
    probe = (
        "import sys\n"
        "from huorn.cli import main\n"
        "try:\n"
        "    main.app(['validate', 'examples/quickstart.yaml'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "heavy = sorted(m for m in ('torch', 'sklearn', 'kopf', 'ray') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "HEAVY=\n" in result.stdout, result.stdout


def test_version_flag() -> None:
    result = CliRunner().invoke(main.app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("huorn ")


def test_operator_refuses_bad_flags_before_it_connects() -> None:
    for args, field in ((["-n", "a", "-A"], "--all-namespaces"),
                        (["--metrics-port", "70000"], "--metrics-port"),
                        (["--resync-seconds", "0"], "--resync-seconds"),
                        (["--pod-start-seconds", "-1"], "--pod-start-seconds"),
                        (["--priority", "5"], "--peering"),
                        (["--peering", "huorn", "-n", "a"], "-A")):
        result = CliRunner().invoke(main.app, ["operator", "--kubeconfig", "/nonexistent", *args])
        assert result.exit_code == 2, (args, result.output)
        assert field in result.output, (args, result.output)


def test_graph_and_run_say_what_is_wrong_with_the_file(tmp_path: Path) -> None:
    """One job per file: the message spoke of load_manifests (a Python function) behind an
    `<unknown kind>/<unnamed>` that named nothing; a file not in UTF-8 raised a traceback."""
    job = (EXAMPLES / "quickstart.yaml").read_text()
    (tmp_path / "two.yaml").write_text(job + "---\n" + job)
    (tmp_path / "none.yaml").write_text("---\n")
    (tmp_path / "latin1.yaml").write_bytes(b"kind: caf\xe9\n")
    for command in ("graph", "run"):
        for name, message in (("two.yaml", "holds 2 YAML documents; give a file with exactly one job"),
                              ("none.yaml", "holds no YAML document; give a file with exactly one job"),
                              ("latin1.yaml", "not UTF-8 text (byte 9); save the manifest as UTF-8")):
            result = CliRunner().invoke(main.app, [command, str(tmp_path / name)])
            assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
            assert f"error: {tmp_path / name}: {message}" in result.stderr, (command, result.stderr)


def test_output_paths_are_refused_before_any_work(tmp_path: Path) -> None:
    """A path that cannot be written exits 2 naming the flag, and nothing is written; these
    raised FileExistsError, IsADirectoryError or matplotlib's ValueError after the work."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    quickstart = str(EXAMPLES / "quickstart.yaml")
    cases = [
        (["graph", quickstart, "--output", str(tmp_path)], f"--output {tmp_path}: is a directory"),
        (["graph", quickstart, "--output", str(a_file / "g.dot")],
         f"--output {a_file / 'g.dot'}: {a_file} is a file, not a directory; give a file path"),
        (["graph", quickstart, "-o", "png", "--output", str(tmp_path / "g.dot")],
         "-o png writes a PNG; give a path ending in .png"),
        (["schedule", "-o", "png", "--file", str(tmp_path / "s")], "give a path ending in .png"),
        (["schedule", "-o", "png", "--file", str(a_file / "s.png")], f"--file {a_file / 's.png'}: "),
        (["crds", "--output-dir", str(a_file)], f"--output-dir {a_file}: is a file, not a directory"),
        (["run", quickstart, "--run-dir", str(a_file / "run")], f"--run-dir {a_file / 'run'}: {a_file} is"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main.app, args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (args, result.output)
        assert message in result.stderr, (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    target = tmp_path / "new" / "g.dot"  # a missing parent is made, as for -o png
    result = CliRunner().invoke(main.app, ["graph", quickstart, "--output", str(target)])
    assert result.exit_code == 0 and target.read_text().startswith("digraph")


def test_output_given_a_format_name_or_a_contradicting_suffix_is_refused(tmp_path: Path, monkeypatch) -> None:
    """In kubectl `--output json` is the format; here graph and simulate read --output as the
    path, so the habit wrote a file (or a directory) named json and exited 0, and DOT text went
    into g.png."""
    monkeypatch.chdir(tmp_path)
    quickstart = str(EXAMPLES / "quickstart.yaml")
    cases = [
        (["graph", quickstart, "--output", "json"], "--output json: --output is the path to write; for the "
                                                    "json format use -o json"),
        (["graph", quickstart, "--output", "g.png"], "--output g.png: a .png path with -o dot; add -o png"),
        (["simulate", "--output", "yaml"], "for the yaml format use -o yaml"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main.app, args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(main.app, ["graph", quickstart, "--output", str(tmp_path / "json")])
    assert result.exit_code == 0 and (tmp_path / "json").read_text().startswith("digraph")


def test_flags_the_chosen_mode_does_not_read_are_refused_not_ignored(tmp_path: Path) -> None:
    """Each of these had been accepted and silently dropped, the output not what was asked."""
    steps = tmp_path / "steps.csv"
    steps.write_text("iteration,worker,time\n0,a,0.1\n")
    qps = tmp_path / "qps.csv"
    qps.write_text("timestamp_anon,value\n0,1\n")
    cases = [
        (["detect", str(steps), "--json", "-o", "yaml"], "--json with -o yaml: choose one"),
        (["forecast", "--qps", str(qps), "--requests-per-gpu", "1", "--query", "rate(x[5m])"],
         "--query applies to --prometheus only, not to --qps"),
        (["forecast", "--qps", str(qps), "--requests-per-gpu", "1", "--history", "2d"],
         "--history applies to --prometheus only"),
        (["schedule", "--file", str(tmp_path / "s.png")], "--file applies to -o png only"),
        (["schedule", "-o", "png", "--file", str(tmp_path / "s.png"), "--lockstep"],
         "--lockstep applies to -o table and -o json"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main.app, args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qps.csv", "steps.csv"]


def test_detect_names_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    path.write_bytes(b"iteration,worker,time\n1,w\xff,1.0\n")
    result = CliRunner().invoke(main.app, ["detect", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"error: {path}: not UTF-8 text (byte 25): expected a CSV with header" in result.stderr


def test_operator_refuses_a_metrics_port_in_use_before_it_connects() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main.app, ["operator", "--kubeconfig", "/nonexistent",
                                               "--metrics-port", str(port)])
    assert result.exit_code == 2
    assert f"error: --metrics-port {port}: cannot listen there" in result.stderr and "or 0" in result.stderr


def test_operator_names_a_kubeconfig_that_is_not_there(tmp_path: Path) -> None:
    """The client's "No configuration found; pass --kubeconfig" was no fix to someone who had.
    A refused command leaves the process's logging alone: it once put a handler on the runner's
    captured stderr, and every later log line of the test process failed to write."""
    handlers = list(logging.root.handlers)
    for path, message in ((tmp_path / "nope", "no such file"), (tmp_path, "is a directory")):
        result = CliRunner().invoke(main.app, ["operator", "--kubeconfig", str(path)])
        assert result.exit_code == 2
        assert f"error: --kubeconfig {path}: {message}; give the path of a kubeconfig file" in result.stderr
    # from the environment, as kubectl reads it: the error names where it came from, not a flag
    result = CliRunner().invoke(main.app, ["operator"], env={"KUBECONFIG": str(tmp_path / "nope")})
    assert result.exit_code == 2 and f"error: $KUBECONFIG {tmp_path / 'nope'}: no such file" in result.stderr
    assert logging.root.handlers == handlers


@pytest.mark.parametrize(("args", "words"), [
    (["--stages", "100000"], "--stages 100000 is more than a pipeline has (at most 128"),
    (["--microbatches", "100000"], "--microbatches 100000 is more than this tool draws (at most 4096)"),
])
def test_schedule_sizes_past_a_real_pipeline_are_refused_not_computed_forever(
        args: list[str], words: str) -> None:
    result = CliRunner().invoke(main.app, ["schedule", *args])
    assert result.exit_code == 2 and words in result.output, result.output


def test_graph_where_it_cannot_write_exits_2_naming_the_path(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o png` without --output writes into the current directory, which was never checked: a
    read-only one ended in a PermissionError traceback. /proc refuses new files even to root, who
    writes into a directory of mode 555 (that case runs only where the mode holds)."""
    quickstart = str(EXAMPLES / "quickstart.yaml")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    places = [Path("/proc")] + ([read_only] if not os.access(read_only, os.W_OK) else [])
    for place in places:
        monkeypatch.chdir(place)
        result = CliRunner().invoke(main.app, ["graph", quickstart, "-o", "png"])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (place, result.output)
        assert "error: -o png (no --output: the current directory) quickstart-graph.png: " in result.stderr
        assert "give --output a" in result.stderr and result.stdout == ""
    result = CliRunner().invoke(main.app, ["graph", quickstart, "-o", "json", "--output", "/proc/g.json"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "error: --output /proc/g.json: " in result.stderr



def test_every_subcommands_help_shows_its_flags_whole_at_80_columns() -> None:
    """Subcommand help was drawn in rich's boxes, which cut `--replacement-backoff-seconds` to
    `--replacement-backoff-seco…` at 80 columns: a flag that cannot be copied or grepped. The top
    level's help was already plain."""
    for name in EXPECTED:
        result = CliRunner().invoke(main.app, [name, "--help"], terminal_width=80)
        assert result.exit_code == 0, (name, result.output)
        assert "…" not in result.output and "╭" not in result.output, (name, result.output)
    result = CliRunner().invoke(main.app, ["operator", "--help"], terminal_width=80)
    assert "  --replacement-backoff-seconds <float>\n" in result.output, result.output
    entrypoint = subprocess.run([sys.executable, "-m", "huorn.cli.operator", "--help"], capture_output=True,
                                text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert entrypoint.returncode == 0 and "  --replacement-backoff-seconds <float>\n" in entrypoint.stdout
