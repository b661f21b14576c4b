"""The `pdserve` command: `serve` starts a deployment, `generate` streams a completion from one, `bench`
measures layouts side by side (`benchmarks.serving.cli`), `plan` sizes the pools (`planner.cli`); `workers`,
`scale`, `drain` and `restart-pool` operate a running one (`control.admin_cli`); `stop` stops one with
router replicas, whichever replica leads it."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from control import admin_cli
from control.admin_cli import DEFAULT_SERVER


def _resources(text: str) -> dict[str, float]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict) or not all(isinstance(v, int | float) for v in value.values()):
        raise argparse.ArgumentTypeError('expected a JSON object of numbers, e.g. \'{"GPU": 1}\'')
    return value


def _metrics_port(text: str) -> int | None:
    if text == "off":
        return None
    try:
        return int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError("expected a port number or 'off'") from e


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start prefill/decode pools on Ray and a gRPC server")
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in name (smollm2-135m, tiny-random), HF model directory, or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds (default loopback)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--colocated-workers", type=int, default=0,
                   help="serve with N workers that both prefill and decode (the baseline); "
                        "use with --prefill-workers 0 --decode-workers 0")
    p.add_argument("--ray-address", default=None,
                   help="join a running Ray cluster (auto or HOST:PORT); default: start one on 127.0.0.1")
    p.add_argument("--prefill-resources", type=_resources, default={"CPU": 1})
    p.add_argument("--decode-resources", type=_resources, default={"CPU": 1})
    p.add_argument("--kv-transport", choices=["torch", "ray"], default="torch")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix")
    p.add_argument("--worker-threads", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="each worker's KV cache in bytes, instead of --num-blocks (as many blocks as fit: a "
                        "narrower --kv-cache-dtype holds more tokens)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for KV room; past it RESOURCE_EXHAUSTED at once, before any prefill")
    p.add_argument("--admission-timeout", type=float, default=60.0,
                   help="seconds a request waits for KV room or a live worker before it fails")
    p.add_argument("--max-queued-prefill-tokens", type=int, default=65536,
                   help="prompt tokens queued per prefill worker before new requests get RESOURCE_EXHAUSTED")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request is placed again after a worker loss or a failed KV transfer")
    p.add_argument("--max-pool-size", type=int, default=64,
                   help="the most workers `pdserve scale` may ask of one pool (a larger request is refused "
                        "with INVALID_ARGUMENT)")
    p.add_argument("--worker-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat (or engine progress while busy) before a worker is "
                        "declared dead, killed and replaced")
    p.add_argument("--prefill-order", choices=["fair", "fifo"], default="fair",
                   help="the order prompts share each engine step: fair (fewest uncomputed tokens first, aged so "
                        "none starves: a short prompt is not stuck behind a long one) or fifo (arrival)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=256,
                   help="fair order: the most prompt tokens one engine step computes, all prompts together (0: "
                        "the whole step budget); bounds how long a new prompt waits for the step in progress. "
                        "256 suits CPUs (steps of a fraction of a second); on GPUs raise it (1024-2048) so a "
                        "step keeps the GPU busy")
    p.add_argument("--lower-class-chunk-tokens", type=int, default=128,
                   help="fair order: while prompts of a higher priority class keep arriving (one seen in the "
                        "worker's last 256 steps), the lower classes' prompts compute at most this many tokens a "
                        "step, so a high-class prompt waits for a smaller step in progress (0: no cap of their "
                        "own). With one class, as when no tenant has a priority, it changes nothing")
    p.add_argument("--decode-prefill-chunk-tokens", type=int, default=64,
                   help="the same on decode workers, for prompts they prefill themselves (--local-prefill): "
                        "small, so a local prefill stalls the worker's streams by about one decode step at a "
                        "time (0: the whole step budget)")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas over the same pools, sharing --port and --http-port (SO_REUSEPORT): "
                        "this process is the lead, the others run as Ray actors; each relays its own "
                        "clients' tokens, so the front door scales past one core")
    p.add_argument("--routers-spread", action="store_true",
                   help="place the other router replicas over the cluster's nodes (each binds --port on its "
                        "node: put a Service or load balancer over all of them) instead of on this node")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish")
    p.add_argument("--placement", choices=["joint", "separate"], default="joint",
                   help="joint: each request goes to the (prefill, decode) pair with the lowest estimated time "
                        "until it decodes (measured prefill rates, per-pair link rates, decode steps), or is "
                        "prefilled by its decode worker when its uncached part is short; separate: the prefill "
                        "worker by prefix and load, then the decode worker by node and free blocks")
    p.add_argument("--local-prefill", action="store_true",
                   help="conditional disaggregation: joint placement may prefill a prompt on its decode worker "
                        "(no transfer, no prefill queue) when that is cheaper and stalls the worker's running "
                        "streams for less than it saves (router.placement.choose_path)")
    p.add_argument("--late-reservation", action=argparse.BooleanOptionalAction, default=True,
                   help="reserve a long prompt's decode KV blocks when its prefill worker nears the prompt's "
                        "last chunk, not at placement, so they serve decoding sequences while it queues and "
                        "computes (joint placement; --no-late-reservation: at placement)")
    p.add_argument("--verify-kv-moves", action="store_true",
                   help="check each drained sequence's KV at its destination against its source (SHA-256 of "
                        "both; costs a full read of the KV on each side)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP door (/v1/completions, /v1/chat/completions), bound to "
                        "--host like gRPC; 0 turns it off")
    sec = p.add_argument_group("security (README: Security)")
    sec.add_argument("--metrics-host", default=None,
                     help="address /metrics binds (default: --host); a cluster-internal one keeps it inside")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    sec.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None,
                     help="PEM CA: mutual TLS, clients must present a certificate it signed")
    sec.add_argument("--api-key", default=None,
                     help="require 'authorization: Bearer KEY' on every call but health "
                          "(default: $PDSERVE_API_KEY; prefer the variable: flags show in `ps`)")
    sec.add_argument("--api-keys", default=None, metavar="FILE",
                     help="YAML/JSON key file: tenants, their keys, roles (client/admin) and limits (concurrent "
                          "requests, queued prompt tokens, tokens per minute, priority class, cache salt); "
                          "reloaded when it changes (docs/security.md). --api-key beside it is an admin key")
    sec.add_argument("--stalled-stream-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="cancel a stream whose client takes no token for this long, freeing its KV blocks "
                          "(default 30)")
    sec.add_argument("--http-header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="close an HTTP connection whose request head has not arrived in this long (default 10)")
    sec.add_argument("--http-max-connections-per-client", type=int, default=256, metavar="N",
                     help="reset HTTP connections past N open from one client address (default 256; 0: no "
                          "cap; raise it behind a proxy that sends every client from one address)")
    p.add_argument("--metrics-port", type=_metrics_port, default=9400,
                   help="Prometheus /metrics port, bound on --host (default 9400; 0: any free port; "
                        "'off': no endpoint)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                   help="what runs the model: pdserve's own engine (boots in seconds), or vLLM in-process in each "
                        "worker (every model vLLM serves; needs the [vllm] extra, README: vLLM)")
    p.add_argument("--prefill-engine", choices=["builtin", "vllm"], default=None,
                   help="the prefill pool's engine (default --engine); it must match the decode pool's")
    p.add_argument("--decode-engine", choices=["builtin", "vllm"], default=None,
                   help="the decode pool's engine (default --engine)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each worker splits its model over (vLLM engines: a process each, and a "
                        "GPU each on a GPU machine: give the pools' resources as many)")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="the prefill pool's ranks per worker (default --tensor-parallel-size); the pools "
                        "may differ")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="the decode pool's ranks per worker (default --tensor-parallel-size)")
    p.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                   help="the built-in engine's weights from a GGUF file: gguf keeps its Q4_0/Q4_1/Q8_0 "
                        "matrices in their blocks (5-8.5 bits a weight, as in the file; decoded exactly in a "
                        "CPU kernel, the float32 model still), none dequantises them at load. Default: gguf for "
                        "a .gguf --model and for smollm2-135m (shipped as GGUF), none for an HF directory")
    p.add_argument("--kv-cache-dtype", default=None,
                   choices=["float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the built-in engine's KV cache dtype (default: the model's); bfloat16 under a float32 "
                        "model halves the KV a long-context decode step reads and fp8 (e4m3) quarters it, at "
                        "a rounding of K and V")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the engine's, 16 built-in, 128 vLLM)")
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="speculative decoding in the decode (and colocated) workers: ngram = prompt lookup")
    p.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="with --speculative: the most draft tokens verified per sequence per step (default 8)")
    p.add_argument("--max-draft-tokens-per-step", type=int, default=32,
                   help="with --speculative: the most draft tokens one step verifies, shared equally by the "
                        "decoding sequences (default 32, for CPUs; 0: no cap)")
    a = p.add_argument_group("autoscaling (docs/planner.md)")
    a.add_argument("--autoscale", default=None, metavar="SLO_FILE",
                   help='size the prefill and decode pools for this SLO ({"ttft_s": S, "itl_s": S, "target": '
                        '0.9}) from the live traffic, scaling up at once and down by draining with KV moves')
    a.add_argument("--autoscale-profile", default=None, metavar="PROFILE",
                   help="with --autoscale: `pdserve plan profile`'s JSON, taken on this machine and model")
    a.add_argument("--autoscale-interval", type=float, default=30.0, help="seconds between plans (default 30)")
    a.add_argument("--autoscale-cooldown", type=float, default=60.0,
                   help="seconds a pool stays as it is after it changed (default 60)")
    a.add_argument("--autoscale-down-after", type=int, default=2,
                   help="intervals in a row asking for fewer workers before a scale-down (default 2)")
    a.add_argument("--autoscale-advise", action="store_true",
                   help="log what should change (and export it as metrics), change nothing")
    a.add_argument("--autoscale-as-profiled", action="store_true",
                   help="size for the machine the profile was taken on, whose workers share its cores (as "
                        "`pdserve plan size --as-profiled`; --max-pool-size at most 6); default: a device a worker")


def _autoscale(args: argparse.Namespace):
    if args.autoscale is None:
        if args.autoscale_profile is not None:
            raise ValueError("--autoscale-profile goes with --autoscale SLO_FILE")
        return None
    if args.autoscale_profile is None:
        raise ValueError("--autoscale needs --autoscale-profile (make one with `pdserve plan profile`)")
    from control.config import AutoscaleConfig

    return AutoscaleConfig(args.autoscale, args.autoscale_profile, args.autoscale_interval, args.autoscale_cooldown,
                           args.autoscale_down_after, apply=not args.autoscale_advise,
                           as_profiled=args.autoscale_as_profiled)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("prompt")
    p.add_argument("--server", default=DEFAULT_SERVER)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    from router.security import add_client_args

    add_client_args(p)


def serve_config(args: argparse.Namespace):
    """`pdserve serve`'s arguments as a ServeConfig (ValueError names a bad flag)."""
    from control.config import ServeConfig
    from router.security import resolve_api_key

    return ServeConfig(
        model=args.model, host=args.host, port=args.port, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, colocated_workers=args.colocated_workers,
        ray_address=args.ray_address, prefill_resources=args.prefill_resources,
        decode_resources=args.decode_resources, kv_transport=args.kv_transport, routing=args.routing,
        worker_threads=args.worker_threads, max_model_len=args.max_model_len, num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue, admission_timeout_s=args.admission_timeout,
        max_queued_prefill_tokens=args.max_queued_prefill_tokens, migration_limit=args.migration_limit,
        worker_timeout=args.worker_timeout, shutdown_grace=args.shutdown_grace,
        verify_kv_moves=args.verify_kv_moves, placement=args.placement, local_prefill=args.local_prefill,
        late_reservation=args.late_reservation,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, api_key=resolve_api_key(args.api_key),
        api_keys=args.api_keys, stalled_stream_timeout=args.stalled_stream_timeout,
        http_header_timeout=args.http_header_timeout,
        http_max_connections_per_client=args.http_max_connections_per_client,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, http_port=args.http_port or None, device=args.device, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        max_draft_tokens_per_step=args.max_draft_tokens_per_step, routers=args.routers, prefill_order=args.prefill_order,
        prefill_chunk_tokens=args.prefill_chunk_tokens, decode_prefill_chunk_tokens=args.decode_prefill_chunk_tokens,
        lower_class_chunk_tokens=args.lower_class_chunk_tokens,
        routers_spread=args.routers_spread, max_pool_size=args.max_pool_size, engine=args.engine,
        prefill_engine=args.prefill_engine, decode_engine=args.decode_engine, block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size, autoscale=_autoscale(args))


