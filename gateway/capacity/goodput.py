"""Goodput: the requests a pool served within their latency targets, as the gateway saw them.

A request counts as served when a worker of the pool answered it to its end and the client
got all of it (status 200; a stream cut short, an in-band error or a client gone is not
served). A served request meets its targets (`meets_targets`) when:

- streamed: its first token reached the client within its ticket's TTFT target (counted
  from its arrival at the gateway, as admission counts it) and no gap between tokens
  relayed was longer than the pool's ITL target (the one its workers report in /load);
  no ITL target known: its TTFT alone;
- not streamed: the gateway sees no first token, so the whole answer must have come within
  the TTFT target plus its tokens (per sample) times the ITL target; no ITL target known:
  within the TTFT target alone (strict: goodput is then a lower bound).

A target of inf (none configured) is met by any time.
"""

import math

# Weight of each served request in the typical size (EWMA).
TYPICAL_ALPHA = 0.05


def meets_targets(
    ttft_target_s: float,
    itl_target_s: float | None,
    *,
    first_token_s: float | None,
    max_itl_s: float,
    whole_s: float,
    num_tokens: int,
) -> bool:
    """Whether a served request met its targets (see the module's docstring).
    `first_token_s`: arrival to its first token relayed, None when not streamed;
    `max_itl_s`: its worst gap between tokens relayed; `whole_s`: arrival to its whole
    answer; `num_tokens`: its output tokens per sample."""
    if first_token_s is not None:
        itl_ok = itl_target_s is None or max_itl_s <= itl_target_s
        return first_token_s <= ttft_target_s and itl_ok
    allowance = ttft_target_s + (num_tokens * itl_target_s if itl_target_s is not None else 0.0)
    return whole_s <= allowance


class Goodput:
    """A pool's served requests since start: how many (`served`), how many met their
    targets (`met`), and their typical size (the request the pool's predicted TTFT is
    shown for: a one-token prompt and answer until one was served)."""

    __slots__ = ("served", "met", "_prompt_tokens", "_max_tokens")

    def __init__(self) -> None:
        self.served = 0
        self.met = 0
        self._prompt_tokens: float | None = None  # EWMA over served requests
        self._max_tokens: float | None = None

    def record(self, met: bool, prompt_tokens: int, max_tokens: int) -> None:
        """One served request: whether it met its targets, and its size (prompt tokens,
        max_tokens over all of its samples)."""
        self.served += 1
        self.met += met
        if self._prompt_tokens is None or self._max_tokens is None:
            self._prompt_tokens, self._max_tokens = float(prompt_tokens), float(max_tokens)
            return
        self._prompt_tokens += TYPICAL_ALPHA * (prompt_tokens - self._prompt_tokens)
        self._max_tokens += TYPICAL_ALPHA * (max_tokens - self._max_tokens)

    def typical(self) -> tuple[int, int]:
        """(prompt tokens, max_tokens) of a typical served request; (1, 1) before any."""
        if self._prompt_tokens is None or self._max_tokens is None:
            return 1, 1
        return max(1, math.ceil(self._prompt_tokens)), max(1, math.ceil(self._max_tokens))
