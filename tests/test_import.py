"""`tiergram import`: a checkpoint in DeepSeek-V4.1's published layout -> table files, byte for byte, and refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support import word_tokenizer
from tokenizers import Tokenizer

from tiergram.bench.v41_checkpoint import write_v41_checkpoint
from tiergram.cli import main
from tiergram.engine import EngineConfig, LLMEngine, SamplingParams
from tiergram.format import TableFile
from tiergram.hashing import NgramHasher
from tiergram.model.checkpoint import hasher_of, load_tokenizer_of, read_config
from tiergram.model.import_checkpoint import import_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# case and accent variants, so the Engram compression merges ids and a wrong token map changes the row ids
WORDS = "the The THE a A of and And to in is it that for on with as was at by an be this from or über Über".split()
VOCAB = 60  # engram_vocab_size: each head's prime search starts here (V4.1: 16,000,000)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", WORDS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer_file):
    return write_v41_checkpoint(tmp_path_factory.mktemp("ckpt") / "v41", tokenizer_file, engram_vocab_size=VOCAB,
                                pad_token_id=1, progress=False)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, ckpt):
    out = tmp_path_factory.mktemp("imported") / "model"
    assert main(["import", str(ckpt), str(out), "--backbone", "tiny", "--quiet"]) == 0
    return out


def tensor_bytes(ckpt, name: str) -> np.ndarray:
    """A checkpoint tensor's raw bytes, uint8 [rows, cols], read with the safetensors library."""
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(ckpt / shard), framework="pt") as f:
        return f.get_tensor(name).view(torch.uint8).numpy()


def table_rows(path) -> np.ndarray:
    """Every row of a table file, uint8 [total_rows, row_bytes], pages checked."""
    t = TableFile.open(path)
    m = t.manifest
    pages = t.read_data().reshape(m.n_pages, m.page_size)[:, : m.rows_per_page * m.row_bytes]
    return pages.reshape(-1, m.row_bytes)[: m.total_rows]


