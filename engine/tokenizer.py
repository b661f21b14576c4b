"""The checkpoint's own tokenizer and chat template (transformers), plus incremental detokenizing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        if path.suffix == ".gguf":
            self.hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            self.hf = AutoTokenizer.from_pretrained(str(path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Text for tokens as they arrive, never splitting a multi-byte character (the vLLM offsets trick:
    decode a short window before the new tokens and emit only the stable difference)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an unfinished UTF-8 sequence: wait for the next token
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]
