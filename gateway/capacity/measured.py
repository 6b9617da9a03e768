"""A foreign replica's capacity, measured by the gateway from the answers it relays.

A Switchyard worker reports its step model on `/load`; vLLM, llama-server, a hosted API
report none (or figures the gateway should not trust for admission). So for those the
gateway measures what admission needs (`predictor.ReplicaCapacity`) itself, from its own
requests to that replica:

- `decode_step_s`: seconds per output token of one stream, the mean gap between a
  stream's first and last token over the tokens between them (EWMA). It is measured at
  the load the replica had, which is what its seats are run at.
- `prefill_tokens_per_s`: from each stream's time from sending to its first token, less
  one step: a line fitted through (prompt tokens, prefill seconds) over recent requests
  where their prompts differ enough to tell a slope; else their ratio, which counts the
  fixed part of a first token (network, scheduling) as prefill and so errs slow.

A non-streaming answer gives only its whole time: with the step known it is a prefill
sample (the whole less the decode), else a step sample (the whole over its tokens: slow).
"""

from collections import deque
from dataclasses import dataclass, field

STEP_ALPHA = 0.2  # weight of each stream's mean gap in the step's EWMA
MIN_SPREAD_TOKENS = 64  # prompts must differ this much (std) before a slope is fitted
MIN_PREFILL_S = 0.001


@dataclass
class MeasuredService:
    """The running estimates for one replica (None until its first sample)."""

    decode_step_s: float | None = None
    prefill_tokens_per_s: float | None = None
    samples: int = 0
    _prefills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=32))

    def stream(
        self, prompt_tokens: int, first_token_s: float, tokens: int, decode_s: float
    ) -> None:
        """A stream ended: sent -> first token `first_token_s`, first -> last token
        `decode_s` over `tokens` output tokens."""
        if tokens >= 2 and decode_s > 0:
            self._step(decode_s / (tokens - 1))
        if prompt_tokens > 0 and first_token_s > 0:
            self._prefill(prompt_tokens, first_token_s - (self.decode_step_s or 0.0))
        self.samples += 1

    def whole(self, prompt_tokens: int, total_s: float, tokens: int) -> None:
        """A non-streaming answer of `tokens` output tokens took `total_s` from sending."""
        if total_s <= 0 or tokens <= 0:
            return
        if self.decode_step_s is None:
            self._step(total_s / tokens)
        elif prompt_tokens > 0:
            self._prefill(prompt_tokens, total_s - tokens * self.decode_step_s)
        self.samples += 1

    def _step(self, gap_s: float) -> None:
        if self.decode_step_s is None:
            self.decode_step_s = gap_s
        else:
            self.decode_step_s += STEP_ALPHA * (gap_s - self.decode_step_s)

    def _prefill(self, prompt_tokens: int, seconds: float) -> None:
        self._prefills.append((prompt_tokens, max(seconds, MIN_PREFILL_S)))
        self.prefill_tokens_per_s = _rate(self._prefills)


def _rate(samples: deque[tuple[int, float]]) -> float:
    """Prompt tokens per second of prefill: the inverse slope of the line through the
    samples where their prompts spread enough, else total tokens over total seconds."""
    n = len(samples)
    mean_p = sum(p for p, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var_p = sum((p - mean_p) ** 2 for p, _ in samples) / n
    if n >= 4 and var_p >= MIN_SPREAD_TOKENS**2:
        slope = sum((p - mean_p) * (t - mean_t) for p, t in samples) / n / var_p
        if slope > 0:
            return 1.0 / slope
    return sum(p for p, _ in samples) / sum(t for _, t in samples)
