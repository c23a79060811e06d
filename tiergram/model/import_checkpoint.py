"""`tiergram import`: a released checkpoint's Engram tables -> table files, byte for byte, in a servable directory
with a random backbone (docs/deepseek-v4.1.md). A V4.1 row's F8_E4M3 weight bytes then its F8_E8M0 scale bytes are
exactly a tiergram `fp8_e4m3` row."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.format import PageFiller, TableManifest, write_pages
from tiergram.format.safetensors_index import TensorLocation, locate_tensors
from tiergram.format.writer import chunk_pages
from tiergram.model.export import table_filename
from tiergram.model.init_model import CODEC, PAGE_SIZE, check_room, write_servable_dir

# config.json `architectures` entries (or `model_type`) whose Engram tables tiergram imports
ARCHITECTURES = {"DeepseekV41ForCausalLM": "deepseek-v4.1", "deepseek_v41": "deepseek-v4.1"}
FP8_BLOCK = 32  # values per ue8m0 scale
WEIGHT, SCALE = "layers.{layer}.engram.embed.weight", "layers.{layer}.engram.embed.scale"


@dataclass(frozen=True)
class EngramConfig:
    """The Engram fields of a checkpoint's config.json (top level or under `text_config`)."""

    architecture: str
    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # rows per layer
    max_ngram_size: int
    n_heads: int  # hash heads per n-gram order
    head_dim: int
    vocab_size: int  # engram_vocab_size: where each head's prime search starts
    pad_token_id: int  # original token id left-padding the n-grams
    compressed_vocab_size: int | None  # what the tokenizer must normalise to, when the config says


