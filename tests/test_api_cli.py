"""`huorn validate`: what a user sees and the exit codes scripts rely on (0 valid, 2 invalid)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from api_support import ROOT, build_manifest
from typer.testing import CliRunner

from huorn.cli import main

EXAMPLES = ROOT / "examples"


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main.app, ["validate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_valid_examples_print_ok_and_exit_0() -> None:
    code, out, err = _invoke(*[str(p) for p in sorted(EXAMPLES.glob("*.yaml"))])
    assert code == 0, err
    assert f"{EXAMPLES / 'quickstart.yaml'}: TrainingJob/quickstart: ok" in out.splitlines()
    assert out.count(": ok") == 8 and err == ""


def test_an_invalid_manifest_exits_2_naming_file_kind_name_and_field() -> None:
    path = EXAMPLES / "invalid" / "elasticity-min-above-max.yaml"
    code, out, err = _invoke(str(path))
    assert code == 2 and out == ""
    assert err.strip() == (
        f"{path}: TrainingJob/elasticity-min-above-max: spec.elasticity.minReplicas: must be ≤ maxReplicas "
        "(3 > 2); set minReplicas to at most maxReplicas, or raise maxReplicas"
    )


def test_directories_recurse_and_one_bad_file_fails_the_run() -> None:
    code, out, err = _invoke(str(EXAMPLES))
    assert code == 2
    assert "quickstart.yaml: TrainingJob/quickstart: ok" in out
    assert len(err.strip().splitlines()) >= len(list((EXAMPLES / "invalid").glob("*.yaml")))


def test_a_huorn_kind_with_a_mistyped_group_is_invalid_and_another_groups_kind_is_skipped(
        tmp_path: Path) -> None:
    """`huron.io/v1alpha1` was skipped as "not a huorn.io resource" with exit 0, a CI gate's false
    pass for a manifest kubectl then refuses; SageMaker's TrainingJob is not ours to judge."""
    typos = ["huron.io/v1alpha1", "Huorn.io/v1alpha1", "huorn/v1alpha1", "v1alpha1", "hourn.io/v1alpha1"]
    documents = [{**build_manifest("TrainingJob", name=f"t{i}"), "apiVersion": av}
                 for i, av in enumerate(typos)]
    sagemaker = {**build_manifest("TrainingJob", name="sm"), "apiVersion": "sagemaker.aws.amazon.com/v1"}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([*documents, sagemaker]))
    code, out, err = _invoke(str(path))
    assert code == 2
    must = "apiVersion: must be huorn.io/v1alpha1"
    assert err.splitlines() == [f"{path}: TrainingJob/t{i}: {must} (got {av!r})"
                                for i, av in enumerate(typos)]
    assert out.splitlines() == [f"{path}: TrainingJob/sm: skipped (not a huorn.io resource)"]


def test_multi_document_files_and_foreign_documents(tmp_path: Path) -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}}
    path = tmp_path / "stack.yml"
    path.write_text(yaml.safe_dump_all([build_manifest("TrainingJob", name="a"), service,
                                        build_manifest("RLJob", name="b")]))
    code, out, _ = _invoke(str(tmp_path))
    assert code == 0
    assert out.splitlines() == [
        f"{path}: TrainingJob/a: ok",
        f"{path}: Service/web: skipped (not a huorn.io resource)",
        f"{path}: RLJob/b: ok",
    ]


def test_wrong_huorn_version_is_an_error_not_a_skip(tmp_path: Path) -> None:
    manifest = build_manifest("TrainingJob") | {"apiVersion": "huorn.io/v1"}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(manifest))
    code, _, err = _invoke(str(tmp_path / "old.yaml"))
    assert code == 2 and "apiVersion: must be huorn.io/v1alpha1" in err


def test_missing_paths_empty_directories_and_broken_yaml_exit_2(tmp_path: Path) -> None:
    assert _invoke(str(tmp_path / "nope.yaml"))[0] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _invoke(str(empty))
    assert code == 2 and "no *.yaml files" in err
    (tmp_path / "broken.yaml").write_text("spec: [\n")
    code, _, err = _invoke(str(tmp_path / "broken.yaml"))
    assert code == 2 and "not valid YAML" in err


