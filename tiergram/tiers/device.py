"""Device tier: a table in accelerator memory, and host tables registered in place for UVA reads (on the CPU the
"device" is host memory and nothing is registered)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from tiergram.format import TableFile
from tiergram.tiers.base import TableTier

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: visible to every context
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: mapped into the device address space (UVA)
CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: needed for a read-only mapping (/dev/shm copy)
DEVICE_BYTES_ENV = "TIERGRAM_DEVICE_BYTES"
COPY_CHUNK_BYTES = 64 << 20


def device_memory_budget(device: torch.device | str | None = None, *, cpu_bytes: int | None = None) -> int:
    """Free accelerator bytes (cudaMemGetInfo); on the CPU `cpu_bytes`, else $TIERGRAM_DEVICE_BYTES, else 0."""
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])  # (free, total)
    if cpu_bytes is None:
        cpu_bytes = int(os.environ.get(DEVICE_BYTES_ENV, "0") or 0)
    if cpu_bytes < 0:
        raise ValueError(f"device memory budget must be >= 0 bytes, got {cpu_bytes}")
    return int(cpu_bytes)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """A torch.device (CUDA with an index); None or 'auto': the current GPU, else the CPU. Every --device uses it."""
    dev = torch.device(device) if device is not None and device != "auto" else _default_device()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA device was asked for but torch.cuda.is_available() is False")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def host_view(array: np.ndarray) -> torch.Tensor:
    """A CPU uint8 tensor over a numpy array's memory, read-only mappings included (no copy)."""
    with warnings.catch_warnings():  # torch warns that a read-only array stays read-only; kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class PinnedHost:
    """A host uint8 array registered with CUDA in place: kernels read `tensor` (a CPU view) by UVA."""

    def __init__(self, array: np.ndarray, device: torch.device | str) -> None:
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError(f"expected a contiguous uint8 vector, got {array.dtype} {array.shape}")
        self.device = resolve_device(device)
        self.array = array
        self.tensor = host_view(array)
        self.registered = False
        if self.device.type == "cuda" and array.size:
            flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
            if not array.flags.writeable:
                flags |= CUDA_HOST_REGISTER_READ_ONLY
            with torch.cuda.device(self.device):
                err = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, flags)
            if not _cuda_ok(err):
                raise RuntimeError(f"cudaHostRegister of {array.nbytes} bytes at {array.ctypes.data:#x} "
                                   f"(flags {flags}) failed: {err}")
            self.registered = True

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def close(self) -> None:
        """Unregister (after every kernel on the device finished); the array itself is the owner's."""
        if self.registered:
            torch.cuda.synchronize(self.device)
            err = torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.registered = False
            if not _cuda_ok(err):
                raise RuntimeError(f"cudaHostUnregister at {self.array.ctypes.data:#x} failed: {err}")


def _cuda_ok(err) -> bool:
    """True for cudaSuccess as torch.cuda.cudart() returns it (a pybind enum, or an int)."""
    return int(getattr(err, "value", err)) == 0


class DeviceTier(TableTier):
    """A whole table resident in device memory: its page-structured data region as one uint8 tensor."""

    name = "device"

    def __init__(self, table: TableFile, device: torch.device | str, *, host_data: np.ndarray | None = None,
                 progress: bool = False) -> None:
        super().__init__(table)
        m = self.manifest
        self.device = resolve_device(device)
        src = host_data if host_data is not None else table.read_data(progress=progress)  # pages verified
        if src.dtype != np.uint8 or src.size != m.data_bytes:
            raise ValueError(f"host data must be uint8 [{m.data_bytes}], got {src.dtype} [{src.size}]")
        self.data = torch.empty(m.data_bytes, dtype=torch.uint8, device=self.device)
        copy_to_device(src, self.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def close(self) -> None:
        """Free the device copy."""
        self.data = torch.empty(0, dtype=torch.uint8, device=self.device)


def copy_to_device(src: np.ndarray, dst: torch.Tensor, chunk: int = COPY_CHUNK_BYTES) -> None:
    """Copy host uint8 [n] into device uint8 [n] through one pinned bounce buffer, chunk by chunk."""
    view = host_view(src)
    if dst.device.type != "cuda":
        dst.copy_(view)
        return
    bounce = torch.empty(min(chunk, max(1, src.size)), dtype=torch.uint8, pin_memory=True)
    for start in range(0, src.size, chunk):
        n = min(chunk, src.size - start)
        bounce[:n].copy_(view[start:start + n])
        dst[start:start + n].copy_(bounce[:n], non_blocking=True)
        torch.cuda.current_stream(dst.device).synchronize()  # the bounce buffer is refilled next round
