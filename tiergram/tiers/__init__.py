"""Tiers: where rows live (host memory, the file on SSD, Mooncake Store); each is a `TableTier` (tiers.base)."""

from tiergram.tiers.file import FILE_MODES, FileTier
from tiergram.tiers.host import HostTier

__all__ = ["FILE_MODES", "FileTier", "HostTier"]
