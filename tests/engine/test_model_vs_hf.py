"""The engine against an independent reference: transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from engine import LLM
from engine.checkpoint import byte_tokenizer
from engine.config import ModelConfig
from engine.hub import TINY_RANDOM_CONFIG
from tests.engine.helpers import greedy, hf_of_random_checkpoint, make_engine, rel_err, run_capturing_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]


def hf_next_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def assert_logits_match(engine, hf, prompt_ids: list[int], max_tokens: int, tol: float = 1e-4) -> None:
    req = engine.add_request(prompt_ids, greedy(max_tokens, ignore_eos=True))
    steps = run_capturing_logits(engine)[req.request_id]
    assert len(steps) == max_tokens
    tokens = prompt_ids + req.output_token_ids
    for i, ours in enumerate(steps):  # step 0 is the prefill, then one decode step per token
        ref = hf_next_logits(hf, tokens[:len(prompt_ids) + i])
        assert rel_err(ours, ref) <= tol, f"step {i}: relative error {rel_err(ours, ref):.2e}"


@pytest.fixture(scope="module")
def smollm2_llm():
    """SmolLM2 from the dense float32 matrices (its HF directory), as transformers reads it."""
    return LLM("smollm2-135m", num_blocks=128, dtype="float32", device="cpu", quantization="none")


def test_tiny_random_logits_match_hf_prefill_and_every_decode_step():
    engine = make_engine()
    from engine.hub import ensure_tiny_random

    hf = LlamaForCausalLM.from_pretrained(str(ensure_tiny_random()), attn_implementation="eager").eval()
    assert_logits_match(engine, hf, list(range(3, 40)), max_tokens=24)


@pytest.mark.parametrize("variant", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"num_kv_heads": 4, "tie_word_embeddings": True},  # plain MHA, tied embeddings (TinyLlama/SmolLM2 shape)
    {"num_kv_heads": 1, "head_dim": 32},  # MQA and head_dim != hidden / heads
], ids=["llama3-rope", "linear-rope", "mha-tied", "mqa-wide-head"])
def test_llama_family_variants_match_hf(tmp_path, variant):
    hf = hf_of_random_checkpoint(tmp_path, dataclasses.replace(TINY_RANDOM_CONFIG, **variant), seed=1)
    engine = make_engine(str(tmp_path))
    # a prompt longer than original_max_position_embeddings so the llama3 long-wavelength branch matters
    assert_logits_match(engine, hf, [(7 * i) % 250 for i in range(90)], max_tokens=8)


@pytest.mark.parametrize("traits", [
    {"qkv_bias": True},  # Qwen2 (Qwen2.5): biases on q/k/v
    {"qk_norm": True, "head_dim": 32},  # Qwen3: q and k normed per head; a head wider than hidden / heads
    {"qk_norm": True, "qkv_bias": True, "o_bias": True},  # Qwen3 with attention_bias
    {"qkv_bias": True, "o_bias": True},  # Llama with attention_bias
], ids=["qwen2", "qwen3", "qwen3-attention-bias", "llama-attention-bias"])
def test_qwen_families_and_attention_biases_match_hf(tmp_path, traits):
    hf = hf_of_random_checkpoint(tmp_path, dataclasses.replace(TINY_RANDOM_CONFIG, **traits), seed=2)
    engine = make_engine(str(tmp_path))
    assert_logits_match(engine, hf, [(5 * i) % 250 for i in range(40)], max_tokens=8)


def _randomise(hf) -> None:
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = p.shape[-1] ** -0.5
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_model_transformers_wrote_itself_loads_and_matches_it(tmp_path, family):
    """The config.json and weights as transformers saves them (not our writer): every key the engine reads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        family, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=256, eos_token_id=257)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    _randomise(hf)  # HF initialises biases to 0 and norms to 1: make every term count
    hf.save_pretrained(tmp_path)
    byte_tokenizer("").save_pretrained(str(tmp_path))
    engine = make_engine(str(tmp_path))
    c = engine.model_config
    expected = {"qwen2": (True, False, True), "qwen3": (False, True, True)}[family]
    assert (c.qkv_bias, c.qk_norm, c.tie_word_embeddings) == expected
    assert_logits_match(engine, hf, [(3 * i) % 250 for i in range(40)], max_tokens=8)


