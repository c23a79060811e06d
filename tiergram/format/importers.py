"""Importing table values from a safetensors checkpoint: one [N_total, D] tensor or one tensor per head."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from safetensors import safe_open

from tiergram.format.create import ValueSource, stacked_values


@dataclass
class SafetensorsSource:
    """Rows of one or more tensors of a safetensors file, read a chunk at a time (never whole into memory)."""

    path: str
    names: list[str]
    head_rows: tuple[int, ...]
    dim: int

    def values(self) -> ValueSource:
        """A ValueSource over the global row space (the tensors end to end)."""

        def read(t: int, lo: int, hi: int) -> np.ndarray:
            with safe_open(self.path, framework="pt") as f:
                return f.get_slice(self.names[t])[lo:hi].float().numpy()

        with safe_open(self.path, framework="pt") as f:
            return stacked_values([int(f.get_slice(n).get_shape()[0]) for n in self.names], read)


def open_safetensors(path: str | os.PathLike, tensor: str, head_rows: tuple[int, ...] | None,
                     heads: int | None) -> SafetensorsSource:
    """Locate the tensor(s): `tensor` names one [N_total, D] tensor, or has `{head}` for per-head tensors."""
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such safetensors file")
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        per_head = "{head}" in tensor
        if per_head:
            names = []
            while tensor.replace("{head}", str(len(names))) in keys:
                names.append(tensor.replace("{head}", str(len(names))))
            if not names:
                raise ValueError(f"{path}: no tensor matches {tensor!r} (for head 0: "
                                 f"{tensor.replace('{head}', '0')!r})")
            if heads and heads != len(names):
                raise ValueError(f"{path}: --heads is {heads} but {len(names)} tensors match {tensor!r}")
        elif tensor in keys:
            names = [tensor]
        else:
            raise ValueError(f"{path}: no tensor named {tensor!r} (has: {', '.join(sorted(keys)[:10])})")
        shapes = [f.get_slice(n).get_shape() for n in names]
        dtypes = {n: f.get_slice(n).get_dtype() for n in names}
    fp8 = [n for n, d in dtypes.items() if d.startswith("F8")]
    if fp8:  # values of block-scaled FP8 mean nothing without their scale tensor
        raise ValueError(f"{path}: tensor {fp8[0]!r} is {dtypes[fp8[0]]}, whose values need their block scales; "
                         "import a checkpoint's FP8 Engram tables with `tiergram import CKPT_DIR OUT_DIR`")
    for name, shape in zip(names, shapes, strict=True):
        if len(shape) != 2:
            raise ValueError(f"{path}: tensor {name!r} has shape {list(shape)}, expected [rows, D]")
    dims = {s[1] for s in shapes}
    if len(dims) != 1:
        raise ValueError(f"{path}: per-head tensors disagree on D: {sorted(dims)}")
    if per_head:
        rows = tuple(int(s[0]) for s in shapes)
        if head_rows and tuple(head_rows) != rows:
            raise ValueError(f"{path}: --rows-per-head {list(head_rows)} disagrees with the tensors' rows {list(rows)}")
        head_rows = rows
    else:
        total = int(shapes[0][0])
        if head_rows is None:
            if not heads or total % heads:
                raise ValueError(f"{path}: tensor {names[0]!r} has {total} rows; give --rows-per-head, or --heads "
                                 f"that divides {total}")
            head_rows = (total // heads,) * heads
        if sum(head_rows) != total:
            raise ValueError(f"{path}: heads of {list(head_rows)} rows sum to {sum(head_rows)}, tensor {names[0]!r} "
                             f"has {total}")
    return SafetensorsSource(path, names, tuple(head_rows), int(shapes[0][1]))
