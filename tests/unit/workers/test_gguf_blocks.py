"""GGUF Q4_0 / Q4_1 blocks into our q4 layout (`workers.runner.gguf_blocks`): only the
nibbles move, so the values are the blocks' own; and the q/k row permutation undone."""

import numpy as np
import pytest
import torch

from tests.support.tiny_gguf import permute_rows
from workers.runner.gguf_blocks import BLOCK_BYTES, blocks_to_q4, unpermute_rows
from workers.runner.quant import QuantizedWeight, quantize_q4, unpack_nibbles

gguf = pytest.importorskip("gguf")


def weights(n: int = 8, k: int = 96, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_our_q4_of_a_block_stands_for_exactly_what_gguf_dequantizes_it_to(kind):
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(weights(), qtype)  # [8, 3 blocks * block bytes]
    packed, d, m = blocks_to_q4(raw.reshape(8, 3, BLOCK_BYTES[kind]), kind)
    ours = QuantizedWeight(
        "q4", (8, 96), torch.from_numpy(packed), torch.from_numpy(d), torch.from_numpy(m)
    )
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(ours.dequantize(), want)
    assert packed.dtype == np.uint8 and packed.shape == (8, 48)
    assert d.dtype == m.dtype == np.float16 and d.shape == (8, 3)


def test_q4_1_blocks_are_what_quantize_q4_makes_of_their_floats():
    """A Q4_1 block's floats quantize back to it (each block holds a 0 and a 15)."""
    qtype = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(weights(seed=1), qtype)
    packed, d, m = blocks_to_q4(raw.reshape(8, 3, 20), "Q4_1")
    q, d_ref, m_ref = quantize_q4(torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    assert torch.equal(unpack_nibbles(torch.from_numpy(packed)), q)
    assert torch.equal(torch.from_numpy(d), d_ref) and torch.equal(torch.from_numpy(m), m_ref)


def test_a_q4_0_scale_too_large_for_fp16_m_gives_an_infinite_m_to_refuse():
    block = np.zeros((1, 1, 18), dtype=np.uint8)
    block[0, 0, 0:2] = np.array([np.float16(60000.0)]).view(np.uint8)
    _, _, m = blocks_to_q4(block, "Q4_0")
    assert not np.isfinite(m).all()


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_unpermute_rows_undoes_llama_cpps_q_k_permutation(heads):
    rows = np.arange(heads * 8 * 5).reshape(heads * 8, 5)
    permuted = permute_rows(rows, heads)
    assert not np.array_equal(permuted, rows)
    assert np.array_equal(unpermute_rows(permuted, heads), rows)
    # the blocks of a row travel with it: [N, G, block bytes] as [N, G * bytes]
    blocks = rows.reshape(heads * 8, 5, 1)
    assert np.array_equal(unpermute_rows(permute_rows(blocks, heads), heads), blocks)
