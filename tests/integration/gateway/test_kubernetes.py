"""deploy/kubernetes: the kustomize base and the example overlay, rendered with `kubectl kustomize`.

Every rendered object is checked against the Kubernetes OpenAPI schemas of a pinned version, offline and
strict (unknown fields are errors), and the ServiceMonitor against the fields of its CRD. Then what the
schemas cannot see: the objects refer to each other correctly, the ConfigMap's config passes `sluice check`,
the drain timing adds up, and the pod's own command, config and environment serve real requests on
loopback (a scripted upstream, a real redis-server), also with a read-only root filesystem as in the pod.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import openai
import pytest
import yaml

from plugins.auth.keys import new_key
from tests.support.gateway import free_port, wait_ready
from tests.support.redis import RedisServer
from tests.support.upstream import Ok, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy/kubernetes/base"
OVERLAY = ROOT / "deploy/kubernetes/overlays/example"
K8S_VERSION = "1.32"  # the schemas every object must satisfy (kubernetes-validate bundles them)
DEFAULT_GRACE_S = 30  # the gateway's shutdown.grace_s when the config leaves it out
EXIT_MARGIN_S = 5
GATEWAY = {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/component": "gateway"}
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
# The part of the Prometheus Operator's PrometheusRule CRD (monitoring.coreos.com/v1) that the base uses.
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
# The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) that the base uses.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port", "path"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def kustomize_major(binary: str | None) -> int:
    """The major version of the kustomize built into kubectl (0 if none): v4 and later know this base's fields."""
    if binary is None:
        return 0
    done = subprocess.run([binary, "version", "--client"], capture_output=True, text=True, timeout=60)
    found = re.search(r"Kustomize Version: v(\d+)", done.stdout)
    return int(found[1]) if found else 0


kubectl = shutil.which("kubectl")
pytestmark = [
    pytest.mark.skipif(kubectl is None, reason="kubectl is not installed (apt-get install kubectl)"),
    pytest.mark.skipif(
        kubectl is not None and kustomize_major(kubectl) < 4,
        reason="kubectl embeds a kustomize older than v4 (kubectl 1.20 or older): install kubectl 1.21 or later",
    ),
]


