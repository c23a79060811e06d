"""The degrade policy: off changes nothing; under a stall bound decode positions skip their Engram reads (and
behave as Engram-off), then predicted-useless prefill positions; levels go up and back down; metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine import GREEDY, PROMPTS, engine, finish_warmups, make_model_dir

from tiergram.analysis.predictor import LayerModel, SkipPredictor
from tiergram.engine import DegradePolicy, EngineConfig, Placement, SamplingParams
from tiergram.engine.degrade import Degrader
from tiergram.model.checkpoint import load_pretrained
from tiergram.model.generate import generate
from tiergram.server.metrics import ServerMetrics, parse

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("degrade") / "model")


@pytest.fixture(scope="module")
def ref(model_dir):
    """EngramLM on this module's model (test_engine's reference cache is keyed by codec, not model dir)."""
    return load_pretrained(model_dir, tier="memory")[0]


@pytest.fixture(scope="module")
def want(ref) -> list[list[int]]:
    return [generate(ref, p, GREEDY.max_tokens).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def predictor_path(ref, tmp_path_factory) -> Path:
    """A real SkipPredictor on position features only: positions before 8 are predicted useless."""
    e = ref.config.engram
    coef = np.array([-10 * np.log1p(7.5), 10.0, 0.0])  # logit 10 (log1p(p) - log1p(7.5)): < 0 for p < 8
    layer = LayerModel(offsets=np.zeros(e.n_heads, np.int64), orders=np.ones(e.n_heads, np.int64), prior=0.5,
                       coef=coef)
    pred = SkipPredictor(dict.fromkeys(e.layers, layer), ("position",), e.max_ngram_size, threshold=0.5)
    path = tmp_path_factory.mktemp("predictor") / "skip.npz"
    pred.save(path)
    return path


@torch.no_grad()
def decode_engram_off(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy: the prompt with Engram on, every decode step with Engram off."""
    logits, past = model(torch.tensor([prompt]), use_cache=True)
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_tokens:
        logits, past = model(torch.tensor([[out[-1]]]), past, engram_enabled=False)
        out.append(int(logits[0, -1].argmax()))
    return out


def ids_requested(eng) -> int:
    return sum(s.stats()["ids"] for s in eng.sources.values())


def scripted_stalls(eng, stalls: list[float]) -> list[int]:
    """Make the runner report these stalls, one per step; -> the level after each step."""
    run, script = eng.runner.execute, iter(stalls)

    def execute(*args):
        result = run(*args)
        result.stall_s = next(script)
        return result

    eng.runner.execute = execute
    levels = []
    while eng.has_unfinished():
        eng.step()
        levels.append(eng.metrics().degrade_level)
    return levels


@pytest.mark.parametrize("policy", [None, DegradePolicy(), DegradePolicy(stall_bound_s=1e9)])
def test_off_or_never_over_changes_nothing(model_dir, ref, want, policy):
    kw = {} if policy is None else {"degrade": policy}
    with engine(model_dir, max_num_batched_tokens=16, **kw) as eng:  # chunked + mixed steps
        assert eng.generate(PROMPTS, GREEDY) == want
        m = eng.metrics()
        assert m.degrade_level == 0 and m.skipped_rows == 0
        assert m.degrade_steps == {0: m.steps, 1: 0, 2: 0}
        assert ids_requested(eng) == m.computed_tokens * ref.config.engram.n_heads * 2


