"""tiergram's cache folder: `$TIERGRAM_CACHE`, else `~/.cache/tiergram` (corpus, models, benchmark tables, plans)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str = "") -> Path:
    """The cache folder, or its `sub` folder, created on demand."""
    env = os.environ.get("TIERGRAM_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "tiergram"
    path = root / sub if sub else root
    path.mkdir(parents=True, exist_ok=True)
    return path
