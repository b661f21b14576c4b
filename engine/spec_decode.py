"""Speculative decoding by prompt lookup (n-gram): drafts from the sequence's own tokens, verified exactly.

A decoding sequence whose last n tokens occurred earlier in its prompt or output is likely to continue as
it did then (a quote, an edited code block, a repeated list). `NgramProposer` proposes the up to k tokens
that followed the most recent earlier occurrence; the scheduler puts them in the sequence's chunk after
its last token, so one forward computes the target's distributions at all k + 1 positions over the paged
cache; `verify` keeps the longest prefix the target agrees with plus one token of the target's own. KV
written for rejected drafts is rolled back by the scheduler (the sequence's computed length stops at the
accepted tokens; blocks past its end are freed; their slots are overwritten by later steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import SpeculativeConfig
from engine.request import Request, RequestStatus
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from protocol.messages import SpecCounts


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured k) tokens that followed the most recent earlier occurrence of
        the longest suffix of `tokens` (between max_n and min_n long); [] when no suffix recurs."""
        k = self.k if k is None else min(k, self.k)
        if k <= 0:
            return []
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = list(tokens[L - n:])
            last = tail[-1]
            # NOTE: scanning back from the end finds the most recent occurrence first: in a repetition
            # loop or an edit of recent text, that is the one the sequence is following now.
            for end in range(L - 2, n - 2, -1):  # `end`: where an earlier occurrence's last token sits
                if tokens[end] == last and list(tokens[end - n + 1:end + 1]) == tail:
                    return list(tokens[end + 1:min(end + 1 + k, L)])
        return []


class Drafter:
    """The scheduler's side of speculation: how many drafts each decoding sequence may take this step,
    the drafts themselves, and the running counts of drafted and accepted tokens."""

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int) -> None:
        self.config = config
        self.proposer = NgramProposer(config) if config.enabled else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.counts = SpecCounts()

    def share(self, running: list[Request]) -> int:
        """The most drafts one sequence may propose this step: an equal share of the step's draft cap over
        the sequences that decode (at least one each)."""
        cap = self.config.max_draft_tokens_per_step
        if self.proposer is None or not cap:
            return self.max_num_batched_tokens
        decoding = sum(1 for r in running if r.status == RequestStatus.RUNNING)
        return max(1, cap // max(1, decoding))

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafts for a decoding sequence: at most `room` (what the step's budget and draft cap leave), its
        draft length, and what its max_tokens and context leave room for (all of them accepted plus the
        target's own token must still fit)."""
        if (self.proposer is None or req.params.disable_speculation
                or req.num_computed_tokens != req.num_tokens - 1 or req.status != RequestStatus.RUNNING):
            return []
        room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
        if req.max_model_len is not None:
            room = min(room, req.max_model_len - req.num_tokens - 1)
        return self.proposer.propose(req.all_token_ids, room) if room > 0 else []

    def count(self, drafts: list[int], tokens: list[int]) -> None:
        """A decoding sequence's step: `drafts` proposed, `tokens` kept (the accepted ones plus its own)."""
        c = self.counts
        accepted = len(tokens) - 1 if drafts else 0
        self.counts = SpecCounts(c.num_draft_tokens + len(drafts), c.num_accepted_tokens + accepted,
                                 c.num_decode_seq_steps + 1, c.num_decode_tokens + len(tokens))


def verify(logits: torch.Tensor, params: SamplingParams, position: int, drafts: list[int]) -> list[int]:
    """The tokens a sequence appends after one verify pass: the accepted drafts, then one of the target's.

    logits: [len(drafts) + 1, vocab], row i the target's logits for the token at `position + i` (the
    sequence held `position` tokens before this step), i.e. after drafts[:i].

    Greedy: accept while the draft is the argmax, then append the argmax where they first differ (or after
    the last draft). Sampling: the same rule on the token the plain sampler draws at each position, with
    the same processed distribution p (temperature, top-k, top-p) and the same (seed, position) generator.
    NOTE: that is exact rejection sampling for a point-mass draft x: the draw y ~ p equals x with
    probability p(x) (accept), and given y != x it is distributed as p with x removed and renormalised,
    i.e. max(0, p - onehot(x)) / (1 - p(x)), the residual the rule samples from on rejection. So the output
    is distributed as the target's whatever the draft, and a seeded request gets token for token what it
    would get without speculation (each position's draw depends only on (seed, position)).
    """
    if params.greedy:
        return verify_greedy(logits, drafts)
    accepted: list[int] = []
    for i, draft in enumerate(drafts):
        target = sample(logits[i:i + 1], [params], [position + i])[0]
        accepted.append(target)
        if target != draft:
            return accepted
    return accepted + sample(logits[-1:], [params], [position + len(drafts)])


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """`verify` for a greedy sequence, with one argmax over all its rows."""
    targets = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]]
