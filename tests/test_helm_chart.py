"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk), checked against the
Kubernetes schemas (kubernetes-validate) and against what the operator actually needs."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import shutil
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import typer
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import huorn
from huorn.api import kinds
from huorn.backends.kubernetes import manifests
from huorn.cli import operator as operator_cli
from huorn.operator import runner

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "huorn"
KUBE_VERSION = "1.33"
# Kinds outside the core Kubernetes schemas: the Prometheus operator's and kopf's own CRDs.
NOT_IN_KUBERNETES = {"ServiceMonitor", "PrometheusRule", "ClusterKopfPeering"}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ha": {"replicaCount": 2, "peering": {"enabled": True, "name": "huorn"}},
    "namespaced-monitored": {
        "watchNamespaces": ["team-a", "team-b"],
        "logLevel": "debug",
        "metrics": {"port": 9090, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}},
        "podStartSeconds": 1800,
    },
    # OpenShift's restricted-v2 SCC assigns the UID and groups from the namespace's range
    "platform-uid": {"podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}},
}


def _render(values: dict[str, Any], namespace: str = "huorn-system") -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(CHART)
    files = chart.render(values, name="huorn", namespace=namespace)
    docs = []
    for path, text in files.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _operator_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The operator's own ClusterRole (the others are the tenants', aggregated into the default
    roles, which the operator's must never be)."""
    [role] = [d for d in docs if d["kind"] == "ClusterRole" and not any(
        label.startswith(AGGREGATE) for label in d["metadata"].get("labels", {}))]
    return role


def _granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group, resource in ((g, r) for g in rule["apiGroups"] for r in rule["resources"]):
            granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def _value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: tuple[str, ...] = ()):
    """Every key that values.yaml sets, down through the chart's own objects (those whose schema
    is closed to other keys); free-form maps (resources, nodeSelector, ...) are the user's."""
    for key, value in values.items():
        path = (*prefix, key)
        yield path
        schema_of_key = schema["properties"][key]
        if isinstance(value, dict) and schema_of_key.get("additionalProperties") is False:
            yield from _value_paths(value, schema_of_key, path)


VALUE_PATHS = list(_value_paths(
    yaml.safe_load((CHART / "values.yaml").read_text()),
    json.loads((CHART / "values.schema.json").read_text()),
))


def _chart_without(tmp_path: Path, path: tuple[str, ...], schema: bool = True) -> Path:
    """A copy of the chart whose values.yaml lacks `path`: what `helm upgrade --reuse-values`
    hands the templates when the release was installed from a chart without that value (Helm
    takes the old chart's values.yaml with the release's own overrides)."""
    chart = Path(shutil.copytree(CHART, tmp_path / "huorn"))
    values = yaml.safe_load((chart / "values.yaml").read_text())
    parent = values
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    if not schema:
        (chart / "values.schema.json").unlink()
    return chart


