"""Model directories (config.json + model.safetensors + tokenizer.json; docs/model.md) and training checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tiergram.engram import RowSourceTable
from tiergram.hashing import NgramHasher
from tiergram.model.model import EngramLM

FORMAT = "tiergram-model/1"
CONFIG, WEIGHTS, TOKENIZER, CHECKPOINT = "config.json", "model.safetensors", "tokenizer.json", "checkpoint.pt"
TIERS = ("memory", "host", "file")
EXPORT_SUBDIR = "export"


def write_json(path: Path, obj: Any) -> None:
    """Write JSON crash-safely (temp file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a model directory, with a clear error when it is not one."""
    path = Path(model_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no {CONFIG}); train one with "
                                "`tiergram train --out DIR`")
    obj = json.loads(path.read_text())
    if obj.get("format") != FORMAT:
        raise ValueError(f"{path}: format is {obj.get('format')!r}, expected {FORMAT!r}")
    return obj


def table_keys(model: EngramLM) -> list[str]:
    """State-dict keys of the trainable Engram tables (left out of an exported directory)."""
    return [k for k in model.state_dict() if ".engram.table." in k]


def save_pretrained(model: EngramLM, out: str | os.PathLike, *, tokenizer: Any = None,
                    include_tables: bool = True, extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json: a tokenizers.Tokenizer or a path) to out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set() if include_tables else set(table_keys(model))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in skip}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            if Path(tokenizer).resolve() != (out / TOKENIZER).resolve():
                shutil.copyfile(tokenizer, out / TOKENIZER)
        else:
            tokenizer.save(str(out / TOKENIZER))
    config = {"format": FORMAT, "model": model.config.to_dict(),
              "hashing": model.hasher.config() if model.hasher is not None else None,
              "tables": None, **(extra or {})}
    write_json(out / CONFIG, config)
    return out


def load_tokenizer_of(model_dir: str | os.PathLike):
    """The directory's tokenizers.Tokenizer, or None when it has none."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / TOKENIZER
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def hasher_of(config: dict[str, Any], tokenizer: Any) -> NgramHasher | None:
    """Rebuild the saved hasher (verifying the tokenizer's compression digest against the saved one)."""
    hashing = config.get("hashing")
    if hashing is None:
        return None
    if hashing.get("compression") == "identity":
        return NgramHasher.from_config(hashing)
    if tokenizer is None:
        raise FileNotFoundError("the model hashes with a tokenizer compression but its directory has no "
                                f"{TOKENIZER}")
    return NgramHasher.from_config(hashing, tokenizer=tokenizer)


def load_pretrained(model_dir: str | os.PathLike, *, tier: str = "memory", device: str | torch.device = "cpu",
                    cache_bytes: int = 0) -> tuple[EngramLM, Any]:
    """(model in eval mode on device, tokenizer | None); tier host / file reads the exported table files."""
    from tiergram.model.model_dir import ModelDir
    from tiergram.store import TieredTable

    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r} (valid: {', '.join(TIERS)})")
    src = ModelDir.open(model_dir)
    if tier == "memory" and src.exported:
        raise ValueError(f"{model_dir} is an exported model (tables in table files): load it with tier "
                         "host or file, or load the training directory for tier memory")
    if tier != "memory" and not src.exported:
        if not (src.path / EXPORT_SUBDIR / CONFIG).is_file():
            raise ValueError(f"tier {tier} reads the Engram tables from table files, and {model_dir} has none: run "
                             f"`tiergram export {model_dir} --codec fp32|bf16|fp8_e4m3` first")
        src = ModelDir.open(src.path / EXPORT_SUBDIR)
    tables = {}
    for layer, name in (src.config.get("tables") or {}).items():
        store = TieredTable(src.path / name, tier=tier, cache_bytes=cache_bytes if tier == "file" else 0)
        check_table(store.manifest, src.hasher, int(layer), src.model_config.engram.dim, src.path / name)
        tables[int(layer)] = RowSourceTable(store)
    model = EngramLM(src.model_config, src.hasher, tables)
    model.load_state_dict(load_file(str(src.path / WEIGHTS)), strict=True)
    return model.to(device).eval(), src.tokenizer


def check_table(manifest: Any, hasher: NgramHasher, layer: int, dim: int, path: Path) -> None:
    """Raise if a table file does not serve this layer of this hasher (geometry, layer id, hashing)."""
    want_rows = tuple(hasher.head_sizes(layer))
    if manifest.layer_id != layer or tuple(manifest.head_rows) != want_rows or manifest.dim != dim:
        raise ValueError(f"{path}: table is for layer {manifest.layer_id} with heads {list(manifest.head_rows)} "
                         f"x {manifest.dim}, but the model's layer {layer} needs heads {list(want_rows)} x {dim}")
    if manifest.hashing is not None:
        have, want = manifest.hashing, hasher.config()
        for key in ("multipliers", "head_table_sizes", "compression_sha256", "max_ngram_size"):
            if have.get(key) != want.get(key):
                raise ValueError(f"{path}: the table was hashed with a different {key} than the model's hasher")


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """torch.save a training state crash-safely."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The training state saved by save_checkpoint."""
    return torch.load(path, map_location="cpu", weights_only=False)
