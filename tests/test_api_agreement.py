"""Schema and model agree: hypothesis generates specs around every boundary, valid and not, and
the pydantic model (huorn.api.manifests) must accept exactly the ones the API server would
accept with our CRD (OpenAPI schema + CEL, reproduced in api_support from crds/ alone). When
both accept, the object the server stores (its defaults applied) must equal the model's.

The generators draw from small pools that straddle each bound (0 and 1 for a `ge=1` field,
the limit and one past it), so invalid and valid specs both come up often."""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from api_support import admit, build_manifest, crd_errors, failing_rule_paths, normalise, openapi_schema
from hypothesis import HealthCheck, Phase, given, settings

from huorn.api import manifests

# NB: no shrink phase. Shrinking a disagreement took minutes (every step runs cel-python), and
# the unshrunk spec printed with the failure already names the fields at odds.
SETTINGS = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],
)


_ABSENT = object()


def _present_mostly(value: st.SearchStrategy, absent: Any) -> st.SearchStrategy:
    """The value 6 times in 8, else null (pruned like an absent field) or `absent`."""
    return st.integers(0, 7).flatmap(
        lambda i: value if i > 1 else (st.none() if i == 1 else st.just(absent))
    )


def some(
    required: dict[str, st.SearchStrategy] | None = None,
    always: dict[str, st.SearchStrategy] | None = None,
    **fields: st.SearchStrategy,
) -> Any:
    """An object whose fields are mostly present; any may be null, optional ones absent (the
    defaults then apply). A missing required field is one more bad value."""
    parts = {k: _present_mostly(v, None) for k, v in (required or {}).items()}
    parts |= {k: _present_mostly(v, _ABSENT) for k, v in fields.items()}
    parts |= always or {}
    return st.fixed_dictionaries(parts).map(lambda d: {k: v for k, v in d.items() if v is not _ABSENT})


