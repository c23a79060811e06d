"""`tiergram init-model`: a DeepSeek-V4.1-geometry model directory with random weights that the engine serves."""

from __future__ import annotations

import json

import pytest
from support import offline_default_sources, word_tokenizer

from tiergram.cli import main
from tiergram.engine import EngineConfig, LLMEngine, SamplingParams
from tiergram.format import TableFile
from tiergram.model.init_model import GEOMETRIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the a of and to in is it that for on with as was at by an be this from or".split()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", WORDS)


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory, tokenizer_file):
    out = tmp_path_factory.mktemp("v41") / "model"
    rc = main(["init-model", str(out), "--table-gib", "0.004",
               "--backbone", "tiny", "--tokenizer", str(tokenizer_file), "--quiet"])
    assert rc == 0
    return out


def test_directory_has_the_v41_geometry(v41_dir):
    config = json.loads((v41_dir / "config.json").read_text())
    e = config["model"]["engram"]
    assert e["max_ngram_size"] == 4 and e["n_head_per_ngram"] == 8 and e["dim"] == 256 and e["conv_kernel"] == 0
    assert len(e["layers"]) == 2 and config["table_codec"] == "fp8_e4m3"
    assert config["init"]["random_weights"] is True and config["init"]["geometry"] == "deepseek-v4.1"
    total = 0
    for layer, name in config["tables"].items():
        t = TableFile.open(v41_dir / name)
        m = t.manifest
        assert m.layer_id == int(layer) and m.n_heads == 24 and m.row_bytes == 264 and m.codec == "fp8_e4m3"
        assert len(set(m.head_rows)) == 24  # a distinct prime per head
        assert m.hashing["head_table_sizes"][layer] == [list(m.head_rows[i:i + 8]) for i in (0, 8, 16)]
        assert t.verify() == []
        total += t.data_offset + m.data_bytes
    assert total == config["init"]["table_bytes"]
    # tiny tables: the distinct primes of 48 heads push the later heads up; at GiB sizes the total is within 1%
    assert 0.004 * 2**30 <= total < 0.006 * 2**30


def test_rows_per_head_scale_with_the_table_size():
    geo = GEOMETRIES["deepseek-v4.1"]
    assert geo.rows_per_page == 15 and geo.n_heads == 24
    rows = geo.rows_per_head(8 << 30)
    assert rows * 24 * 2 / 15 * 4096 == pytest.approx(8 << 30, rel=1e-4)  # 8 GiB of pages for both layers
    # V4.1-Flash's 189 GiB counts 264 B per row; 15 rows per 4 KiB page cost 3.4% more on disk
    assert geo.rows_per_head(189 << 30) == pytest.approx(geo.full_rows_per_head / 1.034, rel=0.01)


def test_host_and_file_placements_give_the_same_greedy_tokens(v41_dir):
    prompts = [[0, 2, 3, 4, 5, 6, 7, 2, 3], [0, 9, 10, 11], [0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for placement in ("host", {"kind": "file", "cache_bytes": 64 * 264}, "file"):
        with LLMEngine(EngineConfig(str(v41_dir), placement, max_num_seqs=4)) as eng:
            got[str(placement)] = eng.generate(prompts, params)
            assert all(len(t) == 12 for t in got[str(placement)])
    first, *rest = got.values()
    assert all(r == first for r in rest)


def test_refused_when_the_tables_do_not_fit_the_disk(tmp_path, tokenizer_file, capsys, monkeypatch):
    import tiergram.model.init_model as im

    monkeypatch.setattr(im, "free_bytes", lambda d: 1 << 20)
    rc = main(["init-model", str(tmp_path / "m"), "--table-gib", "0.01", "--backbone", "tiny",
               "--tokenizer", str(tokenizer_file), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "need" in err and "1,048,576 bytes" in err
    assert not any((tmp_path / "m").glob("*.tgram"))


def test_default_tokenizer_is_the_cache_corpus_s_built_when_missing(tmp_path, monkeypatch):
    """No --tokenizer on a fresh machine: the cache's corpus and tokenizer are built first (as demo does)."""
    corpus = offline_default_sources(monkeypatch, tmp_path)
    out = tmp_path / "m"
    assert main(["init-model", str(out), "--table-gib", "0.004", "--backbone", "tiny", "--quiet"]) == 0
    assert (corpus / "tokenizer.json").is_file() and (out / "tokenizer.json").is_file()
