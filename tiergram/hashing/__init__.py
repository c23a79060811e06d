"""Token ids -> Engram row ids: tokenizer compression and multi-head n-gram hashing."""

from .compression import SENTINEL, build_compression, engram_normalizer
from .ngram import NgramHasher, engram_multipliers
from .primes import engram_head_table_sizes, isprime, next_prime

__all__ = ["SENTINEL", "NgramHasher", "build_compression", "engram_head_table_sizes", "engram_multipliers",
           "engram_normalizer", "isprime", "next_prime"]
