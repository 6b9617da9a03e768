"""What an engine step costs, learned from the steps it ran. No torch: numpy only.

A step's wall time is close to linear in what it computes:

    step_s ~ base_s + per_seq_s * sequences + per_token_s * tokens + per_context_s * context

`base_s` is reading the weights once (a decode step of one sequence is almost all of it),
`per_seq_s` each sequence's own work (sampling, bookkeeping), `per_token_s` each token's
share of the matrix multiplies (a prefill chunk is many tokens of one sequence), and
`per_context_s` attention: `context` is the tokens the step's sequences attend over, in
all (a long conversation's decode reads all of its KV). `StepModel` fits the four to the
last `window` steps by least squares with every coefficient kept at or above zero,
refitting every `refit_every` observations, so a replica whose cores become shared (a
slower step at every size) sees it within a few dozen steps. The scheduler asks it two
questions at a step-time bound (the ITL target): how many sequences may decode together
(`max_seqs`), and how many tokens one step may compute with that many running
(`max_tokens`).

Until `min_samples` steps of at least two different sizes are seen, the model does not
know (`fitted` is false) and bounds nothing.
"""

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepFit:
    """The fitted coefficients, in seconds."""

    base_s: float
    per_seq_s: float
    per_token_s: float
    per_context_s: float = 0.0

    def predict(self, num_seqs: int, num_tokens: int, context: int = 0) -> float:
        return (
            self.base_s
            + self.per_seq_s * num_seqs
            + self.per_token_s * num_tokens
            + self.per_context_s * context
        )

    def max_seqs(self, target_s: float, cap: int, context_per_seq: float = 0.0) -> int:
        """The most sequences (1..cap) whose decode step (one token each, attending over
        `context_per_seq` tokens each) fits `target_s`; at least 1, so a replica always
        makes progress."""
        per_seq = self.per_seq_s + self.per_token_s + self.per_context_s * context_per_seq
        if per_seq <= 0:
            return cap
        return max(1, min(cap, int((target_s - self.base_s) / per_seq)))

    def max_tokens(self, target_s: float, num_seqs: int, cap: int, context: int = 0) -> int:
        """The most tokens one step with `num_seqs` sequences (attending over `context`
        tokens) may compute within `target_s`; at least `num_seqs` (their decodes) and at
        most `cap`. A prefill chunk's own attention is in `per_token_s` on average."""
        if self.per_token_s <= 0:
            return cap
        room = target_s - self.base_s - self.per_seq_s * num_seqs - self.per_context_s * context
        return max(num_seqs, min(cap, int(room / self.per_token_s)))


class StepModel:
    """Least-squares fit of step time to (sequences, tokens) over recent steps."""

    def __init__(self, window: int = 256, refit_every: int = 16, min_samples: int = 24) -> None:
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self._samples: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.fit: StepFit | None = None
        self.num_observed = 0

    @property
    def fitted(self) -> bool:
        return self.fit is not None

    def observe(self, num_seqs: int, num_tokens: int, context: int, seconds: float) -> None:
        """One step that computed `num_tokens` tokens of `num_seqs` sequences, attending
        over `context` tokens in all, in `seconds`."""
        if num_seqs <= 0 or seconds <= 0:
            return
        self._samples.append((num_seqs, num_tokens, context, seconds))
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._samples) >= self.min_samples:
            self._since_fit = 0
            self.fit = fit_steps(list(self._samples))

    def reset(self) -> None:
        """Forget every step seen (and the fit)."""
        self._samples.clear()
        self._since_fit = 0
        self.fit = None
        self.num_observed = 0

    def refit(self) -> None:
        """Fit now to the steps seen, whatever their number (calibration's end)."""
        self._since_fit = 0
        self.fit = fit_steps(list(self._samples)) if self._samples else None

    def recent_step_s(self, last: int = 16) -> float | None:
        """Mean wall time of the last `last` steps; None before any."""
        if not self._samples:
            return None
        tail = list(itertools.islice(reversed(self._samples), last))
        return sum(s[3] for s in tail) / len(tail)

    def context_per_seq(self, last: int = 64) -> float:
        """Mean context a sequence attended over in the last `last` steps (0 before any)."""
        tail = list(itertools.islice(reversed(self._samples), last))
        seqs = sum(s[0] for s in tail)
        return sum(s[2] for s in tail) / seqs if seqs else 0.0


def fit_steps(samples: list[tuple[int, int, int, float]]) -> StepFit | None:
    """Non-negative least squares of seconds on (1, sequences, tokens, context), by trying
    every subset of the four columns (fifteen) and keeping the best fit whose coefficients
    are all >= 0. None when the samples do not pin a model down (all of one size: a
    constant fits them, and says nothing of a larger batch)."""
    data = np.asarray(samples, dtype=np.float64)
    seqs, tokens, context, secs = data[:, 0], data[:, 1], data[:, 2], data[:, 3]
    if np.ptp(seqs) == 0 and np.ptp(tokens) == 0:
        return None
    columns = (np.ones_like(secs), seqs, tokens, context)
    best: tuple[float, list[float]] | None = None
    for size in (4, 3, 2, 1):
        for chosen in itertools.combinations(range(4), size):
            design = np.stack([columns[i] for i in chosen], axis=1)
            coef, *_ = np.linalg.lstsq(design, secs, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(np.sum((design @ coef - secs) ** 2))
            if best is None or residual < best[0]:
                full = [0.0, 0.0, 0.0, 0.0]
                for i, c in zip(chosen, coef, strict=True):
                    full[i] = float(c)
                best = (residual, full)
    if best is None:
        return None
    base, per_seq, per_token, per_context = best[1]
    return StepFit(base, per_seq, per_token, per_context)
