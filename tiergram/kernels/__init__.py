"""Accelerator kernels: fused row gather + dequant (Triton), from a table's pages or through an HBM row cache."""

from tiergram.kernels.gather import (
    BACKENDS,
    HAVE_TRITON,
    gather_dequant,
    ids_to_device,
    interpreted,
    pick_backend,
    triton_usable,
)
from tiergram.kernels.layout import RowLayout
from tiergram.kernels.reference import decode_raw, gather_dequant_torch

__all__ = ["BACKENDS", "HAVE_TRITON", "RowLayout", "decode_raw", "gather_dequant", "gather_dequant_torch",
           "ids_to_device", "interpreted", "pick_backend", "triton_usable"]
