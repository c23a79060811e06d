"""Hot rows: each Engram layer's rows ranked by how often a corpus reads them, to preload a cold cache
(docs/engine.md, "Hot rows")."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tiergram.hashing import NgramHasher

HOT_ROWS = "hot_rows.npz"  # the default file name, in the model directory
FORMAT = "tiergram-hot-rows/1"
CHUNK_TOKENS = 1 << 18  # tokens hashed per call while counting
# layers of up to this many rows add a bincount per chunk (fast, one table-sized temporary); larger ones (real tables:
# V4.1-Flash has ~360M rows a layer) add the chunk's unique keys instead (4x slower on the 8 GiB model, no temporary)
DENSE_ROWS = 1 << 26


def hashing_digest(hasher: NgramHasher) -> str:
    """sha256 hex of the hasher's configuration: rows counted under one hashing mean nothing under another."""
    return hashlib.sha256(json.dumps(hasher.config(), sort_keys=True).encode()).hexdigest()


@dataclass
class HotRows:
    """Per layer, row keys int64 [K] (head offset + row id) hottest first, and their read counts int64 [K]."""

    digest: str  # hashing_digest of the hasher the rows were counted with
    tokens: int  # tokens counted
    source: str  # what was counted (e.g. "corpus train split")
    keys: dict[int, np.ndarray]
    counts: dict[int, np.ndarray]
    reads: dict[int, int]  # per layer: every row read counted (tokens x heads), kept or not

    def per_head(self, layer: int, head_sizes: list[int], n: int) -> list[np.ndarray]:
        """The layer's n hottest rows split by head: one int64 array of row ids per head, hottest first."""
        if layer not in self.keys:
            raise ValueError(f"the hot rows have no Engram layer {layer} (they have {sorted(self.keys)})")
        keys = self.keys[layer][:n]
        offsets = np.cumsum([0, *head_sizes])
        if keys.size and keys.max() >= offsets[-1]:
            raise ValueError(f"hot row key {int(keys.max())} of layer {layer} is outside the layer's "
                             f"{int(offsets[-1])} rows: the file was counted for another table geometry")
        head = np.searchsorted(offsets, keys, side="right") - 1
        return [keys[head == h] - offsets[h] for h in range(len(head_sizes))]


def count_hot_rows(hasher: NgramHasher, tokens: np.ndarray, *, max_fraction: float = 0.25, source: str = "",
                   progress: bool = True) -> HotRows:
    """Count the rows a token stream int [T] reads per layer; keep the most read, at most max_fraction of them."""
    if not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction must lie in (0, 1], got {max_fraction}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"the token stream must be a non-empty 1-D array, got shape {tokens.shape}")
    layers = hasher.layer_ids
    # uint32: one count per row, 4 bytes a row (a real V4.1-Flash layer of ~360M rows: 1.4 GiB)
    counts = {layer: np.zeros(sum(hasher.head_sizes(layer)), dtype=np.uint32) for layer in layers}
    history = np.full((1, hasher.max_ngram_size - 1), hasher.pad_id, dtype=np.int64)
    bar = tqdm(total=tokens.size, desc="counting hot rows", unit="tok", unit_scale=True, disable=not progress)
    for start in range(0, tokens.size, CHUNK_TOKENS):
        chunk = np.asarray(tokens[start:start + CHUNK_TOKENS], dtype=np.int64)
        ids = hasher.row_ids_with_history(chunk[None], history)
        for layer, rows in ids.items():  # [1, T, H]
            keys = (rows[0] + hasher.head_offsets(layer)).reshape(-1)
            if counts[layer].size <= DENSE_ROWS:
                counts[layer] += np.bincount(keys, minlength=counts[layer].size).astype(np.uint32)
            else:
                keys, n = np.unique(keys, return_counts=True)
                counts[layer][keys] += n.astype(np.uint32)
        history = np.concatenate([history, chunk[None]], axis=1)[:, -history.shape[1]:]  # max_ngram_size >= 2
        bar.update(chunk.size)
    bar.close()
    keys_out, counts_out = {}, {}
    for layer, c in counts.items():
        keep = min(int(np.count_nonzero(c)), max(1, int(max_fraction * c.size)))
        read = np.flatnonzero(c)  # rank only the rows read at all (a few % of a real table)
        if keep < read.size:  # the keep most read; of the rows tied at the cut, the lowest keys (deterministic)
            cut = np.partition(c[read], read.size - keep)[read.size - keep]
            above, tied = read[c[read] > cut], read[c[read] == cut]
            read = np.concatenate([above, tied[:keep - above.size]])
        top = read[np.lexsort((read, -c[read].astype(np.int64)))]  # most read first, ties by key
        keys_out[layer], counts_out[layer] = top.astype(np.int64), c[top].astype(np.int64)
    reads = {layer: int(c.sum(dtype=np.int64)) for layer, c in counts.items()}
    return HotRows(hashing_digest(hasher), int(tokens.size), source, keys_out, counts_out, reads)


