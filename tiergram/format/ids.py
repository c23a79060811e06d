"""Row ids: the one validator every reader of a table calls. Per-head ids [..., H], each in 0 .. head_rows[h] - 1;
a non-integer array or a wrong last axis is a ValueError, an id outside its head an IndexError naming it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tiergram import _native

RowIds = np.ndarray | torch.Tensor
INT64_MAX = 2**63 - 1
_TORCH_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_row_ids(row_ids: RowIds, head_rows: Sequence[int] | np.ndarray, *, host: bool = False,
                  check_range: bool = True) -> RowIds:
    """Per-head row ids [..., H] as C-contiguous int64 checked against head_rows [H]: a tensor stays on its device
    unless `host` (then numpy); check_range=False leaves the range to the caller's tier (not uint64 beyond int64)."""
    head_rows = np.ascontiguousarray(head_rows, dtype=np.int64).reshape(-1)
    h = head_rows.size
    if isinstance(row_ids, torch.Tensor):
        if row_ids.dtype not in _TORCH_INTS:
            raise ValueError(f"row ids must be integers, got {str(row_ids.dtype).removeprefix('torch.')}")
        if host:
            ids: RowIds = np.ascontiguousarray(row_ids.detach().cpu().numpy(), dtype=np.int64)
        else:
            ids = row_ids.detach().to(torch.int64).contiguous()
    else:
        arr = np.asarray(row_ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"row ids must be integers, got {arr.dtype}")
        _check_shape(arr.shape, h)
        if arr.dtype == np.uint64 and arr.size and (arr > np.uint64(INT64_MAX)).any():
            # as int64 it would wrap to another id: report the first bad id from the unsigned values
            flat = arr.reshape(-1, h)
            pos, head = divmod(int(np.flatnonzero(flat >= head_rows.astype(np.uint64))[0]), h)
            raise IndexError(out_of_range(int(flat[pos, head]), head, int(head_rows[head]), pos))
        ids = np.ascontiguousarray(arr, dtype=np.int64)
    _check_shape(tuple(ids.shape), h)
    if check_range:
        check_in_range(ids, head_rows)
    return ids


def check_in_range(ids: RowIds, head_rows: Sequence[int] | np.ndarray) -> None:
    """IndexError for the first id of int64 [..., H] outside its head (host: native check; device: one reduction)."""
    head_rows = np.ascontiguousarray(head_rows, dtype=np.int64).reshape(-1)
    if isinstance(ids, np.ndarray):
        _native.check_ids(np.ascontiguousarray(ids.reshape(-1, head_rows.size), dtype=np.int64), head_rows)
        return
    if ids.numel() == 0:
        return
    flat = ids.reshape(-1, head_rows.size)
    bad = (flat < 0) | (flat >= torch.as_tensor(head_rows, device=ids.device))
    if bool(bad.any()):  # one host sync; the position is only looked up on the error path
        pos, head = divmod(int(torch.nonzero(bad.reshape(-1))[0]), head_rows.size)
        raise IndexError(out_of_range(int(flat[pos, head]), head, int(head_rows[head]), pos))


def out_of_range(row_id: int, head: int, rows: int, position: int) -> str:
    """The message of an out-of-range id (the same text the native check raises)."""
    return f"row id {row_id} out of range for head {head} (rows 0..{rows - 1}) at position {position}"


def _check_shape(shape: tuple[int, ...], h: int) -> None:
    if len(shape) < 1 or shape[-1] != h:
        raise ValueError(f"row ids must have shape [..., {h}] (one id per head), got {list(shape)}")
