"""One of each thing: one device resolver, constants defined once (named torch-free in tiergram.settings, checked
against the modules that implement them), every table file called .tgram."""

from __future__ import annotations

import torch

from tiergram import settings
from tiergram.bench import common, gpu, serve_config, serve_stats
from tiergram.cache import POLICIES
from tiergram.cli import model as cli_model
from tiergram.cli import serve as cli_serve
from tiergram.cli import study as cli_study
from tiergram.engine import config as engine_config
from tiergram.format import CODEC_IDS
from tiergram.model import checkpoint
from tiergram.tiers import file as file_tier
from tiergram.tiers.device import resolve_device


def test_auto_device_resolves_like_none() -> None:
    """'auto' is the current GPU, or the CPU without one; the training command uses the same resolver."""
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == resolve_device(None) == want
    assert resolve_device("cpu") == torch.device("cpu")
    assert cli_serve._device("auto") == str(want)


def test_constants_have_one_owner() -> None:
    """Imported from their owner, not copied."""
    assert engine_config.FILE_MODES is settings.FILE_MODES and engine_config.PLACEMENTS is settings.PLACEMENTS
    assert gpu.HOST_TARGET is common.HOST_TARGET and serve_stats.HOST_TARGET is common.HOST_TARGET
    assert serve_stats.FILE_TARGET is common.FILE_TARGET
    assert cli_study.TIERS is cli_model.TIERS


def test_settings_names_agree_with_their_implementations() -> None:
    """settings names codecs, file modes and cache policies torch-free (engine.config imports them); the modules
    that implement them agree, and the CLI offers only what the owners accept."""
    assert set(serve_config.PLACEMENTS) <= set(settings.PLACEMENTS)  # `bench serve` may offer fewer
    assert set(serve_config.DEFAULT_PLACEMENTS) <= set(serve_config.PLACEMENTS)
    assert set(settings.CACHE_POLICIES) == set(POLICIES)
    assert set(settings.CODECS) == set(CODEC_IDS) and set(settings.FILE_MODES) == set(file_tier.FILE_MODES)
    assert tuple(cli_model.TIERS) == tuple(checkpoint.TIERS)


def test_one_table_file_extension() -> None:
    """export writes the same .tgram files the README, the CLI and the benchmarks name."""
    from tiergram.model.export import TABLE_SUFFIX, table_filename

    assert TABLE_SUFFIX == ".tgram" and table_filename(14, "fp8_e4m3") == "engram_layer14.fp8_e4m3.tgram"