def test_json_output_is_machine_readable() -> None:
    code, out, _ = _invoke("-o", "json", str(EXAMPLES / "quickstart.yaml"),
                           str(EXAMPLES / "invalid" / "glvq-without-bits.yaml"))
    assert code == 2
    records = json.loads(out)
    assert [(r["kind"], r["name"], r["status"]) for r in records] == [
        ("TrainingJob", "quickstart", "ok"), ("InferenceJob", "glvq-without-bits", "invalid")]
    assert records[1]["errors"][0]["path"] == "spec.quantization.bits"


def test_table_output_has_a_row_per_error() -> None:
    code, out, _ = _invoke("-o", "table", str(EXAMPLES / "quickstart.yaml"),
                           str(EXAMPLES / "invalid" / "slo-without-target.yaml"))
    assert code == 2
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:3] == ["FILE", "RESOURCE", "STATUS"]
    assert any("TrainingJob/quickstart" in row and "ok" in row for row in rows)
    assert any("invalid" in row and "spec.slo" in row for row in rows)


def test_yaml_output_and_bad_option_value() -> None:
    code, out, _ = _invoke("-o", "yaml", str(EXAMPLES / "rl-job.yaml"))
    assert code == 0 and yaml.safe_load(out)[0]["status"] == "ok"
    assert _invoke("-o", "xml", str(EXAMPLES / "rl-job.yaml"))[0] == 2


