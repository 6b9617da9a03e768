"""Contiguous copies of the decoding sequences' KV, so decode attention reads in place.

Paged KV is scattered over blocks; gathering every block of every decoding sequence at
every step costs more memory bandwidth on a CPU than the attention itself. The workspace
keeps one row per decoding sequence (`[kv_heads, rows, T, dim]` per layer): a sequence's
context is gathered from the paged cache once, when it starts decoding, and each step
appends only its new token. The paged cache stays the source of truth (prefix caching,
preemption); a row is simply dropped and re-gathered whenever in doubt.
"""

import torch

_GROW_TOKENS = 256
_GROW_ROWS = 16


class DecodeWorkspace:
    """Rows 0..n-1 hold the KV of the n sequences decoding in the current step."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.rows: dict[str, int] = {}  # request id -> row
        self.lengths: list[int] = []  # valid tokens per row
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._alloc(0, 0)

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, tokens) the buffers can hold."""
        return (self.k[0].shape[1], self.k[0].shape[2]) if self.k else (0, 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def prepare(
        self,
        request_ids: list[str],
        num_context: list[int],
        block_tables: list[list[int]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
    ) -> list[int]:
        """Give each decoding request a row holding its `num_context` cached tokens.

        Returns the requests' order by row (indexes into `request_ids`): the decode rows
        of the flat batch must come in that order.
        """
        wanted = dict(zip(request_ids, num_context, strict=True))
        for rid in [
            r for r in self.rows if r not in wanted or self.lengths[self.rows[r]] != wanted[r]
        ]:
            self._release(rid)
        new = [rid for rid in request_ids if rid not in self.rows]
        max_tokens = max(num_context) + 1
        need_tokens = max(
            max_tokens,
            max((len(block_tables[request_ids.index(r)]) * block_size for r in new), default=0),
        )
        self._ensure(len(request_ids), need_tokens)
        if new:
            self._fill(new, request_ids, num_context, block_tables, kv_caches, block_size)
        order = sorted(range(len(request_ids)), key=lambda i: self.rows[request_ids[i]])
        return order

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the decode rows' new K/V ([rows, kv_heads, dim], in row order)."""
        n = k.shape[0]
        self.k[layer][:, torch.arange(n, device=k.device), positions] = k.transpose(0, 1)
        self.v[layer][:, torch.arange(n, device=v.device), positions] = v.transpose(0, 1)

    def commit(self, request_ids_in_row_order: list[str]) -> None:
        """After the forward pass: each row gained its step's token."""
        for rid in request_ids_in_row_order:
            self.lengths[self.rows[rid]] += 1

    def view(self, layer: int, num_rows: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :num_rows, :num_tokens], self.v[layer][:, :num_rows, :num_tokens]

    # -- internals ------------------------------------------------------------------

    def _alloc(self, rows: int, tokens: int) -> None:
        shape = (self.num_kv_heads, rows, tokens, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        if old_k and self.rows:
            n = len(self.lengths)
            t = min(old_k[0].shape[2], tokens)
            for new, old in zip(self.k + self.v, old_k + old_v, strict=True):
                new[:, :n, :t] = old[:, :n, :t]

    def _ensure(self, rows: int, tokens: int) -> None:
        cap_rows, cap_tokens = self.capacity
        if rows <= cap_rows and tokens <= cap_tokens:
            return
        grow_r = max(cap_rows, -(-rows // _GROW_ROWS) * _GROW_ROWS)
        grow_t = max(cap_tokens, -(-tokens // _GROW_TOKENS) * _GROW_TOKENS)
        self._alloc(grow_r, grow_t)

    def _release(self, rid: str) -> None:
        """Drop a row; the last row moves into the hole so rows stay 0..n-1."""
        row = self.rows.pop(rid)
        last = len(self.lengths) - 1
        if row != last:
            moved = next(r for r, i in self.rows.items() if i == last)
            n = self.lengths[last]
            for t in self.k + self.v:
                t[:, row, :n] = t[:, last, :n]
            self.rows[moved] = row
            self.lengths[row] = n
        self.lengths.pop()

    def _fill(self, new, request_ids, num_context, block_tables, kv_caches, block_size) -> None:
        index = {rid: i for i, rid in enumerate(request_ids)}
        tables = [block_tables[index[r]] for r in new]
        width = max(len(t) for t in tables)
        padded = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], device=self.device
        ).flatten()
        first = len(self.lengths)
        rows = slice(first, first + len(new))
        span = width * block_size
        for layer, (k_cache, v_cache) in enumerate(kv_caches):
            for dst, src in ((self.k[layer], k_cache), (self.v[layer], v_cache)):
                blocks = src.view(self.num_kv_heads, -1, block_size * self.head_dim)
                gathered = torch.index_select(blocks, 1, padded)
                dst[:, rows, :span] = gathered.view(
                    self.num_kv_heads, len(new), span, self.head_dim
                )
        for i, rid in enumerate(new):
            self.rows[rid] = first + i
            self.lengths.append(num_context[index[rid]])
