"""A profile for a device (and model) this machine does not have, from published figures.

The measured profile gives the structure (how steps are scheduled and priced, the engine settings' shape,
the attention term relative to the per-token term, the router's own costs: it runs on CPUs anywhere); the
target device's datasheet and the target model's size give the constants:

    prefill token_s   = 2 x params / (peak FLOP/s x MFU)              (a dense transformer's FLOPs a token)
    prefill attention = the profile's attention_s x (target token_s / profiled token_s)
    decode step_s     = weight bytes / (HBM bytes/s x MBU), at least MIN_STEP_S
    decode seq_s      = 2 x params / (peak FLOP/s x MFU)              (each sequence's token)
    decode context    = KV bytes a token / (HBM bytes/s x MBU)         (each step reads every sequence's KV)
    KV link           = the cross-node link's bytes/s; KV bytes a token from the model

Published figures used (documented, not measured here):
- NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 989 TFLOPS dense BF16, 3.35 TB/s HBM3;
  InfiniBand NDR 400 Gb/s = 50 GB/s a port for a KV link across nodes.
- Utilisation: 50% MFU in prefill, 60% MBU in decode, the range DistServe (OSDI'24) and Splitwise (ISCA'24)
  report for their engines.
- Llama-3-8B: 8.03 B parameters, BF16; 32 layers x 8 KV heads x 128 x K,V x 2 bytes = 131,072 KV bytes a
  token (its config.json). SmolLM2-135M: 135 M parameters, 30 x 3 x 64 x 2 x 2 = 23,040 (BF16).

What this cannot know: a GPU engine's fixed per-step costs (kernel launches, Python) are not in a
datasheet; `MIN_STEP_S` stands in. Treat a scaled profile as a direction, not a forecast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.profile import DecodeCost, EngineSettings, PrefillCost, Profile, TransferCost

MIN_STEP_S = 0.003  # a GPU serving engine's step floor (launches, scheduling): an assumption, not a datasheet


@dataclass(frozen=True)
class Device:
    """A device's published peak figures and the utilisation a serving engine reaches on it."""

    name: str
    flops: float  # peak dense BF16 FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # a KV link between a prefill and a decode worker
    mfu: float = 0.5
    mbu: float = 0.6
    reference: str = ""


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    kv_bytes_per_token: int  # BF16
    weight_bytes: float


DEVICES = {"h100": Device("H100 SXM5", 989e12, 3.35e12, 50e9,
                          reference="H100 SXM5 datasheet: 989 TFLOPS BF16 (50% MFU), 3.35 TB/s HBM3 (60% MBU), "
                                    "InfiniBand NDR 50 GB/s")}
MODELS = {"smollm2-135m": Model("smollm2-135m", 135e6, 23_040, 270e6),
          "llama3-8b": Model("llama3-8b", 8.03e9, 131_072, 16.06e9)}
# what a GPU deployment would configure (pdserve serve's help: raise the chunk to 1024-2048 on GPUs)
GPU_ENGINE = {"prefill_chunk_tokens": 2048, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
              "num_blocks": 1 << 20}


def on_device(profile: Profile, device: str, model: str | None = None) -> Profile:
    """`profile`'s structure with `device`'s constants for `model` (default: the profiled model)."""
    dev = DEVICES.get(device.lower())
    if dev is None:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    m = MODELS.get((model or profile.model).lower())
    if m is None:
        raise ValueError(f"--target-model must be one of {', '.join(MODELS)}, got {model or profile.model!r}")
    token_s = 2 * m.params / (dev.flops * dev.mfu)
    bandwidth = dev.hbm_bytes_per_s * dev.mbu
    return dataclasses.replace(
        profile, model=m.name, machine={"device": dev.name},
        source=f"{m.name} on {dev.name} from published figures ({dev.reference}; planner/devices.py), "
               f"structure from {profile.model} measured {profile.date}",
        prefill=PrefillCost(MIN_STEP_S, token_s, profile.prefill.attention_s * token_s / profile.prefill.token_s),
        decode=DecodeCost(max(MIN_STEP_S, m.weight_bytes / bandwidth), token_s, m.kv_bytes_per_token / bandwidth),
        transfer=TransferCost(m.kv_bytes_per_token, dev.link_bytes_per_s, profile.transfer.latency_s),
        engine=EngineSettings(**(dataclasses.asdict(profile.engine) | GPU_ENGINE)), shared_cores=None,
        interference=0.0, short_interference=None, samples={})
