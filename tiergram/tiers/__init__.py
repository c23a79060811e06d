"""Tiers: where rows live (host memory, file on SSD); each gathers rows of per-head ids into an output."""

from tiergram.tiers.host import HostTier

__all__ = ["HostTier"]