def read_engram_config(ckpt_dir: str | os.PathLike) -> EngramConfig:
    """Parse and check config.json; ValueError naming the file and field (or the unknown architecture)."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{ckpt_dir}: no config.json: not a checkpoint directory")
    top = json.loads(path.read_text())  # a JSONDecodeError is a ValueError
    if not isinstance(top, dict):
        raise ValueError(f"{path}: not a JSON object")
    names = [*(top.get("architectures") or []), top.get("model_type")]
    arch = next((ARCHITECTURES[n] for n in names if isinstance(n, str) and n in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path}: architecture {top.get('architectures')!r} (model_type {top.get('model_type')!r}) "
                         f"is not one tiergram imports (known: {', '.join(sorted(ARCHITECTURES))})")
    fields = {**top, **(top["text_config"] if isinstance(top.get("text_config"), dict) else {})}

    def get(key: str, minimum: int = 0, *, many: bool = False, alias: str = "") -> Any:
        value = fields.get(key, fields.get(alias))
        values = value if many and isinstance(value, list) and value else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
            raise ValueError(f"{path}: field {key!r} (top level or under 'text_config') is {value!r}, expected "
                             f"{'a non-empty list of integers' if many else 'an integer'} >= {minimum}")
        return tuple(values) if many else value

    layers, rows = get("engram_layer_ids", many=True), get("engram_num_embeddings", many=True)
    if len(rows) != len(layers) or len(set(layers)) != len(layers):
        raise ValueError(f"{path}: engram_layer_ids {list(layers)} must be distinct, one per engram_num_embeddings "
                         f"entry ({len(rows)})")
    head_dim = get("engram_head_dim", 1)
    if head_dim % FP8_BLOCK:
        raise ValueError(f"{path}: engram_head_dim {head_dim} is not a multiple of the {FP8_BLOCK}-value scale block")
    return EngramConfig(
        architecture=arch, layer_ids=layers, num_embeddings=rows, max_ngram_size=get("engram_max_ngram_size", 2),
        n_heads=get("engram_n_heads", 1), head_dim=head_dim, vocab_size=get("engram_vocab_size", 2),
        pad_token_id=get("engram_pad_token_id", alias="engram_pad_id"),
        compressed_vocab_size=None if fields.get("engram_compressed_vocab_size") is None
        else get("engram_compressed_vocab_size", 1))


@dataclass(frozen=True)
class LayerImport:
    """One table to write: the tensors it copies and the manifest it gets."""

    layer_id: int
    weight: TensorLocation
    scale: TensorLocation
    manifest: TableManifest
    file_name: str


@dataclass(frozen=True)
class ImportPlan:
    """Everything checked before a byte is written."""

    ckpt_dir: Path
    out_dir: Path
    config: EngramConfig
    tokenizer: Path
    layers: tuple[LayerImport, ...]
    model_config: Any  # tiergram.model.config.ModelConfig of the random backbone
    hasher: Any  # tiergram.hashing.NgramHasher

    @property
    def table_bytes(self) -> int:
        """Bytes of all table files together."""
        return sum(li.manifest.encode()[1] + li.manifest.data_bytes for li in self.layers)


def plan_import(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
                backbone: str = "small") -> ImportPlan:
    """Read config, index and headers, rebuild the hashing, and check every table against them (no writes)."""
    import dataclasses

    from tiergram.corpus.tokenizer import load_tokenizer, tokenizer_file
    from tiergram.model.config import EngramSettings, preset
    from tiergram.model.model import make_hasher

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    cfg = read_engram_config(ckpt)
    names = [n.format(layer=layer) for layer in cfg.layer_ids for n in (WEIGHT, SCALE)]
    tensors = locate_tensors(ckpt, names)

    tok_path = tokenizer_file(tokenizer if tokenizer is not None else ckpt,
                              "the hashing compresses the checkpoint's own: give --tokenizer a tokenizer.json")
    tok = load_tokenizer(tok_path)
    base = preset(backbone, tok.get_vocab_size(with_added_tokens=True))  # ModelConfig checks the pad id against it
    # Engram sits at the checkpoint's own block indices: the hash multipliers are drawn per layer id
    n_layers = max(base.n_layers, max(cfg.layer_ids) + 1)
    engram = EngramSettings(layers=list(cfg.layer_ids), max_ngram_size=cfg.max_ngram_size,
                            n_head_per_ngram=cfg.n_heads, engram_vocab_size=[cfg.vocab_size] * (cfg.max_ngram_size - 1),
                            dim=cfg.head_dim, conv_kernel=0, seed=0, pad_id=cfg.pad_token_id)
    mconfig = dataclasses.replace(base, n_layers=n_layers, moe=None, engram=engram)
    hasher = make_hasher(mconfig, tokenizer=tok)
    if cfg.compressed_vocab_size is not None and hasher.compressed_vocab_size != cfg.compressed_vocab_size:
        raise ValueError(f"{tok_path} normalises to {hasher.compressed_vocab_size} distinct tokens but config.json's "
                         f"engram_compressed_vocab_size is {cfg.compressed_vocab_size}: every hash multiplier depends "
                         "on it, so rows would be read from the wrong places")

    layers = []
    scale_cols = cfg.head_dim // FP8_BLOCK
    for layer, rows in zip(cfg.layer_ids, cfg.num_embeddings, strict=True):
        w, s = tensors[WEIGHT.format(layer=layer)], tensors[SCALE.format(layer=layer)]
        for t, dtype, cols in ((w, "F8_E4M3", cfg.head_dim), (s, "F8_E8M0", scale_cols)):
            if t.dtype != dtype:
                raise ValueError(f"{t.file}: tensor {t.name!r} is {t.dtype}, expected {dtype}")
            if t.shape != (rows, cols):
                raise ValueError(f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, expected [{rows}, {cols}] "
                                 f"(engram_num_embeddings[{cfg.layer_ids.index(layer)}] = {rows}, "
                                 f"engram_head_dim = {cfg.head_dim})")
        heads = tuple(hasher.head_sizes(layer))
        if sum(heads) != rows:
            raise ValueError(f"layer {layer}: the {len(heads)} heads of the hashing layout (primes above "
                             f"engram_vocab_size {cfg.vocab_size}) hold {sum(heads):,} rows but tensor {w.name!r} "
                             f"has {rows:,}")
        manifest = TableManifest(
            codec=CODEC, dim=cfg.head_dim, head_rows=heads, page_size=PAGE_SIZE, layer_id=layer,
            hashing=hasher.config(),
            provenance={"tool": "tiergram import", "checkpoint": str(ckpt.resolve()), "architecture": cfg.architecture,
                        "weight": {"tensor": w.name, "file": w.file.name},
                        "scale": {"tensor": s.name, "file": s.file.name},
                        "tokenizer": tok_path.name, "rows": "weight row bytes || scale row bytes, unchanged"})
        layers.append(LayerImport(layer, w, s, manifest, table_filename(layer, CODEC)))
    plan = ImportPlan(ckpt, out, cfg, tok_path, tuple(layers), mconfig, hasher)
    out.mkdir(parents=True, exist_ok=True)
    # an existing table of this import is replaced, so its bytes count as free
    have = sum((out / li.file_name).stat().st_size for li in layers if (out / li.file_name).is_file())
    check_room(out, len(layers), plan.table_bytes, have)
    return plan


def _pread_into(fd: int, buf: memoryview, offset: int, what: TensorLocation) -> None:
    """Fill buf from fd at offset; a short read (the file shrank) names the tensor and file."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(f"{what.file}: ended at byte {offset + done:,} while reading tensor {what.name!r}: the "
                          "shard was truncated during the import")
        done += n


