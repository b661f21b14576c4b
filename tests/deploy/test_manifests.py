"""The deploy files parse, and the fields that matter agree with each other and with the CLI."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from control.cli import build_parser, serve_config
from protocol import PoolKind

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_MINOR = ".".join(ray.__version__.split(".")[:2])


def load(path: str) -> dict:
    return yaml.safe_load((DEPLOY / path).read_text())


def serve_command(text: str):
    """The `pdserve serve ...` command in `text`, parsed by the real CLI into a ServeConfig."""
    cmd = re.search(r"pdserve serve[^&>\n]*(?:\n[^&>\n]*)*", text).group(0)
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    return serve_config(args)


def pool_resources(config) -> dict[PoolKind, dict[str, float]]:
    return {spec.kind: spec.resources for spec in config.pool_specs()}


def test_ray_up_cluster_has_a_node_type_per_pool_and_serves_on_the_head():
    c = load("ray/cluster.yaml")
    types = c["available_node_types"]
    assert c["head_node_type"] in types
    assert types["prefill_gpu"]["resources"]["GPU"] == 1 and types["prefill_gpu"]["resources"]["prefill_node"] == 1
    assert types["decode_gpu"]["resources"]["GPU"] == 1 and types["decode_gpu"]["resources"]["decode_node"] == 1
    assert c["docker"]["image"].startswith(f"rayproject/ray:{RAY_MINOR}.")
    assert any("pip install" in cmd and "/home/ray/pdserve" in cmd for cmd in c["setup_commands"])
    serve = serve_command(next(cmd for cmd in c["head_start_ray_commands"] if "pdserve serve" in cmd))
    assert serve.ray_address == "auto" and serve.host == "0.0.0.0"
    assert (serve.port, serve.metrics_port) == (50051, 9400)
    # every pool asks for resources that exactly one node type offers
    res = pool_resources(serve)
    assert res[PoolKind.PREFILL] == {"GPU": 1, "prefill_node": 1}
    assert res[PoolKind.DECODE] == {"GPU": 1, "decode_node": 1}
    for kind, wanted in res.items():
        offering = [n for n, t in types.items() if all(t["resources"].get(k, 0) >= v for k, v in wanted.items())]
        assert len(offering) == 1, (kind, offering)


def test_ray_up_cluster_exposes_nothing_but_a_protected_front_door():
    c = load("ray/cluster.yaml")
    commands = "\n".join(c["head_start_ray_commands"] + c["worker_start_ray_commands"])
    assert "0.0.0.0" not in re.sub(r"pdserve serve.*", "", commands)  # only the front door binds all addresses
    assert "--dashboard-host=127.0.0.1" in commands
    assert "--env RAY_AUTH_MODE=token" in c["docker"]["run_options"]
    assert "/home/ray/.ray/auth_token" in c["file_mounts"]
    serve_text = next(cmd for cmd in c["head_start_ray_commands"] if "pdserve serve" in cmd)
    serve = serve_command(serve_text)
    assert serve.tls_cert and serve.tls_key  # TLS on the front door
    assert "PDSERVE_API_KEY=" in serve_text  # the API key, from a secret file, never on the command line
    assert serve.metrics_host not in (None, "0.0.0.0")  # metrics on the private address only


def kuberay():
    """The RayJob, the RayCluster spec inside it (SidecarMode takes no clusterSelector), and its pod templates."""
    job = load("kuberay/rayjob-serve.yaml")
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    return job, cluster, head, groups


def manifest_images() -> list[str]:
    """Every `image:` in the deploy files, the Ray cluster launcher's included."""
    images = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "image" and isinstance(v, str):
                    images.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc)
    return images


def dockerfile() -> str:
    return (DEPLOY / "docker" / "Dockerfile").read_text()


