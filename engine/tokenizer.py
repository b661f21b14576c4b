"""The checkpoint's own tokenizer and chat template (transformers), plus incremental detokenizing."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def eos_token_id(path: Path) -> int | None:
    """The tokenizer's EOS id, as `Tokenizer(path).eos_token_id` gives it, read from its JSON files where they
    name it (tokenizer_config.json or special_tokens_map.json, then the token's id in tokenizer.json), else
    from the loaded tokenizer.

    NOTE: a worker needs only this of the tokenizer (the router tokenizes and detokenizes), and loading
    one costs 1.7 s of a worker's start here, nearly all of it importing transformers' tokenizer classes."""
    token = None
    if path.is_dir():
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = path / name
            if f.is_file() and (eos := json.loads(f.read_text()).get("eos_token")) is not None:
                token = eos.get("content") if isinstance(eos, dict) else eos
                break
    vocab = path / "tokenizer.json"
    if isinstance(token, str) and vocab.is_file():
        d = json.loads(vocab.read_text())
        added = {t["content"]: t["id"] for t in d.get("added_tokens", [])}
        found = added.get(token, (d.get("model") or {}).get("vocab", {}).get(token))
        if isinstance(found, int):
            return found
    return Tokenizer(path).eos_token_id


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
        eos = self.hf.eos_token_id
        return None if eos is None else int(eos)

    def encode(self, text: str) -> list[int]:
        return cast(list[int], self.hf.encode(text))  # typing only: no copy on the request path

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return cast(str, self._fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        text = self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str), "one sequence decodes to one string"
        return text

    @functools.cached_property
    def _fast(self) -> Any:
        """The Rust tokenizer, when transformers' decode would add nothing to it (no space clean-up).
        NOTE: the router decodes every streamed token; transformers' Python wrapper was most of that cost."""
        fast = getattr(self.hf, "backend_tokenizer", None)
        return fast if fast is not None and not getattr(self.hf, "clean_up_tokenization_spaces", False) else None

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's token ids. Only the template's own markers become special tokens: a message's
        content is tokenized as plain text, so a user who types `<|im_start|>system` gets those characters,
        not a forged system turn.

        NOTE: a conversation whose contents hold no added token's text (every ordinary one) is rendered and
        tokenized in one piece, exactly as transformers does. Otherwise the template is rendered with a
        placeholder per message, the text between placeholders is tokenized with special tokens parsed and
        each content without; templates that drop or repeat a message still work.
        """
        if not self.hf.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        for m in messages:
            if "\ue000" in m["content"] or "\ue001" in m["content"]:
                raise ValueError("messages: content must not contain the code points U+E000 or U+E001")
        if not any(marker in m["content"] for m in messages for marker in self._markers):
            text = str(self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            return cast(list[int], self.hf.encode(text, add_special_tokens=False))
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use code points
        text = str(self.hf.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                               tokenize=False, add_generation_prompt=True))
        ids: list[int] = []
        for i, part in enumerate(_PLACEHOLDER.split(text)):
            if i % 2 == 0:  # the template's own text: its markers are special tokens
                ids += self.hf.encode(part, add_special_tokens=False) if part else []
            else:  # a message's content, as plain text
                content = messages[int(part)]["content"]
                ids += self.hf(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids

    @functools.cached_property
    def _markers(self) -> tuple[str, ...]:
        """The text of every added token (the template's markers among them)."""
        return tuple(t.content for t in self.hf.added_tokens_decoder.values() if t.content)


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
