"""Eviction policies for the row cache: LRU, LFU with frequency admission, lookahead (windowed Belady); a hit calls
observe and touch, a miss observe, victim and admit (LRU: one victims(n, pinned) per admit, every miss admitted)."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable

import numpy as np

Pinned = Callable[[int], bool]
NEVER = 1 << 62  # "no known next use"


class LRUPolicy:
    """Least recently used: the default (docs/benchmarks.md, "Cache policies")."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def observe(self, key: int) -> None:
        """An access (hit or miss); LRU learns from touch/insert alone."""

    def touch(self, key: int) -> None:
        self._order.move_to_end(key)

    def insert(self, key: int) -> None:
        self._order[key] = None

    def remove(self, key: int) -> None:
        del self._order[key]

    def victims(self, count: int, pinned: Pinned) -> list[int]:
        """Up to `count` unpinned keys, least recently used first, in one pass (LRU admits every miss)."""
        return list(itertools.islice((k for k in self._order if not pinned(k)), count))


class LFUPolicy:
    """Least frequently used, admitting a miss only if used more than its victim; counts halve every decay_every."""

    name = "lfu"

    def __init__(self, decay_every: int = 1 << 20) -> None:
        self.freq: Counter[int] = Counter()
        self._resident: set[int] = set()
        self._heap: list[tuple[int, int]] = []  # (freq when pushed, key); stale entries skipped
        self._ticks = 0
        self._decay_every = decay_every

    def observe(self, key: int) -> None:
        self.freq[key] += 1
        self._ticks += 1
        if self._ticks % self._decay_every == 0:
            self.freq = Counter({k: v // 2 for k, v in self.freq.items() if v > 1})
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.freq.get(k, 0), k) for k in self._resident]
        heapq.heapify(self._heap)

    def touch(self, key: int) -> None:
        heapq.heappush(self._heap, (self.freq.get(key, 0), key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild()

    def admit(self, key: int, victim: int | None) -> bool:
        """Enter if there is room, or if this key is used more often than the key it would evict."""
        return victim is None or self.freq.get(key, 0) > self.freq.get(victim, 0)

    def insert(self, key: int) -> None:
        self._resident.add(key)
        heapq.heappush(self._heap, (self.freq.get(key, 0), key))

    def remove(self, key: int) -> None:
        self._resident.discard(key)

    def victim(self, pinned: Pinned) -> int | None:
        """The unpinned resident key with the lowest count."""
        skipped, found = [], None
        while self._heap:
            f, key = self._heap[0]
            if key not in self._resident or f != self.freq.get(key, 0):
                heapq.heappop(self._heap)
            elif pinned(key):
                skipped.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


class LookaheadPolicy:
    """Windowed Belady: evict the key whose next announced use is furthest (none: LRU first); admit only if sooner."""

    name = "lookahead"

    def __init__(self) -> None:
        self._uses: dict[int, deque[int]] = {}  # key -> positions (batch << 32 | index) of announced uses
        self._batches: dict[int, list[int]] = {}  # live batch -> its keys
        self._next_batch = 0
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, no known next use (LRU order)
        self._planned: dict[int, int] = {}  # resident with a known next use -> that position
        self._heap: list[tuple[int, int]] = []  # (-next_use, key); stale entries skipped
        # keys victim() found pinned are parked until the next probe: skipped once per admit, not per victim() call
        self._held: OrderedDict[int, None] = OrderedDict()  # parked idle keys
        self._held_plans: list[tuple[int, int]] = []  # parked heap entries

    def next_use(self, key: int) -> int:
        q = self._uses.get(key)
        while q and (q[0] >> 32) not in self._batches:  # uses of retired batches
            q.popleft()
        if not q:
            self._uses.pop(key, None)
            return NEVER
        return q[0]

    def extend_future(self, keys: Iterable[int]) -> int:
        """Announce a batch of upcoming accesses (batches in the order they will run); returns its id."""
        batch = self._next_batch
        self._next_batch += 1
        keys = [int(k) for k in keys]
        self._batches[batch] = keys
        for i, k in enumerate(keys):
            self._uses.setdefault(k, deque()).append(batch << 32 | i)
            if k in self._idle or k in self._held:
                self._plan(k)
        return batch

    def live_batches(self) -> int:
        """Announced batches not yet finished."""
        return len(self._batches)

    def finish(self, batch: int) -> None:
        """Retire an announced batch (probed, or cancelled): its keys' next uses move on."""
        for k in self._batches.pop(batch, ()):
            if k in self._planned:
                self._plan(k)

    def _plan(self, key: int) -> None:
        nu = self.next_use(key)
        self._held.pop(key, None)
        if nu == NEVER:
            self._planned.pop(key, None)
            self._idle[key] = None
        else:
            self._idle.pop(key, None)
            self._planned[key] = nu
            heapq.heappush(self._heap, (-nu, key))

    def observe(self, key: int) -> None:
        """Accesses are learnt from announced batches; a new probe returns parked keys to the candidates."""
        if self._held or self._held_plans:
            self._unpark()

    def _unpark(self) -> None:
        self._idle.update(self._held)  # pinned by a lookup a moment ago: the most recently used idle keys
        self._held.clear()
        for item in self._held_plans:
            heapq.heappush(self._heap, item)  # entries gone stale meanwhile are skipped as usual
        self._held_plans.clear()

    def touch(self, key: int) -> None:
        if key in self._idle:
            self._idle.move_to_end(key)
        elif key in self._held:
            del self._held[key]
            self._idle[key] = None

    def admit(self, key: int, victim: int | None) -> bool:
        return victim is None or self.next_use(key) <= self.next_use(victim)

    def insert(self, key: int) -> None:
        self._plan(key)

    def remove(self, key: int) -> None:
        self._idle.pop(key, None)
        self._held.pop(key, None)
        self._planned.pop(key, None)

    def victim(self, pinned: Pinned) -> int | None:
        """An idle key (LRU first), else the planned key used furthest ahead (None: all pinned); pinned keys met are
        parked until the next probe, and looked at once more only when nothing else is left."""
        found = self._unpinned(pinned)
        if found is None and (self._held or self._held_plans):
            self._unpark()  # some may have been unpinned since they were parked
            found = self._unpinned(pinned)
        return found

    def _unpinned(self, pinned: Pinned) -> int | None:
        while self._idle:
            key = next(iter(self._idle))
            if not pinned(key):
                return key
            del self._idle[key]
            self._held[key] = None
        while self._heap:
            neg, key = self._heap[0]
            if self._planned.get(key) != -neg:
                heapq.heappop(self._heap)  # stale: evicted or re-planned since
            elif self.next_use(key) != -neg:
                heapq.heappop(self._heap)
                self._plan(key)  # its batch retired since: re-file it (it may have become idle)
                if key in self._idle and not pinned(key):
                    return key
            elif pinned(key):
                self._held_plans.append(heapq.heappop(self._heap))
            else:
                return key
        return next((k for k in self._idle if not pinned(k)), None)


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "lookahead": LookaheadPolicy}


def make_policy(name: str) -> LRUPolicy | LFUPolicy | LookaheadPolicy:
    """A fresh policy by name; ValueError lists the valid names."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (valid: {', '.join(POLICIES)})") from None


def belady_hit_rate(stream: np.ndarray, capacity: int) -> float:
    """Offline optimum on a whole access stream of int keys (Belady's MIN, misses may bypass): hit rate."""
    stream = np.asarray(stream, dtype=np.int64).reshape(-1)
    n = stream.size
    if n == 0 or capacity <= 0:
        return 0.0
    order = np.lexsort((np.arange(n), stream))  # positions grouped by key, in time order
    nxt = np.full(n, n, dtype=np.int64)  # next position with the same key (n: never)
    same = stream[order[1:]] == stream[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    resident: dict[int, int] = {}  # key -> next use
    heap: list[tuple[int, int]] = []
    hits = 0
    for key, nu in zip(stream.tolist(), nxt.tolist(), strict=True):
        if key in resident:
            hits += 1
            if nu == n:
                del resident[key]
                continue
        elif nu == n:
            continue  # never used again: caching it cannot help
        elif len(resident) >= capacity:
            while resident.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] < nu:
                continue  # every resident key is needed sooner: bypass
            del resident[heapq.heappop(heap)[1]]
        resident[key] = nu
        heapq.heappush(heap, (-nu, key))
    return hits / n