def test_the_installed_command_exits_2_on_invalid_input() -> None:
    """The real entry point, in a subprocess, as CI and users run it (one call: start-up is slow)."""
    huorn = Path(sys.executable).with_name("huorn")
    bad = EXAMPLES / "invalid" / "k-without-kfkb.yaml"
    args = [str(huorn), "validate", str(EXAMPLES / "quickstart.yaml"), str(bad)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stdout.endswith("TrainingJob/quickstart: ok\n") and "spec.parallelism.k: " in result.stderr


def test_files_without_documents_unnamed_or_not_utf8_exit_2_naming_the_problem(tmp_path: Path) -> None:
    """Each of these passed in silence (exit 0) or ended in a traceback."""
    (tmp_path / "empty.yaml").write_text("# nothing here yet\n---\n")
    code, out, err = _invoke(str(tmp_path / "empty.yaml"))
    assert code == 2 and out == "" and "empty.yaml: no YAML documents to validate" in err
    unnamed = build_manifest("TrainingJob")
    del unnamed["metadata"]
    (tmp_path / "unnamed.yaml").write_text(yaml.safe_dump(unnamed))
    code, _, err = _invoke(str(tmp_path / "unnamed.yaml"))
    assert code == 2 and "TrainingJob/<unnamed>: metadata.name: required field is missing; name the" in err
    generated = build_manifest("TrainingJob") | {"metadata": {"generateName": "sweep-"}}
    (tmp_path / "generated.yaml").write_text(yaml.safe_dump(generated))
    assert _invoke(str(tmp_path / "generated.yaml"))[0] == 0
    (tmp_path / "latin1.yaml").write_bytes("metadata: {name: caf\xe9}\n".encode("latin-1"))
    result = CliRunner().invoke(main.app, ["validate", str(tmp_path / "latin1.yaml")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "latin1.yaml: not UTF-8 text (byte 20); save the manifest as UTF-8 YAML" in result.stderr


def test_a_key_yaml_reads_as_a_date_is_named_and_the_other_files_still_judged(tmp_path: Path) -> None:
    """JSON keys are strings; an unquoted date key had crashed the run with a TypeError."""
    dated = tmp_path / "a-dated.yaml"
    dated.write_text(yaml.safe_dump(build_manifest("TrainingJob", name="a")).replace(
        "metadata:\n", "metadata:\n  annotations:\n    2024-01-01: release\n", 1))
    (tmp_path / "b-fine.yaml").write_text(yaml.safe_dump(build_manifest("TrainingJob", name="b")))
    code, out, err = _invoke(str(tmp_path))
    assert code == 2 and out.splitlines() == [f"{tmp_path / 'b-fine.yaml'}: TrainingJob/b: ok"]
    assert "metadata.annotations: key 2024-01-01 is a YAML date" in err
    assert 'quote it ("2024-01-01")' in err


def test_a_dash_reads_the_manifests_from_standard_input() -> None:
    """As kubectl's `-f -`: `helm template ... | huorn validate -`."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}}
    text = yaml.safe_dump_all([build_manifest("TrainingJob", name="a"), service])
    result = CliRunner().invoke(main.app, ["validate", "-"], input=text)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == ["-: TrainingJob/a: ok",
                                          "-: Service/web: skipped (not a huorn.io resource)"]
    inverted = {"elasticity": {"minReplicas": 3, "maxReplicas": 2}}
    bad = yaml.safe_dump(build_manifest("TrainingJob", inverted, "b"))
    result = CliRunner().invoke(main.app, ["validate", "-"], input=bad)
    assert result.exit_code == 2 and result.stderr.startswith("-: TrainingJob/b: spec.elasticity.minReplicas")


def test_what_the_operator_would_stall_as_invalid_spec_is_refused_naming_the_field(tmp_path: Path) -> None:
    """`huorn validate` said ok to specs the operator then Stalled as InvalidSpec: the checks of a
    spec alone that only the operator made (checkpoints off the job's volume, a role larger than
    its Ray worker pod) run here too."""
    training = yaml.safe_load((EXAMPLES / "training-job.yaml").read_text())
    training["spec"]["task"]["teacher"]["checkpoint"] = "/models/teacher-1b"
    rl_job = yaml.safe_load((EXAMPLES / "rl-job.yaml").read_text())
    rl_job["spec"]["roles"]["rollout"] = {"replicas": 1, "gpusPerReplica": 6}  # 8 GPUs still, pods of 4
    serving = yaml.safe_load((EXAMPLES / "inference-job.yaml").read_text())
    serving["spec"]["checkpoint"] = {"volume": "models", "path": "/models"}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([training, rl_job, serving]))
    code, out, err = _invoke(str(path))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{path}: TrainingJob/moe-distill: spec.task.teacher.checkpoint: "
                               "'/models/teacher-1b' is not on the checkpoint volume 'research-checkpoints'")
    assert lines[1].startswith(f"{path}: RLJob/dapo-math: spec.roles.rollout.gpusPerReplica: 6 exceeds "
                               "spec.resources.gpus (4)")
    assert lines[2].startswith(f"{path}: InferenceJob/chat: spec.model.checkpoint: '/checkpoints/")
    assert "copy the checkpoint onto that volume" in lines[2]


def test_a_kl_term_with_no_reference_replica_is_refused_before_the_gang(tmp_path: Path) -> None:
    """GRPO's preset has a KL term (0.04) since the algorithm fields lost their defaults, which had
    written klCoefficient 0: `reference.replicas: 0` under it passed validate and the operator,
    and the controller refused it only at its start, its gang placed."""
    rl_job = yaml.safe_load((EXAMPLES / "rl-job.yaml").read_text())
    rl_job["spec"]["algorithm"] = {"name": "grpo"}
    rl_job["spec"]["roles"]["reference"] = {"replicas": 0}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(rl_job))
    code, _, err = _invoke(str(path))
    assert code == 2 and "spec.roles.reference.replicas: 0, but spec.algorithm (grpo) has a KL term " \
        "(klCoefficient 0.04)" in err
    rl_job["spec"]["algorithm"] = {"name": "grpo", "klCoefficient": 0}
    path.write_text(yaml.safe_dump(rl_job))
    assert _invoke(str(path))[0] == 0


def test_remove_the_quotes_is_said_only_where_it_is_the_fix() -> None:
    from huorn.api import manifests

    def message(spec: dict) -> str:
        try:
            manifests.load_manifest(build_manifest("TrainingJob", spec))
        except manifests.ManifestError as error:
            return error.errors[0].message
        raise AssertionError("accepted")

    assert message({"priority": "4"}).endswith("(got '4', a YAML string); remove the quotes")
    assert message({"suspend": "true"}).endswith("(got 'true', a YAML string); remove the quotes")
    assert message({"suspend": "maybe"}).endswith("(got 'maybe')")
    assert message({"priority": "abc"}).endswith("(got 'abc')")
    assert message({"priority": "true"}).endswith("(got 'true')")  # unquoted, a boolean: not an integer
