"""Prefix caching and the host K/V tier's bookkeeping: every position a sequence counts as computed holds its own
token's K/V, whatever the order of admissions, steps, aborts, preemptions, evictions and copies (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.engine.block_manager import BlockManager, block_hash
from tiergram.engine.config import SamplingParams
from tiergram.engine.kv_host import HostKV
from tiergram.engine.sequence import Sequence

BS = 4


def make_seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(f"r{i}", list(tokens), len(tokens), SamplingParams(max_tokens=8), arrival=i, max_tokens=8)


class Pool:
    """A device pool whose K/V 'values' are the token ids themselves, so a wrong block shows as a wrong token."""

    def __init__(self, num_blocks: int, host_slots: int) -> None:
        self.k = torch.full((1, num_blocks * BS, 1), -1.0)
        self.v = torch.full((1, num_blocks * BS, 1), -1.0)
        self.host = HostKV(host_slots, [self.k, self.v], BS) if host_slots else None
        self.blocks = BlockManager(num_blocks, BS, prefix_caching=True, host=self.host)

    def run_copies(self) -> None:
        copies = self.blocks.take_copies()
        if self.host is not None:
            self.host.wait(self.host.start(copies.to_host, copies.to_device))
        else:
            assert not copies

    def compute(self, seq: Sequence, n: int) -> None:
        """A step's K/V writes for seq's next n tokens, then the commit."""
        for p in range(seq.num_computed, seq.num_computed + n):
            slot = seq.block_table[p // BS] * BS + p % BS
            self.k[0, slot, 0] = seq.token_ids[p]
            self.v[0, slot, 0] = -seq.token_ids[p]
        seq.num_computed += n
        self.blocks.commit(seq)

    def check(self, seqs: list[Sequence]) -> None:
        bm = self.blocks
        held: dict[int, int] = {}
        for s in seqs:
            assert len(s.block_table) >= bm.blocks_for(s.num_computed)
            for p in range(s.num_computed):
                slot = s.block_table[p // BS] * BS + p % BS
                assert self.k[0, slot, 0] == s.token_ids[p] and self.v[0, slot, 0] == -s.token_ids[p], (s, p)
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        assert [bm.ref[b] for b in range(bm.num_blocks)] == [held.get(b, 0) for b in range(bm.num_blocks)]
        free, evictable = set(bm._free), set(bm._evictable)
        assert not free & evictable and not (free | evictable) & set(held)
        assert len(free) + len(evictable) + len(held) == bm.num_blocks
        assert all(bm.hash_of[b] is not None for b in evictable) and all(bm.hash_of[b] is None for b in free)
        assert {bm.hash_of[b]: b for b in range(bm.num_blocks) if bm.hash_of[b] is not None} == bm.cached


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 10, []]


@settings(max_examples=120, deadline=None)
@given(data=st.data(), num_blocks=st.integers(6, 14), host_slots=st.sampled_from([0, 2, 5]))
def test_every_computed_position_holds_its_own_tokens(data, num_blocks: int, host_slots: int) -> None:
    pool = Pool(num_blocks, host_slots)
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    for i in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(["new", "new", "step", "step", "step", "finish", "preempt"]))
        if op == "new":
            prefix = data.draw(st.sampled_from(PREFIXES))
            tail = data.draw(st.lists(st.integers(20, 23), min_size=1, max_size=9))
            waiting.append(make_seq(i, prefix + tail))
        if waiting and op in ("new", "step"):  # admit the head of the queue, as the scheduler does
            seq = waiting[0]
            n = pool.blocks.admit(seq, data.draw(st.integers(1, 12)))
            if n:
                waiting.pop(0)
                running.append(seq)
                assert 0 < n <= seq.num_tokens - seq.num_computed and seq.num_computed % BS == 0
                pool.run_copies()
                pool.compute(seq, n)
        elif op == "step" and running:
            seq = data.draw(st.sampled_from(running))
            if seq.num_pending == 0:
                seq.token_ids.append(data.draw(st.integers(20, 23)))  # a sampled token
            n = data.draw(st.integers(1, seq.num_pending))
            if pool.blocks.ensure(seq, seq.num_computed + n):
                pool.run_copies()
                pool.compute(seq, n)
        elif op in ("finish", "preempt") and running:
            seq = data.draw(st.sampled_from(running))
            running.remove(seq)
            pool.blocks.free(seq)
            if op == "preempt":
                seq.reset()
                waiting.insert(0, seq)
        pool.check(running)
    if pool.host is not None:
        pool.host.close()


def test_a_shared_prefix_is_reused_and_the_last_token_always_computed() -> None:
    pool = Pool(8, 0)
    a = make_seq(0, list(range(1, 10)))  # 9 tokens: 2 full blocks
    assert pool.blocks.admit(a, 100) == 9
    pool.compute(a, 9)
    b = make_seq(1, list(range(1, 9)) + [50, 51])  # the same 2 blocks, then its own
    assert pool.blocks.admit(b, 100) == 2 and b.num_computed == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and pool.blocks.ref[a.block_table[0]] == 2
    c = make_seq(2, list(range(1, 9)))  # wholly cached: its last block is recomputed for the logits
    assert pool.blocks.admit(c, 100) == 4 and c.num_cached_tokens == 4
    assert pool.blocks.stats.device_hit_tokens == 12 and pool.blocks.stats.queried_tokens == 8 + 9 + 7


def test_evicted_blocks_come_back_from_the_host() -> None:
    pool = Pool(3, 4)
    a = make_seq(0, list(range(1, 10)))
    pool.blocks.admit(a, 100)
    pool.compute(a, 9)
    pool.blocks.free(a)  # its two full blocks stay cached, evictable
    other = make_seq(1, [30] * 11)  # needs all 3 device blocks: both of a's are evicted to the host
    assert pool.blocks.admit(other, 100) == 11
    pool.run_copies()
    pool.compute(other, 11)
    assert pool.host.stats.bytes_to_host == 2 * pool.host.slot_bytes and pool.blocks.stats.evicted_blocks == 2
    pool.blocks.free(other)
    again = make_seq(2, list(range(1, 9)) + [40])
    assert pool.blocks.admit(again, 100) == 1 and again.num_computed == 8
    pool.run_copies()
    assert pool.host.stats.bytes_to_device == 2 * pool.host.slot_bytes and pool.blocks.stats.host_hit_tokens == 8
    pool.check([again])
    pool.host.close()


def test_names_chain_over_blocks() -> None:
    """A block's name covers its whole prefix: the same tokens after a different prefix get another name."""
    first = block_hash(b"", [1, 2, 3, 4])
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(block_hash(b"", [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(first, [5, 6, 7, 8]) == block_hash(block_hash(b"", [1, 2, 3, 4]), [5, 6, 7, 8])


def test_a_host_tier_needs_prefix_caching() -> None:
    k = torch.zeros(1, 8, 1)
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(2, BS, prefix_caching=False, host=HostKV(1, [k], BS))
