"""The reference Engram LM: shapes, causality, K/V cache, row paths, sparse training, checkpoints, export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import fixture_corpus

from tiergram.cli import main
from tiergram.engram import RowSourceTable, TrainableTable
from tiergram.model import EngramLM, ModelConfig, tiny_config
from tiergram.model.checkpoint import load_pretrained, save_pretrained
from tiergram.model.generate import generate
from tiergram.model.train import TrainConfig, lr_at, make_optimizers, train

V = 97


def make_model(seed: int = 0, engram: bool = True, conv: bool = True) -> EngramLM:
    """A tiny identity-hashing model whose short convs and biases are non-zero (so they are exercised)."""
    cfg = tiny_config(V)
    cfg.engram.pad_id = 0
    if not engram:
        cfg = cfg.without_engram()
    torch.manual_seed(seed)
    model = EngramLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if conv and ("short_conv.conv" in name or name.endswith(".bias")):
                p.normal_(0, 0.3)
    return model.eval()


def ids(b: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the model alone

def test_forward_shapes_and_cache_layout():
    m = make_model()
    x = ids()
    logits, past = m(x)
    assert logits.shape == (2, 24, V) and logits.dtype == torch.float32 and past is None
    _, past = m(x, use_cache=True)
    assert past.length == 24 and len(past.kv) == 2
    assert past.kv[0][0].shape == (2, 2, 24, 16)  # [B, n_kv_heads, P, head_dim]
    assert set(past.conv) == {1} and past.conv[1].shape == (2, 9, 1, 64)  # (kernel-1) * dilation 3
    assert torch.equal(past.tokens, x[:, -2:])
    with pytest.raises(ValueError, match="max_seq"):
        m(ids(t=65))


def test_causality_with_engram_on():
    m = make_model()
    x = ids(t=32)
    base, _ = m(x)
    for j in (0, 5, 17, 31):
        y = x.clone()
        y[:, j] = (y[:, j] + 1) % V
        changed, _ = m(y)
        assert torch.equal(changed[:, :j], base[:, :j]), f"position {j} leaked backwards"
        assert not torch.allclose(changed[:, j:], base[:, j:])


def test_kv_cache_decode_equals_full_forward():
    m = make_model()
    x = ids(t=30)
    full, _ = m(x)
    for split in ([7] + [1] * 23, [1] * 30, [12, 5, 13]):
        past, outs, s = None, [], 0
        for n in split:
            logits, past = m(x[:, s:s + n], past, use_cache=True)
            outs.append(logits)
            s += n
        torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5, rtol=1e-5)


def test_greedy_generation_equals_recomputation():
    m = make_model()
    prompt = ids(b=1, t=6)[0].tolist()
    out = generate(m, prompt, 20, temperature=0.0)
    assert len(out.ids) == 20
    seq = torch.tensor([prompt + out.ids])
    logits, _ = m(seq)
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out.ids


def test_engram_rows_path_equals_internal_lookup():
    m = make_model()
    x = ids()
    want, _ = m(x)
    row_ids = m.engram_row_ids(x)
    rows = {layer: m.engram_tables()[layer](r) for layer, r in row_ids.items()}
    got, _ = m(x, engram_rows=rows)
    assert torch.equal(got, want)
    # decode with given rows: hashing continues from past.tokens
    _, past = m(x[:, :20], use_cache=True)
    step_ids = m.engram_row_ids(x[:, 20:21], past.tokens)
    assert torch.equal(step_ids[1], row_ids[1][:, 20:21])
    step, _ = m(x[:, 20:21], past, engram_rows={1: m.engram_tables()[1](step_ids[1])})
    torch.testing.assert_close(step[:, 0], want[:, 20], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="engram_rows"):
        m(x, engram_rows={1: rows[1][:, :3]})


def test_engram_disabled_equals_the_bare_backbone():
    m = make_model()
    bare = make_model(engram=False)
    missing, unexpected = bare.load_state_dict(m.state_dict(), strict=False)
    assert not missing and all(".engram." in k for k in unexpected)
    x = ids()
    off, _ = m(x, engram_enabled=False)
    assert torch.equal(off, bare(x)[0])
    assert torch.equal(m(x, engram_enabled=[])[0], off)
    assert not torch.allclose(m(x)[0], off)
    with pytest.raises(ValueError, match="Engram layers"):
        m(x, engram_enabled=[0])


def test_no_engram_model_has_no_engram_parameters():
    m = make_model(engram=False)
    assert m.hasher is None and m.engram_layers == []
    assert not any("engram" in n for n in m.state_dict())
    assert m.num_params()["tables"] == 0
    full = make_model()
    assert full.num_params()["backbone"] > m.num_params()["backbone"]
    assert full.num_params()["tables"] == sum(full.hasher.head_sizes(1)) * 32


def test_sparse_gradients_touch_only_the_rows_read():
    m = make_model().train()
    x = ids(b=1, t=10)
    logits, _ = m(x)
    F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    table = m.engram_tables()[1]
    grad = table.embedding.weight.grad
    assert grad.is_sparse
    touched = set((m.engram_row_ids(x)[1][0] + table.offsets).flatten().tolist())
    nonzero = set(grad.coalesce().indices()[0][grad.coalesce().values().abs().sum(1) > 0].tolist())
    assert nonzero and nonzero <= touched
    # SparseAdam moves exactly those rows
    cfg = TrainConfig(out="unused", config="tiny", tokens=1)
    _, sparse = make_optimizers(m, cfg)
    before = table.embedding.weight.detach().clone()
    sparse.step()
    moved = set((table.embedding.weight.detach() != before).any(1).nonzero()[:, 0].tolist())
    assert moved == set(grad.coalesce().indices()[0].tolist()) and moved <= touched


def test_a_few_steps_reduce_loss_on_a_repeated_batch():
    m = make_model().train()
    cfg = TrainConfig(out="unused", config="tiny", tokens=1, lr=3e-3)
    adamw, sparse = make_optimizers(m, cfg)
    x, y = ids(b=4, t=32, seed=3), ids(b=4, t=32, seed=4)
    losses = []
    for _ in range(30):
        logits, _ = m(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        adamw.zero_grad()
        sparse.zero_grad()
        loss.backward()
        adamw.step()
        sparse.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(out="unused", tokens=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1) and lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0) and lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="engram.layers"):
        ModelConfig(n_layers=2, engram={"layers": [2]})
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({"d_modle": 3})


# ------------------------------------------------------------------------- on a corpus, with the tokenizer

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The fixture corpus plus a few stdlib modules, with a 512-token tokenizer."""
    return fixture_corpus(tmp_path_factory.mktemp("cache"))


