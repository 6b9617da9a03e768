"""Speculative decoding's verify step: the target's choice at every position of a verify
chunk, and the drafts it keeps (`workers.engine.speculative.accept_drafts`).

A verify chunk is a decoding request's last token followed by its drafts; the model gives
logits at each of its 1 + k positions. Row i is sampled exactly as a plain decode would
sample the request's output token `num_output_tokens + i` (its bias, its min_tokens mask
for that token, temperature and filters, and for a sampled row one row of noise from its
generator), so what is kept is what plain decoding would have emitted.
"""

from collections.abc import Callable

import torch

from workers.engine.request import Request
from workers.engine.speculative import accept_drafts
from workers.runner.sampler import draw_row, make_sampling_batch, target_distribution


def verify_drafts(
    logits: torch.Tensor,
    requests: list[Request],
    drafts: list[list[int]],
    device: torch.device,
    argmax: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[list[int], int]]:
    """For each request, (its drafts kept, the token after them). `logits` ([rows, vocab]
    fp32) hold each request's 1 + len(drafts) rows in turn."""
    rows = [req for req, d in zip(requests, drafts, strict=True) for _ in range(len(d) + 1)]
    offsets = [i for d in drafts for i in range(len(d) + 1)]
    batch = make_sampling_batch(rows, device, offsets)
    greedy, probs = target_distribution(logits, batch, argmax)
    greedy_ids = greedy.tolist()
    out = []
    first = 0
    for req, draft in zip(requests, drafts, strict=True):
        if req.params.greedy or probs is None:
            row_ids = greedy_ids[first : first + len(draft) + 1]
            out.append(accept_drafts(row_ids.__getitem__, draft))
        else:
            request_probs = probs[first : first + len(draft) + 1]
            generator = req.generator

            def choose(i: int, p: torch.Tensor = request_probs, g=generator) -> int:
                return draw_row(p[i], g, argmax)

            out.append(accept_drafts(choose, draft))
        first += len(draft) + 1
    return out
