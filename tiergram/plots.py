"""Writing a matplotlib figure (imported only where a plot is drawn: matplotlib is the `bench` extra)."""

from __future__ import annotations

from pathlib import Path


def subplots(*args, **kw):
    """(figure, axes) of plt.subplots on the Agg backend (files, no display), at 110 dpi unless kw says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **{"dpi": 110, **kw})


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