def test_chart_lints_clean_in_strict_mode() -> None:
    report = helm_python.lint(CHART, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == [] and report["messages"] == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_manifest_passes_the_kubernetes_schema(variant: str) -> None:
    docs = _render(VARIANTS[variant])
    checked = 0
    for doc in docs:
        if doc["kind"] in NOT_IN_KUBERNETES:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    assert checked >= 5  # ServiceAccount, ClusterRole, ClusterRoleBinding, Deployment, Service


# The chart version whose values.schema.json this is, and a digest of that schema: a change to
# the values (a new one, a rename, a new requirement) is a new chart version. Bump Chart.yaml's
# `version` (minor while 0.x: most such changes break --reuse-values or an old values file) and
# record the new digest here.
CHART_VALUES = ("0.4.3", "579e4610eb809438")


def test_the_chart_version_moves_with_its_values_and_the_app_version_is_the_packages() -> None:
    """The chart stayed 0.1.0 through many incompatible changes to its values, so `helm list` and
    the helm.sh/chart label could not tell a release of one from another. appVersion is the
    operator's version, the default image tag, which must be the package's own."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    digest = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:16]
    assert (chart["version"], digest) == CHART_VALUES, (
        "values.schema.json changed: bump Chart.yaml's version and record it with the new digest in "
        f"CHART_VALUES ({digest})")
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == package == huorn.__version__


def test_chart_crds_equal_the_generated_crds() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert generated, "crds/ is empty: run `huorn crds`"
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == generated
    for name in generated:
        assert (CHART / "crds" / name).read_text() == (ROOT / "crds" / name).read_text(), (
            f"helm/huorn/crds/{name} differs from crds/{name}: copy crds/*.yaml into helm/huorn/crds/"
        )
        kubernetes_validate.validate(
            yaml.safe_load((CHART / "crds" / name).read_text()), KUBE_VERSION, strict=True
        )


def test_deployment_runs_non_root_read_only_with_limits() -> None:
    deployment = _one(_render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "two standalone operators must never overlap"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_arguments_are_accepted_by_huorn_operator(variant: str) -> None:
    [container] = _one(_render(VARIANTS[variant]), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "huorn.cli.operator"]
    params = _operator_params(container)
    values = VARIANTS[variant]
    assert params["all_namespaces"] is not bool(values.get("watchNamespaces"))
    assert params["namespace"] == values.get("watchNamespaces", [])
    assert params["peering"] == (values["peering"]["name"] if "peering" in values else None)
    assert params["metrics_port"] == values.get("metrics", {}).get("port", 8080)
    assert params["health_port"] == 8081
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["httpGet"]["path"] == "/healthz" and ports[probe["httpGet"]["port"]] == 8081
    assert params["pod_start_seconds"] == values.get("podStartSeconds", 600)
    assert params["job_image"] == container["image"] + "-cu126", "jobs run the operator's CUDA build"


def _operator_app() -> typer.Typer:
    app = typer.Typer()
    app.command()(operator_cli.operator_command)
    return app


def _operator_params(container: dict[str, Any]) -> dict[str, Any]:
    """The container's arguments as `huorn operator` parses them (it runs nothing)."""
    command = typer.main.get_command(_operator_app())
    return command.make_context("huorn-operator", list(container["args"])).params


def test_the_health_endpoint_listens_on_ipv6_where_the_chart_says_so() -> None:
    """kopf's liveness endpoint was bound on http://0.0.0.0:PORT, IPv4 only: on an IPv6-only
    cluster the kubelet probes the pod's IPv6 address, the startup probe never passed, and the
    operator was restarted forever. health.address reaches --health-address, and the URL kopf
    binds brackets an IPv6 address."""
    for address, url in (("0.0.0.0", "http://0.0.0.0:8081/healthz"), ("::", "http://[::]:8081/healthz"),
                         ("fd00:0:0::a", "http://[fd00::a]:8081/healthz")):
        values = {} if address == "0.0.0.0" else {"health": {"address": address}}
        [container] = _one(_render(values), "Deployment")["spec"]["template"]["spec"]["containers"]
        params = _operator_params(container)
        assert params["health_address"] == address  # "::" survives YAML: unquoted it read as a mapping
        # the default is not passed: an older image cached under the same tag refuses the flag
        assert any(a.startswith("--health-address") for a in container["args"]) is (address != "0.0.0.0")
        endpoint = runner.liveness_endpoint(params["health_address"], params["health_port"])
        assert endpoint == url
        # kopf binds the URL's hostname (kopf/_core/engines/probing.py)
        assert urllib.parse.urlsplit(endpoint).hostname == str(urllib.parse.urlsplit(url).hostname)
    chart = helm_python.Chart.load(CHART)
    # ":" and "1:2" passed the 0.2.0 schema (any hex, dots and a colon) and crash-looped the operator
    for address in ("localhost", "[::]", "", "10.0.0", ":", "1:2", "1::2::3", "::ffff:1.2.3.256"):
        with pytest.raises(helm_python.HelmValuesError, match="address"):
            chart.render({"health": {"address": address}}, name="huorn", namespace="x")


@settings(max_examples=300)
@given(st.one_of(st.ip_addresses().map(str), st.ip_addresses(v=6).map(lambda a: a.exploded),
                 st.text(alphabet="0123456789abcdefABCDEF:.", max_size=40)))
def test_the_schema_admits_as_health_address_exactly_what_huorn_operator_accepts(address: str) -> None:
    """The schema refuses at `helm install` what `huorn operator --health-address` would refuse
    once started (a crash loop), and admits every address the operator binds: its pattern is
    RFC 3986's IPv6address and dotted-quad IPv4, checked against Python's parser."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["health"]["properties"]["address"]["pattern"]
    try:
        ipaddress.ip_address(address)
        accepted = True
    except ValueError:
        accepted = False
    assert bool(re.search(pattern, address)) is accepted


@pytest.mark.parametrize("address", ["localhost", "[::]", "10.0.0", ""])
def test_huorn_operator_refuses_a_health_address_that_is_no_ip_naming_the_flag(address: str) -> None:
    """kopf would fail on it only once started (a host name is resolved, brackets are no IP),
    after the credentials and the logging; the flag is checked with the others."""
    result = CliRunner().invoke(_operator_app(), ["--kubeconfig", "/nonexistent", "--health-port", "8081",
                                                  "--health-address", address])
    assert result.exit_code == 2
    assert ("error: --health-address must be an IP address such as 0.0.0.0 (IPv4) or :: (IPv6), "
            f"got {address!r}") in result.stderr
    with pytest.raises(ValueError):
        runner.liveness_endpoint(address, 8081)


def test_jobs_are_pulled_from_the_operators_mirror_unless_told_otherwise() -> None:
    """An air-gapped cluster mirrors the one image and sets image.repository; a job without
    spec.image must come from the mirror too, not from the public registry."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

    def job_image(values: dict[str, Any]) -> str:
        [container] = _one(_render(values), "Deployment")["spec"]["template"]["spec"]["containers"]
        [arg] = [a for a in container["args"] if a.startswith("--job-image=")]
        return arg.removeprefix("--job-image=")

    assert job_image({}) == f"ghcr.io/huorn-io/huorn:{app_version}-cu126"
    mirror = {"image": {"repository": "registry.corp/huorn"}}
    assert job_image(mirror) == f"registry.corp/huorn:{app_version}-cu126"
    tagged = {"image": {"repository": "registry.corp/huorn", "tag": "0.1.1"}}
    assert job_image(tagged) == "registry.corp/huorn:0.1.1-cu126"
    # GPU jobs need the CUDA build (their run config asks for cuda); "" for a CPU-only cluster
    assert job_image({**tagged, "jobImageSuffix": ""}) == "registry.corp/huorn:0.1.1"
    # a tag that names the CUDA build already is not suffixed twice
    cuda = {"image": {"repository": "registry.corp/huorn", "tag": "0.1.1-cu126"}}
    assert job_image(cuda) == "registry.corp/huorn:0.1.1-cu126"
    assert job_image({"jobImage": "registry.corp/huorn-cuda:0.1.0"}) == "registry.corp/huorn-cuda:0.1.0"
    with pytest.raises(helm_python.HelmValuesError, match="jobImage"):
        helm_python.Chart.load(CHART).render({"jobImage": "two words"}, name="huorn", namespace="x")


def test_cluster_role_is_least_privilege_and_never_reads_secrets() -> None:
    granted = _granted(_operator_role(_render({})))
    assert all("*" not in verbs for verbs in granted.values()) and all("*" not in k[1] for k in granted)
    assert not any(resource in ("secrets", "pods/exec") for _, resource in granted)
    assert granted[("", "pods")] == {"list", "watch", "create", "patch", "delete"}
    assert granted[("", "nodes")] == {"get", "list", "watch", "patch"}, "read; patched to cordon"
    # delete: a finished TrainingJob's spec.ttlSecondsAfterFinished (operator/training.py)
    assert granted[("huorn.io", "trainingjobs")] == {"get", "list", "watch", "patch", "delete"}
    assert granted[("huorn.io", "rljobs")] == {"get", "list", "watch", "patch"}
    assert ("kopf.dev", "clusterkopfpeerings") not in granted
    # A child's ownerReference with blockOwnerDeletion is admitted by the
    # OwnerReferencesPermissionEnforcement plugin (OpenShift's default) only from a client that may
    # update the owner's finalizers: without it every pod, Service and ConfigMap is refused (403).
    for kind in kinds.JOB_KINDS:
        owner = manifests.JobRef(kind.kind, "job", "ns", "uid").owner_reference
        if owner.get("blockOwnerDeletion"):
            assert granted.get(("huorn.io", f"{kind.plural}/finalizers")) == {"update"}, kind.kind
    ha_rules = _operator_role(_render(VARIANTS["ha"]))["rules"]
    assert any("clusterkopfpeerings" in r["resources"] for r in ha_rules)


def test_the_platform_may_assign_the_operators_uid_and_groups() -> None:
    """The pod's runAsUser, runAsGroup and fsGroup (10001) were fixed in the template and the
    schema refused any override, while OpenShift's restricted-v2 SCC refuses a UID outside the
    namespace's range: its users null them and the platform picks them, the rest of the hardening
    staying as it is (Pod Security "restricted")."""
    pod = _one(_render(VARIANTS["platform-uid"]), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    pod = _one(_render({"podSecurityContext": {"runAsUser": 1000680000, "fsGroup": 1000680000}}),
               "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 1000680000
    with pytest.raises(helm_python.HelmValuesError, match="runAsUser"):
        helm_python.Chart.load(CHART).render(
            {"podSecurityContext": {"runAsUser": "root"}}, name="huorn", namespace="x")


def test_the_default_edit_admin_and_view_roles_carry_the_job_kinds() -> None:
    """Without them a namespace's `edit` or `admin` could not create a TrainingJob, nor `view`
    list one, until a cluster admin wrote roles by hand. Job authors get the jobs, their /scale
    (kubectl scale) and their /status to read; VirtualClusters, the GPU quotas between teams,
    only to read: writing them stays with cluster admins, as status stays the operator's."""
    docs = _render({})
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    edit, view = roles.pop("huorn-huorn-system-edit"), roles.pop("huorn-huorn-system-view")
    operator_role = _operator_role(docs)["metadata"]["name"]
    assert list(roles) == [operator_role], "the operator's own rights aggregate nowhere"

    def aggregated_to(role: dict[str, Any]) -> set[str]:
        labels = role["metadata"]["labels"].items()
        return {k.removeprefix(AGGREGATE) for k, v in labels if k.startswith(AGGREGATE) and v == "true"}

    assert aggregated_to(edit) == {"edit", "admin"}, "view must not gain write verbs"
    assert aggregated_to(view) == {"view", "edit", "admin"}
    read, write = {"get", "list", "watch"}, {"create", "update", "patch", "delete", "deletecollection"}
    expected_edit: dict[tuple[str, str], set[str]] = {("huorn.io", "virtualclusters"): read}
    expected_view: dict[tuple[str, str], set[str]] = {("huorn.io", "virtualclusters"): read,
                                                      ("huorn.io", "virtualclusters/status"): {"get"}}
    for kind in kinds.JOB_KINDS:
        expected_edit[("huorn.io", kind.plural)] = read | write
        expected_view[("huorn.io", kind.plural)] = read
        for expected in (expected_edit, expected_view):
            expected[("huorn.io", f"{kind.plural}/status")] = {"get"}
        if kind.scale_spec_path:  # the CRD's scale subresource
            expected_edit[("huorn.io", f"{kind.plural}/scale")] = {"get", "update", "patch"}
            expected_view[("huorn.io", f"{kind.plural}/scale")] = {"get"}
    assert _granted(edit) == expected_edit
    assert _granted(view) == expected_view
    off = _render({"rbac": {"aggregateToDefaultRoles": False}})
    assert [d["metadata"]["name"] for d in off if d["kind"] == "ClusterRole"] == ["huorn-huorn-system"]


def test_values_schema_and_guards_reject_bad_values_with_the_field() -> None:
    chart = helm_python.Chart.load(CHART)
    with pytest.raises(helm_python.HelmValuesError, match="replicaCount"):
        chart.render({"replicaCount": "two"}, name="huorn", namespace="x")
    with pytest.raises(helm_python.HelmValuesError, match="pullPolicy"):
        chart.render({"image": {"repository": "r", "pullPolicy": "Sometimes"}}, name="huorn", namespace="x")
    with pytest.raises(helm_python.HelmValuesError, match="podStartSeconds"):
        chart.render({"podStartSeconds": 0}, name="huorn", namespace="x")
    with pytest.raises(helm_python.HelmRenderError, match=r"peering\.enabled"):
        chart.render({"replicaCount": 3}, name="huorn", namespace="x")
    with pytest.raises(helm_python.HelmRenderError, match="needs watchNamespaces empty"):
        chart.render({**VARIANTS["ha"], "watchNamespaces": ["team-a"]}, name="huorn", namespace="x")


@pytest.mark.parametrize("path", VALUE_PATHS, ids=".".join)
def test_a_value_missing_after_reuse_values_from_an_older_chart_is_refused_by_name(
        tmp_path: Path, path: tuple[str, ...]) -> None:
    """`helm upgrade --reuse-values` from a chart older than a value renders without it: a missing
    jobImageSuffix silently ran GPU jobs on the CPU image, a missing autoscaleSeconds rendered
    `--autoscale-seconds=` and the operator exited 2. The schema requires every value that
    values.yaml sets, so Helm refuses the upgrade and names the value instead."""
    chart = helm_python.Chart.load(_chart_without(tmp_path, path))
    with pytest.raises(helm_python.HelmValuesError, match=f"missing property '{path[-1]}'"):
        chart.render({}, name="huorn", namespace="huorn-system")


@pytest.mark.parametrize("path", [
    ("jobImageSuffix",), ("resyncSeconds",), ("podStartSeconds",), ("replacementBackoffSeconds",),
    ("autoscaleSeconds",), ("health", "port"), ("metrics", "port"),
], ids=".".join)
def test_a_flag_whose_value_is_missing_fails_rendering_even_without_the_schema(
        tmp_path: Path, path: tuple[str, ...]) -> None:
    """`helm --skip-schema-validation` bypasses the schema's required values: the templates refuse
    on their own rather than render an empty flag (`--autoscale-seconds=`, which the operator
    refuses at start) or drop the CUDA suffix from the job image."""
    chart = helm_python.Chart.load(_chart_without(tmp_path, path, schema=False))
    with pytest.raises(helm_python.HelmRenderError, match=rf"{re.escape('.'.join(path))} is unset.*"
                                                          r"--reset-then-reuse-values"):
        chart.render({}, name="huorn", namespace="huorn-system")


def test_notes_say_how_to_use_it() -> None:
    files = helm_python.Chart.load(CHART).render({}, name="huorn", namespace="huorn-system")
    notes = next(text for path, text in files.items() if path.endswith("NOTES.txt"))
    assert "kubectl get trainingjobs" in notes and "all namespaces" in notes
    named = re.findall(r"kubectl apply -f (\S+)", notes)
    assert len(named) == 2 and all((ROOT / path).is_file() for path in named), named
    # the commands find the example job where it is: its namespace (created first) and its name
    meta = yaml.safe_load((ROOT / "examples" / "training-job.yaml").read_text())["metadata"]
    assert f"kubectl create namespace {meta['namespace']}" in notes
    assert f"-n {meta['namespace']} --for=condition=Ready trainingjob/{meta['name']}" in notes


def test_chart_renders_as_a_subchart_with_helm_globals() -> None:
    """A parent chart's values reach a subchart with `global` in them, which a schema closed to
    unknown keys refused."""
    docs = _render({"global": {"imageRegistry": "registry.corp", "imagePullSecrets": []}})
    assert _one(docs, "Deployment")["spec"]["replicas"] == 1


def test_the_cpu_limit_may_be_dropped_but_the_memory_limit_may_not() -> None:
    [container] = _one(_render({"resources": {"limits": {"cpu": None}}}), "Deployment")["spec"]["template"][
        "spec"]["containers"]
    assert container["resources"]["limits"] == {"memory": "512Mi"}
    with pytest.raises(helm_python.HelmValuesError, match="memory"):
        helm_python.Chart.load(CHART).render(
            {"resources": {"limits": {"memory": None}}}, name="huorn", namespace="x")


@pytest.mark.parametrize("interval", ["30s", "1m30s", "1h", "2h30m", "1d", "500ms", "1w"])
def test_service_monitor_takes_any_prometheus_duration(interval: str) -> None:
    docs = _render({"metrics": {"serviceMonitor": {"enabled": True, "interval": interval}}})
    [endpoint] = _one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["interval"] == interval


@pytest.mark.parametrize("interval", ["", "30", "1.5m", "m", "30 s", "1m 30s"])
def test_service_monitor_refuses_what_is_no_prometheus_duration(interval: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="interval"):
        values = {"metrics": {"serviceMonitor": {"enabled": True, "interval": interval}}}
        helm_python.Chart.load(CHART).render(values, name="huorn", namespace="x")


def test_one_port_for_metrics_and_health_fails_rendering_naming_both() -> None:
    """`huorn operator` exits 2 when --metrics-port is --health-port: the chart says so first,
    instead of a Deployment whose pod crash-loops."""
    with pytest.raises(helm_python.HelmRenderError, match=r"metrics\.port and health\.port are both 8081"):
        helm_python.Chart.load(CHART).render({"metrics": {"port": 8081}}, name="huorn", namespace="x")
    with pytest.raises(helm_python.HelmRenderError, match=r"metrics\.port and health\.port are both 9000"):
        helm_python.Chart.load(CHART).render(
            {"metrics": {"port": 9000}, "health": {"port": 9000}}, name="huorn", namespace="x")


def test_an_existing_service_account_must_be_named() -> None:
    """create=false with no name bound the ClusterRole to the namespace's default ServiceAccount,
    so to every pod of that namespace that names none."""
    with pytest.raises(helm_python.HelmRenderError, match=r"serviceAccount\.name"):
        helm_python.Chart.load(CHART).render(
            {"serviceAccount": {"create": False}}, name="huorn", namespace="x")
    docs = _render({"serviceAccount": {"create": False, "name": "huorn-ops"}})
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    [subject] = _one(docs, "ClusterRoleBinding")["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "huorn-ops", "namespace": "huorn-system"}
    assert _one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "huorn-ops"


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}


def test_installs_of_one_release_name_in_two_namespaces_share_no_cluster_scoped_object() -> None:
    """docs/operator.md runs one install per set of namespaces; the ClusterRole and its binding
    were named after the release alone, so `helm install huorn -n team-b` failed on the objects
    that team-a's `huorn` owned (or, adopted, rebound them to team-b's ServiceAccount)."""
    names = {}
    for namespace in ("team-a", "team-b"):
        docs = _render({"watchNamespaces": [namespace]}, namespace)
        names[namespace] = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED}
        binding = _one(docs, "ClusterRoleBinding")
        assert binding["roleRef"]["name"] == _operator_role(docs)["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == namespace
    assert names["team-a"] and not names["team-a"] & names["team-b"], names
    # cut to 63 characters, names that differ only past the cut still differ
    long_names = []
    for namespace in ("a" * 60 + "-one", "a" * 60 + "-two"):
        docs = _render({"fullnameOverride": "f" * 63}, namespace)
        long_names.append({(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED})
        assert all(len(name) <= 63 for _, name in long_names[-1]), long_names[-1]
    assert not long_names[0] & long_names[1], long_names


def test_name_overrides_rename_the_release_objects() -> None:
    """nameOverride and fullnameOverride are every chart's way to fit a naming scheme; the schema,
    closed to unknown keys, refused both."""
    docs = _render({"fullnameOverride": "gpu-operator"})
    assert _one(docs, "Deployment")["metadata"]["name"] == "gpu-operator"
    assert _one(docs, "ServiceAccount")["metadata"]["name"] == "gpu-operator"
    assert _one(docs, "Service")["metadata"]["name"] == "gpu-operator-metrics"
    assert _operator_role(docs)["metadata"]["name"] == "gpu-operator-huorn-system"
    docs = _render({"nameOverride": "trainer"})
    deployment = _one(docs, "Deployment")
    assert deployment["metadata"]["name"] == "huorn-trainer"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/name"] == "trainer"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert _one(docs, "Service")["spec"]["selector"].items() <= pod_labels.items()
    with pytest.raises(helm_python.HelmValuesError, match="fullnameOverride"):
        helm_python.Chart.load(CHART).render({"fullnameOverride": "Not A Name"}, name="huorn", namespace="x")


def test_a_startup_probe_holds_off_liveness_while_startup_lists_the_cluster() -> None:
    """kopf answers /healthz only after the startup handlers listed every node, pod and job; the
    liveness probe alone (30 s, then 3 × 20 s) restarted the operator mid-startup on a big cluster."""
    [container] = _one(_render({}), "Deployment")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["httpGet"]["path"] == "/healthz" and ports[startup["httpGet"]["port"]] == 8081
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "10 minutes by default"
    liveness_window = liveness.get("initialDelaySeconds", 0) + liveness["periodSeconds"] * liveness[
        "failureThreshold"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > liveness_window
    values = {"health": {"startupProbe": {"periodSeconds": 15, "failureThreshold": 120}}}
    [container] = _one(_render(values), "Deployment")["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 120)
    with pytest.raises(helm_python.HelmValuesError, match="failureThreshold"):
        helm_python.Chart.load(CHART).render(
            {"health": {"startupProbe": {"failureThreshold": 0}}}, name="huorn", namespace="x")


OPERATOR_DOCS = ROOT / "docs" / "operator.md"


def test_the_documented_crd_upgrade_overrides_helms_field_manager() -> None:
    """Helm created the CRDs (field manager `helm`): a server-side apply by kubectl without
    --force-conflicts stops on a conflict for every field the new schema changes."""
    texts = {path: path.read_text() for path in (OPERATOR_DOCS, ROOT / "README.md")}
    applies = [(path.name, line) for path, text in texts.items() for line in
               re.findall(r"kubectl apply[^`\n]*--server-side[^`\n]*", text)]
    assert applies, "docs/operator.md documents the CRD upgrade"
    assert all("--force-conflicts" in line for _, line in applies), applies


def test_every_documented_helm_command_names_the_namespace_and_an_upgrade_keeps_the_values() -> None:
    """The HA steps said `helm upgrade huorn helm/huorn --set replicaCount=2 ...`: run as written,
    it upgraded a release `huorn` in the current namespace (not huorn-system's) and, with no
    values given, put every earlier setting back to the chart's default. `--reuse-values` is no
    better: an older release's values lack those added since, which the schema refuses."""
    texts = {path: path.read_text() for path in (*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md")}
    commands = [(path.relative_to(ROOT), m.group(0)) for path, text in texts.items() for m in
                re.finditer(r"helm (install|upgrade|uninstall) [^\s`]+( [^\s`]+)?[^`\n]*", text)]
    upgrades = [(path, line) for path, line in commands if line.startswith("helm upgrade")]
    assert upgrades, "docs/operator.md documents the upgrade"
    for path, line in commands:
        assert re.search(r" (-n|--namespace)[ =]\S", line), f"{path}: {line}"
    for path, line in upgrades:
        assert re.search(r" (-f|--values)[ =]\S| --reset-then-reuse-values", line), f"{path}: {line}"
        assert " --reuse-values" not in line, f"{path}: {line}"


def test_the_uninstall_docs_release_the_operators_finalizer() -> None:
    """After `helm uninstall` a job keeps the operator's finalizer and hangs in Terminating, with
    its namespace: the docs say to delete jobs first and how to drop the finalizer by hand."""
    source = (ROOT / "huorn" / "operator" / "handlers.py").read_text()
    [finalizer] = re.findall(r'settings\.persistence\.finalizer = "([^"]+)"', source)
    text = OPERATOR_DOCS.read_text()
    section = text[text.index("**Uninstall.**"):]
    section = section[:section.index("\n## ")]
    assert finalizer in section and "Terminating" in section
    deletes = section.index("kubectl delete trainingjobs,rljobs,inferencejobs")
    assert deletes < section.index("helm uninstall huorn"), "the jobs go while the operator still runs"
    assert """--type=merge -p '{"metadata":{"finalizers":null}}'""" in section