def _write_gguf(hf, path, arch: str, rope_freqs=None, quant: dict[str, str] | None = None) -> None:
    """`hf`'s weights as llama.cpp's converter writes them (float32; q and k rows permuted for its interleaved
    RoPE in "llama" files only), with a byte-level BPE vocabulary; `rope_freqs`: Llama 3.1's factors;
    `quant`: GGUF type by tensor role ("embed_tokens", "q_proj", ...), quantised by `gguf`'s own quantiser."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = hf.config
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(tokens) == c.vocab_size
    w = GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3] * 3)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(260)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
             "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.ascontiguousarray(rope_freqs.float().numpy()))

    def permute(x, heads: int):  # llama.cpp's convert_hf_to_gguf `permute`: rotate-half to interleaved
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    for name, t in hf.state_dict().items():
        parts = name.removeprefix("model.").split(".")
        if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):
            t = permute(t, c.num_attention_heads if parts[-2] == "q_proj" else c.num_key_value_heads)
        if parts[0] == "lm_head":
            gguf_name = f"output.{parts[-1]}"
        elif parts[0] == "layers":
            gguf_name = f"blk.{parts[1]}.{names[parts[-2]]}.{parts[-1]}"
        else:
            gguf_name = f"{names[parts[0]]}.{parts[-1]}"
        kind = (quant or {}).get(parts[-2] if parts[0] == "layers" else parts[0])
        if kind is not None:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(gguf_name, quantize(t.float().numpy(), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_gguf_file_loads_and_matches_transformers_reading_the_same_file(tmp_path, family):
    """llama.cpp keeps Qwen's q and k rows in HF's order (it permutes only its "llama" files); transformers'
    own GGUF reader is the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # NOTE: transformers' GGUF reader takes Qwen3's head_dim from its config's default (128), not the file
    hf_config = AutoConfig.for_model(
        family, vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128 if family == "qwen3" else 32,
        max_position_embeddings=512,
        rope_theta=1e6, tie_word_embeddings=False, bos_token_id=258, eos_token_id=260)
    torch.manual_seed(4)
    source = AutoModelForCausalLM.from_config(hf_config).eval()
    _randomise(source)
    _write_gguf(source, tmp_path / "model.gguf", family)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = make_engine(str(tmp_path / "model.gguf"))
    assert engine.model_config.head_dim == hf_config.head_dim
    assert_logits_match(engine, hf, [(11 * i) % 250 for i in range(40)], max_tokens=8)


# up_proj: Q4_0 (kept as Q4_1, gate's type: gate and up run fused) or Q8_0 (two types: two matmuls); only
# llama runs both, to keep the suite's time
@pytest.mark.parametrize("family,up", [("llama", "Q4_0"), ("llama", "Q8_0"), ("qwen2", "Q4_0"),
                                       ("qwen3", "Q4_0")])
def test_a_quantised_gguf_file_runs_from_its_blocks_and_matches_transformers_reading_it(tmp_path, family, up):
    """Q4_0, Q4_1 and Q8_0 matrices (as llama.cpp's quantiser would write them) through the GGUF kernel:
    transformers' GGUF reader dequantises the same file; the engine must keep the blocks (fused q/k/v across
    Q4_0 and Q4_1, llama's permuted q/k rows, Qwen2's biases, Qwen3's q/k norms) and match it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        family, vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128 if family == "qwen3" else 32,
        max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=258,
        eos_token_id=260)
    torch.manual_seed(5)
    source = AutoModelForCausalLM.from_config(hf_config).eval()
    _randomise(source)
    quant = {"embed_tokens": "Q8_0", "lm_head": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q4_1",
             "o_proj": "Q8_0", "gate_proj": "Q4_1", "up_proj": up, "down_proj": "Q4_1"}
    _write_gguf(source, tmp_path / "model.gguf", family, quant=quant)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = make_engine(str(tmp_path / "model.gguf"))
    if not engine.model.quantized:
        pytest.skip("the GGUF kernel could not be built here: the engine dequantised the blocks at load")
    kinds = {type(m).__name__ for layer in engine.model.layers for m in (layer.qkv, layer.o, layer.down)}
    assert kinds == {"QuantizedMatmul"}
    assert all((layer.gate_up is not None) == (up == "Q4_0") for layer in engine.model.layers)
    assert_logits_match(engine, hf, [(11 * i) % 250 for i in range(40)], max_tokens=8)
    # a 30-token prompt: its prefill's matmuls take the kernel's 29-32-row path (the 40-token one, the
    # dequantised matrices)
    assert_logits_match(engine, hf, [(7 * i + 3) % 250 for i in range(30)], max_tokens=2)


def test_a_q4_0_matrix_whose_offset_overflows_half_precision_is_read_dequantised(tmp_path):
    """Q4_0 is kept as Q4_1 with m = -8d; a block whose -8d does not fit a float16 (|w| past 65,504) cannot
    be, so that one matrix is dequantised at load, as gguf gives it, and the others stay in their blocks."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.gguf_loader import load_gguf_quantized

    hf_config = AutoConfig.for_model(
        "llama", vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, bos_token_id=258,
        eos_token_id=260)
    source = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        source.model.layers[0].mlp.up_proj.weight[3, 5] = 70_000.0
    _write_gguf(source, tmp_path / "model.gguf", "llama", quant={"up_proj": "Q4_0"})
    _, state, blocks = load_gguf_quantized(str(tmp_path / "model.gguf"))
    assert "model.layers.1.mlp.up_proj.weight" in blocks
    name = "model.layers.0.mlp.up_proj.weight"
    assert name not in blocks
    raw = next(t for t in GGUFReader(str(tmp_path / "model.gguf")).tensors if t.name == "blk.0.ffn_up.weight")
    assert torch.equal(state[name], torch.from_numpy(dequantize(raw.data, GGMLQuantizationType.Q4_0)))


