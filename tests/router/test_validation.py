"""validate_request: every bad field is rejected with its own name; good requests come out resolved."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import pytest

from protos.pdserve.v1 import generation_pb2 as pb
from router.validation import InvalidArgument, Limits, ValidatedRequest, validate_request

LIMITS = Limits(max_model_len=64, vocab_size=1000, default_max_tokens=16, max_stop_strings=4, max_stop_len=8,
                max_stop_token_ids=4, max_messages=8, max_request_id_len=16, max_prompt_chars=200)
INVISIBLE = "\u200b"  # the fake tokenizer drops it, so a prompt of only these tokenizes to nothing


class TemplateError(Exception):
    """Stands in for jinja2.TemplateError: what a chat template's raise_exception raises (not a ValueError)."""


class FakeTokenizer:
    """One token per character (its code point); the chat template renders "<role>content" per message."""

    def __init__(self, chat_template: bool = True) -> None:
        self.chat_template = chat_template
        self.calls: list[object] = []

    def encode(self, text: str) -> list[int]:
        self.calls.append(text)
        return [ord(c) for c in text if c != INVISIBLE]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        self.calls.append(messages)
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        if messages[0]["role"] == "assistant":
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]


def req(prompt: str | None = "hello", *, ids: list[int] | None = None,
        messages: list[tuple[str, str]] | None = None, request_id: str = "", **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if ids is not None:
        r.prompt_token_ids.ids.extend(ids)
        r.prompt_token_ids.SetInParent()  # an empty list still selects this input
    elif messages is not None:
        r.messages.messages.extend(pb.ChatMessage(role=role, content=c) for role, c in messages)
        r.messages.SetInParent()
    elif prompt is not None:
        r.prompt = prompt
    return r


def validate(r: pb.GenerateRequest, tokenizer: FakeTokenizer | None = None, limits: Limits = LIMITS,
             new_request_id: Callable[[], str] = lambda: "assigned") -> ValidatedRequest:
    return validate_request(r, limits, tokenizer or FakeTokenizer(), new_request_id=new_request_id)


NAN, INF = math.nan, math.inf
BAD: list[tuple[str, Callable[[], pb.GenerateRequest], str, str]] = [
    # (case, request, field, words the message must hold)
    ("no input", lambda: req(None), "input", "set one of prompt"),
    ("empty prompt", lambda: req(""), "prompt", "must not be empty"),
    ("prompt over the character limit", lambda: req("x" * 201), "prompt", "at most 200 characters, got 201"),
    ("prompt fills the context", lambda: req("x" * 64), "prompt", "prompt is 64 tokens"),
    ("prompt tokenizes to nothing", lambda: req(INVISIBLE * 3), "prompt", "no tokens"),
    ("empty token ids", lambda: req(ids=[]), "prompt_token_ids.ids", "must not be empty"),
    ("out-of-vocabulary id", lambda: req(ids=[1, 2, 1000, 3]), "prompt_token_ids.ids[2]", "token id 1000"),
    ("token ids fill the context", lambda: req(ids=[1] * 64), "prompt_token_ids.ids", "prompt is 64 tokens"),
    ("empty messages", lambda: req(messages=[]), "messages.messages", "at least one"),
    ("too many messages", lambda: req(messages=[("user", "a")] * 9), "messages.messages", "at most 8"),
    ("unknown role", lambda: req(messages=[("user", "a"), ("bot", "b")]), "messages.messages[1].role",
     "got 'bot'"),
    ("role in the wrong case", lambda: req(messages=[("User", "a")]), "messages.messages[0].role", "'User'"),
    ("empty role", lambda: req(messages=[("", "a")]), "messages.messages[0].role", "must be one of"),
    ("messages over the character limit", lambda: req(messages=[("user", "x" * 150), ("user", "y" * 51)]),
     "messages", "got 201"),
    ("chat template raises", lambda: req(messages=[("assistant", "hi")]), "messages", "roles must alternate"),
    ("rendered chat fills the context", lambda: req(messages=[("user", "x" * 60)]), "messages", "tokens"),
    ("negative temperature", lambda: req(temperature=-0.5), "sampling.temperature", "got -0.5"),
    ("NaN temperature", lambda: req(temperature=NAN), "sampling.temperature", "got nan"),
    ("infinite temperature", lambda: req(temperature=INF), "sampling.temperature", "got inf"),
    ("temperature over the cap", lambda: req(temperature=100.5), "sampling.temperature", "[0, 100]"),
    ("top_p zero", lambda: req(top_p=0.0), "sampling.top_p", "must be in (0, 1], got 0.0"),
    ("top_p above one", lambda: req(top_p=1.5), "sampling.top_p", "must be in (0, 1], got 1.5"),
    ("top_p NaN", lambda: req(top_p=NAN), "sampling.top_p", "got nan"),
    ("top_p negative", lambda: req(top_p=-0.1), "sampling.top_p", "got -0.1"),
    ("top_k above the vocabulary", lambda: req(top_k=1001), "sampling.top_k", "vocabulary size 1000"),
    ("max_tokens above the context", lambda: req(max_tokens=65), "sampling.max_tokens", "context length 64"),
    ("prompt + max_tokens above the context", lambda: req("x" * 60, max_tokens=5), "sampling.max_tokens",
     "at most 4"),
    ("too many stop strings", lambda: req(stop=["a", "b", "c", "d", "e"]), "sampling.stop", "at most 4"),
    ("empty stop string", lambda: req(stop=["a", ""]), "sampling.stop[1]", "must not be empty"),
    ("stop string too long", lambda: req(stop=["123456789"]), "sampling.stop[0]", "at most 8 characters"),
    ("too many stop token ids", lambda: req(stop_token_ids=[1, 2, 3, 4, 5]), "sampling.stop_token_ids",
     "at most 4"),
    ("stop token id out of vocabulary", lambda: req(stop_token_ids=[5, 1000]), "sampling.stop_token_ids[1]",
     "token id 1000"),
    ("request_id too long", lambda: req(request_id="r" * 17), "request_id", "at most 16 characters"),
    ("request_id with a space", lambda: req(request_id="a b"), "request_id", "position 1"),
    ("request_id with a newline", lambda: req(request_id="ab\n"), "request_id", "'\\n'"),
    ("request_id not ASCII", lambda: req(request_id="caf\u00e9"), "request_id", "visible ASCII"),
]


@pytest.mark.parametrize(("case", "make", "field", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_names_its_field(case: str, make, field: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate(make())
    err = info.value
    assert err.field == field
    assert str(err).startswith(f"{field}: ")
    assert words in err.message, err.message


def test_bad_cases_cover_every_field() -> None:
    roots = {b[2].split(".")[0].split("[")[0] for b in BAD}
    assert roots == {"input", "prompt", "prompt_token_ids", "messages", "sampling", "request_id"}
    sampling = {b[2].split(".")[1].split("[")[0] for b in BAD if b[2].startswith("sampling.")}
    # seed and ignore_eos have no bad values: every uint64 and bool is served
    assert sampling == {"temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids"}


def test_invalid_argument_is_a_value_error_with_the_brief_message() -> None:
    with pytest.raises(ValueError, match=r"^sampling\.top_p: must be in \(0, 1\], got 1\.5$"):
        validate(req(top_p=1.5))


def test_invalid_argument_pickles() -> None:
    err = pickle.loads(pickle.dumps(InvalidArgument("sampling.top_k", "too big")))
    assert (err.field, err.message, str(err)) == ("sampling.top_k", "too big", "sampling.top_k: too big")


def test_no_chat_template_is_reported_against_messages_once() -> None:
    with pytest.raises(InvalidArgument) as info:
        validate(req(messages=[("user", "hi")]), FakeTokenizer(chat_template=False))
    assert info.value.field == "messages"
    assert str(info.value).count("messages:") == 1 and "no chat template" in str(info.value)


def test_bad_sampling_is_rejected_before_tokenizing() -> None:
    tokenizer = FakeTokenizer()
    with pytest.raises(InvalidArgument):
        validate(req("x" * 50, top_p=2.0), tokenizer)
    with pytest.raises(InvalidArgument):
        validate(req("x" * 201), tokenizer)
    assert tokenizer.calls == []


# --- good requests --------------------------------------------------------------------------------------


def test_defaults() -> None:
    v = validate(req("hello"))
    assert v.prompt_token_ids == [ord(c) for c in "hello"] and v.num_prompt_tokens == 5
    p = v.params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos, p.stop_token_ids) == (1.0, 1.0, 0, None, False, ())
    assert p.max_tokens == LIMITS.default_max_tokens and not p.disable_speculation
    assert v.stop == ()
    assert v.request_id == "assigned"


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    assert validate(req("x" * 60)).params.max_tokens == 4


def test_max_tokens_that_exactly_fills_the_context_is_accepted() -> None:
    assert validate(req("x" * 60, max_tokens=4)).params.max_tokens == 4
    assert validate(req("x" * 63, max_tokens=1)).params.max_tokens == 1  # longest prompt allowed


def test_explicit_values_pass_through() -> None:
    v = validate(req(ids=[0, 999, 5], request_id="req-1:A/b", max_tokens=7, temperature=0.7, top_p=0.9,
                     top_k=1000, seed=2**64 - 1, ignore_eos=True, stop=["\n\n", "END", "\n\n"],
                     stop_token_ids=[2, 2, 0], disable_speculation=True))
    assert v.request_id == "req-1:A/b"
    assert v.prompt_token_ids == [0, 999, 5]
    p = v.params
    # float32 on the wire, read back as the decimal the client wrote
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.7, 0.9, 1000, 2**64 - 1)
    assert p.ignore_eos and p.stop_token_ids == (2, 0) and p.disable_speculation
    assert v.stop == ("\n\n", "END")


@pytest.mark.parametrize("t", [0.0, 1e-7])
def test_zero_and_tiny_temperatures_are_greedy(t: float) -> None:
    params = validate(req(temperature=t)).params
    assert params.greedy and params.temperature == 0.0


def test_temperature_at_the_cap_and_top_p_of_one_are_accepted() -> None:
    p = validate(req(temperature=100.0, top_p=1.0)).params
    assert (p.temperature, p.top_p) == (100.0, 1.0)


def test_whitespace_only_prompt_is_accepted() -> None:
    assert validate(req("   ")).prompt_token_ids == [32, 32, 32]


def test_messages_reach_the_template_as_dicts_and_empty_content_is_accepted() -> None:
    tokenizer = FakeTokenizer()
    v = validate(req(messages=[("system", "be brief"), ("user", "hi"), ("assistant", ""), ("tool", "{}")]),
                 tokenizer)
    assert tokenizer.calls == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": ""}, {"role": "tool", "content": "{}"}]]
    assert v.prompt_token_ids == [ord(c) for c in "<system>be brief<user>hi<assistant><tool>{}"]


def test_unset_sampling_message_means_defaults() -> None:
    r = pb.GenerateRequest(prompt="hi")
    assert not r.HasField("sampling")
    assert validate(r).params.max_tokens == LIMITS.default_max_tokens


def test_default_prompt_char_limit_is_derived_from_the_context() -> None:
    limits = Limits(max_model_len=10, vocab_size=1000)
    assert limits.prompt_char_limit == 320
    with pytest.raises(InvalidArgument, match="at most 320 characters"):
        validate(req("x" * 321), limits=limits)


def test_default_request_ids_are_unique() -> None:
    ids = {validate_request(req("hi"), LIMITS, FakeTokenizer()).request_id for _ in range(50)}
    assert len(ids) == 50


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_model_len": 0}, "max_model_len"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"max_stop_len": 0}, "max_stop_len"),
    ({"max_temperature": math.nan}, "max_temperature"),
    ({"max_prompt_chars": 0}, "max_prompt_chars"),
])
def test_limits_reject_nonsense(kwargs: dict, field: str) -> None:
    base = {"max_model_len": 64, "vocab_size": 1000}
    with pytest.raises(ValueError, match=f"^{field} "):
        Limits(**{**base, **kwargs})
