"""Study tools on a tiny random-init model and the fixture corpus: probe, ablation, capacity, skip predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support import fixture_corpus, tiny_config_for

from tiergram.analysis.ablate import (
    SETTINGS,
    Setting,
    ablate,
    ablate_loss,
    answer_losses,
    keep_mask,
    setting_losses,
    task_ids,
)
from tiergram.analysis.capacity import analyze, spearman
from tiergram.analysis.doctest_task import answer_of, document_tasks, extract_tasks, is_finished
from tiergram.analysis.predictor import SkipPredictor, fit_predictor
from tiergram.analysis.probe import probe
from tiergram.analysis.skipping import skip_losses, skip_study
from tiergram.analysis.trace import EngramHooks, load_windows, trace
from tiergram.cli import main
from tiergram.corpus import (
    BuildConfig,
    build_corpus,
    directory_source,
    load_split,
    load_tokenizer,
)
from tiergram.corpus.sources import python_group
from tiergram.engram.sketch import CountMinSketch
from tiergram.model import EngramLM
from tiergram.model.checkpoint import save_pretrained
from tiergram.model.evaluate import batches, evaluate
from tiergram.model.model import make_hasher


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(corpus, model dir, model, tokenizer): a tiny random-init model whose convs and biases are non-zero."""
    corpus = fixture_corpus(tmp_path_factory.mktemp("cache"))
    tok = load_tokenizer(corpus / "tokenizer.json")
    cfg = tiny_config_for(tok)
    torch.manual_seed(0)
    model = EngramLM(cfg, make_hasher(cfg, tokenizer=tok))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "short_conv.conv" in name or name.endswith(".bias"):
                p.normal_(0, 0.3)
    model.eval()
    out = save_pretrained(model, tmp_path_factory.mktemp("model") / "tiny", tokenizer=tok)
    return corpus, out, model, tok


@pytest.fixture(scope="module")
def traces(setup):
    """Gate traces of the validation and test splits."""
    corpus, _, model, tok = setup
    out = {}
    for split in ("validation", "test"):
        _, windows = load_windows(model, corpus, split, tok, 1500)
        out[split] = trace(model, windows)
    return out


# ------------------------------------------------------------------------------------------------- probe

def test_trace_gates_in_unit_interval_and_rows_match_hashing(setup, traces):
    _, _, model, _ = setup
    tr = traces["validation"]
    assert tr.n == sum(len(w.inputs) for w in tr.windows)
    for layer in tr.layers:
        g = tr.gates[layer]
        assert g.shape == (tr.n, 1) and (g > 0).all() and (g < 1).all()
    w0 = tr.windows[int(tr.window[0])]
    rows = model.engram_row_ids(torch.from_numpy(w0.inputs)[None])
    s = tr.window_starts()[int(tr.window[0])]
    for layer in tr.layers:
        assert np.array_equal(tr.row_ids[layer][s:s + len(w0.inputs)], rows[layer][0].numpy())


def test_probe_attributes_every_position_to_one_ngram_per_order(setup, traces):
    _, _, _, tok = setup
    tr = traces["validation"]
    report = probe(tr, tok, min_count=2, top=5)
    assert len(report.layers) == len(tr.layers)
    for lp in report.layers:
        assert set(lp.attributed) == {2, 3}
        assert all(v == tr.n for v in lp.attributed.values())
        for order, rows in lp.top.items():
            means = [r.mean_gate for r in rows]
            assert means == sorted(means, reverse=True) and all(0 < m < 1 for m in means)
            assert all(r.count >= 2 and len(r.compressed) == order for r in rows)
            assert all(abs(sum(r.category_share.values()) - 1) < 1e-9 for r in rows)
            assert all("⟦" in e for r in rows for e in r.examples)
        assert lp.bottom[2][0].mean_gate <= lp.top[2][-1].mean_gate


# ---------------------------------------------------------------------------------------------- ablation