def serve(args: argparse.Namespace) -> int:
    from control.console import ServeError
    from control.serve_loop import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = serve_config(args)
    except ValueError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve_forever(config))
    except ServeError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def generate(args: argparse.Namespace) -> int:
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from router.security import run_client

    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.seed is not None:
        sampling.seed = args.seed
    req = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        req.messages.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    def call(channel) -> None:
        last = None
        for res in pb_grpc.GenerationStub(channel).Generate(req):
            print(res.text, end="", flush=True)
            last = res
        print()
        if last is not None:
            u, t = last.usage, last.timing
            print(f"[{pb.FinishReason.Name(last.finish_reason)}; {u.prompt_tokens} prompt "
                  f"({u.cached_prompt_tokens} cached) + {u.completion_tokens} completion tokens; "
                  f"prefill {last.prefill_worker_id}, decode {last.decode_worker_id}; "
                  f"prefill {t.prefill_seconds * 1e3:.0f} ms, KV {t.kv_transfer_seconds * 1e3:.1f} ms]",
                  file=sys.stderr)

    return run_client(args, "generate", call)


def _add_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="drain and stop a deployment with router replicas (--routers N), "
                                    "whichever replica leads it now")
    p.add_argument("--port", type=int, default=50051, help="the deployment's gRPC port (default 50051)")
    p.add_argument("--ray-address", default="auto", help="the Ray cluster it runs on (default: auto)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish before they are ended (default 30)")


def stop(args: argparse.Namespace) -> int:
    from control.console import ServeError
    from control.ray_cluster import init_ray
    from control.replica_set import stop_deployment

    try:
        init_ray(args.ray_address, 0)
        lead = stop_deployment(args.port, args.grace)
    except ServeError as e:
        print(f"pdserve stop: {e}", file=sys.stderr)
        return 1
    print(f"pdserve stop: the deployment on port {args.port} stopped (its lead: "
          f"{'the serve process' if lead is None else 'router replica ' + lead})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_stop(sub)
    admin_cli.add_parsers(sub)
    sub.add_parser("bench", add_help=False,
                   help="run workloads against server layouts side by side (pdserve bench --help)")
    sub.add_parser("plan", add_help=False,
                   help="profile, simulate, size the pools for an SLO (pdserve plan --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser, in benchmarks/serving/cli.py
        from benchmarks.serving.cli import main as bench

        return bench(argv[1:])
    if argv[:1] == ["plan"]:  # its own parser, in planner/cli.py
        from planner.cli import main as plan

        return plan(argv[1:])
    args = build_parser().parse_args(argv)
    return {"serve": serve, "generate": generate, "stop": stop, **admin_cli.COMMANDS}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
