"""The serving engine: greedy tokens equal EngramLM's own generation for every placement, scheduling (chunked
prefill, mixed steps, preemption, abort), budget arithmetic, replay, queue bounds, bad input, metrics."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support import spread
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from tiergram.cli import build_parser
from tiergram.engine import EngineConfig, LLMEngine, Placement, QueueFullError, RequestOutput, SamplingParams
from tiergram.engram import RowSourceTable
from tiergram.model import EngramLM, tiny_config
from tiergram.model.checkpoint import load_pretrained, save_pretrained
from tiergram.model.export import table_filename
from tiergram.model.generate import generate
from tiergram.store import TieredTable

V = 97
EOS = 0
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def make_model_dir(path: Path) -> Path:
    """A random-init tiny model with Engram at blocks 0 and 1 and a word-level tokenizer, saved as a training dir.

    Weights are scaled up from the training init so that greedy outputs vary and their top-2 logit gaps are far
    above float rounding, and the short convs and biases are non-zero so every path is exercised.
    """
    cfg = tiny_config(V)
    cfg.engram.layers = [0, 1]
    model = spread(EngramLM(cfg), seed=0)
    vocab = {"<|endoftext|>": EOS, "<|pad|>": 1, **{f"t{i}": i for i in range(2, V)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return save_pretrained(model, path, tokenizer=tokenizer)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("engine") / "model")


def prompts_of(*lengths: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of(3, 20, 9, 33)
_REFERENCE: dict[str, EngramLM] = {}
_EXPECTED: dict[tuple, list[int]] = {}


def reference(model_dir: Path, codec: str) -> EngramLM:
    """EngramLM reading the same rows the engine serves: the trained fp32 tables, or the exported codec's file."""
    key = f"{model_dir}:{codec}"  # per model directory: other test modules build their own models
    if key not in _REFERENCE:
        model, _ = load_pretrained(model_dir, tier="memory")
        if codec != "fp32":
            for layer in model.engram_layers:
                path = model_dir / "export" / table_filename(layer, codec)
                model.blocks[layer].engram.table = RowSourceTable(TieredTable(path, tier="host"))
        _REFERENCE[key] = model
    return _REFERENCE[key]


def expected(model_dir: Path, prompts: list[list[int]], max_tokens: int = 12, codec: str = "fp32") -> list[list[int]]:
    model = reference(model_dir, codec)
    for p in prompts:
        key = (str(model_dir), codec, tuple(p), max_tokens)
        if key not in _EXPECTED:
            _EXPECTED[key] = generate(model, p, max_tokens).ids
    return [_EXPECTED[(str(model_dir), codec, tuple(p), max_tokens)] for p in prompts]


def engine(model_dir: Path, placement=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), placement or Placement("host", codec="fp32"), **kw))


