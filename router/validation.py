"""A `GenerateRequest` off the wire -> a `ValidatedRequest` the router can place, or `InvalidArgument`.

Pure: no I/O, no gRPC status handling (the servicer maps `InvalidArgument` to `INVALID_ARGUMENT` with
`str(err)` as the message, e.g. "sampling.top_p: must be in (0, 1], got 1.5"). Field names are the proto
paths, with an index for repeated fields ("sampling.stop[2]", "messages.messages[0].role").

Checks run cheapest first, and everything that bounds work (prompt characters, list lengths) runs before
the tokenizer is called, so a hostile request costs little. The first problem found is reported.

Decisions on the ambiguous cases:
- request_id: empty -> the server assigns one (`new_request_id`, a uuid4 hex by default). Otherwise at most
  `Limits.max_request_id_len` characters of visible ASCII (0x21-0x7e): ids land in logs and trace
  attributes, where spaces, control characters and look-alike Unicode only cause trouble. Uniqueness among
  requests in flight is the servicer's business (it knows what is in flight), not this function's.
- prompt: the empty string is rejected; whitespace-only is accepted (it tokenizes to real tokens and a model
  can continue it; vLLM and OpenAI accept it too). Rejected when it tokenizes to no tokens at all.
- prompt length: the prompt must leave room for one generated token, so `len(prompt) >= max_model_len` is
  rejected (vLLM rejects `>`; a prompt that fills the context can only produce a LENGTH finish with no
  output, which is a client error worth reporting). The error names the input field that was set.
- prompt_token_ids: empty is rejected; every id must be in [0, vocab_size). Ids are used as given (no BOS
  added): the client tokenized, the client decides.
- messages: at least one; at most `Limits.max_messages`; role one of system/user/assistant/tool, exact case
  (chat templates compare roles literally). Empty content is accepted (an assistant turn that only called a
  tool has none). Errors the chat template raises (no template; "roles must alternate") are reported
  against `messages`.
- sampling.temperature: unset -> 1.0. Must be finite and in [0, max_temperature] (100 by default; higher
  is uniform noise in practice). Below 1e-5 (0 included) -> greedy, as vLLM does: dividing logits by a
  near-zero temperature overflows.
- sampling.top_p: unset -> 1.0; must be finite and in (0, 1]. 0 is rejected, not read as "off".
- sampling.top_k: unset or 0 -> off; otherwise at most vocab_size.
- sampling.seed: any uint64 is accepted (torch seeds take the full range).
- sampling.max_tokens: 0 -> `min(default_max_tokens, room)` where room = max_model_len - prompt tokens.
  An explicit value with prompt + max_tokens > max_model_len is rejected rather than clamped (vLLM does the
  same): a client that asked for N tokens should not silently get fewer with finish_reason LENGTH.
- sampling.stop: at most `max_stop_strings`, each non-empty and at most `max_stop_len` characters;
  duplicates are dropped (order kept).
- sampling.stop_token_ids: at most `max_stop_token_ids`, each in [0, vocab_size); duplicates dropped.
- cache_salt: at most `Limits.max_cache_salt_len` characters; empty -> the tenant's salt (the door fills it).
- priority: unset -> the tenant's class; above the tenant's class -> capped to it (not refused: a client
  cannot know its class); above MAX_PRIORITY -> refused.
- Float fields arrive as float32; they are read back as the shortest decimal that round-trips in float32,
  so a client's 0.7 is 0.7 here and in error messages, not 0.699999988079071.
"""

from __future__ import annotations

import math
import struct
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from router.tenants import MAX_PRIORITY

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


