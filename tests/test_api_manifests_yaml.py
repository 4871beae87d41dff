"""The YAML reader under `huorn validate`, `graph` and `run`: what YAML allows but no manifest
needs (aliases without end, aliases that multiply a file a millionfold) is refused with the
problem named, before any later step builds the document."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from api_support import ROOT
from typer.testing import CliRunner

from huorn.api import manifests
from huorn.cli import main

QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# 467 bytes that expand to 10^8 values: every later step (null pruning, JSON, the schema) walks
# the expansion, which took over a minute and 3.6 GB before it was refused.
LAUGHS = "apiVersion: huorn.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n"
LAUGHS += "a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n"
LAUGHS += "".join(f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 8))
LAUGHS += "spec: {steps: *a7}\n"


def _refusal(tmp_path: Path, text: str) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(manifests.ManifestError) as caught:
        list(manifests.read_documents(path))
    return str(caught.value)


def test_an_alias_inside_the_value_it_names_is_refused_not_recursed_into(tmp_path: Path) -> None:
    """`a: &a [*a]` is a list that holds itself: null pruning recursed into it until Python's
    stack ran out, and `huorn validate` printed a RecursionError traceback. Aliases as such are
    YAML, and kubectl takes them: an anchor used twice, or merged (`<<`), still loads."""
    message = _refusal(tmp_path, "kind: TrainingJob\nspec:\n  a: &a [1, *a]\n")
    assert message == (f"{tmp_path / 'm.yaml'}: line 3: the value anchored there holds an alias to "
                       "itself, so it never ends; write the value out instead of aliasing it inside itself")
    text = yaml.safe_dump(yaml.safe_load(QUICKSTART.read_text()))
    text = text.replace("metadata:\n", "labels: &labels {team: a}\nmetadata:\n", 1)
    text = text.replace("spec:\n", "spec:\n  extra: {<<: *labels, more: *labels}\n", 1)
    (tmp_path / "anchors.yaml").write_text(text)
    [loaded] = manifests.read_documents(tmp_path / "anchors.yaml")
    assert loaded["spec"]["extra"] == {"team": "a", "more": {"team": "a"}}


def test_aliases_that_expand_past_a_million_values_are_refused_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    message = _refusal(tmp_path, LAUGHS)
    assert time.monotonic() - started < 5
    assert "line 9: the value there holds more than 1,000,000 values once its aliases (*name) are " \
           "expanded, far more than any manifest; write the values out instead of aliasing them" in message


@pytest.mark.parametrize("command", ["validate", "graph", "run"])
def test_every_command_that_reads_a_manifest_exits_2_on_hostile_aliases(command: str, tmp_path: Path) -> None:
    (tmp_path / "recursive.yaml").write_text("a: &a [*a]\n")
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    for name, words in (("recursive.yaml", "holds an alias to itself"),
                        ("laughs.yaml", "more than 1,000,000 values")):
        extra = ["--run-dir", str(tmp_path / "run")] if command == "run" else []
        result = CliRunner().invoke(main.app, [command, str(tmp_path / name), *extra])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert words in result.stderr and "write the value" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_field_given_twice_is_refused_naming_its_path_and_lines(tmp_path: Path) -> None:
    """PyYAML kept the last `steps:` in silence, so `huorn validate` passed a file that kubectl
    apply's strict field validation refuses, and `huorn run` ran the second value. A key given
    again after a merge (`<<: *base`) still overrides the merged one, as YAML means."""
    text = QUICKSTART.read_text().replace("    steps: 300\n", "    steps: 300\n    steps: 5\n", 1)
    lines = text.splitlines()
    line = lines.index("    steps: 5") + 1
    (tmp_path / "dup.yaml").write_text(text)
    expected = (f"spec.optimization.steps: duplicate field (line {line}; first given on line {line - 1}); "
                "keep one of the two, as kubectl apply refuses a field given twice")
    for command in ("validate", "graph", "run"):
        extra = ["--run-dir", str(tmp_path / "run")] if command == "run" else []
        result = CliRunner().invoke(main.app, [command, str(tmp_path / "dup.yaml"), *extra])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert expected in result.stderr, (command, result.stderr)
    assert not (tmp_path / "run").exists()
    nested = "a: [{name: x}, {name: y, name: z}]\n"
    assert _refusal(tmp_path, nested).endswith("m.yaml: a[1].name: duplicate field (line 1; first given on "
                                               "line 1); keep one of the two, as kubectl apply refuses a "
                                               "field given twice")
    (tmp_path / "merged.yaml").write_text("base: &base {a: 1, b: 2}\nc: {<<: *base, b: 3}\n")
    [merged] = manifests.read_documents(tmp_path / "merged.yaml")
    assert merged["c"] == {"a": 1, "b": 3}


def test_a_document_nested_past_a_hundred_levels_is_refused_not_a_traceback(tmp_path: Path) -> None:
    """`a: [[[[...]]]]`, 3,000 deep: PyYAML's parser recursed until Python's stack ran out; 300
    deep, pydantic refused the JSON quoting the whole document."""
    for depth, line in ((3000, ""), (300, "line 1: ")):
        message = _refusal(tmp_path, "a: " + "[" * depth + "]" * depth + "\n")
        assert message.endswith(f"m.yaml: {line}nested more than 100 levels deep, far deeper than any "
                                "manifest; flatten the document"), message
    shallow = "a: " + "[" * 50 + "]" * 50 + "\n"
    (tmp_path / "shallow.yaml").write_text(shallow)
    assert list(manifests.read_documents(tmp_path / "shallow.yaml")) == [yaml.safe_load(shallow)]
