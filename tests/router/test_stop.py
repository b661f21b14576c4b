"""Stop strings over streamed text: same output as on the whole text, however it is chunked."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.stop import StopResult, StopStringMatcher


def stream(stop: Sequence[str], chunks: Sequence[str]) -> tuple[list[str], str | None]:
    """(the text emitted after each chunk and at flush, the stop string that ended it)."""
    m = StopStringMatcher(stop)
    out, ended = [], None
    for chunk in chunks:
        r = m.add(chunk)
        out.append(r.text)
        if r.stopped:
            ended = r.stop
    r = m.flush()
    out.append(r.text)
    return out, ended or r.stop


def one_shot(stop: Sequence[str], text: str) -> tuple[str, bool]:
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def test_stop_in_one_chunk_is_cut_and_not_included() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.add("Hello.\n\nMore") == StopResult("Hello.", "\n\n")
    assert m.stopped
    assert m.add("ignored") == StopResult("", None)
    assert m.flush() == StopResult("", None)


def test_stop_split_across_chunks() -> None:
    out, stop = stream(["</s>"], ["Hello <", "/", "s> world"])
    assert out == ["Hello ", "", "", ""] and stop == "</s>"


def test_partial_stop_is_held_back_then_released() -> None:
    m = StopStringMatcher(["END"])
    assert m.add("the E") == StopResult("the ", None)
    assert m.add("N") == StopResult("", None)
    assert m.add("D?") == StopResult("", "END")

    m = StopStringMatcher(["END"])
    assert m.add("the EN") == StopResult("the ", None)
    assert m.add("JOY") == StopResult("ENJOY", None)  # not END after all: released in full


def test_flush_releases_held_text_when_generation_ends_otherwise() -> None:
    m = StopStringMatcher(["END"])
    assert m.add("almost E") == StopResult("almost ", None)
    assert m.flush() == StopResult("E", None)


def test_earliest_of_several_stops_wins() -> None:
    assert stream(["world", "lo"], ["hello world"]) == (["hel", ""], "lo")


def test_a_short_stop_inside_a_forming_longer_one_waits() -> None:
    # one-shot on "abc": "abc" starts at 0, before "b" at 1, so the output is ""
    assert stream(["b", "abc"], ["a", "b", "c"]) == (["", "", "", ""], "abc")
    # ...and if the longer one never completes, the short one still ends it where it is
    assert stream(["b", "abc"], ["a", "b", "x"]) == (["", "", "a", ""], "b")
    # ...including when generation ends while it is still undecided
    assert stream(["b", "abc"], ["a", "b"]) == (["", "", "a"], "b")


def test_repeated_prefix_characters() -> None:
    # "aab" inside "aaab": the held suffix must be the longest one that could still match
    assert stream(["aab"], ["a", "a", "a", "b", "c"]) == (["", "", "a", "", "", ""], "aab")


def test_unicode_stop_strings() -> None:
    assert stream(["\u00bfqu\u00e9?"], ["dijo \u00bf", "qu", "\u00e9? y"]) == (["dijo ", "", "", ""], "\u00bfqu\u00e9?")


def test_no_stop_strings_passes_everything_through() -> None:
    assert stream([], ["a", "b"]) == (["a", "b", ""], None)


ALPHABET = "ab"  # two letters: overlapping and nested stop strings come up often
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)


@st.composite
def stops_and_chunks(draw) -> tuple[list[str], list[str]]:
    """Stop strings, and a text built from them, their prefixes and noise, cut into random chunks."""
    stop = draw(STOPS)
    pieces = draw(st.lists(st.one_of(
        st.sampled_from(stop),
        st.sampled_from(stop).flatmap(lambda s: st.integers(1, len(s)).map(lambda n: s[:n])),
        st.text(ALPHABET, max_size=3),
    ), max_size=6))
    text = "".join(pieces)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return stop, [text[i:j] for i, j in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None, database=None)
@given(case=stops_and_chunks())
@example(case=(["b", "abb"], ["ab", "b"]))  # a short stop inside a longer one still forming
def test_streamed_output_equals_one_shot(case: tuple[list[str], list[str]]) -> None:
    stop, chunks = case
    out, ended = stream(stop, chunks)
    expected, stops = one_shot(stop, "".join(chunks))
    assert "".join(out) == expected
    assert (ended is not None) == stops
    if ended is not None:
        assert "".join(chunks)[len(expected):].startswith(ended)


@settings(max_examples=200, deadline=None, database=None)
@given(case=stops_and_chunks())
def test_held_text_stays_shorter_than_the_longest_stop(case: tuple[list[str], list[str]]) -> None:
    stop, chunks = case
    m = StopStringMatcher(stop)
    for chunk in chunks:
        m.add(chunk)
        assert len(m.held) < max(map(len, stop))
