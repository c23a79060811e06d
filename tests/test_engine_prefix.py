"""Prefix caching and the host K/V tier in the engine: a request that starts from cached blocks (device or host)
gets the tokens and reads the Engram rows a cold run does; aborts and preemptions under hypothesis change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import GREEDY, V, drain, engine, make_model_dir

from tiergram.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("prefix") / "model")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = tokens(37, 1)  # 2 full blocks of 16 and 5 more
COLD: dict[tuple, list[int]] = {}


def cold(model_dir, prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
    """Greedy output of a fresh engine without prefix caching."""
    key = (str(model_dir), tuple(prompt), max_tokens)
    if key not in COLD:
        with engine(model_dir, prefix_caching=False) as eng:
            COLD[key] = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    return COLD[key]


def spy_row_ids(eng) -> list[tuple[str, int, dict[int, np.ndarray]]]:
    """Record (request, first position, {layer: row ids [n, H]}) of every chunk the engine hashes."""
    seen, run = [], eng.runner.row_ids

    def row_ids(seqs, counts):
        out = run(seqs, counts)
        offs = np.cumsum([0, *counts])
        for b, s in enumerate(seqs):
            seen.append((s.request_id, s.num_computed, {k: v[offs[b]:offs[b + 1]] for k, v in out.items()}))
        return out

    eng.runner.row_ids = row_ids
    return seen


def rows_by_position(seen, request_id: str) -> dict[int, dict[int, np.ndarray]]:
    out = {}
    for rid, start, ids in seen:
        if rid == request_id:
            for layer, rows in ids.items():
                for i, r in enumerate(rows):
                    out.setdefault(start + i, {})[layer] = r
    return out


def test_a_shared_prefix_gives_the_cold_tokens_and_rows(model_dir):
    second = SHARED[:32] + tokens(9, 2)
    with engine(model_dir, prefix_caching=False) as eng:
        seen = spy_row_ids(eng)
        eng.generate([second], GREEDY)
        cold_rows = rows_by_position(seen, seen[0][0])
    with engine(model_dir) as eng:
        seen = spy_row_ids(eng)
        assert eng.generate([SHARED], GREEDY) == [cold(model_dir, SHARED)]
        eng.add_request("b", second, GREEDY)
        outs = drain(eng)["b"]
        assert [t for o in outs for t in o.new_token_ids] == cold(model_dir, second)
        assert outs[-1].cached_tokens == 32 and outs[0].prompt_tokens == 41
        hit_rows = rows_by_position(seen, "b")
        assert min(hit_rows) == 32  # the 32 cached positions were not hashed or read again ...
        for pos, by_layer in hit_rows.items():  # ... and every position computed read the cold run's rows
            for layer, ids in by_layer.items():
                np.testing.assert_array_equal(ids, cold_rows[pos][layer])
        m = eng.metrics()
        assert m.prefix_device_hit_tokens == 32 and m.prefix_queried_tokens == 36 + 40
        assert m.prefix_hit_rate == pytest.approx(32 / 76)


def test_a_whole_cached_prompt_recomputes_its_last_token(model_dir):
    prompt = SHARED[:32]
    with engine(model_dir) as eng:
        first = eng.generate([prompt], GREEDY)
        eng.add_request("again", prompt, GREEDY)
        outs = drain(eng)["again"]
    assert first == [cold(model_dir, prompt)] == [[t for o in outs for t in o.new_token_ids]]
    assert outs[-1].cached_tokens == 16  # block 2 holds the last token: computed again for its logits


def test_evicted_blocks_come_back_from_the_host_tier(model_dir):
    # 6 device blocks: one 41-token request at a time; the next prompts evict SHARED's blocks to the host
    kw = dict(num_kv_blocks=6, max_num_seqs=1, host_memory_bytes=4 << 20, kv_host_fraction=0.5)
    others = [tokens(60, 10 + i) for i in range(2)]
    with engine(model_dir, **kw) as eng:
        assert eng.metrics().kv_host_blocks_total > 4
        eng.generate([SHARED], GREEDY)
        for o in others:
            eng.generate([o], GREEDY)
        m = eng.metrics()
        assert m.kv_evicted_blocks >= 2 and m.kv_host_bytes_to_host > 0
        second = SHARED[:32] + tokens(9, 2)
        eng.add_request("b", second, GREEDY)
        outs = drain(eng)["b"]
        m = eng.metrics()
    assert [t for o in outs for t in o.new_token_ids] == cold(model_dir, second)
    assert outs[-1].cached_tokens == 32 and m.prefix_host_hit_tokens == 32 and m.kv_host_bytes_to_device > 0


def test_the_host_budget_names_both_shares(model_dir):
    with pytest.raises(ValueError, match="cannot hold one K/V block.*for the Engram tables.*for the host K/V tier"):
        engine(model_dir, host_memory_bytes=4 << 20, kv_host_fraction=1e-6)
    with pytest.raises(ValueError, match="for the Engram tables.*for the host K/V tier"):  # the tables no longer fit
        engine(model_dir, host_memory_bytes=4 << 20, kv_host_fraction=0.9)
    with pytest.raises(ValueError, match="kv_host_fraction needs host_memory_bytes"):
        engine(model_dir, kv_host_fraction=0.5)
    with pytest.raises(ValueError, match="kv_host_fraction must be a number in"):
        engine(model_dir, host_memory_bytes=4 << 20, kv_host_fraction=1.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_aborts_and_preemptions_with_shared_prefixes_change_no_tokens(model_dir, data):
    """Few device blocks (preemptions), a host tier, shared prefixes, random aborts: every request that finishes
    gets its cold tokens."""
    prefixes = [SHARED[:16], SHARED[:32], tokens(20, 3), []]
    prompts = [data.draw(st.sampled_from(prefixes)) + tokens(data.draw(st.integers(1, 12)), 100 + i)
               for i in range(data.draw(st.integers(2, 6)))]
    host = data.draw(st.booleans())
    kw = dict(host_memory_bytes=4 << 20, kv_host_fraction=0.5) if host else {}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    aborted = set()
    with engine(model_dir, num_kv_blocks=7, max_num_batched_tokens=data.draw(st.sampled_from([8, 64])), **kw) as eng:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs: dict[str, list[int]] = {}
        for _ in range(500):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if data.draw(st.integers(0, 9)) == 0:
                victim = f"r{data.draw(st.integers(0, len(prompts) - 1))}"
                eng.abort_request(victim)
                aborted.add(victim)
        assert not eng.has_unfinished()
        assert eng.blocks.num_used == 0  # every hold released
    for i, p in enumerate(prompts):
        if f"r{i}" not in aborted:
            assert outs[f"r{i}"] == cold(model_dir, p, 6), f"r{i}"
