"""Speculative decoding without a draft model: n-gram prompt lookup, as pure functions.

A decoding request's last n tokens (n from `max_ngram` down to `min_ngram`) are looked up
in its prompt and output so far; the tokens that followed their latest earlier occurrence
are the proposal (`propose_ngram`). The engine schedules the request's next token and the
proposal as one chunk, the runner computes the target's choice at every position of it,
and `accept_drafts` keeps the longest prefix of the proposal the target agrees with, plus
the target's own token at the first disagreement (or after the last draft).

Why the output is unchanged: at each position the target's choice is drawn exactly as a
plain decode step would draw it (greedy: the argmax; sampled: one row of noise from the
request's generator, the same exponential race). A draft is kept only when it *is* that
choice, so every emitted token is the token plain decoding would have emitted after the
same prefix. For a proposal that is a point mass on token t (n-gram lookup), this is the
standard speculative rejection rule: t is accepted with probability p(t) and, when
rejected, the token emitted is distributed as p with t removed and renormalised.
A seeded request draws one row per emitted token, as plain decoding does, so its output
is the same with speculation as without (and a resume's `skip_draws` stays exact).

No torch: the engine and the scheduler use these.
"""

from array import array
from collections.abc import Callable, Sequence

from workers.engine.config import SpeculativeConfig
from workers.engine.request import Request

TOKEN_BYTES = 4  # a token id in a haystack: a 32-bit int, native byte order


def token_bytes(tokens: Sequence[int], known: bytearray | None = None) -> bytearray:
    """`tokens` as a haystack for `propose_ngram`: `known` (the haystack of a prefix of
    them, extended in place) brought up to all of them, or a new one."""
    if known is None or len(known) > len(tokens) * TOKEN_BYTES:
        known = bytearray()
    have = len(known) // TOKEN_BYTES
    if have < len(tokens):
        known += array("i", tokens[have:]).tobytes()
    return known


def propose_ngram(
    tokens: Sequence[int],
    num_tokens: int,
    min_ngram: int,
    max_ngram: int,
    haystack: bytes | bytearray | None = None,
) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (between `min_ngram` and `max_ngram` long) found earlier in it;
    [] when no suffix recurs. `haystack`: `token_bytes(tokens)`, when the caller keeps it
    (converting a long context each step costs more than the search).

    The copy may run into the suffix itself (text repeating with a period shorter than
    `num_tokens`): the proposal then goes on repeating that period, as an overlapping copy
    does.
    """
    total = len(tokens)
    if num_tokens < 1 or total < 2:
        return []
    if haystack is None:
        haystack = token_bytes(tokens)
    size = TOKEN_BYTES
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        needle = haystack[(total - n) * size :]
        # An occurrence ending before the last token, so that at least one token follows it.
        end = (total - 1) * size
        while True:
            at = haystack.rfind(needle, 0, end)
            if at < 0:
                break
            if at % size == 0:
                return _copy(tokens, at // size + n, num_tokens)
            end = at + len(needle) - 1  # a match across token boundaries: look further left
    return []


def _copy(tokens: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens from `start`, continuing into the copy itself past the end."""
    out: list[int] = []
    total = len(tokens)
    for i in range(start, start + num_tokens):
        out.append(tokens[i] if i < total else out[i - total])
    return out


def num_speculative_tokens(req: Request, config: SpeculativeConfig, max_model_len: int) -> int:
    """Drafts `req` may have verified in its next decode step: its own bound (None: the
    pool's `num_tokens` where `default_on`, else none) within the pool's, and no more than
    it can still emit past its next token (`max_tokens`) or hold (`max_model_len`).

    0 for what speculation does not cover yet: a request under a grammar (the matcher
    would have to be advanced through drafts and rolled back) or asking for logprobs
    (each emitted token would need its own row of them); they decode one token a step.
    """
    if config.method == "none":
        return 0
    params = req.params
    asked = params.num_speculative_tokens
    if asked is None:
        asked = config.num_tokens if config.default_on else 0
    if asked <= 0 or req.guide is not None or params.logprobs is not None:
        return 0
    room_output = params.max_tokens - req.num_output_tokens - 1
    room_context = max_model_len - req.num_tokens
    return max(0, min(asked, config.num_tokens, room_output, room_context))


def accept_drafts(choose: Callable[[int], int], drafts: Sequence[int]) -> tuple[list[int], int]:
    """Verify `drafts` against the target: (the drafts kept, the target's next token).

    `choose(i)` is the target's token at position i of the verify chunk (after the drafts
    before i); it is called for positions in order, and only until the first disagreement,
    so a sampled target draws exactly one row of noise per token emitted.
    """
    for i, draft in enumerate(drafts):
        token = choose(i)
        if token != draft:
            return list(drafts[:i]), token
    return list(drafts), choose(len(drafts))
