"""The paged KV cache's bookkeeping: blocks with reference counts, and the prefix cache (docs/engine.md)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from tiergram.engine.kv_host import HostKV
from tiergram.engine.sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The 16-byte name of a full block: blake2b over its parent's name and its token ids (int64)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class PrefixStats:
    """Prefix-cache counters since start (tokens and blocks; bytes and seconds are the host tier's)."""

    queried_tokens: int = 0  # prompt tokens of admitted sequences that could have hit (all but the last)
    device_hit_tokens: int = 0  # of those, found in device blocks
    host_hit_tokens: int = 0  # found in the host K/V tier and copied back
    evicted_blocks: int = 0  # cached device blocks reused for other tokens


@dataclass
class Copies:
    """Block copies the next step must finish before its forward: device -> host first, then host -> device."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device)


class BlockManager:
    """Hands out KV blocks of block_size tokens; shares full blocks between sequences by their prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 host: HostKV | None = None) -> None:
        if host is not None and not prefix_caching:
            raise ValueError("a host K/V tier holds cached prefix blocks: it needs prefix caching on")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.host = host
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block name -> device block holding it
        self._free: deque[int] = deque(range(num_blocks))  # unnamed blocks nobody uses
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named blocks nobody uses, least recent first
        self.copies = Copies()  # what the next step must copy before it runs (taken by take_copies)
        self.stats = PrefixStats()

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (cached blocks nobody holds are free to reuse)."""
        return self.num_blocks - self.num_free

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        """One block for new tokens: an unnamed free one, else the least recently used cached one (evicted)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            name = self.hash_of[block]
            assert name is not None
            del self.cached[name]
            self.hash_of[block] = None
            self.stats.evicted_blocks += 1
            if self.host is not None and self.host.has(name):
                self.host.touch(name)  # the host holds these tokens already: nothing to copy
            elif (slot := self.host.put(name) if self.host is not None else None) is not None:
                self.copies.to_host.append((block, slot))
        self.ref[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.ref[block] == 0:
            self._evictable.pop(block, None)
        self.ref[block] += 1

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens positions; all or nothing: False (and no change) if too few."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        seq.block_table.extend(self._take() for _ in range(max(0, need)))
        return True

    def admit(self, seq: Sequence, budget: int) -> int:
        """Start a sequence without blocks after its longest cached prefix; tokens to compute (0: no room)."""
        assert not seq.block_table and seq.num_computed == 0, "admit() is for sequences without blocks"
        # the last token is always computed: its logits choose the next token
        names = self._names(seq.token_ids, (seq.num_tokens - 1) // self.block_size) if self.prefix_caching else []
        hits: list[tuple[bytes, int | None]] = []  # (name, device block or None = in the host tier)
        for name in names:
            block = self.cached.get(name)
            if block is None and (self.host is None or not self.host.has(name)):
                break
            hits.append((name, block))
        hit_tokens = len(hits) * self.block_size
        n = min(seq.num_tokens - hit_tokens, budget)
        on_device = [b for _, b in hits if b is not None]
        taken_back = sum(1 for b in on_device if self.ref[b] == 0)  # free now, but held (not taken) below
        need = self.blocks_for(hit_tokens + n) - len(on_device)
        if n < 1 or need > self.num_free - taken_back:
            return 0
        for block in on_device:  # held first, so taking blocks below cannot evict them
            self._hold(block)
        # host hits pinned first too: a block taken below may be evicted into the host tier, which must not drop them
        slots = {name: self.host.get(name) for name, block in hits if block is None}
        for name, block in hits:
            if block is None:
                block = self._take()
                self.copies.to_device.append((slots[name], block))
                self.cached[name] = block
                self.hash_of[block] = name
            seq.block_table.append(block)
        self.stats.queried_tokens += seq.num_tokens - 1
        self.stats.device_hit_tokens += len(on_device) * self.block_size
        self.stats.host_hit_tokens += (len(hits) - len(on_device)) * self.block_size
        seq.block_names = [name for name, _ in hits]
        seq.num_computed = hit_tokens
        if seq.num_cached_tokens is None:  # what the client is told: its first admission's reuse, in the prompt
            seq.num_cached_tokens = min(hit_tokens, seq.prompt_len)
        grown = self.ensure(seq, hit_tokens + n)
        assert grown
        return n

    def commit(self, seq: Sequence) -> None:
        """After a step advanced seq.num_computed: name the blocks it filled, so later requests can share them."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        start = len(seq.block_names)
        parent = seq.block_names[-1] if seq.block_names else b""
        for i in range(start, full):
            parent = block_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_names.append(parent)
            block = seq.block_table[i]
            if parent not in self.cached and self.hash_of[block] is None:
                self.cached[parent] = block
                self.hash_of[block] = parent
            # else: another block already holds these tokens; this one stays unnamed and is freed as usual

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks (last block first, so a sequence's tail is evicted before its head)."""
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_names = []

    def forget(self, blocks: list[int]) -> None:
        """Unname these blocks (a copy into them failed: their contents are not what their names say)."""
        for block in blocks:
            name = self.hash_of[block]
            if name is None:
                continue
            del self.cached[name]
            self.hash_of[block] = None
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def take_copies(self) -> Copies:
        """The copies the step about to run must make first (and forget them here)."""
        copies, self.copies = self.copies, Copies()
        if self.host is not None:
            self.host.unpin([slot for slot, _ in copies.to_device])
        return copies

    def _names(self, tokens: list[int], n_blocks: int) -> list[bytes]:
        out, parent = [], b""
        for i in range(n_blocks):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            out.append(parent)
        return out
