"""The host-memory budget of a server: split over the Engram layers, host tables must fit, file caches are sized."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from tiergram.cli import build_parser
from tiergram.cli.serve import engine_config
from tiergram.engine import EngineConfig, LLMEngine, Placement, SamplingParams
from tiergram.format import TableFile
from tiergram.model.init_model import init_model
from tiergram.store.table import STAGING_RESERVE_BYTES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<|pad|>", *"a b c d e f g h".split()])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = WhitespaceSplit()
    root = tmp_path_factory.mktemp("hm")
    tok.save(str(root / "tokenizer.json"))
    return init_model(root / "model", table_gib=0.004, backbone="tiny", tokenizer=root / "tokenizer.json",
                      progress=False)


def table_bytes(model_dir) -> list[int]:
    return [TableFile.open(p).manifest.data_bytes for p in sorted(model_dir.glob("*.tgram"))]


def test_budget_is_split_evenly_over_the_layers():
    cfg = EngineConfig("m", "file", host_memory_bytes=300 * MIB)
    got = cfg.placements_for([1, 2])
    assert {layer: p.host_memory_bytes for layer, p in got.items()} == {1: 150 * MIB, 2: 150 * MIB}
    own = EngineConfig("m", {1: Placement("file", host_memory_bytes=7 * MIB), 2: "host"}, host_memory_bytes=300 * MIB)
    got = own.placements_for([1, 2])
    assert got[1].host_memory_bytes == 7 * MIB and got[2].host_memory_bytes == 150 * MIB  # its own budget stays
    assert EngineConfig("m", "host").placements_for([1, 2])[1].host_memory_bytes is None  # no budget: no limit
    for bad in (0, -5, True, 1.5):
        with pytest.raises(ValueError, match="host_memory_bytes"):
            EngineConfig("m", "host", host_memory_bytes=bad)
        with pytest.raises(ValueError, match="host_memory_bytes"):
            Placement("host", host_memory_bytes=bad)


def test_host_placement_that_does_not_fit_is_refused_naming_the_sizes(model_dir):
    need = max(table_bytes(model_dir))
    budget = 2 * (need - 4096)  # each layer's share is a page short of the larger table
    with pytest.raises(ValueError, match=rf"host placement: .*needs {need:,} bytes .* more than its share of "
                                         rf"{budget // 2:,} bytes .*use placement 'file'"):
        LLMEngine(EngineConfig(str(model_dir), "host", host_memory_bytes=budget))


def test_host_placement_that_fits_serves(model_dir):
    budget = 2 * max(table_bytes(model_dir))
    with LLMEngine(EngineConfig(str(model_dir), "host", host_memory_bytes=budget)) as eng:
        assert len(eng.generate([[0, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]) == 3


def test_file_placement_sizes_its_cache_from_the_budget(model_dir):
    budget = 2 * (STAGING_RESERVE_BYTES + 2 * MIB)
    prompts, params = [[0, 2, 3, 4, 5, 6], [0, 7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True)
    with LLMEngine(EngineConfig(str(model_dir), "host")) as eng:
        want = eng.generate(prompts, params)
    with LLMEngine(EngineConfig(str(model_dir), "file", host_memory_bytes=budget)) as eng:
        for source in eng.sources.values():
            cache = source.stats()["cache"]
            assert 0 < cache["bytes"] <= 2 * MIB  # what staging and the index leave of the share
            assert source.stats()["host_memory_bytes"] == budget // 2
        assert eng.generate(prompts, params) == want


def test_explicit_cache_larger_than_the_budget_is_refused(model_dir):
    budget = 2 * (STAGING_RESERVE_BYTES + MIB)
    with pytest.raises(ValueError, match=r"a cache of 4,194,304 bytes for .* does not fit its share of "
                                         rf"{budget // 2:,} bytes"):
        LLMEngine(EngineConfig(str(model_dir), Placement("file", cache_bytes=4 * MIB), host_memory_bytes=budget))


def test_serve_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["serve", "m", "--placement", "file", "--host-memory", "12G"])
    assert engine_config(args).host_memory_bytes == 12 << 30
    assert engine_config(build_parser().parse_args(["serve", "m"])).host_memory_bytes is None
