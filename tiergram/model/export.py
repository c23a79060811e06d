"""Export a trained model for serving: each Engram table -> a table file, everything else -> safetensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tiergram.format import CODEC_IDS, TableManifest, create_table, matrix_values
from tiergram.model.checkpoint import (
    CONFIG,
    EXPORT_SUBDIR,
    TOKENIZER,
    WEIGHTS,
    load_pretrained,
    read_config,
    save_pretrained,
)

TABLE_SUFFIX = ".tgram"  # every table file tiergram writes (exports before this release wrote .tgt)


def table_filename(layer: int, codec: str) -> str:
    """engram_layer{L}.{codec}.tgram"""
    return f"engram_layer{layer}.{codec}{TABLE_SUFFIX}"


def exported_tables(config: dict[str, Any]) -> dict[str, dict[int, str]]:
    """{codec: {layer: table file name}} an exported config.json lists (`tables_by_codec`, else `tables`)."""
    if config.get("tables_by_codec"):
        return {c: {int(k): v for k, v in files.items()} for c, files in config["tables_by_codec"].items()}
    if config.get("tables"):
        return {config.get("table_codec") or "": {int(k): v for k, v in config["tables"].items()}}
    return {}


def export_model(model_dir: str | os.PathLike, codec: str = "fp8_e4m3", out: str | os.PathLike | None = None,
                 *, progress: bool = True) -> Path:
    """Write out (default DIR/export): the weights without the tables, tokenizer.json and a table file per layer."""
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r} (valid: {', '.join(CODEC_IDS)})")
    model_dir = Path(model_dir)
    out = Path(out) if out is not None else model_dir / EXPORT_SUBDIR
    model, _ = load_pretrained(model_dir, tier="memory")
    if model.hasher is None:
        raise ValueError(f"{model_dir} has no Engram layers: there are no tables to export")
    source = read_config(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = exported_tables(read_config(out)) if (out / CONFIG).is_file() else {}
    hashing = model.hasher.config()
    files = {}
    for layer, table in model.engram_tables().items():
        weight, _ = table.weight_for_export()
        manifest = TableManifest(codec=codec, dim=weight.shape[1], head_rows=tuple(table.head_sizes), layer_id=layer,
                                 hashing=hashing, provenance={"tool": "tiergram export", "model": str(model_dir),
                                                              "training": source.get("training")})
        name = table_filename(layer, codec)
        create_table(out / name, manifest, matrix_values(weight.numpy()), progress=progress)
        files[str(layer)] = name
    trained = (model_dir / WEIGHTS).stat().st_mtime_ns
    by_codec = {c: {str(k): v for k, v in names.items()} for c, names in previous.items()
                if c != codec and all((out / n).is_file() and (out / n).stat().st_mtime_ns >= trained
                                      for n in names.values())}
    by_codec[codec] = files
    tokenizer = model_dir / TOKENIZER
    save_pretrained(model, out, tokenizer=tokenizer if tokenizer.is_file() else None, include_tables=False,
                    extra={"training": source.get("training"), "exported_from": str(model_dir), "tables": files,
                           "table_codec": codec, "tables_by_codec": dict(sorted(by_codec.items()))})
    return out
