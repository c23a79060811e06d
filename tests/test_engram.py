"""The Engram module: reference math, shapes, causality, sparse gradients, row sources and codecs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from codec_bounds import error_bound

from tiergram.codecs import CODECS, Codec
from tiergram.engram import Engram, EngramConfig, RowSourceTable, ShortConv, TrainableTable

HEAD_SIZES = [11, 13, 17, 19]  # distinct primes, like the hashing's per-head moduli


def make_config(hc_mult: int = 1, conv_kernel: int = 4, dim: int = 32, d_model: int = 24) -> EngramConfig:
    return EngramConfig(d_model=d_model, head_sizes=list(HEAD_SIZES), dim=dim, max_ngram_size=3,
                        hc_mult=hc_mult, conv_kernel=conv_kernel)


def make_inputs(cfg: EngramConfig, b: int = 2, length: int = 12, seed: int = 0):
    """(hidden [B, L, hc, d] float32, row_ids [B, L, H] int64 within each head's size)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, length, cfg.hc_mult, cfg.d_model, generator=g)
    sizes = torch.tensor(cfg.head_sizes)
    row_ids = (torch.rand(b, length, cfg.n_heads, generator=g) * sizes).long()
    return hidden, row_ids


def make_engram(cfg: EngramConfig, seed: int = 0, table=None) -> Engram:
    torch.manual_seed(seed)
    m = Engram(cfg, table)
    with torch.no_grad():  # non-trivial norm weights and biases, so the reference check sees them
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return m


def reference_forward(m: Engram, hidden: torch.Tensor, rows: torch.Tensor):
    """The demo's math written out with plain ops and an explicit convolution loop."""
    cfg = m.config
    d, hc, length = cfg.d_model, cfg.hc_mult, hidden.shape[1]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    e = rows.reshape(*rows.shape[:2], -1)
    gates = []
    for i in range(hc):
        key = rms(e @ m.key_projs[i].weight.T + m.key_projs[i].bias, m.norm1[i].weight)
        query = rms(hidden[:, :, i], m.norm2[i].weight)
        g = (key * query).sum(-1) / math.sqrt(d)
        g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
        gates.append(torch.sigmoid(g))
    gates = torch.stack(gates, -1)
    value = gates[..., None] * (e @ m.value_proj.weight.T + m.value_proj.bias)[:, :, None, :]
    if cfg.conv_kernel == 0:
        return value, gates
    k, dil = cfg.conv_kernel, cfg.max_ngram_size
    xn = torch.stack([rms(value[:, :, i], m.short_conv.norms[i].weight) for i in range(hc)], dim=2)
    w = m.short_conv.conv.weight.reshape(hc, d, k)  # channel i·d + j is branch i, feature j
    y = torch.zeros_like(xn)
    for t in range(length):
        for j in range(k):
            src = t - (k - 1 - j) * dil  # tap j looks (k-1-j)·dilation steps back
            if src >= 0:
                y[:, t] += w[:, :, j] * xn[:, src]
    return value + F.silu(y), gates


# --- shapes and reference math ---------------------------------------------------------------------


@pytest.mark.parametrize("hc_mult", [1, 4])
@pytest.mark.parametrize("conv_kernel", [0, 4])
def test_matches_reference_math(hc_mult, conv_kernel):
    cfg = make_config(hc_mult, conv_kernel)
    m = make_engram(cfg)
    hidden, row_ids = make_inputs(cfg)
    out, gates = m(hidden, row_ids=row_ids), m.gates(hidden, row_ids=row_ids)
    assert out.shape == hidden.shape and out.dtype == torch.float32
    assert gates.shape == (*hidden.shape[:2], hc_mult)
    with torch.no_grad():
        ref_out, ref_gates = reference_forward(m, hidden, m.table(row_ids))
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert (m.short_conv is None) == (conv_kernel == 0)


@pytest.mark.parametrize("hc_mult", [1, 4])
def test_gates_in_open_unit_interval_and_method_agrees(hc_mult):
    cfg = make_config(hc_mult)
    m = make_engram(cfg)
    hidden, row_ids = make_inputs(cfg)
    hidden[0, 0] = 0.0  # zero query: dot product 0 -> gate exactly 1/2
    hidden[1, 1] *= 1e4  # huge query: RMSNorm bounds the dot product, so the gate stays inside (0, 1)
    gates = m.gated_value(hidden, row_ids=row_ids)[1]
    assert torch.all((gates > 0) & (gates < 1))
    assert torch.all(gates[0, 0] == 0.5)
    assert torch.equal(m.gates(hidden, row_ids=row_ids), gates)


def test_default_table_is_trainable_with_config_geometry():
    m = Engram(make_config())
    assert isinstance(m.table, TrainableTable)
    assert m.table.embedding.weight.shape == (sum(HEAD_SIZES), 32) and m.table.embedding.sparse
    assert m.value_proj.in_features == len(HEAD_SIZES) * 32
    weight, offsets = m.table.weight_for_export()
    assert weight.dtype == torch.float32 and weight.shape == (60, 32)
    assert offsets == [0, 11, 24, 41]
    assert torch.equal(weight, m.table.embedding.weight.detach())
    weight += 1  # a copy: exporting never aliases the live parameter
    assert not torch.equal(weight, m.table.embedding.weight.detach())


def test_table_lookup_uses_per_head_offsets():
    table = TrainableTable(HEAD_SIZES, 8)
    ids = torch.tensor([[[0, 0, 0, 0], [10, 12, 16, 18]]])
    rows = table(ids)
    w = table.embedding.weight
    assert torch.equal(rows[0, 0], w[[0, 11, 24, 41]])
    assert torch.equal(rows[0, 1], w[[10, 23, 40, 59]])


# --- causality -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hc_mult", [1, 4])
@pytest.mark.parametrize("conv_kernel", [0, 4])
def test_causal(hc_mult, conv_kernel):
    cfg = make_config(hc_mult, conv_kernel)
    m = make_engram(cfg)
    hidden, row_ids = make_inputs(cfg, length=16)
    with torch.no_grad():
        base = m(hidden, row_ids=row_ids)
        for t in (0, 5, 15):
            h2, r2 = hidden.clone(), row_ids.clone()
            h2[:, t:] += torch.randn_like(h2[:, t:])
            r2[:, t:] = (r2[:, t:] + 1) % torch.tensor(HEAD_SIZES)
            out = m(h2, row_ids=r2)
            assert torch.equal(out[:, :t], base[:, :t]), f"positions before {t} changed"
            assert not torch.allclose(out[:, t], base[:, t])


def test_short_conv_reach_is_kernel_times_dilation():
    # output t sees inputs t, t-3, t-6, t-9 (kernel 4, dilation 3) and nothing in between
    conv = ShortConv(hidden=8, kernel_size=4, dilation=3, hc_mult=2)
    x = torch.randn(1, 20, 2, 8)
    with torch.no_grad():
        base = conv(x)
        for src in range(20):
            x2 = x.clone()
            x2[:, src] += 1.0
            changed = {t for t in range(20) if not torch.equal(conv(x2)[:, t], base[:, t])}
            assert changed == {t for t in range(src, 20) if (t - src) % 3 == 0 and t - src <= 9}


# --- gradients -------------------------------------------------------------------------------------


def test_sparse_gradient_only_on_touched_rows():
    cfg = make_config(hc_mult=4)
    m = make_engram(cfg)
    hidden, row_ids = make_inputs(cfg, length=5)
    m(hidden, row_ids=row_ids).square().sum().backward()
    grad = m.table.embedding.weight.grad
    assert grad.is_sparse
    touched = torch.unique(row_ids + torch.tensor([0, 11, 24, 41]))
    assert torch.equal(torch.unique(grad.coalesce().indices()[0]), touched)
    assert len(touched) < sum(HEAD_SIZES)  # the test means something: some rows are untouched

    # one SparseAdam step moves exactly the touched rows
    before = m.table.embedding.weight.detach().clone()
    torch.optim.SparseAdam([m.table.embedding.weight], lr=1e-2).step()
    moved = torch.nonzero((m.table.embedding.weight.detach() != before).any(dim=1)).flatten()
    assert torch.equal(moved, touched)


def test_rows_path_equals_row_ids_path():
    cfg = make_config(hc_mult=4)
    m = make_engram(cfg)
    hidden, row_ids = make_inputs(cfg)
    rows = m.table(row_ids).detach().requires_grad_(True)
    out_rows, gates_rows = m(hidden, rows=rows), m.gates(hidden, rows=rows)
    out_ids, gates_ids = m(hidden, row_ids=row_ids), m.gates(hidden, row_ids=row_ids)
    assert torch.equal(out_rows, out_ids) and torch.equal(gates_rows, gates_ids)
    out_rows.sum().backward()  # fetched rows still get a gradient (e.g. to study what the table learns)
    assert rows.grad is not None and rows.grad.shape == rows.shape


# --- row sources and codecs ------------------------------------------------------------------------


class EncodedRows:
    """In-memory row source: every row encoded once with a codec, decoded on lookup, like a tier."""

    def __init__(self, weight: torch.Tensor, offsets: list[int], codec: Codec):
        self.codec, self.dim = codec, weight.shape[1]
        self.encoded = codec.encode(weight)
        self.offsets = torch.tensor(offsets)
        self.calls = 0

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g = (row_ids + self.offsets).reshape(-1).numpy()
        return self.codec.decode(self.encoded[g], self.dim).reshape(*row_ids.shape, self.dim)


def engram_over_source(trained: Engram, source) -> Engram:
    """An Engram with the same projection/norm/conv weights as `trained`, reading rows from `source`."""
    m = Engram(trained.config, RowSourceTable(source))
    missing, unexpected = m.load_state_dict(trained.state_dict(), strict=False)
    assert not missing and unexpected == ["table.embedding.weight"]
    return m


@pytest.mark.parametrize("codec_name", list(CODECS))
@pytest.mark.parametrize("hc_mult", [1, 4])
def test_row_source_table_matches_trainable_within_codec_error(codec_name, hc_mult):
    codec = CODECS[codec_name]
    cfg = make_config(hc_mult, dim=32, d_model=16)
    trained = make_engram(cfg, seed=1)
    hidden, row_ids = make_inputs(cfg, b=2, length=6, seed=1)
    weight, offsets = trained.table.weight_for_export()
    source = EncodedRows(weight, offsets, codec)
    served = engram_over_source(trained, source)
    with torch.no_grad():
        exact = trained(hidden, row_ids=row_ids)
        got = served(hidden, row_ids=row_ids)
    assert source.calls == 1

    # Tolerance: the codec bounds each row value's error by delta (error_bound); to first order the
    # output moves by at most |J|·delta, J the Jacobian of the output in the rows. Twice that covers
    # the second-order terms (gate curvature, RMSNorm), plus float32 round-off.
    rows = trained.table(row_ids).detach()
    delta = torch.from_numpy(error_bound(codec, weight.numpy()))[row_ids + torch.tensor(offsets)]
    jac = torch.func.jacrev(lambda r: trained(hidden, rows=r))(rows)  # [out..., in...]
    jac = jac.reshape(hidden.numel(), rows.numel()).double()
    first_order = (jac.abs() @ delta.reshape(-1)).reshape(hidden.shape)
    tol = 2 * first_order + 1e-5 * (1 + exact.abs().double())
    err = (got - exact).abs().double()
    assert torch.all(err <= tol), f"worst err/tol {(err / tol).max():.3f}"
    if codec_name == "fp32":
        assert torch.equal(got, exact)  # float32 weights survive fp32 bit for bit
    else:  # the codec really perturbs the output ...
        assert err.max() > 0
    # ... and the tolerance has teeth: serving head 0 its neighbouring rows breaks it
    wrong_ids = row_ids.clone()
    wrong_ids[..., 0] = (wrong_ids[..., 0] + 1) % HEAD_SIZES[0]
    with torch.no_grad():
        wrong = served(hidden, row_ids=wrong_ids)
    assert torch.any((wrong - exact).abs().double() > tol)


def test_row_source_table_casts_to_module_dtype():
    cfg = make_config(hc_mult=4)
    trained = make_engram(cfg)
    weight, offsets = trained.table.weight_for_export()
    m = engram_over_source(trained, EncodedRows(weight, offsets, CODECS["fp32"])).to(torch.bfloat16)
    hidden, row_ids = make_inputs(cfg)
    assert m.table(row_ids).dtype == torch.bfloat16  # the source serves float32; the table casts
    out = m(hidden, row_ids=row_ids)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
    torch.testing.assert_close(out.float(), trained(hidden, row_ids=row_ids).detach(), rtol=0.05, atol=0.05)


def test_row_source_table_rejects_bad_sources():
    with pytest.raises(TypeError, match="lookup"):
        RowSourceTable(object())

    class WrongShape:
        def lookup(self, row_ids):
            return torch.zeros(*row_ids.shape[:2], 32)

    m = Engram(make_config(), RowSourceTable(WrongShape()))
    hidden, row_ids = make_inputs(m.config)
    with pytest.raises(ValueError, match="row source returned shape"):
        m(hidden, row_ids=row_ids)


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id,head", [(11, 0), (-1, 2), (19, 3)])
def test_out_of_range_id_raises_index_error(bad_id, head):
    cfg = make_config()
    hidden, row_ids = make_inputs(cfg)
    row_ids[1, 4, head] = bad_id
    weight, offsets = TrainableTable(HEAD_SIZES, 32).weight_for_export()
    for m in (Engram(cfg), Engram(cfg, RowSourceTable(EncodedRows(weight, offsets, CODECS["fp32"])))):
        pos = 1 * row_ids.shape[1] + 4  # positions count over [B, L] flattened, as every reader reports them
        with pytest.raises(IndexError, match=rf"row id {bad_id} out of range for head {head} .*at position {pos}$"):
            m(hidden, row_ids=row_ids)
    with pytest.raises(IndexError, match=f"head {head}"):
        TrainableTable(HEAD_SIZES, 32)(row_ids)


def test_bad_arguments_rejected():
    cfg = make_config(hc_mult=4)
    m = Engram(cfg)
    hidden, row_ids = make_inputs(cfg)
    rows = m.table(row_ids)
    with pytest.raises(ValueError, match="exactly one"):
        m(hidden)
    with pytest.raises(ValueError, match="exactly one"):
        m(hidden, row_ids=row_ids, rows=rows)
    with pytest.raises(ValueError, match="hidden must have shape"):
        m(hidden[:, :, 0], row_ids=row_ids)
    with pytest.raises(ValueError, match=r"\[B, L, H, D\]"):
        m(hidden, rows=rows[:, :, :2])
    with pytest.raises(ValueError, match="one id per head"):
        m(hidden, row_ids=row_ids[..., :3])
    with pytest.raises(ValueError, match="row ids must be integers, got float32"):
        m(hidden, row_ids=row_ids.float())
    with pytest.raises(ValueError, match="does not match"):
        Engram(cfg, TrainableTable([5, 5], 32))
    with pytest.raises(ValueError, match="head_sizes"):
        EngramConfig(d_model=8, head_sizes=[], dim=32, max_ngram_size=3)
    with pytest.raises(ValueError, match="hc_mult"):
        EngramConfig(d_model=8, head_sizes=[3], dim=32, max_ngram_size=3, hc_mult=0)


def test_codec_error_bound_shape_used_above():
    # the tolerance above indexes error_bound by global row: it must be elementwise [rows, D]
    w = np.random.default_rng(0).standard_normal((60, 32)).astype(np.float32)
    for codec in CODECS.values():
        assert error_bound(codec, w).shape == w.shape