def run_config(out: Path, corpus: Path, **kw) -> TrainConfig:
    base = dict(out=str(out), config="tiny", tokens=8 * 4 * 64, batch_size=4, lr=3e-3, warmup_steps=2,
                checkpoint_every=3, eval_tokens=600, corpus=str(corpus))
    return TrainConfig(**{**base, **kw})


def log_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_train_builds_a_missing_tokenizer(tmp_path, capsys):
    """`tiergram train` on a corpus with no tokenizer yet trains one first (with progress) instead of stopping."""
    corpus = fixture_corpus(tmp_path / "cache", vocab_size=None)
    assert not (corpus / "tokenizer.json").exists()
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--corpus", str(corpus), "--config", "tiny", "--tokens", "512",
                 "--batch-size", "2", "--eval-tokens", "64", "--quiet"]) == 0
    assert (corpus / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] >= 1


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny model trained for 8 steps on the fixture corpus (uninterrupted)."""
    out = tmp_path_factory.mktemp("run") / "full"
    summary = train(run_config(out, corpus), progress=False)
    assert summary["steps"] == 8 and summary["finished"]
    return out


def test_training_writes_model_log_and_eval(trained):
    assert (trained / "model.safetensors").is_file() and (trained / "tokenizer.json").is_file()
    losses = log_losses(trained)
    assert len(losses) == 8 and all(np.isfinite(losses))
    result = json.loads((trained / "eval.json").read_text())
    assert result["split"] == "validation" and result["engram_enabled"]
    for r in result["categories"].values():
        assert 0 < r["tokens"] <= 600 and r["ci95"][0] <= r["loss"] <= r["ci95"][1]
    config = json.loads((trained / "config.json").read_text())
    assert config["hashing"]["compression"] == "lookup" and config["training"]["steps"] == 8


def test_resume_continues_identically(trained, corpus, tmp_path):
    out = tmp_path / "resumed"
    first = train(run_config(out, corpus), progress=False, stop_after=5, evaluate_at_end=False)
    assert first["steps"] == 5 and not first["finished"]
    again = train(TrainConfig.load(out), resume=True, progress=False, evaluate_at_end=False)
    assert again["steps"] == 8 and again["finished"]
    assert log_losses(out) == log_losses(trained)  # bit-identical on the CPU
    a, _ = load_pretrained(out)
    b, _ = load_pretrained(trained)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    with pytest.raises(FileExistsError, match="--resume"):
        train(run_config(out, corpus), progress=False)


def test_save_load_round_trip_with_tokenizer_hashing(trained, tmp_path):
    model, tok = load_pretrained(trained)
    assert isinstance(model.engram_tables()[1], TrainableTable) and tok is not None
    x = torch.tensor([tok.encode("def insort(a, x):\n    return bisect(a, x)").ids])
    want, _ = model(x)
    save_pretrained(model, tmp_path / "copy", tokenizer=tok)
    again, _ = load_pretrained(tmp_path / "copy")
    assert torch.equal(again(x)[0], want)
    assert np.array_equal(again.hasher.lookup, model.hasher.lookup)


# (max logit error, relative row error) per codec: fp8_e4m3 keeps 3 mantissa bits, bf16 keeps 8
CODEC_TOLERANCE = {"fp32": (1e-5, 0.0), "bf16": (0.01, 2.0**-8), "fp8_e4m3": (0.1, 2.0**-4)}


@pytest.mark.parametrize("codec", list(CODEC_TOLERANCE))
def test_export_then_serve_from_table_files(trained, tmp_path, codec):
    from tiergram.format import TableFile

    out = tmp_path / f"export-{codec}"
    assert main(["export", str(trained), "--codec", codec, "--out", str(out), "--quiet"]) == 0
    model, tok = load_pretrained(trained)
    x = torch.tensor([tok.encode("import heapq\nheapq.heappush(items, (priority, task))").ids])
    want, _ = model(x)
    manifest = TableFile.open(out / f"engram_layer1.{codec}.tgram").manifest
    assert manifest.layer_id == 1 and manifest.codec == codec
    assert list(manifest.head_rows) == model.hasher.head_sizes(1)
    assert manifest.hashing == model.hasher.config()
    for tier in ("host", "file"):
        served, _ = load_pretrained(out, tier=tier)
        assert isinstance(served.engram_tables()[1], RowSourceTable)
        assert not any("table" in k for k in served.state_dict())
        tol, rel = CODEC_TOLERANCE[codec]
        row_ids = model.engram_row_ids(x)[1]
        rows, served_rows = model.engram_tables()[1](row_ids), served.engram_tables()[1](row_ids)
        assert ((served_rows - rows).abs() <= rel * rows.abs() + 1e-4 * (rel > 0)).all()
        got, _ = served(x)
        err = (got - want).abs().max().item()
        assert err <= tol, f"{codec} {tier}: max logit error {err}"
        assert (err > 0) == (codec != "fp32")  # the lossy codecs really were read from the files
        if codec == "fp32":  # decoding also matches through the K/V cache
            prompt = x[0, :8].tolist()
            assert generate(served, prompt, 10).ids == generate(model, prompt, 10).ids
        served.engram_tables()[1].source.close()


def test_export_lists_every_codec_and_old_exports_still_load(trained, tmp_path):
    """Two exports into one directory: config.json lists both codecs' .tgram files; the latest is the default.
    A directory exported before (.tgt files, only tables + table_codec) still loads and serves."""
    from tiergram.model.export import exported_tables
    from tiergram.model.model_dir import ModelDir

    out = tmp_path / "export"
    assert main(["export", str(trained), "--codec", "int8", "--out", str(out), "--quiet"]) == 0
    assert main(["export", str(trained), "--codec", "fp32", "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    layers = sorted(config["model"]["engram"]["layers"])
    assert config["table_codec"] == "fp32"
    assert config["tables"] == {str(layer): f"engram_layer{layer}.fp32.tgram" for layer in layers}
    assert exported_tables(config) == {c: {layer: f"engram_layer{layer}.{c}.tgram" for layer in layers}
                                       for c in ("fp32", "int8")}
    assert ModelDir.open(out).table_path(1, "int8") == out / "engram_layer1.int8.tgram"
    assert not list(out.glob("*.tgt"))
    # an old export: files named .tgt, config without tables_by_codec
    for layer in layers:
        (out / f"engram_layer{layer}.fp32.tgram").rename(out / f"engram_layer{layer}.fp32.tgt")
    del config["tables_by_codec"]
    config["tables"] = {str(layer): f"engram_layer{layer}.fp32.tgt" for layer in layers}
    (out / "config.json").write_text(json.dumps(config))
    assert ModelDir.open(out).table_path(layers[0], "fp32") == out / f"engram_layer{layers[0]}.fp32.tgt"
    served, tok = load_pretrained(out, tier="host")
    model, _ = load_pretrained(trained)
    x = torch.tensor([tok.encode("import heapq").ids])
    assert torch.allclose(served(x)[0], model(x)[0], atol=1e-5)
    for table in served.engram_tables().values():
        table.source.close()


def test_cli_eval_and_generate(trained, corpus, tmp_path, capsys):
    assert main(["export", str(trained), "--codec", "fp32", "--quiet"]) == 0  # into trained/export
    assert "exported to" in capsys.readouterr().out
    assert main(["eval", str(trained), "--corpus", str(corpus), "--max-tokens", "300", "--json", "--quiet"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert main(["eval", str(trained), "--corpus", str(corpus), "--max-tokens", "300", "--json", "--quiet",
                 "--no-engram-at-inference"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["engram_enabled"] and not off["engram_enabled"]
    assert on["all"]["tokens"] == off["all"]["tokens"] and on["all"]["loss"] != off["all"]["loss"]
    texts = []
    for tier in ("memory", "host", "file"):
        assert main(["generate", str(trained), "--prompt", "def ", "--max-tokens", "6", "--tier", tier]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("def ") and f"tier {tier}" in captured.err
        texts.append(captured.out)
    assert texts[0] == texts[1] == texts[2]  # fp32 tables: same greedy tokens from every tier
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2  # not a model directory: a clear error