def test_kuberay_cluster_job_and_service_fit_together():
    job, cluster, head_template, groups = kuberay()
    service = load("kuberay/service.yaml")
    assert job["kind"] == "RayJob" and service["kind"] == "Service"
    assert cluster["rayVersion"].startswith(f"{RAY_MINOR}.")
    assert set(groups) == {"prefill-gpu", "decode-gpu"}
    for name, resource in (("prefill-gpu", "prefill_node"), ("decode-gpu", "decode_node")):
        g = groups[name]
        assert g["rayStartParams"]["num-gpus"] == "1" and resource in g["rayStartParams"]["resources"]
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    head = head_template["spec"]["containers"][0]
    images = {head["image"]} | {g["template"]["spec"]["containers"][0]["image"] for g in groups.values()}
    assert len(images) == 1, "head and workers must run the same image"
    head_ports = {p["containerPort"] for p in head["ports"]}
    assert {6379, 50051, 9400} <= head_ports
    # KubeRay names the cluster after the RayJob plus a random suffix: the Service finds the head by label
    assert service["spec"]["selector"] == {**head_template["metadata"]["labels"], "ray.io/node-type": "head"}
    for g in groups.values():
        assert g["template"]["metadata"]["labels"] == head_template["metadata"]["labels"]
    serve = serve_command(job["spec"]["entrypoint"])
    # every router replica's /metrics: --metrics-port + i
    metrics_ports = {serve.metrics_port + i for i in range(serve.routers)}
    assert {p["port"] for p in service["spec"]["ports"]} == {serve.port, serve.http_port} | metrics_ports
    assert metrics_ports <= head_ports
    res = pool_resources(serve)
    assert res[PoolKind.PREFILL]["prefill_node"] == 1 and res[PoolKind.DECODE]["decode_node"] == 1