def drain(eng: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is left; every request's outputs in order."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            return outs
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


# ------------------------------------------------------------------------ the same tokens, for every placement

PLACEMENTS = {
    "host": Placement("host", codec="fp32"),
    "device": Placement("device", codec="fp32"),
    "file": Placement("file", codec="fp32"),
    "file-lru": Placement("file", codec="fp32", cache_bytes=4096, cache_policy="lru"),
    "file-lfu": Placement("file", codec="fp32", cache_bytes=4096, cache_policy="lfu"),
    "file-lookahead": Placement("file", codec="fp32", cache_bytes=4096, cache_policy="lookahead"),
    "per-layer": {0: Placement("device", codec="fp32"), 1: Placement("file", codec="fp32", cache_bytes=2048)},
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_greedy_matches_model_generate(model_dir, name):
    want = expected(model_dir, PROMPTS)
    assert len({tuple(w) for w in want}) == len(want) and all(len(set(w)) > 3 for w in want)  # not degenerate
    with engine(model_dir, PLACEMENTS[name], max_num_batched_tokens=16) as eng:  # chunked + mixed steps
        assert eng.generate(PROMPTS, GREEDY) == want
        m = eng.metrics()
        assert m.num_running == m.num_waiting == m.kv_blocks_used == 0 and m.num_preemptions == 0
        assert m.exposed_stall_s >= 0 and m.last_step_stall_s >= 0 and m.step_time_s > 0 and m.steps > 12
        # prefill steps: the prompts' chunks (16 tokens a step here); the rest decode one token per sequence
        assert len(PROMPTS) <= m.prefill_steps < m.steps and 0 <= m.prefill_stall_s <= m.exposed_stall_s
        assert m.generation_tokens == 48 and m.prompt_tokens == sum(map(len, PROMPTS))
        engram = m.engram
        for layer, stats in engram["per_layer"].items():
            assert stats["lookups"] == m.steps and sum(stats["bytes_read"].values()) > 0, layer
        if "file" in name:
            assert engram["bytes_read"]["file"] > 0 and engram["pages_read"] > 0
        if name.startswith("file-") or name == "per-layer":
            assert engram["cache_hit_rate"] is not None and 0 <= engram["cache_hit_rate"] <= 1
            assert engram["bytes_read"].get("cache", 0) > 0
            assert engram["cache_hit_rate"] == engram["cache_hits"] / engram["cache_probes"]
        else:
            assert engram["cache_hit_rate"] is None
        if name == "device":
            assert set(engram["bytes_read"]) == {"device"} and m.budget["device_table_bytes"] > 0
        if name == "host":
            assert set(engram["bytes_read"]) == {"host"} and m.budget["device_table_bytes"] == 0


def test_the_file_placement_reads_into_registered_buffers_and_the_read_ahead_gives_way(model_dir):
    """The file table's reader reads into io_uring-registered buffers and its read-ahead gives way to a step's
    fetch (yield_depth 8), with no option to turn either off; the mooncake placement's waits run at low priority."""
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=4096)) as eng:
        assert eng.generate(PROMPTS, GREEDY) == expected(model_dir, PROMPTS)
        readers = [src.tier.reader for src in eng.sources.values()]
        assert {r.yield_depth for r in readers} == {8}
        if all(r.buffer_refused == 0 and r.backend == "io_uring" for r in readers):
            assert all(r.fixed_reads > 0 for r in readers)
    for gone in ("--no-read-ahead-yield", "--no-fixed-buffers", "--read-nice", "--mooncake-busy-waits",
                 "--engine-core", "--no-early-decode-reads", "--no-prompt-rows-first"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", gone])


@pytest.mark.parametrize("kind", ["device", "host", "file"])
def test_lossy_codec_matches_model_on_the_same_table(model_dir, kind):
    placement = Placement(kind, codec="fp8_e4m3", cache_bytes=8192 if kind == "file" else 0)
    with engine(model_dir, placement, max_num_batched_tokens=16) as eng:
        got = eng.generate(PROMPTS, GREEDY)
    assert got == expected(model_dir, PROMPTS, codec="fp8_e4m3")
    assert got != expected(model_dir, PROMPTS)  # the fp8 rows really were served (they change some tokens)


# ---------------------------------------------------------------------------------------------- scheduling

def test_chunked_prefill_splits_a_long_prompt(model_dir):
    [prompt] = prompts_of(40, seed=9)
    with engine(model_dir, max_num_batched_tokens=8) as eng:
        eng.add_request("long", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        for i in range(4):
            assert eng.step() == []  # 8 prompt tokens a step, no output until the prompt is in
            assert eng.scheduler.last == [("long", 8, True)] and eng.metrics().computed_tokens == 8 * (i + 1)
        [out] = eng.step()
        assert out.new_token_ids == expected(model_dir, [prompt], 3)[0][:1] and not out.finished
        assert eng.scheduler.last == [("long", 8, True)]
        tokens = out.new_token_ids + [t for o in drain(eng)["long"] for t in o.new_token_ids]
    assert tokens == expected(model_dir, [prompt], 3)[0]


def test_decode_and_prefill_share_a_step(model_dir):
    a, b = prompts_of(5, 30, seed=11)
    with engine(model_dir, max_num_batched_tokens=8) as eng:
        eng.add_request("a", a, SamplingParams(max_tokens=10, ignore_eos=True))
        [first] = eng.step()
        assert first.request_id == "a" and first.new_token_ids and first.output_tokens == 1
        eng.add_request("b", b, SamplingParams(max_tokens=4, ignore_eos=True))
        got = {"a": list(first.new_token_ids), "b": []}
        mixed = 0
        while eng.has_unfinished():
            outs = eng.step()
            last = eng.scheduler.last
            assert sum(n for _, n, _ in last) <= 8
            if last[0][0] == "a" and any(rid == "b" and prefill for rid, _, prefill in last):
                assert last[0] == ("a", 1, False)  # the decode is scheduled first, the chunk fills the rest
                mixed += 1
            for out in outs:
                got[out.request_id] += out.new_token_ids
    assert mixed >= 3  # b's 30 prompt tokens took 7-token chunks next to a's decodes
    assert [got["a"], got["b"]] == [expected(model_dir, [a], 10)[0], expected(model_dir, [b], 4)[0]]


def test_prefill_ahead_guesses_the_next_steps_prompt_chunks(model_dir):
    a, b, c = prompts_of(5, 30, 12, seed=13)
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=8192), max_num_batched_tokens=8) as eng:
        eng.add_request("a", a, SamplingParams(max_tokens=10, ignore_eos=True))
        eng.step()  # a's prompt is in: it decodes from now on
        for rid, p in (("b", b), ("c", c)):
            eng.add_request(rid, p, SamplingParams(max_tokens=2, ignore_eos=True))
        sched, seqs = eng.scheduler, eng._seqs
        assert seqs["b"].warmed_to == seqs["c"].warmed_to == 8  # each first chunk is read as it arrives
        for source in eng.sources.values():
            source.drain_warm()
        assert sched.prefill_ahead({}) == []  # the next step: a's decode and 7 tokens of b, read already
        eng.step()  # runs that step (b's rows are in), and reads b's next window (7..14) behind it, from 8 on
        assert seqs["b"].num_computed == 7 and seqs["b"].warmed_to == 14
        assert sched.prefill_ahead({}) == []  # a window is handed out once
        assert sched.prefill_ahead({"a": 1, "b": 7}) == [(seqs["b"].token_ids, 14, 21)]  # after a step that runs 7..14
        assert sched.prefill_ahead({"a": 1, "b": 19}) == [(seqs["b"].token_ids, 26, 30)]  # c's 0..3 was read on arrival
        seqs["b"].reset()  # a preempted sequence is warmed again from its start
        assert seqs["b"].warmed_to == 0