def test_ablation_none_is_plain_eval_and_both_is_engram_off(setup):
    corpus, _, model, tok = setup
    docs, windows = load_windows(model, corpus, "test", tok, 1200)
    sums = ablate_loss(model, windows)
    results = {r.setting: r for r in sums.results()}
    for name, enabled in (("none", True), ("both", False)):
        plain = evaluate(model, corpus, "test", tok, max_tokens_per_category=1200, engram_enabled=enabled,
                         progress=False)
        assert results[name].all_positions["all"].value == pytest.approx(plain["all"]["loss"], rel=1e-9)
    assert results["none"].delta_all["all"].value == 0.0
    assert results["prefill"].all_positions["all"].value != results["none"].all_positions["all"].value


def test_masked_forward_matches_the_switches(setup):
    _, _, model, _ = setup
    x = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    plain, _ = model(x)
    off, _ = model(x, engram_enabled=False)
    for keep, want in ((torch.ones(2, 40, dtype=torch.bool), plain), (torch.zeros(2, 40, dtype=torch.bool), off)):
        hooks = EngramHooks(record=False, keep={layer: keep for layer in model.engram_layers})
        with hooks.installed(model):
            got, _ = model(x)
        torch.testing.assert_close(got, want)
    # prefill off in teacher forcing = a cached forward with Engram off for the first half, on for the second
    _, past = model(x[:, :20], use_cache=True, engram_enabled=False)
    second, _ = model(x[:, 20:], past)
    prefill_off = keep_mask([20, 20], 40, SETTINGS[1])
    hooks = EngramHooks(record=False, keep={layer: prefill_off for layer in model.engram_layers})
    with hooks.installed(model):
        masked, _ = model(x)
    torch.testing.assert_close(masked[:, 20:], second, rtol=1e-4, atol=1e-4)
    loss = setting_losses(model, x, y, [20, 20], Setting("decode", True, False))
    assert loss.shape == (2, 40) and loss[:, -1].eq(0).all()


def test_ablate_report_with_generation(setup):
    corpus, _, model, tok = setup
    _, windows = load_windows(model, corpus, "test", tok, 600)
    tasks = document_tasks(">>> 1 + 1\n2\n>>> print('ab')\nab\n", "test", "python-docs", "x.rst", max_output_chars=20)
    report = ablate(model, windows, tok, tasks, max_new=4)
    assert [g.setting for g in report.generation] == [s.name for s in SETTINGS]
    assert all(0 <= g.exact_match.value <= 1 and g.mean_generated_tokens <= 4 for g in report.generation)
    assert list(report.answer_sums) == [s.name for s in SETTINGS] and len(report.answer_tokens) == len(tasks)
    # the answer loss with Engram off everywhere is the plain Engram-off loss of the answer tokens
    sums, counts = answer_losses(model, tok, tasks)
    for k, t in enumerate(tasks):
        prompt, answer = task_ids(tok, t, model.config.max_seq)
        seq = torch.tensor([prompt + answer])
        for name, enabled in (("none", True), ("both", False)):
            with torch.no_grad():
                logits, _ = model(seq[:, :-1], engram_enabled=enabled)
            nll = torch.nn.functional.cross_entropy(logits[0, len(prompt) - 1:], seq[0, len(prompt):], reduction="sum")
            assert sums[name][k] == pytest.approx(float(nll), rel=1e-5)
        assert counts[k] == len(answer) and tok.decode(answer).startswith("\n")


# --------------------------------------------------------------------------------------------- doctests

