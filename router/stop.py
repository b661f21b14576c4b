"""Stop strings over streamed text: emit what is safe, hold back what could still become a stop string.

As in vLLM and the OpenAI API, the output ends just before the earliest stop string and the stop string
itself is not returned. Text that ends with the beginning of some stop string ("...</" while waiting for
"</s>") is held back until the next chunk decides it; `flush` releases it when the request finishes for
another reason (EOS, length) and cuts it if it held a complete stop string waiting on a longer one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    text: str  # safe to send to the client now
    stop: str | None  # the stop string that ended the output, if one did

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopStringMatcher:
    """One per request. Feed it the detokenized text chunk by chunk with `add`, then `flush` at the end.

    The streamed output equals the one-shot one however the text is split into chunks: the whole text cut
    before the stop string that starts earliest.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "empty stop string (validation rejects them)"
        self.stop = tuple(stop)
        self.held = ""  # text not yet emitted; always shorter than the longest stop string
        self.stopped = False

    def add(self, chunk: str) -> StopResult:
        """The text safe to emit after `chunk`, and the stop string if the output ends here. Once it has
        ended, later chunks are ignored."""
        if self.stopped:
            return StopResult("", None)
        text = self.held + chunk
        match = self._earliest_match(text)
        # the earliest place a stop string could still be forming, running to the end of the text
        partial = len(text) - self._partial_suffix_len(text)
        if match is not None and match[0] <= partial:
            return self._end(text, match)
        # NOTE: a complete match after `partial` must wait: a longer stop string starting at `partial`
        # may still complete, and the earliest start wins ("b" inside a forming "abc" does not end "ab").
        self.held = text[partial:]
        return StopResult(text[:partial], None)

    def flush(self) -> StopResult:
        """The held-back text once generation finished: cut at a stop string it holds, if any."""
        if self.stopped:
            return StopResult("", None)
        text, self.held = self.held, ""
        match = self._earliest_match(text)
        return StopResult(text, None) if match is None else self._end(text, match)

    def _end(self, text: str, match: tuple[int, str]) -> StopResult:
        self.held = ""
        self.stopped = True
        return StopResult(text[:match[0]], match[1])

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = text.find(s)
            if pos >= 0 and (best is None or (pos, -len(s)) < (best[0], -len(best[1]))):
                best = (pos, s)
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            # candidate starts: positions in the last len(s) - 1 characters holding s's first character
            start = max(0, len(text) - len(s) + 1)
            while (i := text.find(s[0], start)) >= 0:
                if s.startswith(text[i:]):
                    longest = max(longest, len(text) - i)
                    break  # earlier starts are longer suffixes: the first hit is this stop's longest
                start = i + 1
        return longest
