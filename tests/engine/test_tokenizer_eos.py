"""A worker's EOS id read from the tokenizer's files (`engine.tokenizer.eos_token_id`) against the id the
loaded tokenizer (transformers) gives, over every way a directory can name it."""

from __future__ import annotations

import json

import pytest

from engine.checkpoint import byte_tokenizer
from engine.hub import ensure_smollm2, ensure_tiny_random
from engine.tokenizer import Tokenizer, eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "tiny-random"])
def test_the_built_in_models_eos_is_the_loaded_tokenizers(model):
    path = ensure_smollm2() if model == "smollm2" else ensure_tiny_random()
    assert eos_token_id(path) == Tokenizer(path).eos_token_id is not None


def _edit(path, name, fn):
    f = path / name
    f.write_text(json.dumps(fn(json.loads(f.read_text()) if f.is_file() else {})))


@pytest.mark.parametrize("how", ["string", "dict", "special_tokens_map", "a_vocab_token", "none_named"])
def test_each_way_a_directory_names_its_eos_reads_as_transformers_does(tmp_path, how):
    byte_tokenizer("").save_pretrained(str(tmp_path))  # </s> = 257, an added token

    def config(d):
        if how == "dict":
            d["eos_token"] = {"content": "</s>", "lstrip": False, "rstrip": False, "normalized": False,
                              "single_word": False, "special": True, "__type": "AddedToken"}
        elif how == "a_vocab_token":
            d["eos_token"] = "a"  # a plain vocabulary entry, not an added token
        elif how in ("special_tokens_map", "none_named"):
            d.pop("eos_token", None)
        return d

    _edit(tmp_path, "tokenizer_config.json", config)
    if how == "special_tokens_map":
        _edit(tmp_path, "special_tokens_map.json", lambda d: {**d, "eos_token": "</s>"})
    want = Tokenizer(tmp_path).eos_token_id
    assert eos_token_id(tmp_path) == want
    assert want == {"a_vocab_token": Tokenizer(tmp_path).hf.convert_tokens_to_ids("a"), "none_named": None}.get(
        how, 257)