def copy_ckpt(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def edit_json(path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def test_every_row_is_weight_then_scale_byte_for_byte(ckpt, imported):
    config = read_config(imported)
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    assert sorted(int(k) for k in config["tables"]) == text["engram_layer_ids"] == [1, 14]
    for layer, rows in zip(text["engram_layer_ids"], text["engram_num_embeddings"], strict=True):
        path = imported / config["tables"][str(layer)]
        assert TableFile.open(path).verify() == []
        weight = tensor_bytes(ckpt, f"layers.{layer}.engram.embed.weight")
        scale = tensor_bytes(ckpt, f"layers.{layer}.engram.embed.scale")
        got = table_rows(path)
        assert got.shape == (rows, 264) and weight.shape == (rows, 256) and scale.shape == (rows, 8)
        np.testing.assert_array_equal(got[:, :256], weight)
        np.testing.assert_array_equal(got[:, 256:], scale)


def test_manifest_carries_layout_hashing_and_provenance(ckpt, imported):
    config = read_config(imported)
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for layer, rows in zip(text["engram_layer_ids"], text["engram_num_embeddings"], strict=True):
        m = TableFile.open(imported / config["tables"][str(layer)]).manifest
        assert m.layer_id == layer and m.codec == "fp8_e4m3" and m.dim == 256 and m.n_heads == 24
        assert sum(m.head_rows) == rows and len(set(m.head_rows)) == 24
        assert m.hashing["layer_ids"] == [1, 14] and m.hashing["max_ngram_size"] == 4
        assert m.hashing["n_head_per_ngram"] == 8 and m.hashing["seed"] == 0 and m.hashing["pad_id"] == 1
        assert m.hashing["compressed_vocab_size"] == text["engram_compressed_vocab_size"]
        p = m.provenance
        assert p["tool"] == "tiergram import" and p["checkpoint"] == str(ckpt.resolve())
        assert p["weight"] == {"tensor": f"layers.{layer}.engram.embed.weight",
                               "file": index[f"layers.{layer}.engram.embed.weight"]}
        assert p["scale"] == {"tensor": f"layers.{layer}.engram.embed.scale",
                              "file": index[f"layers.{layer}.engram.embed.scale"]}
        assert p["weight"]["file"] != p["scale"]["file"]  # the layout splits them; the import followed the index
    assert config["import"]["backbone_imported"] is False and config["import"]["random_weights"] is True


def test_directory_hashes_as_v41_with_its_tokenizer(ckpt, imported, tokenizer_file):
    config = read_config(imported)
    hasher = hasher_of(config, load_tokenizer_of(imported))
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    want = NgramHasher([VOCAB] * 3, 4, 8, [1, 14], 1, 0, tokenizer=Tokenizer.from_file(str(tokenizer_file)))
    assert hasher.config() == want.config()
    assert hasher.compressed_vocab_size == text["engram_compressed_vocab_size"] < len(WORDS) + 2
    assert config["model"]["engram"]["layers"] == [1, 14] and config["model"]["n_layers"] >= 15
    assert config["model"]["engram"]["conv_kernel"] == 0


def test_host_and_file_serve_the_same_tokens(imported):
    prompts = [[0, 2, 3, 4, 5, 6, 7, 2, 3], [0, 9, 10, 11], [0, 3, 4, 3, 4, 3, 4]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = []
    for placement in ("host", "file"):
        with LLMEngine(EngineConfig(str(imported), placement, max_num_seqs=4)) as eng:
            got.append(eng.generate(prompts, params))
    assert got[0] == got[1] and all(len(t) == 8 for t in got[0])


def test_single_file_checkpoint_imports(ckpt, tmp_path):
    single = copy_ckpt(ckpt, tmp_path)
    index = json.loads((single / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, shard in index.items():
        with safe_open(str(single / shard), framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    for shard in set(index.values()):
        (single / shard).unlink()
    (single / "model.safetensors.index.json").unlink()
    save_file(tensors, str(single / "model.safetensors"))
    plan = import_checkpoint(single, tmp_path / "out", backbone="tiny", progress=False, log=lambda s: None)
    for li in plan.layers:
        got = table_rows(tmp_path / "out" / li.file_name)
        np.testing.assert_array_equal(got[:, :256], tensors[li.weight.name].view(torch.uint8).numpy())
        np.testing.assert_array_equal(got[:, 256:], tensors[li.scale.name].view(torch.uint8).numpy())


def refused(ckpt_dir, out, match: str, capsys) -> None:
    rc = main(["import", str(ckpt_dir), str(out), "--backbone", "tiny", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert match in err, err
    assert not list(out.glob("*.tgram*")) if out.exists() else True  # no table and no temp file left behind
    assert not (out / "config.json").exists()


def test_unknown_architecture_is_refused_by_name(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    edit_json(bad / "config.json", lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    refused(bad, tmp_path / "out", "['LlamaForCausalLM'] (model_type 'llama') is not one tiergram imports", capsys)


def test_missing_weight_or_scale_is_refused(ckpt, tmp_path, capsys):
    for tensor in ("layers.14.engram.embed.weight", "layers.1.engram.embed.scale"):
        bad = copy_ckpt(ckpt, tmp_path / tensor)
        edit_json(bad / "model.safetensors.index.json", lambda c, t=tensor: c["weight_map"].pop(t))
        refused(bad, tmp_path / tensor / "out", f"tensor '{tensor}' is not in the checkpoint", capsys)
    bad = copy_ckpt(ckpt, tmp_path / "moved")  # the index names a shard whose header lacks the tensor
    edit_json(bad / "model.safetensors.index.json",
              lambda c: c["weight_map"].update({"layers.1.engram.embed.scale": "model-00001-of-00003.safetensors"}))
    refused(bad, tmp_path / "moved" / "out", "its header has no such tensor", capsys)


def test_wrong_dtype_is_refused(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    shard = bad / "model-00001-of-00003.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8:8 + n] = raw[8:8 + n].replace(b"F8_E4M3", b"F8_E5M2")  # same length: the header still parses
    shard.write_bytes(bytes(raw))
    refused(bad, tmp_path / "out", "tensor 'layers.1.engram.embed.weight' is F8_E5M2, expected F8_E4M3", capsys)


def test_rows_that_disagree_with_the_config_are_refused(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    edit_json(bad / "config.json", lambda c: c["text_config"]["engram_num_embeddings"].__setitem__(0, 1000))
    refused(bad, tmp_path / "out", "has shape [2826, 256], expected [1000, 256]", capsys)


def test_heads_that_do_not_sum_to_the_tensor_rows_are_refused(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    edit_json(bad / "config.json", lambda c: c["text_config"].update(engram_vocab_size=50))
    refused(bad, tmp_path / "out", "(primes above engram_vocab_size 50) hold", capsys)


def test_truncated_shard_is_refused(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    shard = bad / "model-00002-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    refused(bad, tmp_path / "out", "the shard is truncated", capsys)


def test_tokenizer_that_compresses_differently_is_refused(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path)
    edit_json(bad / "config.json", lambda c: c["text_config"].update(engram_compressed_vocab_size=99092))
    refused(bad, tmp_path / "out", "engram_compressed_vocab_size is 99092", capsys)


def test_checkpoint_that_would_not_fit_the_disk_is_refused(ckpt, tmp_path, capsys, monkeypatch):
    import tiergram.model.init_model as im

    monkeypatch.setattr(im, "free_bytes", lambda d: 1 << 20)  # the room check of init-model and import
    refused(ckpt, tmp_path / "out", "but the disk has 1,048,576 bytes (0.00 GiB) free; nothing was written", capsys)


def test_rerun_after_kill_9_works_and_leaves_no_temp(ckpt, tmp_path):
    """A kill -9 mid-table leaves a temp file (no table); the rerun removes it and writes every table."""
    out = tmp_path / "out"
    slow = (
        "import sys, time\n"
        "import tiergram.format.writer as w\n"
        "import tiergram.model.import_checkpoint as imp\n"
        "w._CHUNK_PAGES = 4\n"
        "copier = imp.row_copier\n"
        "def slow_copier(*a):\n"
        "    fill = copier(*a)\n"
        "    def slow(pages, p0, n):\n"
        "        fill(pages, p0, n)\n"
        "        time.sleep(0.2)\n"
        "    return slow\n"
        "imp.row_copier = slow_copier\n"
        "imp.import_checkpoint(sys.argv[1], sys.argv[2], backbone='tiny', progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", slow, str(ckpt), str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.tgram.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(out.glob("*.tgram.tmp-*")), "the import never started writing a table"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(out.glob("*.tgram")) and not (out / "config.json").exists()
    import_checkpoint(ckpt, out, backbone="tiny", progress=False, log=lambda s: None)
    assert sorted(p.name for p in out.glob("*.tgram*")) == ["engram_layer1.fp8_e4m3.tgram",
                                                          "engram_layer14.fp8_e4m3.tgram"]
    assert all(TableFile.open(p).verify() == [] for p in out.glob("*.tgram"))


def test_benchmark_parts_copy_and_import_for_real(ckpt, tmp_path):
    """`bench import`'s two measured operations: the disk copy of the Engram tensors and the import in a child."""
    from tiergram.bench.import_bench import copy_limit, import_once
    from tiergram.format.safetensors_index import locate_tensors

    tensors = list(locate_tensors(ckpt, ["layers.1.engram.embed.weight", "layers.14.engram.embed.scale"]).values())
    assert copy_limit(tensors, tmp_path) > 0
    assert not list(tmp_path.iterdir())  # the copy is removed
    got = import_once(ckpt, tmp_path / "model")
    assert got["peak_rss_bytes"] > 50 << 20 and got["wall_s"] >= got["tables_s"] > 0
    assert got["table_bytes"] == sum(p.stat().st_size for p in (tmp_path / "model").glob("*.tgram"))


def test_only_the_shards_holding_engram_tensors_are_needed(ckpt, tmp_path):
    """A user downloads config, tokenizer, index and the Engram shards; the index may name shards not present."""
    part = copy_ckpt(ckpt, tmp_path)
    expert = {"layers.0.ffn.experts.0.w1.weight": "model-00009-of-00009.safetensors"}  # a shard not downloaded
    edit_json(part / "model.safetensors.index.json", lambda c: c["weight_map"].update(expert))
    plan = import_checkpoint(part, tmp_path / "out", backbone="tiny", progress=False, log=lambda s: None)
    assert [li.layer_id for li in plan.layers] == [1, 14]
    assert all(TableFile.open(tmp_path / "out" / li.file_name).verify() == [] for li in plan.layers)


def test_planner_takes_the_imported_directory(imported):
    from tiergram.plan.specs import model_from_dir

    spec = model_from_dir(imported)
    config = read_config(imported)
    rows = tuple(TableFile.open(imported / config["tables"][str(layer)]).manifest.total_rows for layer in (1, 14))
    assert (spec.engram.layers, spec.engram.heads, spec.engram.row_bytes) == ((1, 14), 24, 264)  # 256 values + scales
    assert spec.engram.rows_per_layer == rows and rows[0] != rows[1]