def finish_warmups(eng: LLMEngine) -> None:
    """Wait for the read-aheads queued so far (each table warms on a worker of its own, in order)."""
    for src in eng.sources.values():
        if hasattr(src, "drain_warm"):
            src.drain_warm(30)
        elif getattr(src, "_warm_executor", None) is not None:
            src._warm_executor.submit(lambda: None).result(30)


def test_read_ahead_fills_the_cache_and_changes_no_token(model_dir):
    placement = Placement("file", codec="fp32", cache_bytes=16384)
    want = expected(model_dir, PROMPTS)
    stats = {}
    for read_ahead in (True, False):
        with engine(model_dir, replace(placement, read_ahead=read_ahead), max_num_batched_tokens=16) as eng:
            for i, p in enumerate(PROMPTS):
                eng.add_request(str(i), p, GREEDY)
            got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
            while eng.has_unfinished():
                for out in eng.step():
                    got[out.request_id] += out.new_token_ids
                finish_warmups(eng)  # as when a step's compute hides the read-ahead: the warmed rows are there
            assert [got[str(i)] for i in range(len(PROMPTS))] == want
            stats[read_ahead] = eng.metrics().engram
    on, off = stats[True], stats[False]
    assert on["warmed_rows"] > 0 and off["warmed_rows"] == 0
    assert on["cache_hit_rate"] > off["cache_hit_rate"]  # the warmed prompt rows are hits when their step comes
    assert on["per_layer"][0]["warmed_rows"] > 0 and on["per_layer"][1]["warmed_rows"] > 0


