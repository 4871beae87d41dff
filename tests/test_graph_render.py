"""DOT and PNG rendering, and the `huorn graph` command."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from huorn import graph
from huorn.cli import main
from huorn.graph import mutate, render

MANIFEST = {
    "apiVersion": "huorn.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "demo", "annotations": {"huorn.io/eval": "true"}},
    "spec": {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": 2}},
}


def write_manifest(tmp_path: Path, manifest: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_dot_names_every_vertex_edge_and_waiting_state() -> None:
    g = graph.compile(MANIFEST)
    mutate.resize(g, "trainer", 2, reason="grow")
    dot = render.render_dot(g)
    assert dot.startswith('digraph "demo" {') and dot.rstrip().endswith("}")
    assert '"rendezvous" -> "trainer"' in dot and '"trainer" -> "eval"' in dot
    assert "2 of 1..2" in dot and "eval (waiting)" in dot and "rounded,dashed" in dot
    assert "TrainingJob demo v2" in dot
    assert "\n\n" not in dot.split("{", 1)[1]  # labels use \\n escapes, one statement per line


def test_png_is_written_for_every_kind(tmp_path: Path) -> None:
    rl = {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "rl"},
        "spec": {"virtualCluster": "train", "roles": {"reward": {"replicas": 1}}},
    }
    for manifest in (MANIFEST, rl):
        out = render.render_png(graph.compile(manifest), tmp_path / f"{manifest['kind']}.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_cli_graph_prints_dot_and_writes_png(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, MANIFEST)
    runner = CliRunner()
    result = runner.invoke(main.app, ["graph", str(path)])
    assert result.exit_code == 0 and '"rendezvous" -> "trainer"' in result.stdout
    png = tmp_path / "g.png"
    result = runner.invoke(main.app, ["graph", str(path), "-o", "png", "--output", str(png)])
    assert result.exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    result = runner.invoke(main.app, ["graph", str(path), "-o", "json"])
    assert result.exit_code == 0 and '"summary"' in result.stdout


def test_cli_graph_bad_manifest_exits_2_naming_field(tmp_path: Path) -> None:
    bad = {**MANIFEST, "spec": {**MANIFEST["spec"], "elasticity": {"minReplicas": 1, "maxReplica": 2}}}
    result = CliRunner().invoke(main.app, ["graph", str(write_manifest(tmp_path, bad))])
    assert result.exit_code == 2
    assert "spec.elasticity.maxReplica" in result.stderr
