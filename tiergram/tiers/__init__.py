"""Tiers: where rows live (host memory, the file on SSD); each gathers rows of per-head ids into an output."""

from tiergram.tiers.file import FILE_MODES, FileTier
from tiergram.tiers.host import HostTier

__all__ = ["FILE_MODES", "FileTier", "HostTier"]
