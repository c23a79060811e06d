"""The Engram module gives the same output through its trainable table and through a TieredTable file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiergram.engram import Engram, EngramConfig, RowSourceTable
from tiergram.format import TableManifest, create_table, matrix_values
from tiergram.hashing import NgramHasher
from tiergram.store import TieredTable

# per-codec tolerance on the module output, relative to the output's scale
TOLERANCE = {"fp32": 1e-6, "bf16": 2e-2, "int8": 3e-2, "fp8_e4m3": 8e-2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    hasher = NgramHasher([211, 223], max_ngram_size=3, n_head_per_ngram=2, layer_ids=[1], pad_id=0,
                         compressed_vocab_size=100)
    cfg = EngramConfig(d_model=64, head_sizes=hasher.head_sizes(1), dim=32, max_ngram_size=3, hc_mult=2)
    module = Engram(cfg).eval()
    weights, _ = module.table.weight_for_export()
    ids = torch.randint(0, 100, (2, 24))
    row_ids = torch.from_numpy(hasher.row_ids(ids)[1])
    hidden = torch.randn(2, 24, 2, 64)
    with torch.no_grad():
        expected = module(hidden, row_ids=row_ids)
    return tmp_path_factory.mktemp("tables"), cfg, module, weights.numpy(), row_ids, hidden, expected


@pytest.mark.parametrize("codec", sorted(TOLERANCE))
@pytest.mark.parametrize("tier", ["host", "file"])
def test_tiered_table_matches_trainable(setup, codec: str, tier: str) -> None:
    root, cfg, module, weights, row_ids, hidden, expected = setup
    path = root / f"{codec}.tgram"
    if not path.exists():
        create_table(path, TableManifest(codec=codec, dim=cfg.dim, head_rows=tuple(cfg.head_sizes)),
                     matrix_values(weights), progress=False)
    store = TieredTable(path, tier=tier, **({"file_mode": "buffered"} if tier == "file" else {}))
    tiered = Engram(cfg, table=RowSourceTable(store)).eval()
    state = {k: v for k, v in module.state_dict().items() if not k.startswith("table.")}
    missing, unexpected = tiered.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("table.") for k in missing)
    with torch.no_grad():
        got = tiered(hidden, row_ids=row_ids)
    scale = expected.abs().max().item()
    err = (got - expected).abs().max().item()
    assert err <= TOLERANCE[codec] * scale, f"{codec}/{tier}: max error {err} vs scale {scale}"
    if codec == "fp32":
        assert torch.equal(got, expected)
    store.close()


def test_wrong_row_is_caught(setup) -> None:
    """The tolerance has teeth: a table whose head 0 rows are shifted by one fails it."""
    root, cfg, module, weights, row_ids, hidden, expected = setup
    shifted = np.roll(weights, 1, axis=0)
    path = root / "shifted.tgram"
    create_table(path, TableManifest(codec="fp32", dim=cfg.dim, head_rows=tuple(cfg.head_sizes)),
                 matrix_values(shifted), progress=False)
    tiered = Engram(cfg, table=RowSourceTable(TieredTable(path))).eval()
    tiered.load_state_dict({k: v for k, v in module.state_dict().items() if not k.startswith("table.")},
                           strict=False)
    with torch.no_grad():
        got = tiered(hidden, row_ids=row_ids)
    assert (got - expected).abs().max().item() > TOLERANCE["fp8_e4m3"] * expected.abs().max().item()