def test_early_decode_reads_are_hits_at_their_step_and_change_no_token(model_dir):
    """With read-ahead a step's sampled tokens' next rows are read before the next step starts, on the prefetch
    worker in front of its prefetch: that step finds them cached (every prompt here is in the first step, so the
    read-ahead reads only decode rows). Tokens are the same either way."""
    want = expected(model_dir, PROMPTS)
    stats = {}
    for early in (True, False):  # holds every row: no eviction in the way
        placement = Placement("file", codec="fp32", cache_bytes=1 << 20, read_ahead=early)
        with engine(model_dir, placement) as eng:
            assert eng.generate(PROMPTS, GREEDY) == want
            stats[early] = eng.metrics().engram
    on, off = stats[True], stats[False]
    miss = {k: v["cache_probes"] - v["cache_hits"] for k, v in stats.items()}
    e = eng.runner.model.config.engram
    decode_rows = len(PROMPTS) * (GREEDY.max_tokens - 1) * len(e.layers) * e.n_head_per_ngram * (e.max_ngram_size - 1)
    assert on["cache_probes"] == off["cache_probes"]  # the same steps probed the same rows
    assert on["warmed_rows"] > off["warmed_rows"]
    # the decode rows were read before their step probed: at most that many fewer misses, and most of them
    assert decode_rows // 2 < miss[False] - miss[True] <= decode_rows


def test_read_ahead_of_an_arriving_prompt_only_while_a_step_runs(model_dir):
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=16384), max_num_batched_tokens=8) as eng:
        [prompt] = prompts_of(20, seed=17)

        def warmed() -> int:
            finish_warmups(eng)
            return eng.metrics().engram["warmed_rows"]

        eng.read_ahead(prompt)  # idle: the next step fetches it itself
        assert warmed() == 0
        eng._inflight = {"other": 1}  # as while a step runs
        eng.read_ahead(prompt + [V + 5])  # bad input is add_request's to refuse: nothing read
        assert warmed() == 0
        eng.read_ahead(prompt)
        assert warmed() > 0  # the first chunk (8 tokens) of each layer's rows
        eng._inflight = {}


def test_preemption_under_a_tiny_kv_budget_still_gives_the_right_tokens(model_dir):
    prompts = prompts_of(9, 6, 8, 7, seed=3)
    # 5 blocks of 4 tokens: one max-length sequence (20 tokens) fits, four sequences of ~17 do not
    with engine(model_dir, block_size=4, max_model_len=20, num_kv_blocks=5, max_num_batched_tokens=32) as eng:
        got = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        m = eng.metrics()
    assert got == expected(model_dir, prompts, 8)
    assert m.num_preemptions > 0 and m.kv_blocks_total == 5 and m.kv_blocks_used == 0
    assert m.computed_tokens > sum(len(p) + 7 for p in prompts)  # preempted sequences were recomputed


def test_abort_frees_blocks_and_reports_once(model_dir):
    p1, p2, p3 = prompts_of(10, 12, 5, seed=4)
    with engine(model_dir, max_num_seqs=2) as eng:
        eng.add_request("r1", p1, SamplingParams(max_tokens=20, ignore_eos=True))
        eng.add_request("r2", p2, SamplingParams(max_tokens=20, ignore_eos=True))
        eng.add_request("r3", p3, SamplingParams(max_tokens=20, ignore_eos=True))  # waits: max_num_seqs 2
        eng.step()
        eng.step()
        before = eng.metrics()
        assert before.num_running == 2 and before.num_waiting == 1 and before.kv_blocks_used == 2
        eng.abort_request("r1")
        eng.abort_request("r3")  # a waiting one
        eng.abort_request("r3")  # twice, and an unknown id: nothing happens
        eng.abort_request("nope")
        after = eng.metrics()
        assert after.kv_blocks_used == 1 and after.num_running == 1 and after.num_waiting == 0
        outs = {o.request_id: o for o in eng.step()}
        assert outs["r1"].finished and outs["r1"].finish_reason == "abort" and outs["r1"].new_token_ids == []
        assert outs["r3"].finished and outs["r3"].finish_reason == "abort" and outs["r3"].output_tokens == 0
        assert not outs["r2"].finished
        rest = drain(eng)
        assert set(rest) == {"r2"} and rest["r2"][-1].finish_reason == "length"
        assert eng.metrics().kv_blocks_used == 0 and not eng.has_unfinished()


