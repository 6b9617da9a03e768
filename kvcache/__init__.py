"""Paged KV-cache bookkeeping: block pool, prefix hashing and per-request allocation.

Pure Python: no torch, no I/O. The KV tensors themselves live in the model runner;
this package only hands out block ids and keeps their reference counts.
"""

from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager, KVRequest, PrefixCacheStats
from kvcache.prefix import NONE_HASH, hash_block

__all__ = [
    "NONE_HASH",
    "BlockPool",
    "KVCacheManager",
    "KVRequest",
    "PrefixCacheStats",
    "hash_block",
]
