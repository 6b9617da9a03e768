"""The int8 KV cache (`EngineConfig.kv_cache_dtype = "int8"`): storage, the write, reads.

Each key (and each value) row of one KV head, `head_dim` numbers, is stored as int8 with
one bf16 scale: `scale = bf16(max|x| / 127)`, `q = round_half_even(x / scale)` clamped to
+-127, read back as `q * scale`. A scale per token and head, not per block: a row is
quantized once, when its token is written, and never again, so appending to a block
never re-scales the rows already in it (a per-block scale fixed by its first token would
clip later, larger rows; one re-fitted as rows arrive would re-quantize the block, and
the copies of it in the decode workspace, at every write). The price is the scale's two
bytes per row: `head_dim + 2` bytes against bf16's `2 x head_dim` (64-dim heads: 66
against 128, 1.94x the tokens in the same bytes; 128-dim heads 1.97x; fp32 3.9x).

Every attention of the model reads the int8 values, a prompt's own keys too (the write
hands them back to the forward pass as `q * scale`): a prefix served from cached blocks,
a prompt recomputed after preemption, a prompt in one chunk or in ten, all attend over
the same numbers.

`Int8KV` stands for one layer's K (or V) tensor wherever the float cache has one: the
paged cache ([kv_heads, slots, dim] + [kv_heads, slots]) and the decode workspace's rows
([kv_heads, rows, tokens, dim] + [kv_heads, rows, tokens]). Its torch functions here run
on any device; the CPU's native kernels (`workers/runner/native/kv_int8.cpp`) do the same
arithmetic, the quantization to the same bits.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.runner.memory import zeros

SCALE_DTYPE = torch.bfloat16
QMAX = 127


@dataclass(frozen=True, eq=False)
class Int8KV:
    """One layer's keys or values in int8, a bf16 scale per row (token and head)."""

    data: torch.Tensor  # int8 [..., dim]
    scale: torch.Tensor  # bf16 [...]: row i of `data` is data[i] * scale[i]
    out_dtype: torch.dtype  # what attention reads it as: the model's dtype
    # The native kernels' module (`workers.runner.native.kv_int8()`) that writes and reads
    # it on the CPU; None = torch.
    kernels: Any = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @classmethod
    def zeros(
        cls, shape: tuple[int, ...], out_dtype: torch.dtype, device: torch.device, kernels: Any
    ) -> "Int8KV":
        """A zeroed store of `shape` ([..., dim]) rows, on huge pages on the CPU."""
        return cls(
            zeros(shape, torch.int8, device),
            zeros(shape[:-1], SCALE_DTYPE, device),
            out_dtype,
            kernels,
        )

    def dequantize(self) -> torch.Tensor:
        """All of it as `out_dtype` ([..., dim])."""
        return dequantize(self.data, self.scale, self.out_dtype)

    def blocks(self, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """The paged cache's blocks `block_ids`, in order, as `out_dtype`: [kv_heads,
        len(block_ids) * block_size, dim]."""
        kernel = self.kernels
        if kernel is not None and self.data.device.type == "cpu":
            h, _, d = self.data.shape
            out = torch.empty(h, len(block_ids) * block_size, d, dtype=self.out_dtype)
            kernel.dequantize_blocks(self.data, self.scale, block_ids, block_size, out)
            return out
        h, _, d = self.data.shape
        data = torch.index_select(self.data.view(h, -1, block_size * d), 1, block_ids)
        scale = torch.index_select(self.scale.view(h, -1, block_size), 1, block_ids)
        return dequantize(data.view(h, -1, d), scale.view(h, -1), self.out_dtype)

    def rows(self, slots: torch.Tensor) -> "Int8KV":
        """The paged cache's rows at `slots`, [len(slots), kv_heads, dim]: copied as they are
        stored (this step's new tokens, for the decode workspace)."""
        data = self.data[:, slots].transpose(0, 1)
        return Int8KV(data, self.scale[:, slots].transpose(0, 1), self.out_dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x ([..., dim], any float dtype) as (int8 [..., dim], bf16 scale [...]).

    fp32 arithmetic throughout, in the order the native write uses, so both give the same
    bits: scale = bf16(amax * (1 / 127)), q = round_half_even(x * (1 / scale)), and a row
    of zeros has scale 0 and q 0."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) * (1.0 / QMAX)).to(SCALE_DTYPE)
    sf = scale.float()
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data * scale per row ([..., dim] int8, [...] scale), computed in fp32 (the product is
    exact there) and rounded once to `dtype`."""
    return (data.float() * scale.float().unsqueeze(-1)).to(dtype)


def write_kv(
    k_cache: Int8KV,
    v_cache: Int8KV,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Quantize new keys/values ([tokens, kv_heads, dim]) into their cache slots, and
    replace k and v in place by what the cache now holds (`q * scale` in their dtype): the
    prompt chunk that wrote them attends over the same numbers as every later reader."""
    kernel = k_cache.kernels
    if kernel is not None and k.device.type == "cpu":
        kernel.write_kv(k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, k, v, slots)
        return
    for cache, x in ((k_cache, k), (v_cache, v)):
        q, scale = quantize(x)
        cache.data[:, slots] = q.transpose(0, 1)
        cache.scale[:, slots] = scale.transpose(0, 1)
        x.copy_(dequantize(q, scale, x.dtype))


def allocate(
    num_layers: int,
    shape: tuple[int, ...],
    out_dtype: torch.dtype,
    device: torch.device,
    kernels: Any,
) -> list[tuple[Int8KV, Int8KV]]:
    """Each layer's K and V stores of `shape` ([kv_heads, slots, dim])."""
    return [
        (
            Int8KV.zeros(shape, out_dtype, device, kernels),
            Int8KV.zeros(shape, out_dtype, device, kernels),
        )
        for _ in range(num_layers)
    ]


# (q, k_cache, v_cache, cache_slots, k_workspace, v_workspace, lengths, scale, out) -> None
WorkspaceKernel = Callable[..., None]
# (q, k_cache, v_cache, block_tables, lengths, block_size, scale, out) -> None
PagedKernel = Callable[..., None]


def workspace_kernel(module: Any) -> WorkspaceKernel:
    """The native workspace decode attention over int8 rows: copies each row's new token
    from the paged cache (`cache_slots`) to the row, then attends."""

    def run(q, k_cache, v_cache, cache_slots, k_ws, v_ws, lengths, scale, out) -> None:
        module.decode_attention(
            q,
            k_cache.data,
            k_cache.scale,
            v_cache.data,
            v_cache.scale,
            cache_slots,
            k_ws.data,
            k_ws.scale,
            v_ws.data,
            v_ws.scale,
            lengths,
            scale,
            out,
        )

    return run


def paged_kernel(module: Any) -> PagedKernel:
    """The native decode attention over int8 blocks of the paged cache, in place."""

    def run(q, k_cache, v_cache, tables, lengths, block_size, scale, out) -> None:
        module.paged_decode_attention(
            q,
            k_cache.data,
            k_cache.scale,
            v_cache.data,
            v_cache.scale,
            tables,
            lengths,
            block_size,
            scale,
            out,
        )

    return run
