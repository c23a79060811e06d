"""The typed store contract: TieredTable and DeviceTable both satisfy RowStore, member for member."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from tiergram.format import TableManifest, create_table, random_values
from tiergram.store import RowStore, RowTicket, TieredTable
from tiergram.store.device_table import DeviceTable

METHODS = ("lookup", "prefetch", "warm", "stats", "close")
PROPERTIES = ("num_heads", "dim")


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract") / "t.tgram"
    create_table(path, TableManifest(codec="fp32", dim=8, head_rows=[5, 7]), random_values(8), progress=False)
    return path


def opened(kind: str, path):
    if kind == "host":
        return TieredTable(path, tier="host")
    if kind == "file+cache":
        return TieredTable(path, tier="file", file_mode="buffered", cache_bytes=1 << 16)
    if kind == "device":
        return DeviceTable(path, device="cpu", tier="device", kernel_backend="torch")
    return DeviceTable(path, device="cpu", tier="host", cache_bytes=1 << 12, kernel_backend="torch")


@pytest.mark.parametrize("cls", [TieredTable, DeviceTable])
def test_signatures_match_the_protocol(cls):
    """Every method takes the protocol's parameters under the same names; the sizes are properties."""
    for name in METHODS:
        want = list(inspect.signature(getattr(RowStore, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[:len(want)] == want, f"{cls.__name__}.{name}{got} does not take {want}"
        assert all(p.default is not inspect.Parameter.empty for p in
                   list(inspect.signature(getattr(cls, name)).parameters.values())[len(want):]), name
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, name), property), f"{cls.__name__}.{name} is not a property"


@pytest.mark.parametrize("kind", ["host", "file+cache", "device", "device-host+cache"])
def test_tables_satisfy_the_contract(table_path, kind):
    """isinstance(RowStore) holds and each member behaves as documented: shapes, Ticket, warm, stats."""
    with opened(kind, table_path) as t:
        assert isinstance(t, RowStore)
        assert (t.num_heads, t.dim) == (2, 8)
        ids = np.array([[0, 1], [4, 6], [2, 3]], dtype=np.int64)
        rows = t.lookup(ids)
        assert tuple(rows.shape) == (3, 2, 8)
        ticket = t.prefetch(ids)
        assert isinstance(ticket, RowTicket)
        assert torch.equal(ticket.wait().cpu(), rows.cpu())
        warmed = t.warm(ids)
        assert (warmed is None) == (t.cache is None)
        if warmed is not None:
            assert isinstance(warmed, RowTicket)
            warmed.wait()
        assert isinstance(t.stats(), dict)


def test_a_partial_store_is_not_one():
    """An object with only `lookup` (an old duck-typed source) is not a RowStore."""
    class LookupOnly:
        def lookup(self, row_ids, out=None):
            return torch.zeros(1)

    assert not isinstance(LookupOnly(), RowStore)