def test_stop_tokens_eos_and_length(model_dir):
    [prompt] = prompts_of(6, seed=21)
    want = expected(model_dir, [prompt], 12)[0]
    with engine(model_dir, eos_token_id=want[3]) as eng:
        assert eng.eos_token_id == want[3]
        eng.add_request("eos", prompt, SamplingParams(max_tokens=12))
        eng.add_request("stop", prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[want[5]]))
        eng.add_request("len", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        outs = drain(eng)
    for rid, n, reason in (("eos", want.index(want[3]) + 1, "stop"), ("stop", want.index(want[5]) + 1, "stop"),
                           ("len", 12, "length")):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert tokens == want[:n] and outs[rid][-1].finish_reason == reason, rid
        assert [o.finished for o in outs[rid]] == [False] * (len(outs[rid]) - 1) + [True]
        assert outs[rid][-1].output_tokens == n and outs[rid][-1].prompt_tokens == 6
    with engine(model_dir) as eng:  # the tokenizer's <|endoftext|> is the default eos
        assert eng.eos_token_id == EOS and eng.model_name == "model" and eng.max_model_len == 64
        [near_full] = prompts_of(60)
        assert eng.generate([near_full], SamplingParams(max_tokens=50, ignore_eos=True)) == \
            expected(model_dir, [near_full], 50)  # cut at max_model_len, as the model's own generate does


def test_forced_tokens_are_replayed_exactly_and_their_rows_fetched(model_dir):
    forced = [5, EOS, 7, 7, 3, 96]  # eos and a stop token do not end a replay
    [prompt] = prompts_of(8, seed=2)
    params = SamplingParams(max_tokens=2, forced_tokens=forced, stop_token_ids=[7])
    assert params.max_tokens == len(forced)
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=4096)) as eng:
        eng.add_request("replay", prompt, params)
        outs = drain(eng)["replay"]
        m = eng.metrics()
    assert [t for o in outs for t in o.new_token_ids] == forced and outs[-1].finish_reason == "length"
    assert m.steps == len(forced)  # the model ran for every token (the last is not fed back)
    assert all(layer["lookups"] == len(forced) for layer in m.engram["per_layer"].values())
    assert m.computed_tokens == len(prompt) + len(forced) - 1 and m.engram["bytes_read"]["file"] > 0


def test_seeded_sampling_is_reproducible(model_dir):
    [prompt] = prompts_of(7, seed=8)
    runs = []
    with engine(model_dir) as eng:
        for seed in (1, 1, 2):
            params = SamplingParams(max_tokens=12, temperature=1.5, top_k=20, top_p=0.9, seed=seed, ignore_eos=True)
            runs.append(eng.generate([prompt, prompt], params))
    assert runs[0] == runs[1] and runs[0][0] == runs[0][1] and runs[0] != runs[2]
    assert runs[0][0] != expected(model_dir, [prompt])[0]


# ------------------------------------------------------------------------------------------------ devices