def test_a_llama_3_1_gguf_file_with_rope_freqs_matches_transformers_on_the_hf_directory(tmp_path):
    """llama.cpp writes Llama 3.1's RoPE scaling as a `rope_freqs` tensor (a divisor per frequency), not as
    config: read, it gives the logits transformers computes from the HF directory's llama3 rope_scaling."""
    config = dataclasses.replace(
        TINY_RANDOM_CONFIG, vocab_size=261, bos_token_id=258, eos_token_ids=(260,), rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})
    hf = hf_of_random_checkpoint(tmp_path / "hf", config, seed=6)
    d = config.head_dim
    plain = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    factors = plain / hf.model.rotary_emb.inv_freq  # (what llama.cpp's converter computes and stores)
    assert factors.max() > 4  # the long wavelengths are scaled
    _write_gguf(hf, tmp_path / "llama31.gguf", "llama", rope_freqs=factors)
    engine = make_engine(str(tmp_path / "llama31.gguf"))
    assert engine.model_config.rope_scaling["rope_type"] == "freq_factors"
    # past original_max_position_embeddings, where the scaled frequencies matter most
    assert_logits_match(engine, hf, [(7 * i) % 250 for i in range(90)], max_tokens=8)


def test_a_sliding_window_model_is_served_up_to_its_window_where_full_attention_equals_it():
    base = {**TINY_RANDOM_CONFIG.to_hf(), "max_position_embeddings": 32768}
    mistral = {**base, "model_type": "mistral"}
    assert ModelConfig.from_hf({**mistral, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).max_position_embeddings == 32768
    # a Mistral config without the key has transformers' default window
    unset = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert transformers.MistralConfig().sliding_window == 4096
    assert ModelConfig.from_hf(unset).max_position_embeddings == 4096
    # Qwen2 and Qwen3 slide from layer max_window_layers on (28 where unset), with use_sliding_window only: as
    # transformers' config writes it, and as an older config.json without layer_types says it
    for family, cls in (("qwen2", transformers.Qwen2Config), ("qwen3", transformers.Qwen3Config)):
        qwen = {**base, "model_type": family, "sliding_window": 4096, "num_hidden_layers": 4}
        for window_layers, context in ((None, 32768), (1, 4096), (4, 32768)):
            keys = {"use_sliding_window": True}
            if window_layers:
                keys["max_window_layers"] = window_layers
            written = cls(**{**qwen, **keys}).to_dict()
            assert "layer_types" in written
            for d in (written, {**qwen, **keys}):
                assert ModelConfig.from_hf(d).max_position_embeddings == context, (family, keys)
        # use_sliding_window off: full attention whatever the other keys say (transformers drops the window)
        off = {**qwen, "use_sliding_window": False, "max_window_layers": 1,
               "layer_types": ["sliding_attention"] * 4}
        assert cls(**off).sliding_window is None
        for d in (cls(**off).to_dict(), off):
            assert ModelConfig.from_hf(d).max_position_embeddings == 32768
    # Llama never slides
    llama = ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 64})
    assert llama.max_position_embeddings == 32768