def test_bound_zero_skips_every_decode_read(model_dir, ref, want):
    h = ref.config.engram.n_heads
    with engine(model_dir) as normal:
        normal.generate(PROMPTS, GREEDY)
        read_normally = normal.metrics().engram
    with engine(model_dir, degrade=DegradePolicy(stall_bound_s=0.0)) as eng:
        got = eng.generate(PROMPTS, GREEDY)
        m = eng.metrics()
        off = [decode_engram_off(ref, p, GREEDY.max_tokens) for p in PROMPTS]
        assert got == off and off != want  # Engram matters, and is off in decode
        decode_positions = len(PROMPTS) * (GREEDY.max_tokens - 1)
        assert m.degrade_level == 1 and m.degrade_steps == {0: 1, 1: m.steps - 1, 2: 0}  # no predictor: level 1
        assert m.skipped_rows == decode_positions * h * 2  # both Engram layers
        assert ids_requested(eng) == sum(map(len, PROMPTS)) * h * 2  # only the prefill positions were read
        for layer, stats in m.engram["per_layer"].items():
            assert stats["lookups"] == 1  # the one prefill step; decode-only steps start no fetch at all
            assert stats["bytes_read"]["host"] < read_normally["per_layer"][layer]["bytes_read"]["host"]
        samples = parse(ServerMetrics(lambda: (m, 0, False, (0, 0, 0))).render())  # /metrics of this snapshot
        assert samples["tiergram_degrade_level"] == 1
        assert samples["tiergram_engram_skipped_rows_total"] == m.skipped_rows
        assert samples['tiergram_degrade_steps_total{level="1"}'] == m.steps - 1


def test_levels_go_up_and_back_down(model_dir, predictor_path):
    policy = DegradePolicy(stall_bound_s=1.0, window_steps=2, recover_factor=0.5, predictor_path=str(predictor_path))
    with engine(model_dir, degrade=policy) as eng:
        eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        levels = scripted_stalls(eng, [2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        # over at once -> 1; window_steps at 1 still over -> 2; under bound x 0.5 for window_steps -> 1, -> 0
        assert levels == [1, 1, 2, 2, 1, 1, 0, 0]
        m = eng.metrics()
        assert m.degrade_steps == {0: 2, 1: 4, 2: 2}
        h = eng.model.config.engram.n_heads
        assert m.skipped_rows == 6 * h * 2  # decode steps 2..7 ran at level >= 1; step 8 read again
        assert all(s["lookups"] == 2 for s in m.engram["per_layer"].values())
    with engine(model_dir, degrade=DegradePolicy(stall_bound_s=1.0, window_steps=2)) as eng:  # no predictor
        eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        assert scripted_stalls(eng, [2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_level_two_skips_prefill_positions_the_predictor_marks(model_dir, ref, predictor_path):
    h = ref.config.engram.n_heads
    policy = DegradePolicy(stall_bound_s=0.0, window_steps=1, predictor_path=str(predictor_path))
    with engine(model_dir, degrade=policy) as eng:
        eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
        eng.step()
        eng.step()
        assert eng.metrics().degrade_level == 2
        before, asked = eng.metrics().skipped_rows, ids_requested(eng)
        eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))  # 20 tokens
        eng.step()  # a's decode position and b's 20 prefill positions, at level 2
        assert eng.metrics().skipped_rows - before == (1 + 8) * h * 2  # a's decode, b's positions 0..7
        assert ids_requested(eng) - asked == 12 * h * 2  # b's positions 8..19 were read
        while eng.has_unfinished():
            eng.step()


def test_policy_config():
    assert EngineConfig("m", "host", degrade={"stall_bound_s": 0.01}).degrade == DegradePolicy(0.01)
    for bad in ({"stall_bound_s": -1.0}, {"window_steps": 0}, {"recover_factor": 1.5}):
        with pytest.raises(ValueError):
            DegradePolicy(**bad)
    d = Degrader(DegradePolicy())  # off: never moves
    for _ in range(20):
        d.observe(10.0, 0)
    assert d.level == 0 and d.level_steps[0] == 20


def test_no_read_ahead_while_degraded(model_dir):
    placement = Placement("file", codec="fp32", cache_bytes=16384)
    with engine(model_dir, placement, max_num_batched_tokens=16, degrade=DegradePolicy(stall_bound_s=0.0)) as eng:
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), p, GREEDY)
        eng.step()  # at level 0: the next step's prompt rows are read ahead; a bound of 0 then lifts the level
        finish_warmups(eng)
        first = eng.metrics().engram["warmed_rows"]
        assert first > 0 and eng.metrics().degrade_level == 1
        eng._inflight = {"0": 1}  # as while a step runs: an arriving prompt is not read ahead either
        eng.read_ahead(PROMPTS[3])
        eng._inflight = {}
        while eng.has_unfinished():  # the prompts take several 16-token steps, none of which reads ahead
            eng.step()
        finish_warmups(eng)
        assert eng.metrics().engram["warmed_rows"] == first
