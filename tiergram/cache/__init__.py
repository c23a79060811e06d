"""Hot-row caches: encoded rows of a slower tier kept in a faster one, with LRU, LFU and lookahead policies."""

from tiergram.cache.policies import POLICIES, belady_hit_rate, make_policy
from tiergram.cache.row_cache import CacheCounters, RowCache

__all__ = ["POLICIES", "CacheCounters", "RowCache", "belady_hit_rate", "make_policy"]
