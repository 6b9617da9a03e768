"""Contiguous copies of the decoding sequences' KV, so decode attention reads in place.

Paged KV is scattered over blocks; gathering every block of every decoding sequence at
every step costs more memory bandwidth on a CPU than the attention itself. The workspace
keeps one row per decoding sequence (`[kv_heads, rows, tokens, dim]` per layer): a
sequence's context is gathered from the paged cache once, when it starts decoding, and
each step appends only its new token. The paged cache stays the source of truth (prefix
caching, preemption); a row is simply dropped and re-gathered whenever in doubt.

The buffers are allocated once, at start-up, for `max_rows` rows of `max_tokens` tokens:
growing them while serving would stall every stream for the copy. Sequences longer than
`max_tokens` decode through the block gather instead.

With an int8 KV cache the rows are int8 too, with their scales (`kv_int8.Int8KV`): copies
of the cache's bytes, half the memory of bf16 rows, and read by the int8 decode kernel.
"""

from typing import Any

import torch

from workers.runner.kv_int8 import Int8KV
from workers.runner.memory import zeros

Rows = torch.Tensor | Int8KV  # one layer's K or V rows: [kv_heads, rows, tokens, dim]


def parts(x: torch.Tensor | Int8KV) -> tuple[torch.Tensor, ...]:
    """The tensors of a float or int8 K/V store, each with a trailing dim per token
    (an int8 store's scales as [..., 1]), for copies that treat them alike."""
    if isinstance(x, Int8KV):
        return x.data, x.scale.unsqueeze(-1)
    return (x,)


class DecodeWorkspace:
    """Rows 0..n-1 hold the KV of the n workspace decodes of the current step."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        int8: bool = False,
        int8_kernels: Any = None,
    ) -> None:
        """`int8`: rows of an int8 KV cache (read as `dtype`; `int8_kernels` as the
        cache's)."""
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        shape = (num_kv_heads, max_rows, max_tokens, head_dim)

        def store() -> Rows:
            if int8:
                return Int8KV.zeros(shape, dtype, device, int8_kernels)
            return zeros(shape, dtype, device)

        self.k = [store() for _ in range(num_layers)]
        self.v = [store() for _ in range(num_layers)]
        self.device = device
        self.rows: dict[str, int] = {}  # request id -> row
        self.lengths: list[int] = []  # valid tokens per row

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def fits(self, num_context: int) -> bool:
        """Whether a decode with this many cached tokens can use a row."""
        return num_context + 1 <= self.max_tokens

    def prepare(
        self,
        request_ids: list[str],
        num_context: list[int],
        block_tables: list[list[int]],
        kv_caches: list[tuple[Rows, Rows]],
        block_size: int,
    ) -> list[int]:
        """Give each request a row holding its `num_context` cached tokens.

        All requests must `fit` and be at most `max_rows`. Returns their order by row
        (indexes into `request_ids`): the workspace decodes of the flat batch come in
        that order.
        """
        wanted = dict(zip(request_ids, num_context, strict=True))
        stale = [r for r, row in self.rows.items() if wanted.get(r) != self.lengths[row]]
        for rid in stale:
            self._release(rid)
        new = [i for i, rid in enumerate(request_ids) if rid not in self.rows]
        if new:
            self._fill(new, request_ids, num_context, block_tables, kv_caches, block_size)
        return sorted(range(len(request_ids)), key=lambda i: self.rows[request_ids[i]])

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slots (row * max_tokens + position) of rows 0..n-1 at `positions`: computed
        once per step, used by every layer's `append`."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        return rows * self.max_tokens + positions

    def append(self, layer: int, k: Rows, v: Rows, slots: torch.Tensor) -> None:
        """Write the rows' new K/V ([rows, kv_heads, dim], in row order; int8 rows for an
        int8 workspace) at `slots`."""
        h = self.num_kv_heads
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            for dst, src in zip(parts(store), parts(new), strict=True):
                dst.view(h, -1, dst.shape[-1]).index_copy_(1, slots, src.transpose(0, 1))

    def commit(self, request_ids_in_row_order: list[str]) -> None:
        """After the forward pass: each row gained its step's token."""
        for rid in request_ids_in_row_order:
            self.lengths[self.rows[rid]] += 1

    def view(self, layer: int, num_rows: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..num_rows-1, their first num_tokens (an int8 workspace's dequantized)."""
        k, v = self.k[layer], self.v[layer]
        if isinstance(k, Int8KV) and isinstance(v, Int8KV):
            at = (slice(None), slice(num_rows), slice(num_tokens))
            return (
                Int8KV(k.data[at], k.scale[at], k.out_dtype).dequantize(),
                Int8KV(v.data[at], v.scale[at], v.out_dtype).dequantize(),
            )
        assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        return k[:, :num_rows, :num_tokens], v[:, :num_rows, :num_tokens]

    def _release(self, rid: str) -> None:
        """Drop a row; the last row moves into the hole so rows stay 0..n-1."""
        row = self.rows.pop(rid)
        last = len(self.lengths) - 1
        if row != last:
            moved = next(r for r, i in self.rows.items() if i == last)
            n = self.lengths[last]
            for store in self.k + self.v:
                for t in parts(store):
                    t[:, row, :n] = t[:, last, :n]
            self.rows[moved] = row
            self.lengths[row] = n
        self.lengths.pop()

    def _fill(self, new, request_ids, num_context, block_tables, kv_caches, block_size) -> None:
        """Gather the new rows' context from the paged cache, whole blocks at a time."""
        num_blocks = [-(-num_context[i] // block_size) for i in new]
        width = max(num_blocks)
        padded = [
            block_tables[i][:n] + [0] * (width - n) for i, n in zip(new, num_blocks, strict=True)
        ]
        flat = torch.tensor(padded, device=self.device).flatten()
        first = len(self.lengths)
        rows = slice(first, first + len(new))
        span = min(width * block_size, self.max_tokens)
        h = self.num_kv_heads
        for layer, (k_cache, v_cache) in enumerate(kv_caches if span else ()):
            for store, cache in ((self.k[layer], k_cache), (self.v[layer], v_cache)):
                for dst, src in zip(parts(store), parts(cache), strict=True):
                    d = src.shape[-1]
                    blocks = src.view(h, -1, block_size * d)
                    gathered = torch.index_select(blocks, 1, flat).view(h, len(new), -1, d)
                    dst[:, rows, :span] = gathered[:, :, :span]
        for j, i in enumerate(new):
            self.rows[request_ids[i]] = first + j
            self.lengths.append(num_context[i])
