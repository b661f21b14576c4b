"""The deploy files parse, and the fields that matter agree with each other and with the CLI."""

from __future__ import annotations

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


def test_kuberay_cluster_job_and_service_fit_together():
    cluster = load("kuberay/raycluster.yaml")
    job = load("kuberay/rayjob-serve.yaml")
    service = load("kuberay/service.yaml")
    assert cluster["kind"] == "RayCluster" and job["kind"] == "RayJob" and service["kind"] == "Service"
    assert cluster["spec"]["rayVersion"].startswith(f"{RAY_MINOR}.")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill-gpu", "decode-gpu"}
    for name, resource in (("prefill-gpu", "prefill_node"), ("decode-gpu", "decode_node")):
        g = groups[name]
        assert g["rayStartParams"]["num-gpus"] == "1" and resource in g["rayStartParams"]["resources"]
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    images = {head["image"]} | {g["template"]["spec"]["containers"][0]["image"] for g in groups.values()}
    assert len(images) == 1, "head and workers must run the same image"
    head_ports = {p["containerPort"] for p in head["ports"]}
    assert {6379, 50051, 9400} <= head_ports
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    serve = serve_command(job["spec"]["entrypoint"])
    # every router replica's /metrics: --metrics-port + i
    metrics_ports = {serve.metrics_port + i for i in range(serve.routers)}
    assert {p["port"] for p in service["spec"]["ports"]} == {serve.port, serve.http_port} | metrics_ports
    assert metrics_ports <= head_ports
    res = pool_resources(serve)
    assert res[PoolKind.PREFILL]["prefill_node"] == 1 and res[PoolKind.DECODE]["decode_node"] == 1


def test_kuberay_files_expose_nothing_but_a_protected_front_door(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cluster = load("kuberay/raycluster.yaml")
    policy = load("kuberay/networkpolicy.yaml")
    job = load("kuberay/rayjob-serve.yaml")
    assert cluster["spec"]["authOptions"]["mode"] == "token"  # Ray's token authentication
    head_spec = cluster["spec"]["headGroupSpec"]
    assert head_spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    head = head_spec["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]}.isdisjoint({8265, 10001})  # no dashboard, no Ray client
    env = {e["name"]: e for e in head["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"
    serve = serve_command(job["spec"]["entrypoint"])
    mounts = {m["mountPath"] for m in head["volumeMounts"]}
    assert serve.tls_cert and str(Path(serve.tls_cert).parent) in mounts and serve.api_key is None
    # the policy: the cluster's own pods, the front door from anywhere, metrics from monitoring only
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    open_ports = set()
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if "from" not in rule:
            open_ports |= ports
        elif ports == {serve.metrics_port + i for i in range(serve.routers)}:
            assert all((f.get("namespaceSelector") or f.get("podSelector") or {}).get("matchLabels")
                       for f in rule["from"]), rule  # a named namespace or pods: never "anyone"
        else:
            assert rule["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": "pdserve"}}}] and not ports
    assert open_ports == {serve.port, serve.http_port}


def test_dockerfile_base_image_matches_the_ray_we_install():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(RAY_MINOR)}\.\d+-py311", text, re.M)


@pytest.mark.parametrize("bad", ["--prefill-resources", "--decode-resources"])
def test_the_cli_refuses_malformed_resources(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", bad, "{not json"])
