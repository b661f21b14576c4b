"""Configuration: one frozen dataclass per component, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the HF families the built-in engine serves: model_type -> architecture. Qwen2 and Qwen3 are Llama with
# biases on q/k/v (Qwen2) or an RMSNorm over each head of q and k before RoPE (Qwen3); `--engine vllm`
# serves every family vLLM does
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
# the RoPE scalings it computes, besides none (`engine.models.rope`); "freq_factors" is a GGUF file's
# `rope_freqs` tensor (llama.cpp's form of Llama 3.1's scaling): each frequency divided by its factor
ROPE_TYPES = ("linear", "llama3", "freq_factors")


def _sliding_window(d: dict[str, Any], family: str) -> int | None:
    """The window of the model's sliding-window layers, None where none slides, as transformers' configs
    read the keys (a missing `sliding_window` is 4,096): every Mistral layer; a Qwen2 or Qwen3 layer only
    with `use_sliding_window`, from `max_window_layers` on (28 where unset), or as `layer_types` lists
    them where the config has that key."""
    window = d.get("sliding_window", 4096)
    if window is None:
        return None
    if family == "mistral":
        return int(window)
    if family not in ("qwen2", "qwen3") or not d.get("use_sliding_window"):
        return None
    layers = d.get("layer_types")
    slides = ("sliding_attention" in layers if layers is not None
              else d.get("max_window_layers", 28) < d["num_hidden_layers"])
    return int(window) if slides else None


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder of the Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2) or of its
    close relatives Qwen2 (Qwen2.5) and Qwen3 (dense)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2; Llama and Qwen3's `attention_bias`)
    o_bias: bool = False  # the output projection with a bias (Llama and Qwen3's `attention_bias`)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        kind = self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if kind and kind not in ROPE_TYPES:  # (YaRN, dynamic NTK, ...: wrong at every length if ignored)
            raise ValueError(f"rope_scaling type {kind!r} is not computed by the built-in engine (it "
                             f"computes {', '.join(ROPE_TYPES)}); `--engine vllm` serves it")
        if self.qk_norm and self.qkv_bias != self.o_bias:
            raise ValueError("a Qwen3-style model (qk_norm) has biases on q/k/v and o together or on none")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
                     + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
                     + self.qkv_bias * (self.q_size + 2 * self.kv_size) + self.o_bias * self.hidden_size
                     + self.qk_norm * 2 * self.head_dim)
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """From an HF `config.json` dict of a model of one of the `FAMILIES`."""
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        family = d.get("model_type")
        if family not in FAMILIES:  # a model_type of its own over a known architecture
            family = next((f for f, a in FAMILIES.items() if a in archs), None)
        if family is None:
            served = ", ".join(FAMILIES)
            raise ValueError(f"model_type {d.get('model_type')!r} ({', '.join(archs)}) is not served by the "
                             f"built-in engine (it serves {served}); `--engine vllm` serves every family "
                             "vLLM does")
        if not any(a.endswith("ForCausalLM") for a in archs):  # (a reward or classification head: no lm_head)
            raise ValueError(f"architectures {archs}: the built-in engine serves causal language models "
                             "(*ForCausalLM) only")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: the built-in engine serves MLPs without biases; use `--engine vllm`")
        attention_bias = bool(d.get("attention_bias", False))  # (Qwen2 has no such key: its q/k/v always do)
        context = d.get("max_position_embeddings", 2048)
        # NOTE: sliding-window attention (Mistral 7B v0.1; Qwen2/3 layers from max_window_layers) equals
        # full attention up to the window. The built-in engine attends over everything, so it serves such a
        # model up to its window, exactly, rather than past it, wrongly.
        window = _sliding_window(d, family)
        if window:
            context = min(context, window)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # NOTE: transformers >= 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        params = d.get("rope_parameters")
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        num_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            # (a Qwen3 config without the key has transformers' default of 128, not hidden / heads)
            head_dim=d.get("head_dim") or (128 if family == "qwen3" else d["hidden_size"] // num_heads),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),  # (transformers' default for all four)
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qkv_bias=attention_bias or family == "qwen2",
            o_bias=attention_bias and family != "qwen2",
            qk_norm=family == "qwen3",
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict transformers reads: Llama's, or Qwen2's or Qwen3's for their traits."""
        family = "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias and not self.o_bias else "llama"
        if self.o_bias and not self.qkv_bias:
            raise ValueError("no HF family has an output projection bias without q/k/v biases")
        d: dict[str, Any] = {
            "architectures": [FAMILIES[family]],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


@dataclass(frozen=True)
class CacheConfig:
    """How big the paged KV cache is: `num_blocks`, or `memory_bytes`, or else a `memory_fraction` of the
    device's free memory."""

    block_size: int = 16  # tokens per block; also the granularity of prefix caching
    num_blocks: int | None = None
    # the cache's bytes (vLLM's --kv-cache-memory-bytes): as many blocks as fit, so a narrower `dtype` holds
    # more tokens in the same memory
    memory_bytes: int | None = None
    # fraction of the device's free memory (after weights) given to the cache; None -> device default
    memory_fraction: float | None = None
    # the share of its GPU this engine was granted (Ray's fractional `{"GPU": 0.5}`): engines sharing a GPU each
    # size their cache from that share of its memory, whichever of them starts first
    device_share: float = 1.0
    # the cache's dtype; None: the model's. A bfloat16 or float16 cache under a float32 model halves the
    # bytes a decode step reads at long context (and doubles the blocks a memory budget holds), at a
    # rounding of K and V to 8 significant bits (bfloat16) or 11 (float16); an 8-bit one (`FP8_KV_DTYPES`,
    # under a model of any dtype) quarters them at a rounding to 4 bits (fp8) or 3 (fp8_e5m2). The
    # built-in engine's.
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"CacheConfig.dtype must be one of {list(KV_CACHE_DTYPES)} (or None: the "
                             f"model's), got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"CacheConfig.block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"CacheConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"CacheConfig.memory_bytes must be >= 1, got {self.memory_bytes}")
        if self.memory_bytes is not None and self.num_blocks is not None:
            raise ValueError("CacheConfig.num_blocks and memory_bytes (--num-blocks, "
                             "--kv-cache-memory-bytes) both size the cache: set one")
        if self.memory_bytes is not None and self.memory_fraction is not None:
            raise ValueError("CacheConfig.memory_bytes and memory_fraction both size the cache: set one")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"CacheConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.device_share <= 1.0:
            raise ValueError(f"CacheConfig.device_share must be in (0, 1], got {self.device_share}")

    def fixed_blocks(self, bytes_per_block: int) -> int | None:
        """The blocks `num_blocks` or `memory_bytes` asks for, with blocks of `bytes_per_block`; None: sized
        from the device's free memory."""
        if self.memory_bytes is None:
            return self.num_blocks
        n = self.memory_bytes // bytes_per_block
        if n < 1:
            raise ValueError(f"CacheConfig.memory_bytes (--kv-cache-memory-bytes) {self.memory_bytes} holds "
                             f"no KV block of {bytes_per_block} bytes; give it at least that")
        return n


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64  # sequences in one step's batch
    # token budget per step, shared by decode rows (1 token each) and prefill chunks
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # the order prompts take what the step's budget leaves after decoding rows: "fifo" (arrival, a prompt
    # keeps the budget until it is done), or "fair": the fewest uncomputed tokens first, each prompt's count
    # lowered by `prefill_aging_tokens_per_step` for every step it has waited (so nothing starves), the
    # longest chunked to what is left -- a short prompt waits at most one step behind a long one. Aging counts
    # steps, not seconds, so the same setting means the same on a CPU (steps of a second) and a GPU (steps of
    # milliseconds).
    prefill_order: str = "fifo"
    prefill_aging_tokens_per_step: int = 64
    # fair order: the most prompt tokens one step computes, all prompts together (0: the whole budget).
    # NOTE: a step cannot be interrupted, so this bounds how long a prompt that just arrived waits for the
    # step in progress, however many long prompts are queued (a per-prompt cap would not: four long prompts'
    # chunks fill a 2,048-token step). Keep it large enough for a step to stay compute-bound.
    prefill_chunk_tokens: int = 0
    # fair order: the most prompt tokens a step computes for prompts of a class below the highest one this
    # engine has seen in its last `priority_memory_steps` steps (0: no cap of their own). A high-class prompt
    # that arrives mid-step waits for the step in progress; while such prompts keep coming, lower classes run
    # in smaller steps so that wait is short. With one class, nothing changes.
    lower_class_chunk_tokens: int = 0
    priority_memory_steps: int = 256

    def __post_init__(self) -> None:
        if self.prefill_order not in ("fifo", "fair"):
            raise ValueError(f"SchedulerConfig.prefill_order must be 'fifo' or 'fair', got {self.prefill_order!r}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"SchedulerConfig.prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        if self.lower_class_chunk_tokens < 0:
            raise ValueError("SchedulerConfig.lower_class_chunk_tokens must be >= 0 (0: no cap of their own), "
                             f"got {self.lower_class_chunk_tokens}")
        if self.priority_memory_steps < 0:
            raise ValueError(f"SchedulerConfig.priority_memory_steps must be >= 0, got {self.priority_memory_steps}")
        if self.prefill_aging_tokens_per_step < 0:
            raise ValueError("SchedulerConfig.prefill_aging_tokens_per_step must be >= 0, "
                             f"got {self.prefill_aging_tokens_per_step}")
        if self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("SchedulerConfig.max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose draft tokens, verify them all in one forward, keep what the target
    model agrees with (exactly: greedy output and the sampled distribution are the target's own)."""

    method: str | None = None  # None -> off; "ngram" -> prompt lookup over the sequence's own tokens
    num_speculative_tokens: int = 8  # the most draft tokens verified per sequence per step (k)
    # the most draft tokens one step verifies over all its sequences (0: no cap), shared equally by the
    # decoding sequences: at batch 1 drafts are nearly free, in a big batch the verify pass turns
    # compute-bound (README, "Speculative decoding")
    max_draft_tokens_per_step: int = 32
    # n-gram sizes matched against earlier context, longest first; a longer match proposes better drafts
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("SpeculativeConfig.num_speculative_tokens must be >= 1, "
                             f"got {self.num_speculative_tokens}")
        if self.max_draft_tokens_per_step < 0:
            raise ValueError("SpeculativeConfig.max_draft_tokens_per_step must be >= 0 (0: no cap), "
                             f"got {self.max_draft_tokens_per_step}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("SpeculativeConfig.prompt_lookup_min must be in [1, prompt_lookup_max], got "
                             f"{self.prompt_lookup_min} (max {self.prompt_lookup_max})")

    @property
    def enabled(self) -> bool:
        return self.method is not None


SPECULATIVE_METHODS = (None, "ngram")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one model replica) needs."""

    model: str  # a built-in name, an HF model directory, or a .gguf file
    device: str | None = None  # None -> cuda when available, else cpu
    dtype: str | None = None  # None -> bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None  # None -> the model's context length
    num_threads: int | None = None  # torch intra-op threads on CPU; None -> leave torch's choice
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # what runs the model: "builtin" (pdserve's own engine) or "vllm" (an in-process vLLM engine)
    backend: str = "builtin"
    # "gguf": keep a GGUF checkpoint's Q4_0/Q4_1/Q8_0 matrices in their blocks (`engine.quant`; the model is
    # still the float32 one, read in 5-8.5 bits a weight); "none": dequantise them to `dtype` at load. None:
    # "gguf" for a .gguf file and the built-in smollm2-135m (shipped as one), "none" for an HF directory
    quantization: str | None = None
    # ranks the model is split over (vLLM's tensor parallelism, its processes the worker's children); the
    # built-in engine runs one device
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "vllm" and self.speculative.enabled:
            raise ValueError("speculative decoding is the built-in engine's; --speculative needs --engine builtin")
        if not self.model:
            raise ValueError("EngineConfig.model must name a model")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError("EngineConfig.quantization (--quantization) must be one of "
                             f"{', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization == "gguf" and self.backend == "vllm":
            raise ValueError("--quantization gguf is the built-in engine's; a vLLM engine loads the model's "
                             "HF directory (use --engine builtin, or drop --quantization)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.cache.dtype is not None and self.backend == "vllm":
            raise ValueError("CacheConfig.dtype (--kv-cache-dtype) is the built-in engine's; a vLLM engine keeps "
                             "its KV in the model's dtype (use --dtype)")
        if self.device is not None:  # (an engine picking its own device checks again, `LLMEngine`)
            refuse_fp8_off_cpu(self.cache.dtype, self.device)
        # (and `LLMEngine`, once the model's dtype is resolved)
        refuse_narrow_cache_under_narrow_model(self.cache.dtype, self.dtype)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError(f"EngineConfig.tensor_parallel_size {self.tensor_parallel_size}: the built-in "
                             "engine runs one device per worker; tensor parallelism needs --engine vllm")


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("gguf", "none")
# a KV cache may also hold one byte a value, by vLLM's `--kv-cache-dtype` names -> torch's: fp8 (= fp8_e4m3,
# 3 mantissa bits, to +-448) or fp8_e5m2 (2 bits, to +-57,344); K and V past the range saturate. No scale
# factors: vLLM's default (k_scale = v_scale = 1) without a calibrated checkpoint.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = (*DTYPES, *FP8_KV_DTYPES)


def refuse_fp8_off_cpu(cache_dtype: str | None, device: str) -> None:
    """An 8-bit cache has run on the CPU only; on another device it is refused, naming the field.
    NOTE: no GPU has run one yet (the gather path's index_select into float8, among others)."""
    if cache_dtype in FP8_KV_DTYPES and device != "cpu":
        raise ValueError(f"CacheConfig.dtype {cache_dtype!r} (--kv-cache-dtype): an 8-bit cache is checked "
                         f"on the CPU only, not on {device}; use bfloat16 there")


def refuse_narrow_cache_under_narrow_model(cache_dtype: str | None, model_dtype: str | None) -> None:
    """A bfloat16 or float16 cache sits under a float32 model only (an 8-bit one under any); `model_dtype`
    None: not resolved yet, nothing to check."""
    if cache_dtype not in (None, model_dtype, *FP8_KV_DTYPES) and model_dtype not in (None, "float32"):
        raise ValueError(f"CacheConfig.dtype {cache_dtype!r} under a {model_dtype} model: the KV cache may "
                         "be narrower than a float32 model only, or match the model's dtype")


BACKENDS = ("builtin", "vllm")
# the block size each backend runs by default on this kind of machine (vLLM's CPU attention: 128)
DEFAULT_BLOCK_SIZE = {"builtin": 16, "vllm": 128}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
