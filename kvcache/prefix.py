"""Stable chained hashes of full KV blocks, for prefix caching.

A block's hash covers its parent's hash, its token ids and a namespace salt, so two
blocks share a hash only if the whole prefix up to and including them matches (and
they belong to the same namespace). We use blake2b, never Python's `hash()`, which is
salted per process.
"""

from collections.abc import Sequence
from hashlib import blake2b
from struct import pack

NONE_HASH = b"\x00" * 16
"""Parent hash of a request's first block."""


def hash_block(parent_hash: bytes, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """Hash one full block: 16 bytes, stable across processes and machines."""
    h = blake2b(digest_size=16)
    h.update(parent_hash)
    h.update(pack(f"<{len(token_ids)}q", *token_ids))
    if salt:
        h.update(b"\xffsalt:")
        h.update(salt.encode())
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None,
    known: list[bytes],
) -> list[bytes]:
    """Extend `known` (hashes of the first len(known) blocks) to every full block."""
    num_full = len(token_ids) // block_size
    parent = known[-1] if known else NONE_HASH
    for i in range(len(known), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        known.append(parent)
    return known