def test_no_step_mixes_gpu_and_host_tensors_as_run_on_cuda(model_dir, monkeypatch):
    """The engine's CUDA path without a GPU: tables opened as on CUDA (DeviceTable for every placement) and tensors
    tracked by a virtual CUDA device; no op may mix the GPU's tensors with the host's (degrade masks, sampling,
    short-conv lookbacks, KV slots and attention masks included). The prefetch workers' threads are not seen."""
    from virtual_cuda import VirtualCuda

    import tiergram.engine.llm_engine as llm_engine
    from tiergram.engine import DegradePolicy
    from tiergram.store.device_table import DeviceTable

    probe = VirtualCuda()
    with probe:  # the tracker itself works: what is computed from a device tensor is one, and a host mask is caught
        (~(torch.zeros(2, 3, device="cpu")[0] + 1).bool()).float() * torch.ones(3)
    assert [what for what, _op, _where in probe.flags] == ["GPU and host tensors in one op"]

    def open_as_on_cuda(path, placement, device):
        return DeviceTable(path, device=device, tier=placement.kind, cache_bytes=placement.cache_bytes,
                           cache_policy=placement.cache_policy, file_mode=placement.file_mode)

    monkeypatch.setattr(llm_engine, "open_table", open_as_on_cuda)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, top_p=0.9, seed=3, ignore_eos=True)
    for placement, degrade in ((Placement("device"), None), (Placement("host"), DegradePolicy(stall_bound_s=0.0)),
                               (Placement("file", cache_bytes=8192), None)):
        mode = VirtualCuda()
        with mode:
            with engine(model_dir, placement, max_num_batched_tokens=16, degrade=degrade) as eng:
                eng.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
                eng.generate(PROMPTS[:2], sampled)
                m = eng.metrics()
        assert mode.gpu(eng.runner.k_cache) and mode.gpu(eng.model.tok_emb.weight) and m.generation_tokens == 24
        assert degrade is None or m.skipped_rows > 0
        assert not mode.flags, (placement.kind, dict(mode.flags))


# ------------------------------------------------------------------------------------------------- budget

def test_device_placement_costs_kv_blocks(model_dir):
    probe = engine(model_dir, max_num_seqs=1024)
    b = probe.budget
    probe.close()
    total = b.weights_bytes + b.activation_bytes + 200 * b.block_bytes
    with engine(model_dir, Placement("host", codec="fp32"), device_memory_bytes=total, max_num_seqs=1024) as host, \
            engine(model_dir, Placement("device", codec="fp32"), device_memory_bytes=total, max_num_seqs=1024) as dev:
        h, d = host.metrics(), dev.metrics()
        table_bytes = d.budget["device_table_bytes"]
    assert h.kv_blocks_total == 200 and h.budget["device_table_bytes"] == 0
    assert table_bytes >= 2 * 4 * 1009 * 32 * 4  # two layers of 4 heads x 1009 rows x 32 fp32 values
    assert d.kv_blocks_total == (total - b.weights_bytes - b.activation_bytes - table_bytes) // b.block_bytes
    assert table_bytes // b.block_bytes <= h.kv_blocks_total - d.kv_blocks_total <= table_bytes // b.block_bytes + 1
    assert d.budget["max_concurrency"] < h.budget["max_concurrency"] == 200 // 4
    assert h.budget["kv_bytes"] == 200 * b.block_bytes
    with engine(model_dir, Placement("device", codec="fp8_e4m3"), device_memory_bytes=total, max_num_seqs=1024) as f8:
        assert f8.budget.device_table_bytes < table_bytes and f8.budget.kv_blocks > d.kv_blocks_total
    with pytest.raises(ValueError, match="needs 4 KV blocks"):  # too small for one full-length sequence
        engine(model_dir, Placement("host"), device_memory_bytes=total - 197 * b.block_bytes, max_num_seqs=1024)


def test_default_budget_is_capped_at_what_the_sequences_can_use(model_dir):
    with engine(model_dir, max_num_seqs=3) as eng:
        b = eng.metrics().budget
    assert b["total_bytes"] == 2 << 30 and b["kv_blocks"] == 3 * 4 < b["kv_blocks_affordable"]
    # K and V (2 layers, 2 kv heads x 16) and the short conv's input (2 Engram layers x d_model 64), 16 tokens, fp32
    assert b["block_bytes"] == (2 * 2 * 2 * 16 + 2 * 64) * 16 * 4


# --------------------------------------------------------------------------------------- queues and input

