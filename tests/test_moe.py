"""The MoE FFN option: a 1-expert MoE is the dense FFN, routing is deterministic and per token, the load-balancing
loss on a hand-computed case, forced routing, cached decode, training/export/eval, and the engine's greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from support import fixture_source, spread
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from tiergram.cli import main
from tiergram.corpus import BuildConfig, build_corpus, directory_source, train_tokenizer
from tiergram.corpus.sources import python_group
from tiergram.model import EngramLM, tiny_config
from tiergram.model.checkpoint import load_pretrained, save_pretrained
from tiergram.model.config import ModelConfig, MoESettings, preset, tiny_moe_config
from tiergram.model.generate import generate
from tiergram.model.model import SwiGLU
from tiergram.model.moe import MoE, aux_loss, load_balancing_loss, moe_layers, routing
from tiergram.model.train import TrainConfig, train

V = 97

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def one_expert(cfg: ModelConfig, layers: list[int]) -> ModelConfig:
    """cfg with a top-1 MoE of one expert as wide as the dense FFN, no shared expert, in `layers`."""
    return dataclasses.replace(cfg, moe=MoESettings(layers=layers, n_experts=1, top_k=1, expert_ffn=cfg.ffn))


def test_one_expert_moe_equals_the_dense_ffn():
    torch.manual_seed(0)
    dense = SwiGLU(16, 24)
    moe = MoE(16, MoESettings(layers=[0], n_experts=1, top_k=1, expert_ffn=24))
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 5, 16)
    assert torch.equal(moe(x), dense(x))
    # the whole model: dense blocks' FFN weights copied into the MoE's one expert give the same logits
    cfg = tiny_config(V)
    base = spread(EngramLM(cfg), 0)
    routed = EngramLM(one_expert(cfg, [0, 1]))
    state = {k.replace(".mlp.", ".mlp.experts.0."): v for k, v in base.state_dict().items()}
    missing = routed.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["blocks.0.mlp.router.weight", "blocks.1.mlp.router.weight"]
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(routed.eval()(ids)[0], base(ids)[0], atol=1e-5, rtol=0)


def test_routing_is_deterministic_and_per_token():
    torch.manual_seed(0)
    model = spread(EngramLM(tiny_moe_config(V)), 2)
    ids = torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(3))
    with routing(model, record=True) as layers:
        a, _ = model(ids)
        first = {i: m.last_choices.clone() for i, m in layers.items()}
        b, _ = model(ids)
        assert torch.equal(a, b) and all(torch.equal(first[i], m.last_choices) for i, m in layers.items())
        model(ids[1:2])  # one sequence alone routes exactly as it did inside the batch
        assert all(torch.equal(first[i][1:2], m.last_choices) for i, m in layers.items())
    choices = first[1]
    assert choices.shape == (3, 24, 2) and len(torch.unique(choices)) > 1  # several experts are used
    assert (choices[..., 0] != choices[..., 1]).all()  # top-2: two distinct experts per token
    assert all(m.last_choices is None or not m.record for m in moe_layers(model).values())


def test_load_balancing_loss_on_a_hand_computed_case():
    # 2 experts, top-1, router = identity: logits are the inputs themselves
    moe = MoE(2, MoESettings(layers=[0], n_experts=2, top_k=1, expert_ffn=4))
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    moe(x)
    p = math.e / (math.e + 1)  # softmax([1, 0])[0]
    f = [3 / 4, 1 / 4]  # three tokens go to expert 0, one to expert 1
    mean_p = [(3 * p + (1 - p)) / 4, (3 * (1 - p) + p) / 4]
    want = 2 * (f[0] * mean_p[0] + f[1] * mean_p[1])
    assert abs(moe.aux_loss.item() - want) < 1e-6
    # balanced assignments with uniform probabilities give exactly 1; everything on one expert gives E
    uniform = torch.full((4, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]]), 4).item() == pytest.approx(1.0)
    onehot = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert load_balancing_loss(onehot, torch.zeros(4, 1, dtype=torch.int64), 4).item() == pytest.approx(4.0)


def test_aux_loss_is_scaled_and_absent_for_a_dense_model():
    model = EngramLM(tiny_moe_config(V))
    model(torch.randint(0, V, (2, 8)))
    m = moe_layers(model)[1]
    assert aux_loss(model).item() == pytest.approx(0.01 * m.aux_loss.item())
    dense = EngramLM(tiny_config(V))
    dense(torch.randint(0, V, (2, 8)))
    assert aux_loss(dense) is None and moe_layers(dense) == {}
    model.eval()(torch.randint(0, V, (2, 8)))
    assert m.aux_loss is None and aux_loss(model) is None  # inference does not compute it


def test_forced_routing():
    model = spread(EngramLM(tiny_moe_config(V)), 4)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with routing(model, record=True) as layers:
        want, _ = model(ids)
        recorded = layers[1].last_choices.clone()
    with routing(model, force={1: recorded}):
        same, _ = model(ids)
    assert torch.equal(same, want)  # forcing the router's own choices changes nothing
    with routing(model, force={1: (recorded + 1) % 4}):
        other, _ = model(ids)
    assert not torch.allclose(other, want)
    assert moe_layers(model)[1].forced is None  # the context restores the router
    with pytest.raises(ValueError, match="MoE blocks are"):
        with routing(model, force={0: recorded}):
            pass


def test_cached_decode_equals_full_forward():
    model = spread(EngramLM(tiny_moe_config(V)), 6)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(7))
    full, _ = model(ids)
    a, past = model(ids[:, :11], use_cache=True)
    b, past = model(ids[:, 11:12], past)
    c, _ = model(ids[:, 12:], past)
    assert torch.allclose(torch.cat([a, b, c], 1), full, atol=1e-4, rtol=0)


def test_config_round_trip_and_errors():
    cfg = preset("small-moe", 1000)
    assert cfg.moe.layers == [1, 2, 3] and cfg.moe.top_k == 2 and cfg.moe.shared_ffn > 0
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "moe" not in tiny_config(V).to_dict()  # a dense model's config.json is as before
    assert cfg.without_engram().moe == cfg.moe
    assert cfg.moe.expert_params(cfg.d_model) == 3 * 8 * 3 * 256 * 176
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(tiny_config(V), moe=MoESettings(layers=[0], n_experts=2, top_k=3))
    with pytest.raises(ValueError, match="moe.layers"):
        dataclasses.replace(tiny_config(V), moe=MoESettings(layers=[5]))
    counts = EngramLM(tiny_moe_config(V)).num_params()
    moe = tiny_moe_config(V).moe
    dense_ffn = 3 * 64 * 176
    moe_ffn = moe.n_experts * 3 * 64 * moe.expert_ffn + 3 * 64 * moe.shared_ffn + 64 * moe.n_experts
    assert counts["backbone"] - EngramLM(tiny_config(V)).num_params()["backbone"] == moe_ffn - dense_ffn


# ------------------------------------------------------------------ training, export, evaluation, the engine

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run dir): tiny-moe trained for 6 steps on the fixture corpus plus modules with doctests."""
    mods = tmp_path_factory.mktemp("lib")
    for i in range(24):  # modules with short-output doctests: held-out ones give the doctest tasks
        (mods / f"mod{i:02d}.py").write_text(f'"""Module {i}: adds numbers and joins words.\n\n>>> {i} + 1\n{i + 1}\n'
                                             f'>>> sorted([{i}, 1, 0])\n{sorted([i, 1, 0])}\n"""\n\nX = {i}\n')
    src = [fixture_source(),
           directory_source("python-stdlib", mods, "PSF-2.0", group=python_group)]
    corpus = build_corpus(tmp_path_factory.mktemp("cache"), src, progress=False,
                          config=BuildConfig(validation=0.25, test=0.25))
    train_tokenizer(corpus, 512, progress=False)
    out = tmp_path_factory.mktemp("run") / "moe"
    cfg = TrainConfig(out=str(out), config="tiny-moe", tokens=6 * 4 * 64, batch_size=4, warmup_steps=2,
                      eval_tokens=300, corpus=str(corpus), device="cpu")
    summary = train(cfg, progress=False)
    assert summary["steps"] == 6 and summary["finished"]
    return corpus, out