def test_a_config_without_optional_keys_reads_as_transformers_defaults_them():
    bare = {k: v for k, v in TINY_RANDOM_CONFIG.to_hf().items() if k not in ("head_dim", "rms_norm_eps")}
    assert ModelConfig.from_hf({**bare, "model_type": "qwen3"}).head_dim == 128  # Qwen3Config's default
    c = TINY_RANDOM_CONFIG
    assert ModelConfig.from_hf(bare).head_dim == c.hidden_size // c.num_heads
    assert ModelConfig.from_hf(bare).rms_norm_eps == 1e-6


def test_a_family_the_built_in_engine_does_not_serve_is_refused_naming_it_and_the_way_out():
    with pytest.raises(ValueError, match=r"'gemma3'.*qwen3.*--engine vllm"):
        ModelConfig.from_hf({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]})
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf({**TINY_RANDOM_CONFIG.to_hf(), "mlp_bias": True})
    with pytest.raises(ValueError, match=r"'yarn' is not computed by the built-in engine.*--engine vllm"):
        ModelConfig.from_hf({**TINY_RANDOM_CONFIG.to_hf(),
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"causal language models \(\*ForCausalLM\) only"):
        ModelConfig.from_hf({**TINY_RANDOM_CONFIG.to_hf(), "model_type": "qwen2",
                             "architectures": ["Qwen2ForRewardModel"]})


@pytest.mark.slow
def test_smollm2_logits_match_hf_prefill_and_every_decode_step(smollm2_llm, smollm2_hf):
    ids = smollm2_llm.tokenizer.encode(PROMPTS[2])
    assert_logits_match(smollm2_llm.engine, smollm2_hf, ids, max_tokens=12)


@pytest.fixture(scope="module")
def smollm2_gguf_llm():
    llm = LLM("smollm2-135m", num_blocks=128, dtype="float32", device="cpu")  # (the default: its blocks)
    if not llm.engine.model.quantized:
        pytest.skip("the GGUF kernel could not be built here: the engine dequantised the blocks at load")
    return llm


def test_smollm2_from_its_gguf_blocks_matches_hf_on_the_dequantised_weights(smollm2_gguf_llm, smollm2_hf):
    """The built-in model's Q4_1/Q8_0 blocks through the kernel: still the float32 model transformers runs.
    A 13-token prompt takes the kernel, a 160-token one the wide path (dequantised for the call)."""
    model = smollm2_gguf_llm.engine.model
    assert model.weight_bytes < 160 * 2**20  # the blocks, not 620 MiB of float32 matrices
    short = smollm2_gguf_llm.tokenizer.encode(PROMPTS[2])
    assert_logits_match(smollm2_gguf_llm.engine, smollm2_hf, short, max_tokens=6)
    long = smollm2_gguf_llm.tokenizer.encode(" ".join(PROMPTS * 12))
    assert len(long) > 32
    assert_logits_match(smollm2_gguf_llm.engine, smollm2_hf, long, max_tokens=3)
    assert_greedy_equals_hf_generate(smollm2_gguf_llm, smollm2_hf, 16)


@pytest.mark.slow
def test_the_fast_gguf_reader_reads_every_field_and_tensor_as_the_stock_reader_does():
    """`gguf_reader` overrides a private method of gguf's reader (its views over the file): a gguf release
    that changes that method fails here, on SmolLM2's file (strings, string arrays, scalars, two tensor
    types)."""
    import numpy as np
    from gguf import GGUFReader

    from engine.hub import smollm2_gguf_path
    from engine.model_files import gguf_reader

    path = smollm2_gguf_path()
    stock, fast = GGUFReader(path), gguf_reader(path)
    assert list(stock.fields) == list(fast.fields) and len(stock.fields) > 20
    for name, want in stock.fields.items():
        got = fast.fields[name]
        assert (got.types, got.data, got.offset) == (want.types, want.data, want.offset), name
        assert all(np.array_equal(a, b) for a, b in zip(got.parts, want.parts, strict=True)), name
    assert fast.data_offset == stock.data_offset
    assert [(t.name, t.tensor_type, t.data_offset) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in stock.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, stock.tensors, strict=True))


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_equal_hf_generate(smollm2_llm, smollm2_hf):
    assert_greedy_equals_hf_generate(smollm2_llm, smollm2_hf, 32)


def assert_greedy_equals_hf_generate(llm: LLM, hf, tokens: int) -> None:
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy(tokens))):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)[0, len(ids):]
        assert out.token_ids == ref.tolist(), prompt
        assert out.text == llm.tokenizer.decode(ref.tolist())