def pick(*good: Any, bad: tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    """Good values, and a bad one about once in 40 draws: a spec has some 40 fields, so about a
    third of the specs are schema-valid and only the cross-field rules decide them. The good
    pools are small and overlapping (replicas 1-3, heads 1-4) so that the rules' boundaries,
    equal values included, come up often."""
    repeat = max(1, 40 * len(bad) // len(good))
    return st.sampled_from([*good * repeat, *bad])


QUANTITIES = pick("1", "500m", 4, 0, "16Gi", "1.5", bad=("x", -1, "16GB", 1.5, True))
DURATIONS = pick("10m", "1h30m", "250ms", "0s", bad=("5", "10 m", ""))

# Both matchers, one, or none (the failure-rule-one-matcher rule); 0 with In, repeats.
FAILURE_RULES = some(
    required={"action": pick("FailJob", "Ignore", "Count", bad=("FailIndex",))},
    onExitCodes=some(required={"operator": pick("In", "NotIn", bad=("Is",)),
                               "values": st.lists(pick(0, 1, 42, 255, bad=(256, -1)), max_size=3)}),
    onPodConditions=st.lists(some(required={"type": pick("DisruptionTarget", "example.com/Gone", bad=("",))},
                                  status=pick("True", "False", bad=("yes",))), max_size=2),
)

model_specs = some(
    layers=pick(1, 2, 3, 4, bad=(0, 257)),
    width=pick(8, 12, 16, 24, 48, bad=(7,)),
    heads=pick(1, 2, 3, 4, bad=(0,)),
    kvHeads=pick(1, 2, 3, 4, bad=(0,)),
    vocabulary=pick(2, 256, bad=(1,)),
    context=pick(2, 128, bad=(1,)),
    kvSharing=pick("none", "fusedkv", "fusedkv-lite", bad=("yoco",)),
    moe=some(
        required={"experts": pick(2, 4, 6, 8, bad=(1, 1025))},
        prototypes=pick(1, 2, 3, 4, bad=(0,)),
        topK=pick(1, 2, 4, 8, bad=(0, 17)),
        capacityFactor=pick(0.5, 1.25, 2, bad=(0, 17)),
    ),
)

SUBDOMAINS = pick("hf-token", "a.b", "x", bad=("Bad_Name", "-a", "a.", ""))
# A Secret's or ConfigMap's key: value and valueFrom together, and both refs or none, are the
# env rules' business.
KEY_REFS = some(required={"name": SUBDOMAINS, "key": pick("token", ".env", "a_b", bad=("a/b", ""))},
                optional=pick(True, False, bad=("yes",)))

# Labels and annotations: valid keys only, since the model alone judges keys (the CRD cannot
# within the API server's CEL cost budget; docs/api.md, "Known differences"); bad values and
# over-full maps for the schema's bounds.
METADATA_KEYS = st.sampled_from(["team", "example.com/cost-centre", "a", "x" * 63, "sidecar.istio.io/inject"])
LABELS = st.one_of(
    st.dictionaries(METADATA_KEYS, pick("nlp", "", "a.b-c_d", "z" * 63, bad=("-x", "z" * 64, "a b")),
                    max_size=3),
    st.just({f"l{i}": "x" for i in range(33)}),
)
ANNOTATIONS = st.dictionaries(METADATA_KEYS, pick("false", "", "a b: c", "y" * 7680, bad=("y" * 7681,)),
                              max_size=3)

# The fields every job kind has (JobBasics), and those only TrainingJob and RLJob have
# (JobCommon): an InferenceJob given priority or remediation is refused, which
# test_api_fields_per_kind checks; generating them for it would only make refusals.
basic_fields = dict(
    resources=some(gpus=pick(0, 1, 16, bad=(-1, 17)), cpu=QUANTITIES, memory=QUANTITIES),
    checkpoint=some(volume=pick("ckpt", bad=("Bad",)), path=pick("/c", "./c", bad=("",)), interval=DURATIONS,
                    intervalSteps=pick(1, 25, bad=(0,))),
    env=st.lists(some(required={"name": pick("A", "NCCL_DEBUG", bad=("1BAD",))}, value=pick("", "x"),
                      valueFrom=some(secretKeyRef=KEY_REFS, configMapKeyRef=KEY_REFS)),
                 max_size=2),
    imagePullSecrets=st.lists(some(required={"name": SUBDOMAINS}), max_size=2),
    serviceAccountName=SUBDOMAINS,
    podMetadata=some(labels=LABELS, annotations=ANNOTATIONS),
)

gang_fields = dict(
    basic_fields,
    priority=pick(0, 50, 1000, bad=(-1, 1001)),
    remediation=some(hangTimeout=DURATIONS, failSlowDetection=pick(True, False, bad=("yes",)),
                     maxMitigation=pick("observe", "restart", bad=("reboot",)),
                     maxRestarts=pick(0, 3, 1000, bad=(-1, 1001)),
                     podFailurePolicy=some(required={"rules": st.lists(FAILURE_RULES, max_size=3)})),
)

# Always present and good: their bad values are the schema's business, tested on the examples.
JOB_REQUIRED = {"virtualCluster": st.just("local")}

training_specs = some(
    always=JOB_REQUIRED,
    **gang_fields,
    # A TrainingJob's only (an RLJob refuses it, test_api_fields_per_kind).
    elasticity=some(
        minReplicas=pick(1, 2, 3, bad=(0, 4097)),
        maxReplicas=pick(1, 2, 3, 4096, bad=(0, 4097)),
        policy=pick("goodput", "fixed", bad=("elastic",)),
    ),
    task=some(kind=pick("pretrain", "cpt", "distill", bad=("finetune",)),
              teacher=some(required={"checkpoint": pick("/t", "s3://t", bad=("",))}),
              initCheckpoint=pick("/c", "gs://c", bad=("",))),
    model=model_specs,
    data=some(
        sources=st.lists(
            some(required={"name": pick("code", "general", "math", bad=("Bad_Name",))},
                 weight=pick(0, 0.5, 1)),
            max_size=3,
        ),
        mixture=pick("manual", "auto", bad=("dynamic",)),
    ),
    optimization=some(
        globalBatch=pick(4, 8, 12, 16, bad=(0,)), microBatch=pick(1, 2, 4, 8, bad=(0,)),
        learningRate=pick(3e-3, 1, bad=(0, 11)), steps=pick(1, 300, bad=(0,)), tokens=pick(1000, bad=(0,)),
        schedule=pick("cosine", "constant", bad=("step",)), warmupSteps=pick(0, 10, bad=(-1,)),
    ),
    parallelism=some(pipelineStages=pick(1, 2, 4, 5, bad=(0, 129)),
                     schedule=pick("1f1b", "kfkb", "auto", "gpipe", bad=("zb",)), k=pick(1, 2, bad=(0, 65))),
)

role_specs = some(
    replicas=pick(0, 1, 2, 3, bad=(-1,)),
    gpusPerReplica=pick(0, 1, 2, bad=(17,)),
    colocationGroup=pick("a", "b", bad=("Bad",)),
    deviceMapping=st.lists(pick(0, 1, 3, 4, bad=(-1,)), max_size=4),
)

rl_specs = some(
    always=JOB_REQUIRED,
    **gang_fields,
    model=model_specs,
    gpus=pick(0, 2, 4, 6, 8, bad=(-1,)),
    roles=some(actorTrain=role_specs, rollout=role_specs, reference=role_specs, reward=role_specs,
               environment=role_specs),
    algorithm=some(
        name=pick("grpo", "dapo", "lite-ppo", "ppo", bad=("reinforce",)),
        groupSize=pick(1, 8, bad=(0, 1025)),
        clipLow=pick(0.1, 0.2, 0.28, bad=(0, 1)),
        clipHigh=pick(0.1, 0.2, 0.28, 9.5, bad=(10,)),
        klCoefficient=pick(0, 0.1, bad=(-1,)),
        advantageStd=pick("group", "batch", "none", bad=("token",)),
        lossAggregation=pick("token", "sequence", bad=("mean",)),
        overlongMaxLength=pick(1, 64, 512, bad=(0,)),
        overlongBuffer=pick(1, 64, 512, bad=(0,)),
    ),
    rollout=some(maxNewTokens=pick(1, 64, bad=(0,)), temperature=pick(0, 1.0, bad=(-1,)),
                 topP=pick(0.9, 1, bad=(0, 1.1))),
    steps=pick(1, 100, bad=(0,)),
)

inference_specs = some(
    always={
        **JOB_REQUIRED,
        "model": st.fixed_dictionaries({"checkpoint": st.just("/c")}, optional={"architecture": model_specs}),
    },
    **basic_fields,
    serving=some(maxBatch=pick(1, 64, bad=(0, 4097)), maxTokens=pick(1, 2048, bad=(0,))),
    quantization=some(method=pick("none", "glvq", bad=("int4",)), bits=pick(1, 4, 8, bad=(0, 9)),
                      groupSize=pick(2, 8, bad=(1,))),
    slo=some(p99TimeToFirstTokenMs=pick(1, 250.5, bad=(-1, 0)), p99LatencyMs=pick(1, 250.5, bad=(-1, 0)),
             tokensPerSecond=pick(10, 2000.0, bad=(0,))),
    autoscaling=some(minReplicas=pick(0, 1, 2, 3, bad=(-1,)), maxReplicas=pick(1, 2, 3, bad=(0, 4097))),
)

virtual_cluster_specs = some(
    required={"members": some(
        nodeSelector=some(matchLabels=st.dictionaries(pick("pool", "zone"), pick("a100", "h100"))),
        nodes=st.lists(pick("node-0", "node-1"), max_size=2),
    )},
    purpose=pick("training", "inference", bad=("batch",)),
    lending=some(lendable=pick(True, False), maxGPUsLent=pick(0, 4, bad=(-1,)),
                 reclaimGraceSeconds=pick(0, 30, bad=(-1, 86401))),
    borrowing=some(maxGPUsBorrowed=pick(0, 8, bad=(-1,))),
    namespaces=st.lists(pick("research", bad=("Bad_Ns",)), max_size=2),
)

# Focused generators: only the fields the cross-field rules read, from small good pools, so
# that specs sitting right on a rule's boundary (minReplicas == maxReplicas, buffer == max
# length, a colocation group exactly filling gpus) are common rather than lucky.
only = st.sampled_from

training_focus = some(
    always=JOB_REQUIRED,
    elasticity=some(minReplicas=only([1, 2, 3]), maxReplicas=only([1, 2, 3]),
                    policy=only(["goodput", "fixed"])),
    optimization=some(globalBatch=only([4, 6, 8, 12]), microBatch=only([1, 2, 4, 8]), steps=only([1]),
                      tokens=only([1])),
    model=some(layers=only([1, 2, 3]), width=only([8, 12, 16, 24]), heads=only([1, 2, 3, 4]),
               kvHeads=only([1, 2, 3]), kvSharing=only(["none", "fusedkv"]),
               moe=some(required={"experts": only([2, 4, 6])}, prototypes=only([1, 2, 3]),
                        topK=only([1, 2, 6]))),
    parallelism=some(pipelineStages=only([1, 2, 3, 4]), schedule=only(["1f1b", "kfkb", "auto"]),
                     k=only([1, 2])),
    task=some(kind=only(["pretrain", "distill"]), teacher=st.just({"checkpoint": "/t"})),
    data=some(sources=st.lists(some(required={"name": only(["code", "math"])}, weight=only([0, 1])),
                               max_size=2),
              mixture=only(["manual", "auto"])),
)

role_focus = some(
    replicas=only([0, 1, 2]), gpusPerReplica=only([1, 2]), colocationGroup=only(["a", "b"]),
    deviceMapping=st.lists(only([0, 1, 3, 4]), max_size=3),
)

rl_focus = some(
    always=JOB_REQUIRED,
    gpus=only([1, 2, 3, 4, 5, 6]),
    roles=some(actorTrain=role_focus, rollout=role_focus, reference=role_focus, reward=role_focus,
               environment=role_focus),
    algorithm=some(clipLow=only([0.2, 0.28]), clipHigh=only([0.2, 0.28]), overlongMaxLength=only([64, 128]),
                   overlongBuffer=only([64, 128])),
)

inference_focus = some(
    always={**JOB_REQUIRED, "model": st.just({"checkpoint": "/c"})},
    quantization=some(method=only(["none", "glvq"]), bits=only([2, 4])),
    slo=some(p99TimeToFirstTokenMs=only([100]), p99LatencyMs=only([100]), tokensPerSecond=only([10])),
    autoscaling=some(minReplicas=only([0, 1, 2]), maxReplicas=only([1, 2])),
)

virtual_cluster_focus = some(
    required={"members": some(nodeSelector=st.just({"matchLabels": {"pool": "a"}}),
                               nodes=st.lists(only(["node-0"]), max_size=1))},
    lending=some(lendable=only([True, False]), maxGPUsLent=only([0, 1])),
)

STRATEGIES = {
    "TrainingJob": st.one_of(training_specs, training_focus),
    "RLJob": st.one_of(rl_specs, rl_focus),
    "InferenceJob": st.one_of(inference_specs, inference_focus),
    "VirtualCluster": st.one_of(virtual_cluster_specs, virtual_cluster_focus),
}


def _manifest(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "huorn.io/v1alpha1", "kind": kind, "metadata": {"name": "generated"}, "spec": spec}


def _model_errors(manifest: dict[str, Any]) -> list[str]:
    try:
        manifests.load_manifest(manifest)
    except manifests.ManifestError as error:
        return [str(e) for e in error.errors]
    return []


def judge_both(kind: str, spec: dict[str, Any]) -> str:
    """Assert the two sides agree on `spec`; return the verdict: accepted, schema or rule."""
    manifest = _manifest(kind, spec)
    server = crd_errors(kind, manifest)
    model = _model_errors(manifest)
    assert not any("-> error:" in e for e in server), f"a CEL rule failed to evaluate: {server}"
    assert bool(server) == bool(model), f"server: {server}\nmodel: {model}"
    if server and not all(" -> " in e for e in server):
        return "schema"
    if server:
        # Schema-valid, so pydantic's errors are rule errors too; pydantic stops at the first
        # broken rule of an object (and skips a parent's rules), so its paths are a subset.
        model_paths = {error.split(": ")[0] for error in model}
        assert model_paths <= failing_rule_paths(kind, manifest), f"server: {server}\nmodel: {model}"
        return "rule"
    stored = admit(kind, manifest)["spec"]
    loaded = manifests.load_manifest(manifest).spec.to_wire()
    spec_schema = openapi_schema(kind)["properties"]["spec"]
    assert normalise(spec_schema, stored) == normalise(spec_schema, loaded)
    return "accepted"


# cel-python walks the RLJob's GPU-accounting rule (five roles, every pair compared) slowly.
EXAMPLES = {"RLJob": 70}


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_model_and_crd_agree(kind: str) -> None:
    """The property, per kind. The verdict counts prove the generator reaches all three outcomes:
    accepted, refused by the schema, and refused by a cross-field rule alone (schema-valid)."""
    verdicts: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=EXAMPLES.get(kind, 100))
    @given(spec=STRATEGIES[kind])
    def check(spec: dict[str, Any]) -> None:
        verdicts[judge_both(kind, spec)] += 1

    check()
    assert verdicts["accepted"] and verdicts["schema"] and verdicts["rule"], verdicts


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_unknown_fields_are_refused_by_both(kind: str) -> None:
    """Strict field validation (kubectl's default) and extra="forbid" both refuse a typo."""
    manifest = build_manifest(kind, {"bogus": 1})
    assert not crd_errors(kind, build_manifest(kind)) and not _model_errors(build_manifest(kind))
    assert crd_errors(kind, manifest) and _model_errors(manifest)
