"""Every cross-field rule, on a valid and an invalid object, in both places it is enforced:
the CEL string of the generated CRD (evaluated by cel-python on the object as the API server
would store it) and the pydantic model (through huorn.api.manifests, as the CLI and operator
load manifests). Each invalid object breaks exactly one rule, so a rule that never fires, or
fires on the wrong field, fails its own case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from api_support import (
    DELETE,
    ROOT,
    apply_defaults,
    build_manifest,
    crd_errors,
    evaluate_rule,
    openapi_schema,
)

from huorn.api import kinds, manifests, rl


@dataclass(frozen=True)
class Case:
    rule: str
    kind: str
    node: str  # wire path of the object the rule sits on
    valid: dict[str, Any]
    invalid: dict[str, Any]


_SOURCES = [{"name": "general"}, {"name": "math"}]
_FORECAST = {"prometheusURL": "http://prometheus:9090", "query": "sum(rate(r[5m]))", "requestsPerGPU": 4}


def _failure_rule(matcher: dict[str, Any]) -> dict[str, Any]:
    return {"remediation": {"podFailurePolicy": {"rules": [{"action": "FailJob", **matcher}]}}}


CASES = [
    Case("elasticity-min-le-max", "TrainingJob", "spec.elasticity",
         {"elasticity": {"minReplicas": 2, "maxReplicas": 2}},
         {"elasticity": {"minReplicas": 3, "maxReplicas": 2}}),
    Case("task-teacher-iff-distill", "TrainingJob", "spec.task",
         {"task": {"kind": "distill", "teacher": {"checkpoint": "/t"}}}, {"task": {"kind": "distill"}}),
    Case("moe-prototypes-divide-experts", "TrainingJob", "spec.model.moe",
         {"model": {"moe": {"experts": 8, "prototypes": 4}}},
         {"model": {"moe": {"experts": 10, "prototypes": 4}}}),
    Case("moe-top-k", "TrainingJob", "spec.model.moe",
         {"model": {"moe": {"experts": 8, "topK": 8}}}, {"model": {"moe": {"experts": 4, "topK": 5}}}),
    Case("model-width-divisible-by-heads", "TrainingJob", "spec.model",
         {"model": {"width": 96, "heads": 3}}, {"model": {"width": 100, "heads": 8}}),
    Case("model-head-dim-even", "TrainingJob", "spec.model",
         {"model": {"width": 128, "heads": 4}}, {"model": {"width": 24, "heads": 8}}),
    Case("model-kv-heads-divide-heads", "TrainingJob", "spec.model",
         {"model": {"heads": 4, "kvHeads": 2}}, {"model": {"heads": 4, "kvHeads": 3}}),
    Case("model-kv-sharing-layers", "TrainingJob", "spec.model",
         {"model": {"layers": 2, "kvSharing": "fusedkv"}},
         {"model": {"layers": 1, "kvSharing": "fusedkv-lite"}}),
    Case("data-source-names-unique", "TrainingJob", "spec.data",
         {"data": {"sources": [{"name": "code"}, {"name": "math"}]}},
         {"data": {"sources": [{"name": "code"}, {"name": "code"}]}}),
    Case("data-manual-weights", "TrainingJob", "spec.data",
         {"data": {"sources": [{"name": "code", "weight": 0}, {"name": "math", "weight": 0.5}]}},
         {"data": {"sources": [{"name": "code", "weight": 0}, {"name": "math", "weight": 0}]}}),
    Case("optimization-steps-or-tokens", "TrainingJob", "spec.optimization",
         {"optimization": {"steps": DELETE, "tokens": 1000}}, {"optimization": {"steps": DELETE}}),
    Case("optimization-micro-le-global", "TrainingJob", "spec.optimization",
         {"optimization": {"globalBatch": 4, "microBatch": 4}},
         {"optimization": {"globalBatch": 4, "microBatch": 8}}),
    Case("optimization-global-multiple-of-micro", "TrainingJob", "spec.optimization",
         {"optimization": {"globalBatch": 12, "microBatch": 4}},
         {"optimization": {"globalBatch": 10, "microBatch": 4}}),
    Case("parallelism-k-needs-kfkb", "TrainingJob", "spec.parallelism",
         {"parallelism": {"schedule": "kfkb", "k": 4}}, {"parallelism": {"schedule": "auto", "k": 2}}),
    Case("training-stages-le-layers", "TrainingJob", "spec",
         {"model": {"layers": 4}, "parallelism": {"pipelineStages": 4}},
         {"model": {"layers": 4}, "parallelism": {"pipelineStages": 5}}),
    Case("training-fixed-batch-divisible", "TrainingJob", "spec",
         {"elasticity": {"policy": "fixed", "minReplicas": 2, "maxReplicas": 2}},
         {"elasticity": {"policy": "fixed", "minReplicas": 3, "maxReplicas": 3}}),
    Case("training-in-place-one-process", "TrainingJob", "spec",
         {"elasticity": {"resize": "inPlace"}, "resources": {"gpus": 1}},
         {"elasticity": {"resize": "inPlace"}, "parallelism": {"pipelineStages": 2}}),
    Case("training-distill-data-parallel", "TrainingJob", "spec",
         {"task": {"kind": "distill", "teacher": {"checkpoint": "/t"}}, "parallelism": {"pipelineStages": 1}},
         {"task": {"kind": "distill", "teacher": {"checkpoint": "/t"}},
          "parallelism": {"pipelineStages": 2}}),
    Case("training-auto-mixture-has-a-method", "TrainingJob", "spec",
         {"task": {"kind": "distill", "teacher": {"checkpoint": "/t"}}, "data": {"mixture": "auto"}},
         {"task": {"kind": "pretrain"}, "data": {"mixture": "auto"}}),
    Case("training-plan-needs-auto-without-distill", "TrainingJob", "spec",
         {"data": {"mixture": "auto", "sources": _SOURCES, "plan": {"domain": "math"}}},
         {"data": {"mixture": "manual", "sources": _SOURCES, "plan": {"domain": "math"}}}),
    Case("data-plan-domain-and-general", "TrainingJob", "spec.data",
         {"data": {"mixture": "auto", "sources": _SOURCES, "plan": {"domain": "math"}}},
         {"data": {"mixture": "auto", "sources": [{"name": "math"}, {"name": "code", "weight": 0}],
                   "plan": {"domain": "math"}}}),
    Case("plan-probe-ratios-distinct", "TrainingJob", "spec.data.plan",
         {"data": {"mixture": "auto", "sources": _SOURCES,
                   "plan": {"domain": "math", "probeRatios": [0.1, 0.5, 0.9]}}},
         {"data": {"mixture": "auto", "sources": _SOURCES,
                   "plan": {"domain": "math", "probeRatios": [0.1, 0.5, 0.5]}}}),
    Case("task-cpt-init-checkpoint", "TrainingJob", "spec.task",
         {"task": {"kind": "cpt", "initCheckpoint": "/checkpoints/base"}}, {"task": {"kind": "cpt"}}),
    Case("task-init-checkpoint-is-a-path", "TrainingJob", "spec.task",
         {"task": {"kind": "cpt", "initCheckpoint": "/checkpoints/base"}},
         {"task": {"kind": "cpt", "initCheckpoint": "s3://bucket/base"}}),
    Case("teacher-checkpoint-is-a-path", "TrainingJob", "spec.task.teacher",
         {"task": {"kind": "distill", "teacher": {"checkpoint": "/checkpoints/teacher"}}},
         {"task": {"kind": "distill", "teacher": {"checkpoint": "gs://bucket/teacher"}}}),
    Case("role-device-mapping-size", "RLJob", "spec.roles.rollout",
         {"roles": {"rollout": {"replicas": 2, "deviceMapping": [0, 1]}}},
         {"roles": {"rollout": {"replicas": 2, "deviceMapping": [0]}}}),
    Case("algorithm-clip-high-ge-low", "RLJob", "spec.algorithm",
         {"algorithm": {"clipLow": 0.2, "clipHigh": 0.2}}, {"algorithm": {"clipLow": 0.3, "clipHigh": 0.25}}),
    Case("algorithm-overlong-buffer", "RLJob", "spec.algorithm",
         {"algorithm": {"overlongMaxLength": 100, "overlongBuffer": 20}},
         {"algorithm": {"overlongBuffer": 20}}),
    Case("algorithm-overlong-max-length", "RLJob", "spec.algorithm",
         {"algorithm": {"overlongMaxLength": 100, "overlongBuffer": 20}},
         {"algorithm": {"overlongMaxLength": 100}}),
    Case("rl-colocated-roles-fit", "RLJob", "spec",
         {"gpus": 4, "roles": {"actorTrain": {"replicas": 4, "colocationGroup": "a"},
                               "rollout": {"replicas": 4, "colocationGroup": "a"}}},
         {"gpus": 3, "roles": {"actorTrain": {"replicas": 4, "colocationGroup": "a"},
                               "rollout": {"replicas": 4, "colocationGroup": "a"}}}),
    Case("rl-gpus-fill-worker-pods", "RLJob", "spec",
         {"gpus": 4, "resources": {"gpus": 2}},
         {"gpus": 5, "resources": {"gpus": 2}}),
    Case("rl-device-mapping-within-gpus", "RLJob", "spec",
         {"gpus": 2, "roles": {"rollout": {"deviceMapping": [1]}}},
         {"gpus": 2, "roles": {"rollout": {"deviceMapping": [2]}}}),
    Case("rl-mini-batches-le-prompts", "RLJob", "spec.optimization",
         {"optimization": {"promptsPerStep": 4, "miniBatches": 4}},
         {"optimization": {"promptsPerStep": 4, "miniBatches": 5}}),
    Case("rl-init-checkpoint-is-a-path", "RLJob", "spec",
         {"initCheckpoint": "/checkpoints/base"}, {"initCheckpoint": "s3://bucket/base"}),
    Case("served-checkpoint-is-a-path", "InferenceJob", "spec.model",
         {"model": {"checkpoint": "/checkpoints/chat"}}, {"model": {"checkpoint": "s3://bucket/chat"}}),
    Case("quantization-glvq-bits", "InferenceJob", "spec.quantization",
         {"quantization": {"method": "glvq", "bits": 3}}, {"quantization": {"method": "none", "bits": 3}}),
    Case("slo-needs-target", "InferenceJob", "spec.slo", {"slo": {"tokensPerSecond": 10}}, {"slo": {}}),
    Case("autoscaling-min-le-max", "InferenceJob", "spec.autoscaling",
         {"autoscaling": {"minReplicas": 0, "maxReplicas": 1}},
         {"autoscaling": {"minReplicas": 2, "maxReplicas": 1}}),
    Case("members-selector-or-nodes", "VirtualCluster", "spec.members",
         {"members": {"nodes": DELETE, "nodeSelector": {"matchLabels": {}}}}, {"members": {"nodes": []}}),
    Case("toleration-exists-no-value", "VirtualCluster", "spec.members.tolerations[0]",
         {"members": {"tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]}},
         {"members": {"tolerations": [{"key": "dedicated", "operator": "Exists", "value": "gpu"}]}}),
    Case("toleration-empty-key-exists", "VirtualCluster", "spec.members.tolerations[0]",
         {"members": {"tolerations": [{"operator": "Exists"}]}},
         {"members": {"tolerations": [{"value": "gpu", "effect": "NoSchedule"}]}}),
    Case("toleration-key-prefix", "VirtualCluster", "spec.members.tolerations[0]",
         {"members": {"tolerations": [{"key": "a" * 253 + "/dedicated", "operator": "Exists"}]}},
         {"members": {"tolerations": [{"key": "a" * 254 + "/dedicated", "operator": "Exists"}]}}),
    Case("toleration-seconds-no-execute", "VirtualCluster", "spec.members.tolerations[0]",
         {"members": {"tolerations": [{"key": "maint", "effect": "NoExecute", "tolerationSeconds": 300}]}},
         {"members": {"tolerations": [{"key": "maint", "effect": "NoSchedule", "tolerationSeconds": 300}]}}),
    Case("lending-max-needs-lendable", "VirtualCluster", "spec.lending",
         {"lending": {"lendable": True, "maxGPUsLent": 2}},
         {"lending": {"lendable": False, "maxGPUsLent": 2}}),
    Case("exit-codes-unique", "TrainingJob", "spec.remediation.podFailurePolicy.rules[0].onExitCodes",
         _failure_rule({"onExitCodes": {"operator": "NotIn", "values": [0, 1]}}),
         _failure_rule({"onExitCodes": {"operator": "NotIn", "values": [1, 0, 1]}})),
    Case("exit-codes-in-not-zero", "TrainingJob", "spec.remediation.podFailurePolicy.rules[0].onExitCodes",
         _failure_rule({"onExitCodes": {"operator": "NotIn", "values": [0]}}),
         _failure_rule({"onExitCodes": {"operator": "In", "values": [42, 0]}})),
    Case("failure-rule-one-matcher", "TrainingJob", "spec.remediation.podFailurePolicy.rules[0]",
         _failure_rule({"onPodConditions": [{"type": "DisruptionTarget"}]}),
         _failure_rule({"onPodConditions": [{"type": "DisruptionTarget"}],
                        "onExitCodes": {"operator": "In", "values": [42]}})),
    Case("env-value-or-value-from", "InferenceJob", "spec.env[0]",
         {"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]},
         {"env": [{"name": "HF_TOKEN", "value": "x",
                   "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]}),
    Case("env-source-one-ref", "RLJob", "spec.env[0].valueFrom",
         {"env": [{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "hf", "key": "t"}}}]},
         {"env": [{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "hf", "key": "t"},
                                                     "secretKeyRef": {"name": "hf", "key": "t"}}}]}),
    Case("forecast-needs-inference", "VirtualCluster", "spec",
         {"purpose": "inference", "lending": {"forecast": {
             "prometheusURL": "http://prometheus:9090", "query": "sum(rate(r[5m]))", "requestsPerGPU": 4}}},
         {"purpose": "training", "lending": {"forecast": {
             "prometheusURL": "http://prometheus:9090", "query": "sum(rate(r[5m]))", "requestsPerGPU": 4}}}),
    Case("rate-history-bounds", "VirtualCluster", "spec.lending.forecast",
         {"purpose": "inference", "lending": {"forecast": {**_FORECAST, "history": "90m"}}},
         {"purpose": "inference", "lending": {"forecast": {**_FORECAST, "history": "1000h"}}}),
    Case("forecast-history-covers-grace", "VirtualCluster", "spec",
         {"purpose": "inference", "lending": {"reclaimGraceSeconds": 86400,
                                              "forecast": {**_FORECAST, "history": "1525m"}}},
         {"purpose": "inference", "lending": {"reclaimGraceSeconds": 86400,
                                              "forecast": {**_FORECAST, "history": "1524m"}}}),
]

RULES = {rule.name: rule for _, rule in kinds.RULES}


def _node(value: dict[str, Any], path: str) -> Any:
    """The schema node (or the stored value) at a wire path; `rules[0]` steps into a list."""
    for part in path.split("."):
        name, _, index = part.partition("[")
        value = value["properties"][name] if "properties" in value else value[name]
        if index:
            value = value["items"] if "items" in value else value[int(index.rstrip("]"))]
    return value


def test_every_rule_has_a_case() -> None:
    assert sorted(RULES) == sorted(case.rule for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.rule for case in CASES])
def test_rule_in_cel_accepts_valid_and_refuses_invalid(case: Case) -> None:
    rule = RULES[case.rule]
    schema = openapi_schema(case.kind)
    node_schema = _node(schema, case.node)
    assert rule.to_crd() in node_schema["x-kubernetes-validations"]
    for patch, expected in ((case.valid, True), (case.invalid, False)):
        stored = apply_defaults(schema, build_manifest(case.kind, patch))
        assert evaluate_rule(rule.cel, node_schema, _node(stored, case.node)) is expected
    assert crd_errors(case.kind, build_manifest(case.kind, case.valid)) == []
    refused = crd_errors(case.kind, build_manifest(case.kind, case.invalid))
    assert len(refused) == 1 and refused[0].endswith(f"{rule.cel} -> False"), refused


@pytest.mark.parametrize("case", CASES, ids=[case.rule for case in CASES])
def test_rule_in_pydantic_names_the_field_and_the_fix(case: Case) -> None:
    rule = RULES[case.rule]
    manifests.load_manifest(build_manifest(case.kind, case.valid))
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(build_manifest(case.kind, case.invalid))
    expected_path = f"{case.node}.{rule.field}" if rule.field else case.node
    assert [error.path for error in caught.value.errors] == [expected_path]
    assert rule.message in str(caught.value) and rule.fix in str(caught.value)


def test_model_rules_sit_on_every_copy_of_the_model() -> None:
    """ModelSpec appears in all three job kinds; its rules must guard every occurrence."""
    width_rule = RULES["model-width-divisible-by-heads"].to_crd()
    for kind, node in (("TrainingJob", "spec.model"), ("RLJob", "spec.model"),
                       ("InferenceJob", "spec.model.architecture")):
        assert width_rule in _node(openapi_schema(kind), node)["x-kubernetes-validations"]
        bad = {"model": {"width": 100, "heads": 8}}
        if kind == "InferenceJob":
            bad = {"model": {"architecture": {"width": 100, "heads": 8}}}
        assert crd_errors(kind, build_manifest(kind, bad))
        with pytest.raises(manifests.ManifestError, match=f"{node}.width"):
            manifests.load_manifest(build_manifest(kind, bad))


def test_rule_names_are_unique_and_paths_are_wire_names() -> None:
    names = [rule.name for _, rule in kinds.RULES]
    assert len(names) == len(set(names))
    for cls, rule in kinds.RULES:
        if rule.field:
            head = rule.field.split(".")[0]
            aliases = {info.alias or name for name, info in cls.model_fields.items()}
            assert head in aliases, f"{rule.name}: {head} is not a field of {cls.__name__}"


def test_every_rule_is_documented() -> None:
    docs = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in RULES if f"`{name}`" not in docs]
    assert not missing, f"add these rules to the table in docs/api.md: {missing}"


def test_count_gpus_needed_counts_each_group_once_at_its_largest() -> None:
    roles = rl.Roles.model_validate({
        "actorTrain": {"replicas": 4, "gpusPerReplica": 2, "colocationGroup": "main"},
        "rollout": {"replicas": 2, "gpusPerReplica": 2, "colocationGroup": "main"},
        "reference": {"replicas": 3, "colocationGroup": "ref"},
        "reward": {"replicas": 2},
    })
    assert rl.count_gpus_needed(roles) == 8 + 3 + 2


_GRACES = [None, 0, 30, 290, 291, 1800, 81590, 81591, 86400]
_HISTORIES = [None, "89m", "90m", "1h30m", "1524m", "1525m", "24h", "900h", "901h"]


@pytest.mark.parametrize("grace", _GRACES)
def test_the_forecast_history_rules_agree_in_cel_and_pydantic_at_their_edges(grace: int | None) -> None:
    """Both rules on an inference cluster's forecast are arithmetic on durations, with defaults
    for omitted fields: the CEL the API server runs and the model must agree at every edge."""
    for history in _HISTORIES:
        forecast = {**_FORECAST, **({"history": history} if history is not None else {})}
        lending = {"forecast": forecast, **({"reclaimGraceSeconds": grace} if grace is not None else {})}
        manifest = build_manifest("VirtualCluster", {"purpose": "inference", "lending": lending})
        try:
            manifests.load_manifest(manifest)
            model_ok = True
        except manifests.ManifestError:
            model_ok = False
        assert (crd_errors("VirtualCluster", manifest) == []) is model_ok, (grace, history)
