"""Tiers: where rows live (host memory, the file on SSD, Mooncake Store); each is a `Tier` (tiers.base)."""

from tiergram.tiers.base import Tier
from tiergram.tiers.file import FILE_MODES, FileTier
from tiergram.tiers.host import HostTier

__all__ = ["FILE_MODES", "FileTier", "HostTier", "Tier"]
