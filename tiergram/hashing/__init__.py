"""Token ids -> Engram row ids: tokenizer compression, multi-head n-gram hashing, streaming decode state."""

from .compression import SENTINEL, build_compression, engram_normalizer
from .ngram import NgramHasher, engram_multipliers
from .primes import engram_head_table_sizes, isprime, next_prime
from .streaming import HashState

__all__ = ["SENTINEL", "HashState", "NgramHasher", "build_compression", "engram_head_table_sizes", "engram_multipliers",
           "engram_normalizer", "isprime", "next_prime"]
