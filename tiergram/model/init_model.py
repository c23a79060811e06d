"""A serving model directory with a production Engram geometry and random weights (`tiergram init-model`): serving
speed depends on the table geometry, not on what the weights learnt."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from tiergram.engram import RowSourceTable
from tiergram.format import TableManifest, create_random_table
from tiergram.format.writer import free_bytes
from tiergram.hashing import NgramHasher
from tiergram.model.checkpoint import save_pretrained
from tiergram.model.config import EngramSettings, ModelConfig, preset
from tiergram.model.export import table_filename
from tiergram.model.model import EngramLM, make_hasher

CODEC = "fp8_e4m3"
PAGE_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class EngramGeometry:
    """The Engram geometry of a production model: orders, heads, row width and its full-size rows per head."""

    name: str
    max_ngram_size: int  # orders 2..max_ngram_size
    n_head_per_ngram: int
    dim: int  # D: fp8 values per row (+ D/32 ue8m0 scales)
    n_layers: int  # Engram layers
    conv_kernel: int  # 0: no short convolution
    full_rows_per_head: int  # rows per head of the full-size model

    @property
    def n_heads(self) -> int:
        """Heads per layer (all orders together)."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def rows_per_page(self) -> int:
        """Rows of one 4 KiB page of the table file."""
        return TableManifest(codec=CODEC, dim=self.dim, head_rows=(1,), page_size=PAGE_SIZE).rows_per_page

    def rows_per_head(self, table_bytes: int) -> int:
        """Rows per head so that every layer's table file together holds about table_bytes of pages."""
        pages_per_layer = table_bytes // PAGE_SIZE // self.n_layers
        return max(1, pages_per_layer * self.rows_per_page // self.n_heads)


# DeepSeek-V4.1-Flash: 264-byte rows (256 FP8-e4m3 values + 8 ue8m0 scales), ~384M rows per layer, no short conv
GEOMETRIES = {
    "deepseek-v4.1": EngramGeometry("deepseek-v4.1", max_ngram_size=4, n_head_per_ngram=8, dim=256, n_layers=2,
                                    conv_kernel=0, full_rows_per_head=16_000_000),
}


class _NoRows:
    """Stands in for the tables while the model is built and saved: they are written as table files instead."""

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("init_model's placeholder table serves no rows")


def check_room(out: Path, tables: int, need: int, replaced: int = 0) -> None:
    """OSError when the disk under out lacks need bytes (replaced: bytes of files overwritten, counted as free)."""
    free = free_bytes(out) + replaced
    if need > free:
        raise OSError(f"{out}: the {tables} tables need {need:,} bytes ({need / 2**30:.2f} GiB) but the disk has "
                      f"{free:,} bytes ({free / 2**30:.2f} GiB) free; nothing was written")


def write_servable_dir(out: Path, mconfig: ModelConfig, hasher: NgramHasher, tokenizer: Path,
                       tables: dict[int, str], extra: dict[str, Any], *, seed: int = 0) -> None:
    """Beside table files in out: a random backbone, tokenizer.json and config.json naming the tables (+ extra)."""
    torch.manual_seed(seed)
    layers = mconfig.engram.layers if mconfig.engram is not None else []
    model = EngramLM(mconfig, hasher, {layer: RowSourceTable(_NoRows()) for layer in layers}).eval()
    names = {str(layer): name for layer, name in tables.items()}
    save_pretrained(model, out, tokenizer=tokenizer, include_tables=False,
                    extra={**extra, "tables": names, "table_codec": CODEC})


def init_model(out: str | os.PathLike, *, table_gib: float, backbone: str = "small",
               tokenizer: str | os.PathLike | None = None, seed: int = 0, table_std: float = 0.02,
               progress: bool = True) -> Path:
    """Write a servable directory: a random backbone preset and random DeepSeek-V4.1-geometry fp8_e4m3 tables of
    about table_gib GiB."""
    from tiergram.corpus import PAD, ensure_corpus
    from tiergram.corpus.tokenizer import load_tokenizer, tokenizer_file

    geo = GEOMETRIES["deepseek-v4.1"]
    if not table_gib > 0:
        raise ValueError(f"--table-gib must be > 0, got {table_gib}")
    tok_path = tokenizer_file(tokenizer if tokenizer is not None else ensure_corpus(progress=progress),
                              "give --tokenizer a tokenizer.json, or leave it out for the cache corpus's")
    tok = load_tokenizer(tok_path)
    pad = tok.token_to_id(PAD)
    if pad is None:
        raise ValueError(f"{tok_path}: the tokenizer has no {PAD} token to left-pad n-grams with")
    base = preset(backbone, tok.get_vocab_size())
    if base.n_layers < geo.n_layers:
        raise ValueError(f"backbone {backbone!r} has {base.n_layers} blocks: too few for {geo.n_layers} Engram layers")
    # the preset's own Engram blocks where it has enough (small: 1 and 2), else the last blocks
    layers = sorted(base.engram.layers)[: geo.n_layers] if base.engram is not None else []
    if len(layers) < geo.n_layers:
        layers = list(range(base.n_layers - geo.n_layers, base.n_layers))
    rows = geo.rows_per_head(int(table_gib * 2**30))
    engram = EngramSettings(layers=list(layers), max_ngram_size=geo.max_ngram_size,
                            n_head_per_ngram=geo.n_head_per_ngram, engram_vocab_size=[rows] * (geo.max_ngram_size - 1),
                            dim=geo.dim, conv_kernel=geo.conv_kernel, seed=seed, pad_id=pad)
    mconfig = dataclasses.replace(base, engram=engram)
    hasher = make_hasher(mconfig, tokenizer=tok)
    manifests = {layer: TableManifest(codec=CODEC, dim=geo.dim, head_rows=tuple(hasher.head_sizes(layer)),
                                      page_size=PAGE_SIZE, layer_id=layer, hashing=hasher.config(),
                                      provenance={"tool": "tiergram init-model", "geometry": geo.name,
                                                  "init": f"normal(0, {table_std}^2), fp8 pools",
                                                  "seed": seed + layer})
                 for layer in layers}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    need = sum(m.encode()[1] + m.data_bytes for m in manifests.values())
    check_room(out, len(layers), need)
    t0 = time.perf_counter()
    files = {layer: table_filename(layer, CODEC) for layer in layers}
    for layer, m in manifests.items():
        create_random_table(out / files[layer], m, seed=seed + layer, std=table_std, progress=progress)
    write_s = time.perf_counter() - t0
    info: dict[str, Any] = {"geometry": geo.name, "backbone": backbone, "random_weights": True,
                            "table_gib": table_gib, "rows_per_head": rows, "table_bytes": need,
                            "tables_write_s": round(write_s, 3), "seed": seed}
    write_servable_dir(out, mconfig, hasher, tok_path, files, {"init": info}, seed=seed)
    return out
