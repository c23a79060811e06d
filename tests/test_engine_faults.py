"""The engine survives what one request or one step can do to it: numerically hostile sampling settings, a
request whose own sampling fails, a step whose table read fails, and aborts from another thread mid-step."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import V, drain, engine, make_model_dir, prompts_of

from tiergram.engine import Placement, SamplingParams
from tiergram.model.checkpoint import load_pretrained
from tiergram.model.generate import generate
from tiergram.model.sampling import MIN_TEMPERATURE, NonFiniteLogitsError, sample_token

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("faults") / "model")


_REF: dict[str, object] = {}


def expected(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """EngramLM's own greedy tokens on this module's model (test_engine's cache is keyed by codec only)."""
    if str(model_dir) not in _REF:
        _REF[str(model_dir)] = load_pretrained(model_dir, tier="memory")[0]
    return [generate(_REF[str(model_dir)], p, max_tokens).ids for p in prompts]


# ----------------------------------------------------------------------------------------- sampling

@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(1e-40), st.floats(0, 1e6, allow_nan=False)),
       top_p=st.floats(1e-300, 1.0, exclude_min=False).filter(lambda p: p > 0),
       top_k=st.integers(0, V + 10), scale=st.sampled_from([1.0, 1e4, 3e38]), seed=st.integers(0, 2**32))
def test_sample_token_gives_a_token_for_every_valid_setting(temperature, top_p, top_k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.rand(V, generator=g) * 2 - 1) * scale  # up to float32's largest finite values
    token = sample_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert 0 <= token < V
    if temperature < MIN_TEMPERATURE or top_k == 1:
        assert token == int(logits.argmax())


def test_sample_token_refuses_non_finite_logits():
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(V)
        logits[3] = bad
        with pytest.raises(NonFiniteLogitsError, match="non-finite"):
            sample_token(logits, 1.0)


def test_tiny_temperature_does_not_take_the_batch_down(model_dir):
    """temperature 1e-40 once divided the logits into inf/NaN and torch.multinomial raised inside step()."""
    a, b = prompts_of(6, 9, seed=31)
    with engine(model_dir) as eng:
        eng.add_request("tiny-t", a, SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True))
        eng.add_request("greedy", b, SamplingParams(max_tokens=6, ignore_eos=True))
        outs = drain(eng)
        m = eng.metrics()
    assert [t for o in outs["tiny-t"] for t in o.new_token_ids] == expected(model_dir, [a], 6)[0]
    assert [t for o in outs["greedy"] for t in o.new_token_ids] == expected(model_dir, [b], 6)[0]
    assert m.faults == 0 and m.failed_requests == 0


# ------------------------------------------------------------------------------------------ isolation

def test_a_request_whose_sampling_fails_fails_alone(model_dir):
    a, b = prompts_of(5, 7, seed=32)
    with engine(model_dir) as eng:
        eng.add_request("broken", a, SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
        eng.add_request("fine", b, SamplingParams(max_tokens=6, ignore_eos=True))
        eng._seqs["broken"].generator = "not a generator"  # its own sampling raises (TypeError in multinomial)
        outs = drain(eng)
        m = eng.metrics()
        assert m.kv_blocks_used == 0 and m.num_running == 0
    [failed] = outs["broken"]
    assert failed.finished and failed.finish_reason == "error" and "TypeError" in failed.error
    assert [t for o in outs["fine"] for t in o.new_token_ids] == expected(model_dir, [b], 6)[0]
    assert m.failed_requests == 1 and m.faults == 0  # one request failed, not the step


def fail_every_page(eng, times: int = 1 << 20) -> None:
    for src in eng.sources.values():
        for page in range(src.manifest.n_pages):
            src.tier.reader.inject_fault("eio", page, times)


def test_a_failed_table_read_fails_its_step_and_the_engine_goes_on(model_dir):
    a, b, c = prompts_of(5, 8, 6, seed=33)
    with engine(model_dir, Placement("file", codec="fp32")) as eng:
        eng.add_request("early", a, SamplingParams(max_tokens=8, ignore_eos=True))
        eng.step()
        fail_every_page(eng)
        eng.add_request("caught", b, SamplingParams(max_tokens=4, ignore_eos=True))
        outs = {o.request_id: o for o in eng.step()}  # every read of this step fails (twice: PageReadError)
        m = eng.metrics()
        assert set(outs) == {"early", "caught"} and all(o.finish_reason == "error" for o in outs.values())
        assert "PageReadError" in outs["early"].error and "cannot read page" in outs["early"].error
        assert m.faults == 1 and m.consecutive_faults == 1 and m.failed_requests == 2 and m.kv_blocks_used == 0
        assert "PageReadError" in m.last_fault
        for src in eng.sources.values():
            src.tier.reader.clear_faults()
        eng.add_request("after", c, SamplingParams(max_tokens=5, ignore_eos=True))  # the engine serves again
        after = drain(eng)["after"]
        m = eng.metrics()
    assert [t for o in after for t in o.new_token_ids] == expected(model_dir, [c], 5)[0]
    assert m.faults == 1 and m.consecutive_faults == 0


# ------------------------------------------------------------------------------------ aborts mid-step

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_aborts_from_another_thread_never_touch_a_step_in_flight(model_dir, seed):
    """A thread aborts random requests while steps run (half of them while the step in flight computes them);
    every request that was not aborted gets exactly the tokens of a run without aborts, and all blocks come back.
    (Freeing the blocks of a sequence under the step computing it gave a surviving sequence wrong tokens.)"""
    prompts = prompts_of(*[random.Random(seed).randint(3, 30) for _ in range(16)], seed=34 + seed)
    want = expected(model_dir, prompts, 10)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    rng = random.Random(seed)
    with engine(model_dir, max_num_batched_tokens=24, max_num_seqs=8) as eng:
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(rid, p, params)
        doomed = set(rng.sample(ids, 8))
        stop = threading.Event()

        def aborter() -> None:
            left = sorted(doomed)
            deadline = time.monotonic() + 20
            while left and time.monotonic() < deadline:  # half of them while a step computes them, half whenever
                inflight = set(eng._inflight)
                hit = [rid for rid in left if rid in inflight]
                if hit or len(left) <= len(doomed) // 2:
                    rid = hit[0] if hit else left[0]
                    left.remove(rid)
                    eng.abort_request(rid)
                    stop.wait(rng.uniform(0, 0.005))
            for rid in left:
                eng.abort_request(rid)

        t = threading.Thread(target=aborter)
        t.start()
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        reasons: dict[str, str] = {}
        for _ in range(2000):
            if not eng.has_unfinished() and not t.is_alive():
                break
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
                if out.finished:
                    assert out.request_id not in reasons, "reported finished twice"
                    reasons[out.request_id] = out.finish_reason
        t.join()
        drain(eng)
        m = eng.metrics()
    assert m.kv_blocks_used == 0 and m.faults == 0 and m.failed_requests == 0
    assert list(reasons.values()).count("abort") >= 1 and m.deferred_aborts >= 1  # the in-flight path ran
    for rid, w in zip(ids, want, strict=True):
        if reasons.get(rid) == "abort":
            assert rid in doomed and got[rid] == w[:len(got[rid])]  # what it got before the abort is right too
        else:
            assert got[rid] == w and reasons[rid] == "length", rid