def test_queue_full(model_dir):
    with engine(model_dir, max_waiting=2) as eng:
        eng.add_request("a", [5, 6], GREEDY)
        eng.add_request("b", [5, 6], GREEDY)
        with pytest.raises(QueueFullError, match="max_waiting 2"):
            eng.add_request("c", [5, 6], GREEDY)
        eng.step()  # both admitted: the queue has room again
        eng.add_request("c", [5, 6], GREEDY)
        assert set(drain(eng)) == {"a", "b", "c"}


def test_bad_input_is_refused(model_dir):
    with engine(model_dir, max_model_len=16) as eng:
        for prompt, match in (([], "empty"), ([3] * 16, "context length is 16"), ([3, V], "outside the vocabulary"),
                              ([-1], "outside the vocabulary"), ([3, 1.5], "integer token ids"),
                              ([True], "integer token ids"), ("t3 t4", "integer token ids")):
            with pytest.raises(ValueError, match=match):
                eng.add_request("x", prompt, GREEDY)
        with pytest.raises(ValueError, match="in .forced_tokens."):
            eng.add_request("x", [3] * 10, SamplingParams(forced_tokens=[4] * 7))
        with pytest.raises(ValueError, match="forced_tokens holds 200"):
            eng.add_request("x", [3], SamplingParams(forced_tokens=[4, 200]))
        with pytest.raises(ValueError, match="SamplingParams"):
            eng.add_request("x", [3], {"max_tokens": 3})
        eng.add_request("x", [3], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request("x", [4], GREEDY)
        with pytest.raises(ValueError, match="prompt is empty"):
            eng.generate([[3], []], GREEDY)
        eng.abort_request("x")
    for kw, match in ((dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                      (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(forced_tokens=[]), "empty"),
                      (dict(seed=1.5), "seed")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    for kw, match in ((dict(kind="ssd"), "placement kind"), (dict(kind="host", cache_bytes=10), "cache_bytes"),
                      (dict(kind="file", codec="fp4"), "codec"), (dict(kind="file", cache_policy="fifo"), "policy")):
        with pytest.raises(ValueError, match=match):
            Placement(**kw)
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        engine(model_dir, {0: Placement("host")})
    with pytest.raises(ValueError, match=r"unknown \[5\]"):
        engine(model_dir, {0: "host", 1: "host", 5: "host"})
    with pytest.raises(ValueError, match="max_seq 64"):
        engine(model_dir, max_model_len=65)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(str(model_dir), "host", block_size=0)


def test_config_placements_from_plain_values(model_dir):
    cfg = EngineConfig(str(model_dir), {"0": "device", "1": {"kind": "file", "cache_bytes": 4096, "codec": "fp32"}},
                       block_size=8)
    assert cfg.placement == {0: Placement("device"), 1: Placement("file", 4096, codec="fp32")}
    assert EngineConfig("m", {"kind": "host"}).placement == Placement("host")
    with pytest.raises(ValueError, match=r"EngineConfig.max_waiting must be an integer >= 0"):
        EngineConfig("m", "host", max_waiting=-1)


def test_generate_waits_for_queue_room(model_dir):
    with engine(model_dir, max_waiting=1, max_num_seqs=2) as eng:
        assert eng.generate(PROMPTS, GREEDY) == expected(model_dir, PROMPTS)


def test_exported_directory_and_a_model_without_engram(model_dir, tmp_path):
    engine(model_dir, Placement("host", codec="fp32")).close()  # exports DIR/export (if no test did yet)
    with engine(model_dir / "export", Placement("file", codec="fp32")) as eng:
        assert eng.generate(PROMPTS[:2], GREEDY) == expected(model_dir, PROMPTS[:2])
    with pytest.raises(ValueError, match="exported model without engram_layer0.int8.tgram"):
        engine(model_dir / "export", Placement("host", codec="int8"))
    cfg = tiny_config(V).without_engram()
    plain = spread(EngramLM(cfg), seed=1)
    save_pretrained(plain, tmp_path / "plain")
    with engine(tmp_path / "plain") as eng:
        assert eng.generate(PROMPTS, GREEDY) == [generate(plain, p, 12).ids for p in PROMPTS]
        assert eng.metrics().engram["bytes_read"] == {} and eng.tokenizer is None and eng.eos_token_id is None
    with pytest.raises(ValueError, match="has no Engram layers to preload"):
        engine(tmp_path / "plain", hot_rows=str(tmp_path / "hot_rows.npz"))


def test_a_new_prompt_joins_once_its_rows_are_read(model_dir):
    """prompt_rows_first: a prompt arriving while others decode reads its first chunk's rows before it joins the
    batch (its step then finds them cached); one arriving alone starts at once. Same greedy tokens either way."""
    a, b = prompts_of(6, 20, seed=17)
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=1 << 20)) as eng:
        eng.add_request("a", a, SamplingParams(max_tokens=8, ignore_eos=True))
        assert eng._seqs["a"].rows_pending == []  # nothing else runs: no reason to wait
        got = {"a": [t for o in eng.step() for t in o.new_token_ids], "b": []}
        eng.add_request("b", b, SamplingParams(max_tokens=4, ignore_eos=True))
        seq = eng._seqs["b"]
        assert seq.rows_pending and seq.warmed_to == len(b)  # both layers' read-aheads of b's prompt
        for source in eng.sources.values():
            source.drain_warm()
        before = {layer: s.stats()["misses"] for layer, s in eng.sources.items()}
        for out in eng.step():  # b's rows are in: it joins this step beside a's decode
            got[out.request_id] += out.new_token_ids
        assert eng.scheduler.last[0] == ("a", 1, False) and eng.scheduler.last[1][:2] == ("b", len(b))
        m = eng.metrics()  # b waited for its rows (counted once), and they were in before it joined
        assert (m.prompt_rows_waits, m.prompt_rows_timeouts) == (1, 0) and m.prompt_rows_wait_s > 0
        # a's decode token may miss; b's 20 prompt positions hit the cache
        assert all(s.stats()["misses"] - before[layer] <= s.num_heads for layer, s in eng.sources.items())
        for rid, outs in drain(eng).items():
            got[rid] += [t for o in outs for t in o.new_token_ids]
    assert [got["a"], got["b"]] == [expected(model_dir, [a], 8)[0], expected(model_dir, [b], 4)[0]]


def test_a_waiting_prompt_holds_back_no_one(model_dir, monkeypatch):
    """While a prompt's rows are being read, running sequences keep decoding; once nothing else runs the engine
    waits for the rows (not spinning), gives up after PROMPT_ROWS_MAX_WAIT_S, and the tokens are the model's own."""
    import tiergram.engine.read_ahead as read_ahead

    monkeypatch.setattr(read_ahead, "PROMPT_ROWS_MAX_WAIT_S", 0.2)
    a, b = prompts_of(4, 24, seed=19)
    with engine(model_dir, Placement("file", codec="fp32", cache_bytes=1 << 20)) as eng:
        eng.add_request("a", a, SamplingParams(max_tokens=3, ignore_eos=True))
        eng.step()
        eng.add_request("b", b, SamplingParams(max_tokens=3, ignore_eos=True))
        eng._seqs["b"].rows_pending.append(_NeverDone())  # a read-ahead that does not finish
        order, got, steps = [], {"a": [], "b": []}, 0
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
            order += [rid for rid, _, _ in eng.scheduler.last]
            steps += 1
        assert order == ["a", "a", "b", "b", "b"]  # a decoded on while b waited; b came once its wait was over
        m = eng.metrics()  # b joined with a read-ahead still unfinished: a timeout
        assert (m.prompt_rows_waits, m.prompt_rows_timeouts) == (1, 1) and m.prompt_rows_wait_s >= 0.2
        assert steps < 10  # the empty steps while b waited blocked on its rows instead of spinning
    assert got == {"a": expected(model_dir, [a], 3)[0][1:], "b": expected(model_dir, [b], 3)[0]}


class _NeverDone:
    """A read-ahead ticket that never finishes."""

    def done(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0)
        raise TimeoutError
