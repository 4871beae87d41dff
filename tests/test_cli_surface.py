"""The CLI's surface is pinned: a command added by accident (or lost) fails here, as in
torchtitan. Listing help must stay cheap: it may not import torch, sklearn or kopf."""

import importlib
import subprocess
import sys

from typer.testing import CliRunner

from huorn.cli import main

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
                        (["--pod-start-seconds", "-1"], "--pod-start-seconds")):
        result = CliRunner().invoke(main.app, ["operator", "--kubeconfig", "/nonexistent", *args])
        assert result.exit_code == 2, (args, result.output)
        assert field in result.output, (args, result.output)
