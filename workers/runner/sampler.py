"""Sampling as small pure functions over a batch of logits.

Each row carries its own logit bias, temperature, top-k, top-p and min-p; rows with a seed
draw from their own generator so their output does not depend on what they were batched with.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import apply_bitmask, fill_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors (rows = sampling requests)."""

    temperature: torch.Tensor  # [rows] fp32; 0 = greedy
    top_k: torch.Tensor  # [rows] int64; 0 = off
    top_p: torch.Tensor  # [rows] fp32; 1 = off
    min_p: torch.Tensor  # [rows] fp32; 0 = off
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked out (min_tokens)
    max_logprobs: int | None  # largest `logprobs` asked for; None = nobody asked
    guided_rows: list[int] = field(default_factory=list)  # rows under a grammar
    # `logit_bias` of every row, flattened: (rows, token ids, biases), each [entries];
    # None when no row has one.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bitmask: torch.Tensor | None = None  # [len(guided_rows), words] int32: allowed tokens


def make_sampling_batch(
    requests: list[Request], device: torch.device, offsets: list[int] | None = None
) -> SamplingBatch:
    """The rows' parameters. `offsets`: row i samples the request's output token number
    `num_output_tokens + offsets[i]` (the positions of a verify chunk); None: all 0."""
    params = [r.params for r in requests]
    banned = []
    guided_rows = [row for row, r in enumerate(requests) if r.guide is not None]
    for row, r in enumerate(requests):
        num_output = r.num_output_tokens + (offsets[row] if offsets else 0)
        # A grammar decides when EOS may come; min_tokens does not overrule it.
        if num_output < r.params.min_tokens and r.guide is None:
            ids = list(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ids.extend(r.eos_token_ids)
            if ids:
                banned.append((row, ids))
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperature=torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=device
        ),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        generators=[r.generator for r in requests],
        all_greedy=all(p.greedy for p in params),
        any_top_k=any(p.top_k > 0 for p in params),
        any_top_p=any(p.top_p < 1.0 for p in params),
        any_min_p=any(p.min_p > 0.0 for p in params),
        banned=banned,
        max_logprobs=max(asked) if asked else None,
        guided_rows=guided_rows,
        bitmask=fill_bitmask([requests[i].guide for i in guided_rows]) if guided_rows else None,
        bias=_bias_entries(params, device),
    )


def _bias_entries(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            biases += p.logit_bias.values()
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(biases, dtype=torch.float32, device=device),
    )


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` with each row's bias added to its tokens (a new tensor; the same one when
    no row has a bias)."""
    if batch.bias is None:
        return logits
    rows, ids, biases = batch.bias
    return logits.index_put((rows, ids), biases, accumulate=True)


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus and min-p sets."""
    if batch.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (batch.any_top_k or batch.any_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if batch.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= batch.top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
) -> torch.Tensor:
    """Next token per row ([rows] int64). `logits` are fp32 [rows, vocab] and not modified.

    `argmax`: each row's argmax of a [rows, vocab] fp32 tensor, as `argmax_rows` (the
    runner passes the native one on the CPU, ~15x faster at 64 x 8,192).

    Order: the bias first (as a logits processor before any other), then the grammar's
    and min_tokens' masks (a biased token still masked stays at -inf), then temperature."""
    greedy_tokens, probs = target_distribution(logits, batch, argmax)
    if probs is None:
        return greedy_tokens
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one row at a time
    # when the row has its own generator.
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(batch.generators) if g is not None]
    if len(seeded) < len(batch.generators):
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=batch.generators[i])
    sampled = argmax(probs / noise)
    return torch.where(batch.temperature > 0, sampled, greedy_tokens)


def target_distribution(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each row samples from: its greedy token ([rows] int64) and, unless every row
    is greedy, its distribution after bias, masks, temperature and the top-k, top-p and
    min-p filters ([rows, vocab] fp32; a greedy row's is that of temperature 1)."""
    logits = apply_logit_bias(logits, batch)
    if batch.bitmask is not None:
        logits = apply_bitmask(logits, batch.guided_rows, batch.bitmask)
    if batch.banned:
        logits = logits.clone()
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
    greedy_tokens = argmax(logits)
    if batch.all_greedy:
        return greedy_tokens, None
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = apply_top_k_top_p_min_p(logits / temp[:, None], batch)
    return greedy_tokens, scaled.softmax(dim=-1)


def draw_row(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
) -> int:
    """One token from `probs` ([vocab] fp32) by the exponential race `sample` runs, drawing
    one row of noise from `generator` (None: torch's global one), as `sample` does for it."""
    noise = torch.empty_like(probs)
    noise.exponential_(generator=generator)
    return int(argmax((probs / noise)[None, :])[0])


def skip_draws(
    generator: torch.Generator, num_tokens: int, vocab: int, device: torch.device | str
) -> None:
    """Advance a request's generator past `num_tokens` sampled tokens' draws: the state it
    would have had, had it sampled them (`sample` draws one row of `vocab` exponentials per
    token from it)."""
    row = torch.empty(vocab, dtype=torch.float32, device=device)
    for _ in range(num_tokens):
        row.exponential_(generator=generator)


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the chosen tokens ([rows]) and the top `num_top` ([rows, n] x2).

    Taken from the model's distribution before temperature and filtering.
    """
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top_vals, top_ids = (
        logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], tokens[:, None][:, :0])
    )
    return chosen, top_vals, top_ids
