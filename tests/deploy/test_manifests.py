"""The deploy files parse, and the fields that matter agree with each other and with the CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from router.cli import build_parser, serve_config
from router.placement import PoolKind

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
    serve = serve_command("\n".join(c["head_start_ray_commands"]))
    assert serve.ray_address == "auto" and serve.host == "0.0.0.0"
    assert (serve.port, serve.metrics_port) == (50051, 9400)
    # every pool asks for resources that exactly one node type offers
    res = pool_resources(serve)
    assert res[PoolKind.PREFILL] == {"GPU": 1, "prefill_node": 1}
    assert res[PoolKind.DECODE] == {"GPU": 1, "decode_node": 1}
    for kind, wanted in res.items():
        offering = [n for n, t in types.items() if all(t["resources"].get(k, 0) >= v for k, v in wanted.items())]
        assert len(offering) == 1, (kind, offering)


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
    assert {p["port"] for p in service["spec"]["ports"]} == {serve.port, serve.metrics_port}
    res = pool_resources(serve)
    assert res[PoolKind.PREFILL]["prefill_node"] == 1 and res[PoolKind.DECODE]["decode_node"] == 1


def test_dockerfile_base_image_matches_the_ray_we_install():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(RAY_MINOR)}\.\d+-py311", text, re.M)


@pytest.mark.parametrize("bad", ["--prefill-resources", "--decode-resources"])
def test_the_cli_refuses_malformed_resources(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", bad, "{not json"])