def test_kuberay_files_expose_nothing_but_a_protected_front_door(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    job, cluster, head_template, _ = kuberay()
    policy = load("kuberay/networkpolicy.yaml")
    assert cluster["authOptions"]["mode"] == "token"  # Ray's token authentication
    head_spec = cluster["headGroupSpec"]
    assert head_spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    head = head_template["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]}.isdisjoint({8265, 10001})  # no dashboard, no Ray client
    env = {e["name"]: e for e in head["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"
    serve = serve_command(job["spec"]["entrypoint"])
    mounts = {m["mountPath"] for m in head["volumeMounts"]}
    assert serve.tls_cert and str(Path(serve.tls_cert).parent) in mounts and serve.api_key is None
    # the policy: the cluster's own pods, the front door from anywhere, metrics from monitoring only
    own_pods = {"podSelector": {"matchLabels": head_template["metadata"]["labels"]}}
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == own_pods["podSelector"]
    open_ports = set()
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if "from" not in rule:
            open_ports |= ports
        elif ports == {serve.metrics_port + i for i in range(serve.routers)}:
            assert all((f.get("namespaceSelector") or f.get("podSelector") or {}).get("matchLabels")
                       for f in rule["from"]), rule  # a named namespace or pods: never "anyone"
        else:
            assert rule["from"] == [own_pods] and not ports
    assert open_ports == {serve.port, serve.http_port}


def test_kuberay_job_is_submitted_inside_the_head_pod_to_a_loopback_dashboard():
    job, cluster, head_template, _ = kuberay()
    # HTTPMode (the operator) and K8sJobMode (a submitter pod) reach the dashboard from outside the head pod
    assert job["spec"]["submissionMode"] == "SidecarMode"
    assert "clusterSelector" not in job["spec"]  # SidecarMode cannot add its container to a running pod
    assert head_template["spec"]["restartPolicy"] == "Never"  # SidecarMode refuses any other
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"


def test_kuberay_metrics_bind_the_pod_address_not_every_interface(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    job, _, head_template, _ = kuberay()
    serve = serve_command(job["spec"]["entrypoint"])
    assert serve.host == "0.0.0.0"  # the front doors, for the Service
    assert serve.metrics_host == "$POD_IP"  # expanded by the shell Ray runs the entrypoint in
    env = {e["name"]: e for e in head_template["spec"]["containers"][0]["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def pod_templates():
    _, _, head_template, groups = kuberay()
    return {"head": head_template} | {name: g["template"] for name, g in groups.items()}


@pytest.mark.parametrize("pod", ["head", "prefill-gpu", "decode-gpu"])
def test_kuberay_pods_are_hardened(pod):
    spec = pod_templates()[pod]["spec"]
    assert spec["automountServiceAccountToken"] is False
    sc = spec["securityContext"]
    uid = int(re.search(r"^USER (\d+)", dockerfile(), re.M).group(1))
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid != 0  # the image's own user
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    cache_dir = re.search(r"PDSERVE_CACHE_DIR=(\S+)", dockerfile()).group(1)
    for c in spec["containers"]:
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add")
        # a read-only root leaves Ray's /tmp/ray and the model cache on writable scratch volumes
        writable = {m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]}
        assert "/tmp" in writable
        assert any(cache_dir.startswith(path + "/") for path in writable), (cache_dir, writable)


def test_kuberay_only_the_autoscaler_holds_a_service_account_token():
    _, cluster, head_template, _ = kuberay()
    spec = head_template["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    token_volumes = {name for name, v in volumes.items()
                     if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    auto = cluster["autoscalerOptions"]
    sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert cluster["enableInTreeAutoscaling"] is True
    assert [m["name"] for m in auto["volumeMounts"] if m["mountPath"] == sa_dir] == list(token_volumes)
    for c in spec["containers"]:
        assert not token_volumes & {m["name"] for m in c["volumeMounts"]}, c["name"]
    asc = auto["securityContext"]
    assert asc["readOnlyRootFilesystem"] is True and asc["allowPrivilegeEscalation"] is False
    assert asc["capabilities"]["drop"] == ["ALL"]
    assert "/tmp" in {m["mountPath"] for m in auto["volumeMounts"]}


def test_images_are_pinned():
    images = manifest_images()
    assert images
    for image in images:
        name, _, digest = image.partition("@")
        tag = name.rpartition("/")[2].partition(":")[2]
        assert digest.startswith("sha256:") or re.fullmatch(r"v?\d+\.\d+\.\d+\S*", tag), image  # never latest
    _, _, head_template, groups = kuberay()
    for t in [head_template] + [g["template"] for g in groups.values()]:
        for c in t["spec"]["containers"]:
            assert c["imagePullPolicy"] == "IfNotPresent", c["name"]
    # the Dockerfile's base: a build argument whose default is an exact Ray release (a digest can be passed)
    text = dockerfile()
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(rf"rayproject/ray:{re.escape(RAY_MINOR)}\.\d+-py311-gpu", base)
    assert re.search(r"^FROM \$\{RAY_IMAGE\}$", text, re.M)


def test_the_build_context_and_the_cluster_copy_leave_out_history_and_environments():
    root = DEPLOY.parent
    assert "COPY --chown=ray:users . ." in dockerfile()  # the whole context: .dockerignore decides what
    patterns = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".git" in patterns and ".venv" in patterns
    # ... but `pip install .` still finds its project file, its readme and every package it installs
    include = re.search(r"^\[tool\.setuptools\.packages\.find\]\ninclude = \[([^\]]*)\]",
                        (root / "pyproject.toml").read_text(), re.M).group(1)
    needed = ["pyproject.toml", "README.md"] + [p.rstrip("*") for p in re.findall(r'"([^"]+)"', include)]
    for path in needed:
        assert (root / path).exists(), path
        assert not any(fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns), path
    c = load("ray/cluster.yaml")  # `ray up` rsyncs the working tree to every node
    assert {"**/.git", "**/.git/**"} <= set(c["rsync_exclude"]) and ".gitignore" in c["rsync_filter"]
    assert ".venv/" in (root / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("bad", ["--prefill-resources", "--decode-resources"])
def test_the_cli_refuses_malformed_resources(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", bad, "{not json"])
