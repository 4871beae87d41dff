"""Loading manifests: the examples, the invalid examples (each names its field), load_manifest's
contract for the runner and operator, and the quantity and duration parsers."""

from __future__ import annotations

import re
from pathlib import Path

import hypothesis.strategies as st
import pytest
import yaml
from api_support import ROOT, build_manifest, crd_errors
from hypothesis import given

from huorn.api import base, kinds, manifests

EXAMPLES = ROOT / "examples"
VALID = sorted(EXAMPLES.glob("*.yaml"))
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))


def _expected_path(path: Path) -> str:
    match = re.search(r"^# expect: (\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path} lacks a '# expect: <field path>' line"
    return match.group(1)


def test_there_is_one_valid_example_per_kind_and_enough_invalid_ones() -> None:
    kinds_seen = {doc["kind"] for path in VALID for doc in yaml.safe_load_all(path.read_text())}
    assert kinds_seen == set(kinds.KINDS)
    assert len(INVALID) >= 10



@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_an_example_with_gpus_runs_a_cuda_build(path: Path) -> None:
    """A job with GPUs asks its trainers for cuda (a CPU-only torch refuses to start): the
    TrainingJob example named the CPU build and crash-looped (found by review)."""
    for document in yaml.safe_load_all(path.read_text()):
        spec = document.get("spec") or {}
        image = spec.get("image")
        if image is not None and int((spec.get("resources") or {}).get("gpus", 1)) > 0:
            assert image.endswith("-cu126"), f"{path.name}: {image} is not a CUDA build"

@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_valid_examples_load_and_pass_the_crd(path: Path) -> None:
    documents = list(yaml.safe_load_all(path.read_text()))
    for loaded, document in zip(manifests.load_manifests(path), documents, strict=True):
        assert not isinstance(loaded, manifests.ManifestError), str(loaded)
        assert crd_errors(document["kind"], document) == []


def test_quickstart_is_what_the_local_runner_expects() -> None:
    job = manifests.load_manifest(EXAMPLES / "quickstart.yaml")
    assert isinstance(job, kinds.TrainingJob) and job.metadata.name == "quickstart"
    spec = job.spec
    assert (spec.virtual_cluster, spec.resources.gpus, spec.resources.cpu, spec.resources.memory) == (
        "local", 0, "1", "2Gi")
    model = spec.model
    assert (model.layers, model.width, model.heads, model.vocabulary, model.context) == (4, 128, 4, 256, 128)
    assert spec.model.kv_sharing == "fusedkv"
    elastic = spec.elasticity
    assert (elastic.min_replicas, elastic.max_replicas, elastic.policy) == (1, 2, "goodput")
    opt = spec.optimization
    assert (opt.global_batch, opt.micro_batch, opt.steps, opt.learning_rate) == (16, 4, 300, 3e-3)
    assert (spec.checkpoint.path, spec.checkpoint.interval_steps) == ("./checkpoints", 25)
    assert [s.name for s in spec.data.sources] == ["code", "general", "math"]


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_examples_fail_naming_their_field(path: Path) -> None:
    expected = _expected_path(path)
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(path)
    assert expected in [error.path for error in caught.value.errors], str(caught.value)
    assert f"{path}: " in str(caught.value)
    document = yaml.safe_load(path.read_text())
    assert crd_errors(document["kind"], document), "the API server would have accepted it"


def test_load_manifest_round_trips_through_the_wire_form() -> None:
    job = manifests.load_manifest(EXAMPLES / "training-job.yaml")
    wire = {"apiVersion": job.api_version, "kind": job.kind, "metadata": {"name": job.metadata.name},
            "spec": job.spec.to_wire()}
    assert manifests.load_manifest(wire).spec == job.spec


def test_load_manifest_prunes_nulls_as_the_server_does() -> None:
    manifest = build_manifest("TrainingJob", {"elasticity": {"minReplicas": None}, "priority": None})
    job = manifests.load_manifest(manifest)
    assert job.spec.elasticity.min_replicas == 1 and job.spec.priority == 50


def test_load_manifest_is_strict_about_types_like_the_server() -> None:
    with pytest.raises(manifests.ManifestError, match=r"spec\.priority: .*valid integer"):
        manifests.load_manifest(build_manifest("TrainingJob", {"priority": "7"}))
    with pytest.raises(manifests.ManifestError, match=r"spec\.remediation\.failSlowDetection"):
        manifests.load_manifest(build_manifest("TrainingJob", {"remediation": {"failSlowDetection": "yes"}}))
    job = manifests.load_manifest(build_manifest("TrainingJob", {"resources": {"cpu": 2}}))
    assert job.spec.resources.cpu == "2", "an integer quantity is an int-or-string, as in Kubernetes"


def test_manifest_error_lists_every_field_at_fault() -> None:
    manifest = build_manifest("TrainingJob", {"priority": -1, "resources": {"memory": "lots"}, "typo": 1},
                              name="two-bad")
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(manifest, origin="job.yaml")
    error = caught.value
    assert {e.path for e in error.errors} == {"spec.priority", "spec.resources.memory", "spec.typo"}
    assert (error.kind, error.name, error.subject) == ("TrainingJob", "two-bad", "TrainingJob/two-bad")
    assert str(error).splitlines()[0].startswith("job.yaml: TrainingJob/two-bad: spec.")


@pytest.mark.parametrize(
    ("body", "path", "words"),
    [
        ({"apiVersion": "huorn.io/v1", "kind": "TrainingJob", "spec": {}}, "apiVersion", "huorn.io/v1alpha1"),
        ({"apiVersion": "huorn.io/v1alpha1", "kind": "Job", "spec": {}}, "kind", "TrainingJob"),
        ({"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "Bad_Name"},
          "spec": {"virtualCluster": "local"}}, "metadata.name", "DNS label"),
        ({"apiVersion": "huorn.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"}, "spec": {}},
         "spec.virtualCluster", "required"),
    ],
)
def test_envelope_errors_name_the_field(body: dict, path: str, words: str) -> None:
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(body)
    assert [e.path for e in caught.value.errors] == [path] and words in str(caught.value)