def count_model_hot_rows(model_dir: str | os.PathLike, *, corpus: str | os.PathLike | None = None,
                         max_tokens: int | None = None, max_fraction: float = 0.25,
                         out: str | os.PathLike | None = None, progress: bool = True) -> tuple[Path, HotRows]:
    """Count the train split's hot rows under a model's hashing, written to `out` (default DIR/hot_rows.npz)."""
    from tiergram.corpus import ensure_corpus
    from tiergram.model.checkpoint import TOKENIZER
    from tiergram.model.data import tokenize_split
    from tiergram.model.model_dir import ModelDir

    model_dir = Path(model_dir)
    hasher = ModelDir.open(model_dir).hasher
    if hasher is None:
        raise ValueError(f"{model_dir} has no Engram layers: it reads no rows")
    if not (model_dir / TOKENIZER).is_file():
        raise FileNotFoundError(f"{model_dir} has no {TOKENIZER} to tokenize the corpus with")
    folder = ensure_corpus(corpus, tokenizer=False, progress=progress)
    tokens = tokenize_split(folder, "train", model_dir / TOKENIZER, progress=progress)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    hot = count_hot_rows(hasher, tokens, max_fraction=max_fraction, progress=progress,
                         source=f"train split of {folder}")
    return save_hot_rows(hot, Path(out) if out is not None else model_dir / HOT_ROWS), hot


def save_hot_rows(hot: HotRows, path: str | os.PathLike) -> Path:
    """Write hot rows to an .npz (atomically: a temporary file renamed into place)."""
    path = Path(path)
    meta = {"format": FORMAT, "digest": hot.digest, "tokens": hot.tokens, "source": hot.source,
            "layers": sorted(hot.keys), "reads": {str(k): v for k, v in hot.reads.items()}}
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    for layer in hot.keys:  # 32-bit where the values fit: a quarter of a 34 GiB table's rows is 34M keys
        arrays[f"keys_{layer}"], arrays[f"counts_{layer}"] = _narrow(hot.keys[layer]), _narrow(hot.counts[layer])
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def _narrow(a: np.ndarray) -> np.ndarray:
    return a.astype(np.uint32) if a.size == 0 or (a.min() >= 0 and a.max() < 2**32) else a


def load_hot_rows(path: str | os.PathLike, hasher: NgramHasher | None = None) -> HotRows:
    """Read a hot-rows file; ValueError naming the file when it is not one, or was counted under other hashing."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            keys = {int(layer): z[f"keys_{layer}"].astype(np.int64) for layer in meta["layers"]}
            counts = {int(layer): z[f"counts_{layer}"].astype(np.int64) for layer in meta["layers"]}
    except FileNotFoundError:
        raise FileNotFoundError(f"no hot-rows file at {path}: count one with `tiergram hot-rows MODEL_DIR`") from None
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a hot-rows file ({e})") from e
    reads = {int(k): int(v) for k, v in meta.get("reads", {}).items()}
    hot = HotRows(meta["digest"], int(meta["tokens"]), str(meta.get("source", "")), keys, counts, reads)
    if hasher is not None and hot.digest != hashing_digest(hasher):
        raise ValueError(f"{path} was counted under other hashing than this model's (digest {hot.digest[:12]} vs "
                         f"{hashing_digest(hasher)[:12]}): count it again for this model (tiergram hot-rows)")
    return hot
