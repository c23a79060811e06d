"""A synthetic checkpoint in DeepSeek-V4.1's published layout, for `tiergram import` tests and its benchmark.

Per Engram layer L `layers.L.engram.embed.weight` F8_E4M3 [rows, head_dim] and `.scale` F8_E8M0 [rows,
head_dim / 32] in different shards, rows the sum of the layer's head primes, as in the release
(docs/deepseek-v4.1.md); random bytes (finite fp8 codes, scales near 2^-7), every one written: no file is sparse.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tiergram.hashing import build_compression, engram_head_table_sizes

V41_LAYERS = (1, 14)
_CHUNK = 32 << 20
_POOL = 64 << 20


def rows_for_gib(gib: float, layers: int = len(V41_LAYERS), heads: int = 24, head_dim: int = 256) -> int:
    """engram_vocab_size (the per-head prime search start) whose tables total about gib GiB of weight + scale."""
    return max(2, int(gib * 2**30 / (head_dim + head_dim // 32) / (layers * heads)) + 1)


def write_v41_checkpoint(out: str | os.PathLike, tokenizer: str | os.PathLike, *, engram_vocab_size: int,
                         layer_ids: tuple[int, ...] = V41_LAYERS, max_ngram_size: int = 4, n_heads: int = 8,
                         head_dim: int = 256, pad_token_id: int = 0, seed: int = 0, progress: bool = True) -> Path:
    """Write the checkpoint directory; returns it. Weight and scale of each layer land in different shards."""
    from tokenizers import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer))
    _, compressed = build_compression(tok)
    sizes = engram_head_table_sizes([engram_vocab_size] * (max_ngram_size - 1), max_ngram_size, n_heads, layer_ids)
    rows = [sum(sum(o) for o in sizes[layer]) for layer in layer_ids]
    text = {"model_type": "deepseek_v41_text", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "engram_layer_ids": list(layer_ids), "engram_num_embeddings": rows,
            "engram_max_ngram_size": max_ngram_size, "engram_n_heads": n_heads, "engram_head_dim": head_dim,
            "engram_vocab_size": engram_vocab_size, "engram_pad_token_id": pad_token_id,
            "engram_compressed_vocab_size": compressed}
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    shutil.copyfile(tokenizer, out / "tokenizer.json")

    # shard i holds layer i-1's scale, then layer i's weight: each layer's weight and scale lie in different shards
    tensors: list[list[tuple[str, str, tuple[int, int]]]] = [[] for _ in range(len(layer_ids) + 1)]
    for i, (layer, n) in enumerate(zip(layer_ids, rows, strict=True)):
        tensors[i].append((f"layers.{layer}.engram.embed.weight", "F8_E4M3", (n, head_dim)))
        tensors[i + 1].insert(0, (f"layers.{layer}.engram.embed.scale", "F8_E8M0", (n, head_dim // 32)))
    tensors[0].insert(0, ("norm.weight", "BF16", (64,)))  # a tensor that is not Engram's, as real shards have
    rng = np.random.default_rng([seed, 0xC4])
    pool = np.frombuffer(rng.bytes(_POOL), dtype=np.uint8)
    pools = {"F8_E4M3": pool & 0xBF,  # clears the top exponent bit: no NaN code (0x7F, 0xFF), |q| < 2
             "F8_E8M0": (118 + pool % 5).astype(np.uint8), "BF16": pool}
    total = sum(int(np.prod(s)) * (2 if d == "BF16" else 1) for shard in tensors for _, d, s in shard)
    names = [f"model-{k + 1:05d}-of-{len(tensors):05d}.safetensors" for k in range(len(tensors))]
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc="writing checkpoint") as bar:
        for name, shard in zip(names, tensors, strict=True):
            _write_shard(out / name, shard, pools, rng, bar)
            weight_map.update(dict.fromkeys((t for t, _, _ in shard), name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return out


def _write_shard(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], pools: dict[str, np.ndarray],
                 rng: np.random.Generator, bar: tqdm) -> None:
    """One safetensors file of random tensors, written in large chunks, fsynced and dropped from the page cache."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        nbytes = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, dtype, shape in tensors:
            left = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
            while left:
                n = min(_CHUNK, left)
                start = int(rng.integers(0, _POOL - n + 1))
                f.write(memoryview(pools[dtype][start:start + n]))
                left -= n
                bar.update(n)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # an import then reads the disk, not the cache