def row_copier(li: LayerImport, weight_fd: int, scale_fd: int) -> PageFiller:
    """A page filler that copies each row's weight bytes then scale bytes into the table's row slots."""
    m = li.manifest
    d, s, rpp, total = m.dim, m.row_bytes - m.dim, m.rows_per_page, m.total_rows
    max_rows = chunk_pages(m.page_size) * rpp
    wbuf, sbuf = np.empty(max_rows * d, np.uint8), np.empty(max_rows * s, np.uint8)

    def fill(pages: np.ndarray, p0: int, n: int) -> None:
        g0 = p0 * rpp
        rows = min(n * rpp, total - g0)
        w_off, s_off = li.weight.offset + g0 * d, li.scale.offset + g0 * s
        _pread_into(weight_fd, memoryview(wbuf)[: rows * d], w_off, li.weight)
        _pread_into(scale_fd, memoryview(sbuf)[: rows * s], s_off, li.scale)
        # read once: out of the page cache after, and the next chunk read by the kernel while this one is copied
        os.posix_fadvise(weight_fd, w_off, rows * d, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(scale_fd, s_off, rows * s, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(weight_fd, w_off + rows * d, rows * d, os.POSIX_FADV_WILLNEED)
        os.posix_fadvise(scale_fd, s_off + rows * s, rows * s, os.POSIX_FADV_WILLNEED)
        slots = pages[:, : rpp * m.row_bytes].reshape(n, rpp, m.row_bytes)
        full, rest = divmod(rows, rpp)
        w, sc = wbuf[: rows * d].reshape(rows, d), sbuf[: rows * s].reshape(rows, s)
        slots[:full, :, :d] = w[: full * rpp].reshape(full, rpp, d)
        slots[:full, :, d:] = sc[: full * rpp].reshape(full, rpp, s)
        if rest:
            slots[full, :rest, :d] = w[full * rpp:]
            slots[full, :rest, d:] = sc[full * rpp:]
            slots[full, rest:] = 0  # the buffer held an earlier chunk's rows there

    return fill


def import_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      tokenizer: str | os.PathLike | None = None, backbone: str = "small", seed: int = 0,
                      progress: bool = True, log: Callable[[str], None] = print) -> ImportPlan:
    """Import every Engram table of a checkpoint into out_dir, all checked first; a failure removes what it wrote."""
    plan = plan_import(ckpt_dir, out_dir, tokenizer=tokenizer, backbone=backbone)
    out = plan.out_dir
    log(f"importing {len(plan.layers)} Engram tables of {plan.ckpt_dir} ({plan.config.architecture}, "
        f"{plan.table_bytes / 2**30:.2f} GiB) into {out}")
    written: list[Path] = []
    t0 = time.perf_counter()
    try:
        for li in plan.layers:
            fds = [os.open(li.weight.file, os.O_RDONLY), os.open(li.scale.file, os.O_RDONLY)]
            try:
                written.append(write_pages(out / li.file_name, li.manifest, row_copier(li, *fds), progress=progress))
            finally:
                for fd in fds:
                    os.close(fd)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    info = {"checkpoint": str(plan.ckpt_dir.resolve()), "architecture": plan.config.architecture,
            "backbone": backbone, "random_weights": True, "backbone_imported": False,
            "table_bytes": plan.table_bytes, "tables_write_s": round(seconds, 3), "seed": seed}
    write_servable_dir(out, plan.model_config, plan.hasher, plan.tokenizer,
                       {li.layer_id: li.file_name for li in plan.layers}, {"import": info}, seed=seed)
    log(f"wrote {len(plan.layers)} tables ({plan.table_bytes / 2**30:.2f} GiB in {seconds:.1f} s, "
        f"{plan.table_bytes / 2**30 / max(seconds, 1e-9):.2f} GiB/s) byte for byte from the checkpoint's weight and "
        "scale tensors")
    log(f"the backbone is NOT imported: {out} has a random {backbone} backbone "
        f"({plan.model_config.n_layers} blocks, Engram at {list(plan.config.layer_ids)}), so it serves the real "
        "tables with V4.1's hashing at their real size, but generates noise")
    return plan
