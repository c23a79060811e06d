"""Launchers of the fused gather + dequant kernel: every bound checked before launch, then Triton (or torch)."""

from __future__ import annotations

import functools
import importlib.util
from contextlib import nullcontext

import numpy as np
import torch

from tiergram.codecs import OUT_DTYPES, check_out_dtype
from tiergram.format.ids import RowIds, check_row_ids
from tiergram.kernels.layout import RowLayout
from tiergram.kernels.reference import gather_dequant_torch, raw_rows

HAVE_TRITON = importlib.util.find_spec("triton") is not None  # optional: the torch path works without it


@functools.cache
def _kernels():
    """The Triton kernel module, imported on first use: TRITON_INTERPRET=1 is honoured if set by then."""
    from tiergram.kernels import triton_kernels

    return triton_kernels


def interpreted() -> bool:
    """True when the Triton kernel runs in the interpreter (TRITON_INTERPRET=1 before its first use)."""
    return HAVE_TRITON and type(_kernels().gather_kernel).__name__ == "InterpretedFunction"


BACKENDS = ("auto", "triton", "torch")


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """(can the Triton kernel run on `device`, why not)."""
    if not HAVE_TRITON:
        return False, "triton is not installed"
    if device.type == "cuda" or interpreted():
        return True, ""
    return False, f"Triton needs a CUDA device or TRITON_INTERPRET=1 before import (device {device})"