def test_load_manifest_from_files(tmp_path: Path) -> None:
    two = tmp_path / "two.yaml"
    two.write_text((EXAMPLES / "virtual-cluster.yaml").read_text())
    with pytest.raises(manifests.ManifestError, match="expected one YAML document, found 3"):
        manifests.load_manifest(two)
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [unclosed\n")
    with pytest.raises(manifests.ManifestError, match="not valid YAML"):
        manifests.load_manifest(broken)
    with pytest.raises(manifests.ManifestError, match="cannot read the file"):
        manifests.load_manifest(tmp_path / "missing.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(manifests.ManifestError, match="must be a mapping"):
        manifests.load_manifest(scalar)


def test_load_manifests_keeps_good_and_bad_documents_in_order(tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    documents = [
        build_manifest("VirtualCluster", name="a"),
        build_manifest("VirtualCluster", {"members": {"nodes": []}}, name="b"),
        build_manifest("VirtualCluster", name="c"),
    ]
    path.write_text(yaml.safe_dump_all(documents) + "---\n")
    results = manifests.load_manifests(path)
    assert [type(r).__name__ for r in results] == ["VirtualCluster", "ManifestError", "VirtualCluster"]
    assert results[1].errors[0].path == "spec.members"


# Quantities and durations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("4", 4.0), ("500m", 0.5), ("1.5", 1.5), ("16Gi", 16 * 2**30), ("2k", 2000.0), ("1Ti", 2.0**40),
     ("0", 0.0)],
)
def test_parse_quantity(text: str, value: float) -> None:
    assert base.parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "16GB", "-1", "1e3", "Gi", "1.5.2", " 4"])
def test_parse_quantity_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a resource quantity"):
        base.parse_quantity(text)


@given(number=st.integers(0, 10**6), suffix=st.sampled_from(["", "m", "k", "M", "Ki", "Mi", "Gi"]))
def test_quantity_pattern_and_parser_agree(number: int, suffix: str) -> None:
    text = f"{number}{suffix}"
    assert re.fullmatch(base.QUANTITY_PATTERN, text)
    factor = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}[suffix]
    assert base.parse_quantity(text) == pytest.approx(number * factor)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1h1m1s", 3661)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert base.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "30", "5 m", "1d", "m5", "-5s"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        base.parse_duration(text)


@given(parts=st.lists(st.tuples(st.integers(0, 999), st.sampled_from(["h", "m", "s", "ms"])), min_size=1,
                      max_size=4))
def test_duration_pattern_and_parser_agree(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    assert re.fullmatch(base.DURATION_PATTERN, text)
    unit_seconds = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    assert base.parse_duration(text) == pytest.approx(sum(n * unit_seconds[u] for n, u in parts))


def test_a_scalar_where_an_object_belongs_is_told_the_object_s_fields() -> None:
    """`imagePullSecrets: [regcred]` (as Pod specs are often misremembered) said only that an
    object was wanted; the message names its fields, and the fix when there is one field."""
    manifest = build_manifest("InferenceJob", {"imagePullSecrets": ["regcred"]})
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(manifest)
    (error,) = caught.value.errors
    assert (error.path, error.message) == (
        "spec.imagePullSecrets[0]",
        "Input should be an object (got 'regcred'); give an object with name, as {name: 'regcred'}")
    training = build_manifest("TrainingJob", {"elasticity": 3})
    with pytest.raises(manifests.ManifestError, match=r"spec\.elasticity: .*\(got 3\); give an object with "
                                                      r"minReplicas, maxReplicas, policy, resize$"):
        manifests.load_manifest(training)