def test_doctest_parsing_and_scoring():
    text = "Intro.\n\n    >>> x = [3, 1]\n    >>> sorted(x)\n    [1, 3]\n    >>> 'a' * 30\n    " + "'" + "a" * 30 \
        + "'\n\nMore prose.\n\n    >>> len(x)\n    2\n"
    tasks = document_tasks(text, "test", "python-stdlib", "m.py")
    assert [t.expected for t in tasks] == ["[1, 3]", "2"]  # the 32-char output is left out
    assert tasks[0].prompt == "    >>> x = [3, 1]\n    >>> sorted(x)" and tasks[0].indent == 4
    assert tasks[1].prompt == "    >>> len(x)"  # prose ends the session: no earlier context
    assert answer_of("\n    [1, 3]\n\n>>>", 4) == "[1, 3]"
    assert answer_of("\n    [1, 3]\n    >>> y", 4) == "[1, 3]"
    assert answer_of("\n\n    [1, 3]", 4) == ""
    assert not is_finished("\n    [1, 3]\n") and is_finished("\n    [1, 3]\n\n") and is_finished("\n1\n    >>>")


def test_doctest_tasks_come_only_from_held_out_files(tmp_path):
    mods = tmp_path / "lib"
    mods.mkdir()
    for i in range(40):
        doc = f'"""Module {i} with enough words.\n\n>>> {i} + 1\n{i + 1}\n"""\n\nX = {i}\n'
        (mods / f"mod{i:02d}.py").write_text(doc)
    src = directory_source("python-stdlib", mods, "PSF-2.0", group=python_group)
    corpus = build_corpus(tmp_path / "cache", [src], progress=False, config=BuildConfig(validation=0.25, test=0.25))
    split_of = {d.path: s for s in ("train", "validation", "test") for d in load_split(corpus, s)}
    assert set(split_of.values()) == {"train", "validation", "test"}
    tasks = extract_tasks(corpus)
    held = sorted(p for p, s in split_of.items() if s != "train")
    assert sorted(t.path for t in tasks) == held
    assert all(split_of[t.path] == t.split != "train" for t in tasks)
    assert [t.expected for t in tasks if t.path == "mod07.py"] in ([], ["8"])


# ---------------------------------------------------------------------------------------------- capacity

def test_capacity_shares_sum_to_one(setup, traces):
    _, _, model, _ = setup
    tr = traces["validation"]
    report, points = analyze(model, tr.windows, tr)
    for lc in report.layers:
        assert sum(lc.access_share.values()) == pytest.approx(1.0)
        assert lc.accesses == tr.n * tr.row_ids[lc.layer].shape[1]
        assert 0 < lc.never_touched_fraction < 1 and lc.touched == sum(h.touched for h in lc.heads)
        assert 0 <= lc.shared_rows <= lc.touched
        count, gate = points[lc.layer]
        assert len(count) == lc.touched and ((gate > 0) & (gate < 1)).all()
        assert -1 <= report.hotness_gate["trained"][lc.layer].value <= 1


def test_rank_correlation():
    assert spearman(np.array([3.0, 1.0, 3.0, 2.0]), np.array([1.0, 0.0, 1.0, 0.5])) == pytest.approx(1.0)  # ties
    assert spearman(np.arange(10.0), np.arange(10.0) ** 3) == pytest.approx(1.0)
    assert spearman(np.arange(10.0), -np.arange(10.0)) == pytest.approx(-1.0)


# --------------------------------------------------------------------------------------------- predictor

def test_sketch_counts_and_leave_one_out():
    s = CountMinSketch(1024, 2)
    keys = np.array([5, 5, 5, 9, 123456])
    s.add(keys, np.array([0.2, 0.4, 0.6, 0.9, 0.1]))
    count, total = s.query(np.array([5, 9, 77]))
    assert list(count) == [3, 1, 0] and total[0] == pytest.approx(1.2) and total[1] == pytest.approx(0.9)
    count, total = s.query(np.array([5]), own_gates=np.array([0.6]))
    assert count[0] == 2 and total[0] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="power of two"):
        CountMinSketch(1000)