class InvalidArgument(ValueError):
    """A request field the router cannot serve; `str(err)` is "<field>: <message>"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # survives pickling (Ray, multiprocessing) despite the two-argument constructor
        return (InvalidArgument, (self.field, self.message))


class PromptTokenizer(Protocol):
    """What validation needs of a tokenizer (engine.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    """What the served model and this router accept (the servicer builds it from the model config)."""

    max_model_len: int  # context length: prompt + generated tokens never exceed it
    vocab_size: int  # token ids must index the model's embedding: [0, vocab_size)
    default_max_tokens: int = 256  # when the request leaves max_tokens at 0 (still capped by room)
    max_temperature: float = 100.0  # above this sampling is noise; likely a unit mix-up by the client
    max_stop_strings: int = 16  # each one is searched for in every streamed chunk
    max_stop_len: int = 256  # characters; bounds the text held back while a stop string might be forming
    max_stop_token_ids: int = 256  # each one is checked against every sampled token
    max_messages: int = 1024  # bounds the chat-template work before any token is counted
    max_request_id_len: int = 128  # ids land in logs and traces
    max_cache_salt_len: int = 256  # hashed once per request; bounds that work
    max_prompt_chars: int | None = None  # before tokenizing; None -> 32 characters per context token

    def __post_init__(self) -> None:
        for name in ("max_model_len", "vocab_size", "default_max_tokens", "max_stop_strings", "max_stop_len",
                     "max_stop_token_ids", "max_messages", "max_request_id_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not math.isfinite(self.max_temperature) or self.max_temperature <= 0:
            raise ValueError(f"max_temperature must be a finite number > 0, got {self.max_temperature!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or None, got {self.max_prompt_chars!r}")

    @property
    def prompt_char_limit(self) -> int:
        # NOTE: a token rarely spans more than ~16 characters, so 32 per context token cannot reject a prompt
        # that would fit, yet stops megabytes of text from reaching the tokenizer.
        return self.max_prompt_chars if self.max_prompt_chars is not None else 32 * self.max_model_len


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens already resolved (default applied, fits the context)
    stop: tuple[str, ...]  # stop strings, applied by the router to the detokenized text
    # mixed into the prompt's block hashes (`protocol.block_hash.salt_root`): caches are shared only under
    # one salt; the request's own `cache_salt`, else its tenant's (`router.door`)
    cache_salt: str = ""
    priority: int = 0  # its class, 0 (lowest, shed first) .. MAX_PRIORITY; capped by its tenant's

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _new_request_id() -> str:
    return uuid.uuid4().hex


def validate_request(request: pb.GenerateRequest, limits: Limits, tokenizer: PromptTokenizer,
                     new_request_id: Callable[[], str] = _new_request_id) -> ValidatedRequest:
    """Check every field of `request` against `limits`; tokenize its input. Raises `InvalidArgument`."""
    request_id = _request_id(request.request_id, limits) or new_request_id()
    sampling = request.sampling
    temperature = _temperature(sampling, limits)
    top_p = _top_p(sampling)
    top_k = _top_k(sampling, limits)
    stop = _stop_strings(sampling.stop, limits)
    stop_token_ids = _stop_token_ids(sampling.stop_token_ids, limits)
    if len(request.cache_salt) > limits.max_cache_salt_len:
        raise InvalidArgument("cache_salt", f"must be at most {limits.max_cache_salt_len} characters, "
                              f"got {len(request.cache_salt)}")
    if request.HasField("priority") and request.priority > MAX_PRIORITY:
        raise InvalidArgument("priority", f"must be in 0..{MAX_PRIORITY}, got {request.priority}")
    if sampling.max_tokens > limits.max_model_len:  # cheap early exit before tokenizing
        raise InvalidArgument("sampling.max_tokens", f"must be at most the context length "
                              f"{limits.max_model_len}, got {sampling.max_tokens}")

    priority = request.priority if request.HasField("priority") else MAX_PRIORITY
    input_field, prompt_token_ids = _prompt(request, limits, tokenizer)
    n = len(prompt_token_ids)
    if n >= limits.max_model_len:
        raise _too_long(input_field, n, limits)
    room = limits.max_model_len - n
    if sampling.max_tokens == 0:
        max_tokens = min(limits.default_max_tokens, room)
    elif sampling.max_tokens > room:
        raise InvalidArgument("sampling.max_tokens", f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) "
                              f"exceeds the context length {limits.max_model_len}; at most {room}")
    else:
        max_tokens = sampling.max_tokens

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop_token_ids=stop_token_ids,
        ignore_eos=sampling.ignore_eos,
        disable_speculation=sampling.disable_speculation,
        cache_salt=request.cache_salt,
        priority=priority,
    )
    return ValidatedRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, stop=stop,
                            cache_salt=request.cache_salt, priority=priority)


def _too_long(field: str, num_tokens: int, limits: Limits) -> InvalidArgument:
    return InvalidArgument(field, f"prompt is {num_tokens} tokens; the context length is {limits.max_model_len}, "
                           f"so at most {limits.max_model_len - 1} leave room to generate")


def _request_id(request_id: str, limits: Limits) -> str:
    if len(request_id) > limits.max_request_id_len:
        raise InvalidArgument("request_id", f"must be at most {limits.max_request_id_len} characters, "
                              f"got {len(request_id)}")
    for i, ch in enumerate(request_id):
        if not "\x21" <= ch <= "\x7e":
            raise InvalidArgument("request_id", f"must be visible ASCII (no spaces or control characters), "
                                  f"got {ch!r} at position {i}")
    return request_id


def _from_float32(x: float) -> float:
    """The shortest decimal that is the same float32 as `x` (0.699999988079071 -> 0.7)."""
    if not math.isfinite(x):
        return x
    packed = struct.pack("<f", x)
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == packed:
            return y
    return x


