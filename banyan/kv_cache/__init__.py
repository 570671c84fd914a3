"""Paged KV cache bookkeeping: page pool, radix prefix tree, and the scheduler-facing manager."""

from banyan.kv_cache.block_pool import BlockPool, KVCacheIntegrityError
from banyan.kv_cache.manager import CacheStats, KVCacheManager, PrefixMatch, StalePrefixError
from banyan.kv_cache.radix_tree import MatchResult, RadixTree

__all__ = [
    "BlockPool",
    "CacheStats",
    "KVCacheIntegrityError",
    "KVCacheManager",
    "MatchResult",
    "PrefixMatch",
    "RadixTree",
    "StalePrefixError",
]