def test_predictor_thresholds_zero_and_one(setup, traces, tmp_path):
    _, _, model, _ = setup
    fit, held = traces["validation"], traces["test"]
    pred = fit_predictor(model, fit, sketch_width=1024)
    for layer in held.layers:
        g = pred.predict_gate(layer, held.row_ids[layer], held.pos)
        assert g.shape == (held.n,) and ((g >= 0) & (g < 1)).all()
        assert not pred.predict_skip(layer, held.row_ids[layer], held.pos, threshold=0.0).any()
        assert pred.predict_skip(layer, held.row_ids[layer], held.pos, threshold=1.0).all()
        ids = torch.from_numpy(held.row_ids[layer][:10]).view(2, 5, -1)
        mask = pred.predict_skip(layer, ids, torch.arange(5), threshold=0.5)
        assert isinstance(mask, torch.Tensor) and mask.shape == ids.shape and mask.dtype == torch.bool
    masks = {t: {layer: pred.predict_skip(layer, held.row_ids[layer], held.pos, threshold=t) for layer in held.layers}
             for t in (0.0, 1.0)}
    sums, counts = skip_losses(model, held, masks)
    plain = np.zeros_like(counts)
    off = np.zeros_like(counts)
    for idx, x, y in batches(held.windows, 8):
        for enabled, acc in ((True, plain), (False, off)):
            with torch.no_grad():
                logits, _ = model(x, engram_enabled=enabled)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            for j, i in enumerate(idx):
                acc[held.windows[i].doc] += float(loss.view(y.shape)[j].double().sum())
    np.testing.assert_allclose(sums[0.0], plain, rtol=1e-6)
    np.testing.assert_allclose(sums[1.0], off, rtol=1e-6)
    path = tmp_path / "pred.npz"
    pred.save(path)
    again = SkipPredictor.load(path)
    layer = held.layers[0]
    np.testing.assert_array_equal(again.predict_gate(layer, held.row_ids[layer], held.pos),
                                  pred.predict_gate(layer, held.row_ids[layer], held.pos))


def test_skip_study_curve(setup, traces):
    _, _, model, _ = setup
    report, _ = skip_study(model, traces["validation"], traces["test"], rates=(0.3, 0.6), sketch_width=1024,
                           methods=("predictor", "oracle", "random"), random_seeds=2)
    methods = {p.method for p in report.curve}
    assert methods == {"predictor", "oracle", "random"}
    for p in report.curve:
        assert p.rate in (0.3, 0.6) and p.loss.ci95[0] <= p.loss.value <= p.loss.ci95[1]
    assert report.target


# --------------------------------------------------------------------------------------------------- CLI

def test_cli_commands_write_their_outputs(setup, tmp_path, capsys):
    corpus, model_dir, _, _ = setup
    common = ["--corpus", str(corpus), "--quiet"]
    assert main(["probe", str(model_dir), "--max-tokens", "800", "--min-count", "2", "--top", "3",
                 "--json", str(tmp_path / "p.json"), "--markdown", str(tmp_path / "p.md"), *common]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["layers"][0]["layer"] == 1
    assert "## Layer 1" in (tmp_path / "p.md").read_text()
    assert main(["ablate", str(model_dir), "--max-tokens", "600", "--max-new", "3",
                 "--json", str(tmp_path / "a.json"), *common]) == 0
    assert "decode only" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "a.json").read_text())["loss"]) == 4
    assert main(["analyze", str(model_dir), "--max-tokens", "800", "--gate-tokens", "400",
                 "--plot", str(tmp_path / "c.png"), "--markdown", str(tmp_path / "c.md"), *common]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0 and "never touched" in (tmp_path / "c.md").read_text()
    assert main(["predictor", str(model_dir), "--max-tokens", "500", "--fit-tokens", "800", "--rates", "0.5",
                 "--methods", "predictor,random", "--sketch-width", "1024", "--save", str(tmp_path / "s.npz"),
                 "--plot", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json"), *common]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0 and SkipPredictor.load(tmp_path / "s.npz").layers
    assert main(["predictor", str(model_dir), "--rates", "1.5", *common]) == 2