def test_training_export_and_eval(trained, capsys):
    corpus, out = trained
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(np.isfinite(losses))
    model, tok = load_pretrained(out)
    assert set(moe_layers(model)) == {1} and json.loads((out / "config.json").read_text())["model"]["moe"]
    assert main(["export", str(out), "--codec", "fp32", "--quiet"]) == 0
    served, _ = load_pretrained(out, tier="host")
    x = torch.tensor([tok.encode("def f(x):\n    return x").ids])
    assert torch.allclose(served(x)[0], model(x)[0], atol=1e-5, rtol=0)
    served.engram_tables()[1].source.close()
    capsys.readouterr()
    assert main(["eval", str(out), "--corpus", str(corpus), "--max-tokens", "300", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert np.isfinite(result["all"]["loss"]) and result["all"]["tokens"] > 0


def test_engine_greedy_tokens_equal_the_models_own(tmp_path):
    from tiergram.engine import EngineConfig, LLMEngine, Placement, SamplingParams

    cfg = tiny_moe_config(V)
    cfg.engram.layers = [0, 1]
    cfg.moe.layers = [0, 1]
    model = spread(EngramLM(cfg), 8)
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{f"t{i}": i for i in range(2, V)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    path = save_pretrained(model, tmp_path / "moe", tokenizer=tokenizer)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 17, 30)]
    want = [generate(model, p, 10).ids for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLMEngine(EngineConfig(str(path), Placement("host", codec="fp32"), max_num_batched_tokens=16)) as eng:
        assert eng.generate(prompts, params) == want  # chunked prefill and mixed prefill/decode steps


# ------------------------------------------------------------------------------------ the reroute ablation

def test_reroute_ablation(trained, tmp_path, capsys):
    from tiergram.analysis.ablate import answer_losses, reroute, reroute_markdown
    from tiergram.analysis.doctest_task import document_tasks

    corpus, out = trained
    tok = load_pretrained(out)[1]
    cfg = dataclasses.replace(tiny_moe_config(tok.get_vocab_size()), n_layers=3)
    cfg.moe.layers = [1, 2]  # block 2 sees block 1's rerouted outputs through attention
    model = spread(EngramLM(cfg), 10)
    text = ">>> 1 + 1\n2\n>>> print('ab')\nab\n>>> sorted([3, 1, 2])\n[1, 2, 3]\n>>> len('abc')\n3\n"
    tasks = document_tasks(text, "test", "python-docs", "x.rst", max_output_chars=20)
    report = reroute(model, tok, tasks, batch_size=3)
    assert report.moe_layers == [1, 2] and report.tasks == 4
    assert list(report.loss) == ["on", "off", "off, forced all", "off, forced block 1", "off, forced block 2"]
    sums, counts = answer_losses(model, tok, tasks)  # the existing ablation's answer loss, in nats
    assert report.loss["on"].value == pytest.approx(sums["none"].sum() / counts.sum() / math.log(2), rel=1e-6)
    assert report.loss["off"].value == pytest.approx(sums["both"].sum() / counts.sum() / math.log(2), rel=1e-6)
    assert report.delta_vs_on["off"].value == pytest.approx(report.loss["off"].value - report.loss["on"].value)
    for b in ("1", "2"):
        changed = report.changed_sets[b].value
        assert 0 < changed < 1  # spread weights: some tokens reroute, most do not
        assert 0 < report.changed_assignments[b].value <= changed
    both = (report.changed_sets["1"].value + report.changed_sets["2"].value) / 2
    assert report.changed_sets["all"].value == pytest.approx(both)
    for name in ("off, forced all", "off, forced block 1", "off, forced block 2"):
        assert report.loss[name].value != report.loss["off"].value
    assert "Experts that reroute" in reroute_markdown(report)
    # the command, on the corpus's own held-out doctest tasks
    js = tmp_path / "reroute.json"
    assert main(["ablate", str(out), "--reroute", "--corpus", str(corpus), "--json", str(js), "--quiet"]) == 0
    result = json.loads(js.read_text())
    assert result["tasks"] == len(result["doctest_tasks"]) > 0 and "off, forced all" in result["loss"]
    assert "bits/token" in capsys.readouterr().out
    dense = save_pretrained(EngramLM(tiny_config(tok.get_vocab_size())), tmp_path / "dense", tokenizer=tok)
    with pytest.raises(ValueError, match="MoE blocks and Engram"):
        reroute(load_pretrained(dense)[0], tok, tasks)
