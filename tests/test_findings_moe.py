"""docs/findings.md sections 5 and 7 come from result files: the rerouting table (4 shares x 3 seeds) from
`tiergram ablate --reroute --json` (docs/findings/data/reroute/), the CKA tables from `tiergram compare-layers
--json` (docs/findings/data/cka/); each is re-rendered from its files and compared with the doc's text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import doc_block

from tiergram.analysis.cka import LayerComparison, alignment, to_markdown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "findings" / "data" / "cka"
NAMES = sorted(p.stem for p in DATA.glob("*.json"))
REROUTE = ROOT / "docs" / "findings" / "data" / "reroute"


def block(name: str) -> str:
    """The text of docs/findings.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "findings.md", name)


def test_the_results_are_there() -> None:
    assert {"share40-s0", "share40-s1", "seed-control"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_cka_tables_are_their_results(name: str) -> None:
    res = LayerComparison(**json.loads((DATA / f"{name}.json").read_text()))
    table = "\n".join(line for line in to_markdown(res).splitlines() if line.startswith("|"))
    assert block(f"cka/{name}").strip() == table
    import numpy as np

    best, soft = alignment(np.array(res.cka))  # the summary columns follow from the matrix
    assert best == res.best_match and soft == pytest.approx(res.soft_index)


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "\u2212")


def _row(res: dict) -> str:
    """A section 5 row's cells after the model: answer loss on, off - on, forced all - off, top-2 sets changed."""
    on, off = res["loss"]["on"], res["delta_vs_on"]["off"]
    forced, changed = res["forced_minus_off"]["off, forced all"], res["changed_sets"]["all"]
    return (f"{on['value']:.3f} [{on['ci95'][0]:.3f}, {on['ci95'][1]:.3f}] | "
            f"{_signed(off['value'])} [{_signed(off['ci95'][0])}, {_signed(off['ci95'][1])}] | "
            f"{_signed(forced['value'])} [{_signed(forced['ci95'][0])}, {_signed(forced['ci95'][1])}] | "
            f"{100 * changed['value']:.1f}% [{100 * changed['ci95'][0]:.1f}, {100 * changed['ci95'][1]:.1f}] |")


def test_reroute_table_is_its_results() -> None:
    rows = {line.split(" ")[1]: line for line in block("reroute/shares").strip().splitlines()
            if line.startswith("| share")}
    files = sorted(REROUTE.glob("share*.json"))
    assert len(files) == 12 and set(rows) == {f.stem for f in files}  # 4 shares x 3 seeds
    for f in files:
        res = json.loads(f.read_text())
        assert res["tasks"] == 34 and res["answer_tokens"] == 271
        assert rows[f.stem].endswith(_row(res)), f.stem