def render(directory: Path) -> list[dict[str, Any]]:
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(BASE)


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return render(OVERLAY)


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def gateway_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = one(objects, "Deployment", "sluice")["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def config_text(objects: list[dict[str, Any]]) -> str:
    """The gateway.yaml the pod reads: the ConfigMap behind the volume mounted where `-c` points."""
    pod = one(objects, "Deployment", "sluice")["spec"]["template"]["spec"]
    container = gateway_container(objects)
    path = Path(container["args"][container["args"].index("-c") + 1])
    (mount,) = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    (item,) = [i for i in volume["configMap"]["items"] if str(Path(mount["mountPath"]) / i["path"]) == str(path)]
    text: str = configmap["data"][item["key"]]
    return text


def secret_values(secret: dict[str, Any]) -> dict[str, str]:
    values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    given: dict[str, str] = secret.get("stringData", {})
    return values | given


def pod_env(objects: list[dict[str, Any]], secret: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: envFrom, then env with $(NAME) references."""
    container = gateway_container(objects)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= one(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    fields = {"metadata.name": "sluice-0", "metadata.namespace": "test", "spec.nodeName": "node-0"}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = secret[var["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


# -- the schemas --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["base", "overlay"])
def test_every_object_is_valid_for_the_pinned_kubernetes(which: str, request: pytest.FixtureRequest) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(which)
    kinds = sorted(o["kind"] for o in objects)
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR)
        elif obj["kind"] == "PrometheusRule":
            jsonschema.validate(obj, PROMETHEUS_RULE)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    expected = ["ConfigMap", "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"]
    expected += ["PrometheusRule", "Service", "ServiceMonitor"]
    if which == "overlay":
        expected += ["Namespace", "Secret", "Service", "StatefulSet"]
    assert kinds == sorted(expected)


def test_the_schemas_are_strict() -> None:
    """A misspelt field is caught, so the checks above can fail."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor | {"spec": {"selector": {}, "endpoints": [{"port": "http"}]}}, SERVICE_MONITOR)
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"}}
    misspelt = {"groups": [{"name": "g", "rules": [{"alert": "A", "exp": "1"}]}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule | {"spec": misspelt}, PROMETHEUS_RULE)


# -- what refers to what ------------------------------------------------------------------------------------


def test_the_objects_find_each_other(overlay: list[dict[str, Any]]) -> None:
    deployment = one(overlay, "Deployment", "sluice")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == GATEWAY
    assert GATEWAY.items() <= pod_labels.items()
    container = gateway_container(overlay)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    service = one(overlay, "Service", "sluice")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports.keys() == {"http", "admin"}
    http = service_ports["http"]
    assert (http["port"], ports[http["targetPort"]]) == (80, 8080)
    # The admin routes are on a port of their own, the one the config's admin listener opens.
    admin = yaml.safe_load(config_text(overlay))["admin"]
    assert ports[service_ports["admin"]["targetPort"]] == admin["port"]
    assert container["args"][container["args"].index("--port") + 1] == "8080"

    hpa = one(overlay, "HorizontalPodAutoscaler", "sluice")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sluice"}
    assert container["resources"]["requests"]["cpu"]  # CPU utilisation is relative to the request
    pdb = one(overlay, "PodDisruptionBudget", "sluice")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]

    monitor = one(overlay, "ServiceMonitor", "sluice")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"admin"}

    for spread in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]:
        assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    assert {s["topologyKey"] for s in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == 8080


def test_the_overlay_sets_namespace_image_and_a_dev_valkey(overlay: list[dict[str, Any]]) -> None:
    namespace = one(overlay, "Namespace")["metadata"]["name"]
    assert all(o["metadata"].get("namespace") == namespace for o in overlay if o["kind"] != "Namespace")
    assert gateway_container(overlay)["image"] == "registry.example.com/sluice:0.1.0"
    assert one(overlay, "Deployment", "sluice")["spec"]["replicas"] == 3

    # REDIS_URL names the dev Valkey's Service and port, and that Service selects the StatefulSet's pods.
    secret = secret_values(one(overlay, "Secret", "sluice"))
    refs = {
        var["name"]: var["valueFrom"]["secretKeyRef"]
        for var in gateway_container(overlay)["env"]
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    assert refs.keys() == {"OPENAI_API_KEY", "AZURE_OPENAI_API_KEY", "REDIS_URL"}
    assert {ref["name"] for ref in refs.values()} == {"sluice"}
    assert {r["key"] for r in refs.values()} <= secret.keys()
    url = httpx.URL(secret["REDIS_URL"])
    service = one(overlay, "Service", url.host)
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    statefulset = one(overlay, "StatefulSet", url.host)
    assert statefulset["spec"]["replicas"] == 1
    assert statefulset["spec"]["serviceName"] == url.host
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    (valkey,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert {"--save", "--appendonly"} <= set(valkey["args"])  # no persistence
    assert "volumeClaimTemplates" not in statefulset["spec"]

    # The base ships no Secret: real keys are made out of band, never applied from git.
    assert not [o for o in render(BASE) if o["kind"] == "Secret"]


def test_the_config_passes_sluice_check(overlay: list[dict[str, Any]], tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text(overlay))
    env = {**os.environ, **pod_env(overlay, secret_values(one(overlay, "Secret", "sluice")))}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", "-c", str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ok: {path.resolve()}: 2 backend(s)")
    assert "auth, rate_limit, cache, slo" in done.stdout

    # Without the Secret's values the config says which variable is missing: the pod would not start quietly.
    del env["REDIS_URL"]
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", "-c", str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0
    assert "REDIS_URL" in done.stderr


def test_the_grace_period_covers_prestop_and_the_drain(base: list[dict[str, Any]]) -> None:
    pod = one(base, "Deployment", "sluice")["spec"]["template"]["spec"]
    command = gateway_container(base)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    grace_s = (yaml.safe_load(config_text(base)).get("shutdown") or {}).get("grace_s", DEFAULT_GRACE_S)
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + grace_s + EXIT_MARGIN_S


def test_pods_run_locked_down(overlay: list[dict[str, Any]]) -> None:
    for workload in [o for o in overlay if o["kind"] in ("Deployment", "StatefulSet")]:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            assert container["resources"]["requests"]
            assert container["resources"]["limits"]["memory"]
    # The image's user is the pod's: numeric, so that runAsNonRoot can check it.
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert user is not None
    pod = one(overlay, "Deployment", "sluice")["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == tuple(map(int, user.groups()))
    # The only writable path, /tmp, is an emptyDir (the CLI's --workers puts its metrics directory there).
    (tmp,) = [m for m in gateway_container(overlay)["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])


# -- the pod's spec, served on loopback ------------------------------------------------------------------------


def read_only_root() -> list[str] | None:
    """A wrapper that runs a command with / read-only and a fresh tmpfs on /tmp, as the pod does; None if this
    machine cannot (it needs root and mount namespaces). What the command needs from the old /tmp (a checkout,
    a virtualenv or the config may well live there) is bound back at its own path: the old /tmp is first bound
    on /mnt, and each directory named in $KEEP is bound from there into the new /tmp."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or not Path("/mnt").is_dir():
        return None
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return None
    script = (
        "mount --bind /tmp /mnt && mount -o remount,bind,ro / && mount -t tmpfs -o size=64m tmpfs /tmp && "
        'for p in $KEEP; do mkdir -p "$p" && mount --bind "/mnt${p#/tmp}" "$p" || exit 1; done && '
        'cd /tmp && exec "$@"'
    )
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "read-only-root"]


def under_tmp(*paths: Path) -> str:
    """The directories among `paths` that a fresh /tmp would hide, for $KEEP."""
    tmp = Path("/tmp").resolve()
    return " ".join(sorted({str(p.resolve()) for p in paths if p.resolve().is_relative_to(tmp)}))


@contextmanager
def pod_process(
    objects: list[dict[str, Any]], env: dict[str, str], config_dir: Path, *extra: str, wrapper: list[str] | None = None
) -> Iterator[str]:
    """The container's command and args, with loopback instead of 0.0.0.0, a free port and the config there."""
    container = gateway_container(objects)
    config = str(config_dir / "gateway.yaml")
    port = free_port()
    swap = {"/etc/sluice/gateway.yaml": config, "0.0.0.0": "127.0.0.1", "8080": str(port)}
    admin = yaml.safe_load((config_dir / "gateway.yaml").read_text())["admin"]
    text = (config_dir / "gateway.yaml").read_text()  # the admin listener on loopback and a free port too
    (config_dir / "gateway.yaml").write_text(
        text.replace(f"admin: {{host: {admin['host']}, port: {admin['port']}}}", f"admin: {{port: {free_port()}}}")
    )
    args = [swap.get(arg, arg) for arg in container["args"]]
    assert container["command"] == ["sluice"]
    command = [sys.executable, "-m", "gateway.cli", *args, "--log-level", "warning", *extra]
    # The image's working directory is /tmp; this tree's code comes first on the path wherever it runs.
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    if wrapper is not None:
        command = [*wrapper, *command]
        env["KEEP"] = under_tmp(config_dir, ROOT, Path(sys.prefix), Path(sys.base_prefix))
    proc = subprocess.Popen(command, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout=30, path=container["readinessProbe"]["httpGet"]["path"])
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_like_the_pod(objects: list[dict[str, Any]], tmp_path: Path, wrapper: list[str] | None, *extra: str) -> None:
    key, _ = new_key()
    (tmp_path / "gateway.yaml").write_text(config_text(objects))
    with RedisServer() as redis_server, ScriptedUpstream(default=Ok(ttft_ms=5, tokens=4)) as upstream:
        env = pod_env(objects, secret_values(one(objects, "Secret", "sluice")))
        env |= {
            "REDIS_URL": redis_server.url,
            "OPENAI_BASE_URL": f"{upstream.url}/v1",
            "AZURE_OPENAI_ENDPOINT": upstream.url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": "",
        }
        # An operator adds a tenant's key to Redis, as `kubectl exec deploy/sluice -- sluice keys add` does.
        keys = [sys.executable, "-m", "gateway.cli", "keys"]
        subprocess.run(
            [*keys, "add", "--redis", redis_server.url, "--tenant", "acme", "--key", key],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        with pod_process(objects, env, tmp_path, *extra, wrapper=wrapper) as url:
            container = gateway_container(objects)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert httpx.get(url + container[probe]["httpGet"]["path"], timeout=5).status_code == 200
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            answer = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content
            assert upstream.requests[-1].json["model"] == "gpt-4o"
            with pytest.raises(openai.AuthenticationError):
                client.with_options(api_key="sk-unknown").chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
                )
            (endpoint,) = one(objects, "ServiceMonitor", "sluice")["spec"]["endpoints"]
            assert httpx.get(url + endpoint["path"], timeout=5).status_code == 404  # not on the tenants' port
            admin_port = yaml.safe_load((tmp_path / "gateway.yaml").read_text())["admin"]["port"]
            scraped = httpx.get(f"http://127.0.0.1:{admin_port}{endpoint['path']}", timeout=5)
            assert scraped.status_code == 200
            assert "sluice_requests_total{" in scraped.text
            assert 'tenant="acme"' in scraped.text


def test_the_pod_spec_serves(overlay: list[dict[str, Any]], tmp_path: Path) -> None:
    serve_like_the_pod(overlay, tmp_path, None)


def test_the_pod_spec_serves_from_a_read_only_root_with_two_workers(
    overlay: list[dict[str, Any]], tmp_path: Path
) -> None:
    wrapper = read_only_root()
    if wrapper is None:
        pytest.skip("needs root and mount namespaces (unshare -m) to make / read-only")
    serve_like_the_pod(overlay, tmp_path, wrapper, "--workers", "2")
