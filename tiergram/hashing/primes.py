"""Deterministic primality and the Engram per-head table sizes (one distinct prime per head)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

# Miller-Rabin with the first 13 primes as bases is exact below this bound (Sorenson & Webster, 2015).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
MR_EXACT_BELOW = 3_317_044_064_679_887_385_961_981


def isprime(n: int) -> bool:
    """Exact primality test for 0 <= n < MR_EXACT_BELOW (deterministic Miller-Rabin)."""
    n = operator.index(n)
    if n >= MR_EXACT_BELOW:
        raise ValueError(f"isprime is exact only below {MR_EXACT_BELOW}; got {n}")
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, exclude: Iterable[int] = ()) -> int:
    """Smallest prime strictly greater than `start` that is not in `exclude`."""
    taken = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
    candidate = operator.index(start) + 1
    while not (isprime(candidate) and candidate not in taken):
        candidate += 1
    return candidate


def engram_head_table_sizes(
    engram_vocab_size: Sequence[int], max_ngram_size: int, n_head_per_ngram: int, layer_ids: Sequence[int]
) -> dict[int, list[list[int]]]:
    """{layer_id: [[order-2 head primes], [order-3 head primes], ...]}, every prime distinct across all."""
    # Order matters: primes are handed out layer by layer, order by order, head by head, each the next
    # unused prime above the previous one, exactly as the DeepSeek demo does.
    seen: set[int] = set()
    sizes: dict[int, list[list[int]]] = {}
    for layer_id in layer_ids:
        per_order: list[list[int]] = []
        for n in range(2, max_ngram_size + 1):
            start = int(engram_vocab_size[n - 2]) - 1
            heads: list[int] = []
            for _ in range(n_head_per_ngram):
                p = next_prime(start, seen)
                seen.add(p)
                heads.append(p)
                start = p
            per_order.append(heads)
        sizes[int(layer_id)] = per_order
    return sizes