def pick_backend(device: torch.device, backend: str = "auto") -> str:
    """'triton' or 'torch' for `device` ('auto': Triton on CUDA only); RuntimeError if 'triton' cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r} (valid: {', '.join(BACKENDS)})")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    ok, why = triton_usable(device)
    if backend == "triton" and not ok:
        raise RuntimeError(why)
    return "triton" if ok else "torch"


def check_slots(slots: RowIds, capacity: int, n: int, name: str) -> None:
    """ValueError unless slots hold n values in -1 .. capacity-1."""
    if (slots.numel() if isinstance(slots, torch.Tensor) else slots.size) != n:
        raise ValueError(f"{name} must hold one slot per id ({n}), got shape {list(slots.shape)}")
    if n == 0:
        return
    lo, hi = (int(slots.min()), int(slots.max()))
    if lo < -1 or hi >= capacity:
        raise ValueError(f"{name} must lie in -1..{capacity - 1} (cache of {capacity} slots), got {lo}..{hi}")


def gather_dequant(data: torch.Tensor, ids: RowIds, layout: RowLayout, head_offsets: np.ndarray,
                   head_rows: np.ndarray, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, offsets_dev: torch.Tensor | None = None,
                   block_rows: int | None = None, num_warps: int = 4, backend: str = "auto",
                   cache: torch.Tensor | None = None, slots: RowIds | None = None,
                   fill: RowIds | None = None) -> torch.Tensor:
    """Rows [..., H, D] float32/bfloat16 of per-head ids int64 [..., H] from data uint8 [bytes] laid out as `layout`.

    With `cache` uint8 [S, row_bytes], id i with slots[i] >= 0 is read from cache row slots[i], and a miss with
    fill[i] >= 0 is also written to cache row fill[i] (one id per slot)."""
    head_offsets = np.ascontiguousarray(head_offsets, dtype=np.int64).reshape(-1)
    head_rows = np.ascontiguousarray(head_rows, dtype=np.int64).reshape(-1)
    h = head_rows.size
    if head_offsets.size != h or h == 0:
        raise ValueError(f"head_offsets ({head_offsets.size}) and head_rows ({h}) must describe the same heads")
    dev = _kernel_device(device, out, ids, data)
    pick_backend(dev, backend)  # a bad backend name fails even for an empty batch
    ids = check_row_ids(ids, head_rows)  # before anything is launched: no id can address outside its head
    _check_data(data, layout, head_offsets, head_rows, dev)
    id_shape = tuple(ids.shape)
    n = int(np.prod(id_shape))
    out = _output(out, (*id_shape, layout.dim), dtype, dev)
    if cache is not None:
        if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != layout.row_bytes \
                or not cache.is_contiguous() or cache.device != dev:
            raise ValueError(f"cache must be a contiguous uint8 [S, {layout.row_bytes}] tensor on {dev}")
        check_slots(slots, cache.shape[0], n, "slots")
        if fill is not None:
            check_slots(fill, cache.shape[0], n, "fill")
    if n == 0:
        return out
    ids_dev = ids_to_device(ids, dev).reshape(-1)
    off = offsets_dev if offsets_dev is not None else ids_to_device(head_offsets, dev)
    slots_dev = ids_to_device(slots, dev).reshape(-1) if cache is not None else None
    fill_dev = ids_to_device(fill, dev).reshape(-1) if fill is not None else None
    launch_unchecked(data, ids_dev, off, out, layout, cache=cache, slots=slots_dev, fill=fill_dev,
                     block_rows=block_rows, num_warps=num_warps, backend=backend)
    return out


def default_block_rows(dim: int) -> int:
    """Rows per program: about 2048 values per program."""
    return max(1, min(128, 2048 // _next_pow2(dim)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_unchecked(data: torch.Tensor, ids: torch.Tensor, head_offsets: torch.Tensor, out: torch.Tensor,
                     layout: RowLayout, *, cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                     fill: torch.Tensor | None = None, block_rows: int | None = None, num_warps: int = 4,
                     backend: str = "auto") -> None:
    """The bare launch (ids [N*H], head_offsets [H], slots/fill [N*H] int64 on out's device), nothing checked."""
    n, h, dev = ids.numel(), head_offsets.numel(), out.device
    if n == 0:
        return
    if pick_backend(dev, backend) == "torch":
        if data.device != dev:
            raise ValueError("the torch backend cannot read registered host memory from the device; use triton")
        gather_dequant_torch(data, ids, head_offsets, layout, out, cache, slots, fill)
        return
    br = block_rows or default_block_rows(layout.dim)
    bd = _next_pow2(layout.dim)
    slots = slots if slots is not None else ids  # unread without a cache
    # the kernel writes a row to its fill slot where fill >= 0 and slots < 0: without fill, slots stands in for it
    # (never both), not the ids, which are >= 0 and would send every miss into cache row `id`
    fill = fill if fill is not None else slots
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():
        _kernels().gather_kernel[(-(-n // br),)](
            data, ids, head_offsets, out, cache if cache is not None else data, slots, fill,
            n, h, layout.rows_per_page, layout.page_size, layout.row_bytes,
            D=layout.dim, BLOCK_D=bd, BLOCK_S=max(1, bd // 32), BLOCK_R=br, CODEC=layout.codec_id,
            ALIGN=layout.align, HAS_CACHE=cache is not None, OUT_BF16=out.dtype == torch.bfloat16,
            num_warps=num_warps)


def copy_rows_unchecked(data: torch.Tensor, ids: torch.Tensor, head_offsets: torch.Tensor, out: torch.Tensor,
                        layout: RowLayout, *, block_rows: int = 8, num_warps: int = 4, backend: str = "auto") -> None:
    """out uint8 [N*H, row_bytes] = the rows' encoded bytes, undecoded (ids as launch_unchecked's, nothing checked)."""
    n, dev = ids.numel(), out.device
    if n == 0:
        return
    if pick_backend(dev, backend) == "torch":
        if data.device != dev:
            raise ValueError("the torch backend cannot read registered host memory from the device; use triton")
        out.view(n, layout.row_bytes).copy_(raw_rows(data, ids, head_offsets, layout))
        return
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():
        _kernels().copy_rows_kernel[(-(-n // block_rows),)](
            data, ids, head_offsets, out, n, head_offsets.numel(), layout.rows_per_page, layout.page_size,
            layout.row_bytes, BLOCK_B=_next_pow2(layout.row_bytes), BLOCK_R=block_rows, num_warps=num_warps)


def _kernel_device(device, out, ids, data) -> torch.device:
    """The kernel's device: given, else out's, the ids', the data's ('cuda' gets the current GPU's index)."""
    tensors = (t.device for t in (out, ids, data) if isinstance(t, torch.Tensor))
    dev = torch.device(device) if device is not None else next(tensors, None)
    if dev is None:
        raise ValueError("no device to run on")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_data(data: torch.Tensor, layout: RowLayout, head_offsets: np.ndarray, head_rows: np.ndarray,
                dev: torch.device) -> None:
    """ValueError unless data is a uint8 vector holding every head's rows, readable from dev, aligned for the codec."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("data must be a contiguous uint8 tensor [bytes]")
    if (head_offsets < 0).any() or (head_rows < 1).any():
        raise ValueError("every head needs a row offset >= 0 and at least one row")
    need = max(layout.bytes_needed(int(o + r)) for o, r in zip(head_offsets, head_rows, strict=True))
    if data.numel() < need:
        raise ValueError(f"data holds {data.numel()} bytes; the heads' rows need {need}")
    uva = dev.type == "cuda" and data.device.type == "cpu" and data.is_pinned()
    if data.device != dev and not uva:
        raise ValueError(f"data on {data.device} cannot be read from {dev}: put it on the device or register it "
                         f"(tiergram.tiers.device.PinnedHost)")
    elem = {"fp32": 4, "bf16": 2}.get(layout.codec, 1)
    if data.data_ptr() % elem:
        raise ValueError(f"{layout.codec} data must start on a {elem}-byte boundary")


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    check_out_dtype(dtype)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    if tuple(out.shape) != shape or out.dtype not in OUT_DTYPES or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous float32/bfloat16 tensor {list(shape)} on {dev}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    return out


def ids_to_device(x: RowIds, dev: torch.device) -> torch.Tensor:
    """int64 values on dev; host arrays go through pinned memory with a non-blocking copy on a GPU."""
    if isinstance(x, torch.Tensor):
        return x.to(device=dev, dtype=torch.int64, non_blocking=True).contiguous()
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    if dev.type == "cpu":
        return t
    return t.pin_memory().to(dev, non_blocking=True)
