"""Chained block hashes: stable across processes, namespaced by salt, bound to the parent."""

import subprocess
import sys
from pathlib import Path

from kvcache import NONE_HASH, hash_block
from kvcache.prefix import hash_full_blocks

# Computed once from hash_block(NONE_HASH, [1, 2, 3, 4]); a change here invalidates every
# prefix cache shared across processes or restarts.
PINNED_HEX = "7077f7c78cbaa9547bb8ede0e304f4f3"
PINNED_SALTED_HEX = "143afc0e6fae0dc837ab291abd824de7"
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_hash_block_matches_pinned_digest() -> None:
    assert hash_block(NONE_HASH, [1, 2, 3, 4]).hex() == PINNED_HEX
    assert hash_block(NONE_HASH, [1, 2, 3, 4], "tenant-a").hex() == PINNED_SALTED_HEX


def test_hash_block_is_stable_in_a_fresh_process() -> None:
    code = (
        "from kvcache import NONE_HASH, hash_block;print(hash_block(NONE_HASH, [1, 2, 3, 4]).hex())"
    )
    # A different PYTHONHASHSEED would change Python's hash(), never ours.
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.stdout.strip() == PINNED_HEX


def test_hash_block_is_sixteen_bytes() -> None:
    assert len(hash_block(NONE_HASH, [7] * 16)) == 16


def test_hash_block_differs_with_salt() -> None:
    unsalted = hash_block(NONE_HASH, [1, 2, 3, 4])
    salt_a = hash_block(NONE_HASH, [1, 2, 3, 4], "tenant-a")
    salt_b = hash_block(NONE_HASH, [1, 2, 3, 4], "tenant-b")
    assert len({unsalted, salt_a, salt_b}) == 3


def test_hash_block_differs_with_parent() -> None:
    parent = hash_block(NONE_HASH, [9, 9, 9, 9])
    assert hash_block(parent, [1, 2, 3, 4]) != hash_block(NONE_HASH, [1, 2, 3, 4])


def test_hash_block_differs_with_token_order() -> None:
    assert hash_block(NONE_HASH, [1, 2, 3, 4]) != hash_block(NONE_HASH, [4, 3, 2, 1])


def test_hash_full_blocks_chains_and_skips_the_partial_tail() -> None:
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4, None, [])
    first = hash_block(NONE_HASH, tokens[0:4])
    assert hashes == [first, hash_block(first, tokens[4:8])]


def test_hash_full_blocks_extends_known_hashes_without_recomputing() -> None:
    tokens = list(range(12))
    sentinel = b"s" * 16  # not the real hash: proves the known prefix is reused
    hashes = hash_full_blocks(tokens, 4, None, [sentinel])
    assert hashes[0] == sentinel
    assert hashes[1] == hash_block(sentinel, tokens[4:8])
    assert len(hashes) == 3
