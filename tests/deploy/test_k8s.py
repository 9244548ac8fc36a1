"""The Kubernetes manifests: schema-valid, and consistent with each other and with evald.

Schemas: the Kubernetes JSON schemas bundled in ``kubernetes-validate`` (offline), in strict mode
(unknown fields are errors), for the oldest Kubernetes the sidecar layout supports and the newest
the package knows. Then the promises the schema cannot check: the sidecar and SGLang share the
socket path, the probes ask evald through that socket, the config in the Secret is one evald
accepts, every container is locked down and sized, selectors and policies select the pods
they are meant for.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from evald.daemon import parse_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# Native sidecars (init containers with restartPolicy: Always) are on by default from 1.29.
OLDEST_KUBERNETES = "1.29.0"
NEWEST_KUBERNETES = kubernetes_validate.utils.latest_version() + ".0"
SOCKET = "unix:/run/evald/evald.sock"

Doc = dict[str, Any]


@cache
def documents() -> tuple[tuple[str, Doc], ...]:
    """(file name, document) for every Kubernetes object in deploy/k8s."""
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return tuple(found)


def objects(kind: str) -> list[Doc]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def one(kind: str, name: str) -> Doc:
    (found,) = [doc for doc in objects(kind) if doc["metadata"]["name"] == name]
    return found


def _api_objects() -> list[tuple[str, Doc]]:
    return [(file, doc) for file, doc in documents() if doc["kind"] != "Kustomization"]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, NEWEST_KUBERNETES])
@pytest.mark.parametrize(
    ("file", "doc"),
    _api_objects(),
    ids=[f"{file}:{doc['kind']}" for file, doc in _api_objects()],
)
def test_manifest_matches_the_kubernetes_schema(file: str, doc: Doc, version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{file}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_the_schema_check_can_fail() -> None:
    """Strict validation rejects what a typo produces, and the sidecar field before 1.28."""
    deployment = one("Deployment", "sglang-evald")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_KUBERNETES, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(deployment, "1.27.0", strict=True)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = objects("Kustomization")
    listed = set(kustomization["resources"])
    present = {path.name for path in MANIFESTS if path.name != "kustomization.yaml"}
    assert listed == present


# --- the worker pod -------------------------------------------------------------------------------


def _pod() -> Doc:
    pod: Doc = one("Deployment", "sglang-evald")["spec"]["template"]
    return pod


def _sidecar() -> Doc:
    (sidecar,) = [c for c in _pod()["spec"]["initContainers"] if c["name"] == "evald"]
    return sidecar


def _sglang() -> Doc:
    (container,) = [c for c in _pod()["spec"]["containers"] if c["name"] == "sglang"]
    return container


def _arg(container: Doc, flag: str) -> str:
    args: list[str] = container["args"]
    return args[args.index(flag) + 1]


def _mount_of(container: Doc, path: str) -> str:
    """The volume name mounted at the folder holding ``path``."""
    folder = str(Path(path).parent)
    (name,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == folder]
    return name


def _config() -> Doc:
    secret = one("Secret", "evald-config")
    config: Doc = tomllib.loads(secret["stringData"]["evald.toml"])
    return config


def test_evald_is_a_native_sidecar_sharing_the_socket() -> None:
    sidecar, sglang = _sidecar(), _sglang()
    assert sidecar["restartPolicy"] == "Always"
    assert _arg(sidecar, "--listen") == SOCKET
    env = {e["name"]: e for e in sglang["env"]}
    assert env["EVALD_TARGET"]["value"] == SOCKET
    socket_path = SOCKET.removeprefix("unix:")
    shared = _mount_of(sidecar, socket_path)
    assert _mount_of(sglang, socket_path) == shared
    (volume,) = [v for v in _pod()["spec"]["volumes"] if v["name"] == shared]
    assert "emptyDir" in volume
    # The socket has no network listener to guard it: no gRPC port is exposed.
    assert [p["containerPort"] for p in sidecar["ports"]] == [9464]


def test_sidecar_probes_ask_evald_through_the_socket() -> None:
    sidecar = _sidecar()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = sidecar[probe]["exec"]["command"]
        assert command[:2] == ["evald", "health"]
        assert command[command.index("--target") + 1] == SOCKET
        timeout = float(command[command.index("--timeout") + 1])
        assert timeout < sidecar[probe]["timeoutSeconds"], "evald gives up before kubelet does"


def test_config_comes_from_the_secret_and_evald_accepts_it() -> None:
    sidecar = _sidecar()
    config_path = _arg(sidecar, "--config")
    volume_name = _mount_of(sidecar, config_path)
    (volume,) = [v for v in _pod()["spec"]["volumes"] if v["name"] == volume_name]
    secret = one("Secret", volume["secret"]["secretName"])
    assert Path(config_path).name in secret["stringData"]
    config = parse_config(secret["stringData"][Path(config_path).name], "evald-config")
    # SGLang (another uid) reaches the socket through the pod's fsGroup.
    assert config.server.socket_mode == 0o660
    assert _pod()["spec"]["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]
    grace = _pod()["spec"]["terminationGracePeriodSeconds"]
    assert config.server.shutdown_grace_s < grace


def test_prometheus_annotations_point_at_the_metrics_port() -> None:
    annotations = _pod()["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    port = int(annotations["prometheus.io/port"])
    host, _, configured = _config()["server"]["metrics_listen"].rpartition(":")
    assert int(configured) == port and host == "0.0.0.0"
    assert port in [p["containerPort"] for p in _sidecar()["ports"]]


def _pod_templates() -> list[tuple[str, Doc]]:
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in objects("Deployment")]


@pytest.mark.parametrize(
    ("name", "pod"), _pod_templates(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_container_is_locked_down_and_sized(name: str, pod: Doc) -> None:
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    containers = spec.get("initContainers", []) + spec["containers"]
    for container in containers:
        where = f"{name}/{container['name']}"
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"]["drop"] == ["ALL"], where
        assert "add" not in security["capabilities"], where
        resources = container["resources"]
        assert resources["requests"].get("cpu") and resources["requests"].get("memory"), where
        assert resources["limits"].get("memory"), where


def test_images_are_pinned_to_the_released_versions() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert _sidecar()["image"] == f"evald:{project}"
    assert _sglang()["image"].endswith(f":0.5.23-{project}")
    router = one("Deployment", "sglang-router")["spec"]["template"]["spec"]["containers"][0]
    assert re.fullmatch(r"lmsysorg/sglang:v0\.5\.23-cu\d+", router["image"])


# --- scale-out: router, services, policies --------------------------------------------------------


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_services_select_their_pods() -> None:
    pods = {name: pod["metadata"]["labels"] for name, pod in _pod_templates()}
    assert _matches(one("Service", "sglang-evald")["spec"]["selector"], pods["sglang-evald"])
    assert _matches(one("Service", "sglang-router")["spec"]["selector"], pods["sglang-router"])
    assert not _matches(one("Service", "sglang-router")["spec"]["selector"], pods["sglang-evald"])
    budget = one("PodDisruptionBudget", "sglang-evald")["spec"]["selector"]["matchLabels"]
    assert _matches(budget, pods["sglang-evald"])


def test_router_discovers_the_workers() -> None:
    deployment = one("Deployment", "sglang-router")
    pod = deployment["spec"]["template"]
    (router,) = pod["spec"]["containers"]
    selector = dict(item.split("=", 1) for item in _arg(router, "--selector").split(","))
    assert _matches(selector, _pod()["metadata"]["labels"])
    worker_port = int(_arg(router, "--service-discovery-port"))
    assert worker_port == _sglang()["ports"][0]["containerPort"] == int(_arg(_sglang(), "--port"))
    account = pod["spec"]["serviceAccountName"]
    assert one("ServiceAccount", account)
    binding = one("RoleBinding", account)
    role = one("Role", binding["roleRef"]["name"])
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and set(rule["verbs"]) == {"get", "list", "watch"}
    assert _pod()["spec"]["automountServiceAccountToken"] is False, "workers need no API access"


def test_network_policy_admits_only_router_and_monitoring_to_workers() -> None:
    policy = one("NetworkPolicy", "sglang-evald")["spec"]
    assert _matches(policy["podSelector"]["matchLabels"], _pod()["metadata"]["labels"])
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    router_labels = one("Deployment", "sglang-router")["spec"]["template"]["metadata"]["labels"]
    sources = []
    for rule in policy["ingress"]:
        assert rule.get("from"), "every ingress rule names its sources"
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                assert _matches(peer["podSelector"]["matchLabels"], router_labels)
                sources.append(("router", {p["port"] for p in rule["ports"]}))
            else:
                namespace = peer["namespaceSelector"]["matchLabels"]
                sources.append(
                    (namespace["kubernetes.io/metadata.name"], {p["port"] for p in rule["ports"]})
                )
    assert ("router", {30000}) in sources
    assert ("monitoring", {9464, 30000}) in sources
    egress_ports = {p["port"] for rule in policy["egress"] for p in rule["ports"]}
    assert egress_ports == {53, 5432}, "workers reach nothing but DNS and the fleet store"


def test_every_sidecar_follows_the_fleet_store_with_the_password_from_a_secret() -> None:
    config = parse_config(_config_text(), "evald-config")
    assert config.store.fleet and config.store.url.startswith("postgresql://")
    assert config.store.password_env and not config.store.password_file
    env = {e["name"]: e for e in _sidecar()["env"]}
    reference = env[config.store.password_env]["valueFrom"]["secretKeyRef"]
    secret = one("Secret", reference["name"])
    assert reference["key"] in secret["stringData"]
    # The state folder (the store's local cache) survives a restart of the sidecar alone.
    state = _mount_of(_sidecar(), "/var/lib/evald/x")
    (volume,) = [v for v in _pod()["spec"]["volumes"] if v["name"] == state]
    assert "emptyDir" in volume


def _config_text() -> str:
    text: str = one("Secret", "evald-config")["stringData"]["evald.toml"]
    return text


def test_the_worker_pod_gives_evald_whole_cores_of_its_own() -> None:
    """Guaranteed QoS (every container's requests equal to its limits) with integer CPUs: the
    static CPU manager then gives the sidecar and SGLang cores of their own, apart
    (docs/operations.md, "Partitioning the CPU"), and evald runs one worker per core."""
    pod = _pod()
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        resources, where = container["resources"], container["name"]
        assert resources["requests"] == resources["limits"], where
        assert re.fullmatch(r"[1-9]\d*", str(resources["limits"]["cpu"])), where
    cores = int(_sidecar()["resources"]["limits"]["cpu"])
    server = parse_config(_config_text(), "evald-config").server
    assert server.resolved_threads == cores
    assert not server.cpus  # the container's cpuset is its cores
