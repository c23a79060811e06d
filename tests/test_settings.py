"""serve's one configuration: a TOML or JSON file of typed sections, checked key by key, flags on top; per-layer
placement from --engram-config, served end to end."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from support import spread
from test_engine import EOS, GREEDY, V, prompts_of
from test_server import complete, serve_subprocess
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from tiergram import settings
from tiergram.cli import build_parser
from tiergram.cli.serve import engine_config, settings_of
from tiergram.engine import EngineConfig, LLMEngine, Placement
from tiergram.model import EngramLM, tiny_config
from tiergram.model.checkpoint import save_pretrained

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model of three blocks with Engram at blocks 1 and 2."""
    cfg = tiny_config(V)
    cfg.n_layers, cfg.engram.layers = 3, [1, 2]
    vocab = {"<|endoftext|>": EOS, "<|pad|>": 1, **{f"t{i}": i for i in range(2, V)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return save_pretrained(spread(EngramLM(cfg), seed=3), tmp_path_factory.mktemp("settings") / "model",
                           tokenizer=tokenizer)


def args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


TWO_TIERS = '{"layers": {"1": {"tier": "host"}, "2": {"tier": "file", "cache_bytes": "16K", "cache_policy": "lfu"}}}'


def test_engram_config_places_two_layers_on_two_tiers_with_the_tokens_of_all_host(model_dir):
    """--engram-config: layer 1 from host memory, layer 2 from the file tier behind its own cache; the engine
    serves the greedy tokens of the all-host engine."""
    prompts = prompts_of(3, 20, 9, 33)
    with LLMEngine(engine_config(args(str(model_dir)))) as eng:
        assert {p.kind for p in eng.placements.values()} == {"host"}
        want = eng.generate(prompts, GREEDY)
    cfg = engine_config(args(str(model_dir), "--engram-config", TWO_TIERS, "--cache-policy", "lru"))
    assert cfg.placement == {1: Placement("host"), 2: Placement("file", cache_bytes=16384, cache_policy="lfu")}
    with LLMEngine(cfg) as eng:
        assert eng.placements[1].kind == "host" and eng.placements[2].kind == "file"
        assert eng.generate(prompts, GREEDY) == want
        read = eng.metrics().engram["per_layer"]
        assert set(read[1]["bytes_read"]) == {"host"} and "file" in read[2]["bytes_read"]


def test_tiergram_serve_takes_the_engram_config_from_a_file(model_dir, tmp_path):
    """End to end: `tiergram serve --engram-config FILE` and the all-host server complete alike."""
    path = tmp_path / "engram.json"
    path.write_text(TWO_TIERS)
    body = {"prompt": "t5 t9 t33 t2", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    texts = []
    for extra in ((), ("--engram-config", str(path))):
        with serve_subprocess(model_dir, *extra) as (_, base):
            r = complete(base, **body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            engram = httpx.get(f"{base}/metrics").text
    assert texts[0] == texts[1] and texts[0]
    assert 'tier="file"' in engram  # the second server read layer 2's rows from its file tier


def test_the_config_file_holds_every_setting_and_flags_override_it(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TIERGRAM_API_KEY", raising=False)
    toml = tmp_path / "serve.toml"
    toml.write_text('[engine]\nplacement = "file"\ncache_bytes = "64K"\ncodec = "fp32"\nmax_waiting = 9\n'
                    'read_ahead = false\n\n[server]\nport = 9001\nmax_body_bytes = "2M"\ncors_origins = ["https://a"]\n'
                    'header_timeout = 2.5\n\n[engram.layers.2]\ntier = "host"\n\n[engram.layers.1]\ntier = "file"\n')
    s = settings_of(args(str(model_dir), "--config", str(toml), "--max-num-seqs", "3", "--port", "9002"))
    assert (s.engine.placement, s.engine.cache_bytes, s.engine.max_waiting, s.engine.max_num_seqs) == \
        ("file", 65536, 9, 3)
    assert (s.server.port, s.server.max_body_bytes, s.server.cors_origins, s.server.header_timeout) == \
        (9002, 2 << 20, ["https://a"], 2.5)
    cfg = EngineConfig.from_settings(s, model_dir)
    assert cfg.placement == {1: Placement("file", cache_bytes=65536, codec="fp32", read_ahead=False),
                             2: Placement("host", codec="fp32", read_ahead=False)}
    assert (cfg.max_waiting, cfg.max_num_seqs) == (9, 3)
    # --engram-config replaces the file's [engram]; the same settings read back from JSON are equal
    s2 = settings_of(args(str(model_dir), "--config", str(toml), "--engram-config", '{"layers": {}}'))
    assert EngineConfig.from_settings(s2, model_dir).placement == Placement("file", cache_bytes=65536, codec="fp32",
                                                              read_ahead=False)
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(s.to_dict()))
    assert settings.load(path) == s


@pytest.mark.parametrize(("text", "error"), [
    ("[engine]\nmax_num_seqs = 0\n", r"serve.toml: \[engine\]: max_num_seqs: must be an integer >= 1, got 0"),
    ("[engine]\nmax_num_seqs = \"8\"\n", r"\[engine\]: max_num_seqs: expected an integer, got '8'"),
    ("[engine]\nplacement = \"ssd\"\n", r"\[engine\]: placement: 'ssd' is not one of device, host"),
    ("[engine]\nplacement = \"mooncake\"\n", r"\[engine\]: placement 'mooncake' needs mooncake_master"),
    ("[engine]\ncache_bytes = \"lots\"\n", r"\[engine\]: cache_bytes: expected a size like"),
    ("[server]\nmax_stop = 0\n", r"\[server\]: max_stop: must be an integer >= 1, got 0"),
    ("[server]\nbody_timeout = 0\n", r"\[server\]: body_timeout: must be > 0"),
    ("[server]\nspeed = 1\n", r"\[server\]: unknown key 'speed'"),
    ("[cache]\nx = 1\n", r"unknown sections \['cache'\]"),
    ("[engram.layers.1]\ncache_bytes = 5\n", r"\[engram\] layer 1: .*tier"),
    ("[engram.layers.1]\ntier = \"host\"\ncache_bytes = 5\n", r"layer 1: a host layer holds its whole table"),
    ("[engram.layers.x]\ntier = \"host\"\n", r"\[engram\]: layer 'x' is not a layer index"),
    ("[engine\n", r"serve.toml: not a readable TOML or JSON"),
])
def test_a_bad_key_is_named_with_its_file_and_section(tmp_path, text, error):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(settings.ConfigError, match=error):
        settings.load(path)


def test_a_bad_setting_is_one_line_from_the_command(model_dir, tmp_path, capsys):
    from tiergram.cli import main

    path = tmp_path / "serve.toml"
    path.write_text("[server]\nmax_reading = -1\n")
    with pytest.raises(SystemExit, match=r"tiergram serve: error: .*serve.toml: \[server\]: max_reading: must be an "
                                         r"integer >= 1"):
        main(["serve", str(model_dir), "--config", str(path)])
    with pytest.raises(SystemExit, match=r"--engram-config: not valid JSON"):
        main(["serve", str(model_dir), "--engram-config", "{layers: 1}"])
    with pytest.raises(SystemExit, match=r"placement must name exactly the Engram layers \[1, 2\]"):
        main(["serve", str(model_dir), "--engram-config", '{"layers": {"1": {"tier": "host"}}}'])


def test_serve_lists_at_most_25_options():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    options = [line for line in help_text.splitlines() if line.lstrip().startswith("-")]
    assert len(options) <= 25, options
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    sweep = bench._subparsers._group_actions[0].choices["serve"].format_help()
    assert len([line for line in sweep.splitlines() if line.lstrip().startswith("-")]) <= 20


def test_an_engine_start_reads_each_config_json_once(model_dir, monkeypatch):
    """A ModelDir is read once and passed down: a serve start reads the trained directory's config.json once and
    its export's once (tables, tokenizer, hashing from the same object)."""
    cfg = engine_config(args(str(model_dir), "--engram-config", TWO_TIERS))
    LLMEngine(cfg).close()  # exports the tables first, if no earlier test did
    reads: Counter[str] = Counter()
    read_text = Path.read_text

    def counted(self: Path, *a, **kw) -> str:
        if self.name == "config.json":
            reads[str(self)] += 1
        return read_text(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", counted)
    with LLMEngine(engine_config(args(str(model_dir), "--engram-config", TWO_TIERS))) as eng:
        assert eng.model_dir.path == model_dir / "export" and eng.tokenizer is eng.model_dir.tokenizer
    assert reads == {str(model_dir / "config.json"): 1, str(model_dir / "export" / "config.json"): 1}
    reads.clear()
    with LLMEngine(replace(cfg, model_dir=str(model_dir / "export"))):  # an exported directory: one file, once
        pass
    assert reads == {str(model_dir / "export" / "config.json"): 1}