def _temperature(sampling: pb.SamplingParams, limits: Limits) -> float:
    if not sampling.HasField("temperature"):
        return 1.0
    t = _from_float32(sampling.temperature)
    if not math.isfinite(t) or not 0.0 <= t <= limits.max_temperature:
        raise InvalidArgument("sampling.temperature", f"must be a finite number in [0, {limits.max_temperature:g}] "
                              f"(0 for greedy), got {t!r}")
    return 0.0 if t < GREEDY_EPS else t


def _top_p(sampling: pb.SamplingParams) -> float:
    if not sampling.HasField("top_p"):
        return 1.0
    p = _from_float32(sampling.top_p)
    if not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {p!r}")
    return p


def _top_k(sampling: pb.SamplingParams, limits: Limits) -> int:
    k = sampling.top_k  # unset reads 0: off
    if k > limits.vocab_size:
        raise InvalidArgument("sampling.top_k", f"must be at most the vocabulary size {limits.vocab_size} "
                              f"(0 or unset for no top-k), got {k}")
    return k


def _stop_strings(stop: Sequence[str], limits: Limits) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgument("sampling.stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidArgument(f"sampling.stop[{i}]", "must not be empty")
        if len(s) > limits.max_stop_len:
            raise InvalidArgument(f"sampling.stop[{i}]", f"must be at most {limits.max_stop_len} characters, "
                                  f"got {len(s)}")
    return tuple(dict.fromkeys(stop))


def _stop_token_ids(ids: Sequence[int], limits: Limits) -> tuple[int, ...]:
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidArgument("sampling.stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(ids)}")
    for i, t in enumerate(ids):
        if t >= limits.vocab_size:
            raise InvalidArgument(f"sampling.stop_token_ids[{i}]",
                                  f"token id {t} is outside the vocabulary [0, {limits.vocab_size})")
    return tuple(dict.fromkeys(ids))


def _prompt(request: pb.GenerateRequest, limits: Limits, tokenizer: PromptTokenizer) -> tuple[str, list[int]]:
    """(the input field that was set, its prompt token ids)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "set one of prompt, prompt_token_ids or messages")
    if kind == "prompt":
        return kind, _text_prompt(request.prompt, limits, tokenizer)
    if kind == "prompt_token_ids":
        return kind, _token_prompt(request.prompt_token_ids.ids, limits)
    assert kind == "messages", f"unhandled input {kind!r}"
    return kind, _chat_prompt(request.messages.messages, limits, tokenizer)


def _text_prompt(prompt: str, limits: Limits, tokenizer: PromptTokenizer) -> list[int]:
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if len(prompt) > limits.prompt_char_limit:
        raise InvalidArgument("prompt", f"must be at most {limits.prompt_char_limit} characters, got {len(prompt)}")
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise InvalidArgument("prompt", "tokenizes to no tokens")
    return ids


def _token_prompt(ids: Sequence[int], limits: Limits) -> list[int]:
    if not ids:
        raise InvalidArgument("prompt_token_ids.ids", "must not be empty")
    if len(ids) >= limits.max_model_len:  # before the per-id scan: bounds the work
        raise _too_long("prompt_token_ids.ids", len(ids), limits)
    ids = list(ids)
    if max(ids) >= limits.vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise InvalidArgument(f"prompt_token_ids.ids[{i}]",
                              f"token id {ids[i]} is outside the vocabulary [0, {limits.vocab_size})")
    return ids


def _chat_prompt(messages: Sequence[pb.ChatMessage], limits: Limits, tokenizer: PromptTokenizer) -> list[int]:
    if not messages:
        raise InvalidArgument("messages.messages", "must hold at least one message")
    if len(messages) > limits.max_messages:
        raise InvalidArgument("messages.messages", f"at most {limits.max_messages} messages, got {len(messages)}")
    chars = 0
    for i, m in enumerate(messages):
        if m.role not in ALLOWED_ROLES:
            raise InvalidArgument(f"messages.messages[{i}].role",
                                  f"must be one of {', '.join(ALLOWED_ROLES)}, got {m.role!r}")
        chars += len(m.content)
    if chars > limits.prompt_char_limit:
        raise InvalidArgument("messages", f"contents must total at most {limits.prompt_char_limit} characters, "
                              f"got {chars}")
    try:
        ids = list(tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages]))
    # NOTE: deliberately broad: chat templates reject conversations by raising whatever their Jinja
    # `raise_exception` raises (jinja2.TemplateError, not a ValueError); all of it is the client's input.
    except Exception as e:
        message = str(e).removeprefix("messages: ")
        raise InvalidArgument("messages", f"the chat template rejected them: {message}") from e
    if not ids:
        raise InvalidArgument("messages", "render to no tokens")
    return ids
