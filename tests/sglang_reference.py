"""Test support: SGLang's own Engram hashing, loaded from the installed wheel's source without importing sglang.

`import sglang.srt.layers.engram` pulls in SGLang's CUDA runtime, so this reads that file with `ast` and runs only
its hashing definitions (and EngramHasher's CPU methods) against numpy, torch and msgspec. Nothing of SGLang is
copied into this repository: the code comes from the installed package at test time.
"""

from __future__ import annotations

import ast
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import msgspec
import numpy as np
import torch

VERSION = "0.5.23"
INSTALL = f"pip install --no-deps sglang=={VERSION}"
ENGRAM = "sglang/srt/layers/engram.py"
KERNEL = "sglang/kernels/ops/embeddings/engram_hash.py"
SCHEDULE = "sglang/srt/managers/schedule_batch.py"
# Top-level definitions of engram.py the hashing needs.
DEFINITIONS = ("_MILLER_RABIN_WITNESSES", "_cuda_kernels", "_is_prime", "_find_next_prime",
               "build_compressed_token_map", "compute_hash_multipliers", "EngramLayout", "compute_engram_hash_ids")
# EngramHasher's methods that run on a CPU: its real constructor, history, forward (torch path) and commit.
METHODS = ("__init__", "init_history", "history_row", "forward", "_torch_hash_ids", "hash_windows")


class SGLangMissing(RuntimeError):
    """SGLang is not installed (or not the pinned version)."""


def _source(dist: importlib.metadata.Distribution, rel: str) -> tuple[Path, ast.Module]:
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise SGLangMissing(f"sglang {dist.version} has no {rel}; install it with: {INSTALL}")
    return path, ast.parse(path.read_text(), filename=str(path))


def _constant(tree: ast.Module, name: str) -> Any:
    """The literal value of a top-level `name = <literal>` assignment."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"no top-level {name} in the SGLang source")


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _pick(tree: ast.Module) -> list[ast.stmt]:
    """engram.py's __future__ import, DEFINITIONS, and EngramHasher cut down to METHODS."""
    picked: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        name = _name(node)
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            picked.append(node)
        elif name in DEFINITIONS:
            picked.append(node)
            found.add(name)
        elif name == "EngramHasher":
            assert isinstance(node, ast.ClassDef)
            node.body = [m for m in node.body if isinstance(m, ast.FunctionDef) and m.name in METHODS]
            found.update(f"EngramHasher.{m.name}" for m in node.body)
            picked.append(node)
    missing = {*DEFINITIONS, *(f"EngramHasher.{m}" for m in METHODS)} - found
    if missing:
        raise LookupError(f"the SGLang source lacks {sorted(missing)}")
    return picked


def load() -> SimpleNamespace:
    """SGLang's hashing namespace: EngramLayout, build_compressed_token_map, EngramHasher (CPU), MODE_*."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SGLangMissing(f"sglang is not installed; the engine-parity tests need it: {INSTALL}") from None
    if dist.version != VERSION:
        raise SGLangMissing(f"sglang {dist.version} is installed, the tests pin {VERSION}: {INSTALL}")
    path, tree = _source(dist, ENGRAM)
    _, kernel = _source(dist, KERNEL)
    _, schedule = _source(dist, SCHEDULE)
    namespace: dict[str, Any] = {
        "__name__": "sglang_reference_engram",
        "np": np, "torch": torch, "nn": torch.nn, "Optional": Optional, "msgspec": msgspec,
        **{m: _constant(kernel, m) for m in ("MODE_DECODE", "MODE_VERIFY", "MODE_EXTEND")},
        # Only read for multimodal ids (history_row's clamp); images are out of scope here.
        "MM_PAD_SHIFT_VALUE": _constant(schedule, "MM_PAD_SHIFT_VALUE"),
        # The fused extend kernel is off by default (EnvBool(False)); CPU tensors take the torch path anyway.
        "envs": SimpleNamespace(SGLANG_OPT_ENGRAM_EXTEND_HASH=SimpleNamespace(get=lambda: False)),
    }
    # Compiled under the installed file's name so tracebacks point into SGLang's own source lines.
    exec(compile(ast.Module(body=_pick(tree), type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(version=dist.version, path=path, **{k: v for k, v in namespace.items()
                                                               if not k.startswith("__")})


class HFTokenizer:
    """The slice of a transformers fast tokenizer build_compressed_token_map reads, over a tokenizers.Tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        # As transformers' PreTrainedTokenizerFast.__len__.
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


class _Mode:
    """The ForwardMode predicates EngramHasher.forward asks."""

    def __init__(self, name: str) -> None:
        self.name = name

    def is_idle(self) -> bool:
        return False

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_target_verify(self) -> bool:
        return False


@dataclass
class Request:
    """One request's part of a forward: its request-pool slot, its tokens, the absolute position of the first."""

    slot: int
    tokens: list[int]
    position: int


def extend(hasher: Any, reqs: list[Request], history: list[list[int]] | None = None) -> list[torch.Tensor]:
    """One extend forward (prefill chunks packed end to end) -> each request's hash ids [T_i, layers, cols].

    history None reads each request's history from its slot (what the last forward committed); otherwise
    it is the scheduler-supplied rows, oldest first (forward_batch.engram_history, e.g. after a prefix hit).
    """
    lens = [len(r.tokens) for r in reqs]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    batch = SimpleNamespace(
        forward_mode=_Mode("extend"),
        req_pool_indices=torch.tensor([r.slot for r in reqs], dtype=torch.int64),
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32),
        extend_seq_lens_cpu=lens,
        positions=torch.tensor([r.position + i for r in reqs for i in range(len(r.tokens))], dtype=torch.int64),
        engram_history=None if history is None else torch.tensor(history, dtype=torch.int32),
        out_cache_loc=None,
    )
    ids = hasher.forward(torch.tensor([t for r in reqs for t in r.tokens], dtype=torch.int64), batch)
    return list(ids.split(lens))


def decode(hasher: Any, reqs: list[Request]) -> list[torch.Tensor]:
    """One decode forward (one token per request) -> each request's hash ids [1, layers, cols]."""
    assert all(len(r.tokens) == 1 for r in reqs)
    batch = SimpleNamespace(
        forward_mode=_Mode("decode"),
        req_pool_indices=torch.tensor([r.slot for r in reqs], dtype=torch.int64),
        positions=torch.tensor([r.position for r in reqs], dtype=torch.int64),
        out_cache_loc=None,
    )
    ids = hasher.forward(torch.tensor([r.tokens[0] for r in reqs], dtype=torch.int64), batch)
    return list(ids.split(1))
