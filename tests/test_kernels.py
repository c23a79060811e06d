"""Fused gather + dequant kernels against the reference codecs: Triton interpreted on the CPU, compiled on a GPU."""

from __future__ import annotations

import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run on CPU tensors

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]' on Linux x86_64)")

from tiergram.codecs import get_codec  # noqa: E402
from tiergram.format import TableFile, TableManifest, create_table, random_values  # noqa: E402
from tiergram.kernels import (  # noqa: E402
    RowLayout,
    gather_dequant,
    gather_dequant_torch,
    pick_backend,
)

DEV = torch.device("cuda" if GPU else "cpu")
CODECS = ["fp32", "bf16", "int8", "fp8_e4m3"]
DTYPES = [torch.float32, torch.bfloat16]
HEAD_ROWS = np.array([37, 50, 13], dtype=np.int64)
OFFSETS = np.concatenate([[0], np.cumsum(HEAD_ROWS)[:-1]]).astype(np.int64)
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


class Region:
    """A page-structured data region of random row bytes (every bit pattern, edge codes planted) and its rows."""

    def __init__(self, codec: str, dim: int, seed: int = 0, head_rows: np.ndarray = HEAD_ROWS):
        c = get_codec(codec)
        rb = c.row_bytes(dim)
        page = 512 if rb + 8 <= 512 else 4096
        self.layout = RowLayout(codec, dim, rb, (page - 8) // rb, page)
        self.codec, self.dim = c, dim
        total = int(head_rows.sum())
        rng = np.random.default_rng(seed)
        self.rows = rng.integers(0, 256, (total, rb), dtype=np.uint8)
        _plant_edges(self.rows, codec, dim)
        data = np.zeros(self.layout.bytes_needed(total) + 8, dtype=np.uint8)
        for g in range(total):
            o = self.layout.row_offset(g)
            data[o:o + rb] = self.rows[g]
        self.data = torch.from_numpy(data).to(DEV)

    def expect(self, global_rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """The reference decode of global rows [...] as [..., D]."""
        flat = self.codec.decode(self.rows[np.asarray(global_rows).reshape(-1)], self.dim, dtype)
        return flat.reshape(*np.shape(global_rows), self.dim)


def _plant_edges(rows: np.ndarray, codec: str, dim: int) -> None:
    """Put the codes with special decodes into the first rows: NaN, -0, subnormals, extreme scales."""
    if codec == "fp8_e4m3":
        rows[0, :16] = [0x00, 0x80, 0x01, 0x81, 0x07, 0x7F, 0xFF, 0x7E, 0xFE, 0x08, 0x88, 0x3F, 0x40, 0x77, 0x78, 0x06]
        rows[0, dim:] = 0  # scale 2^-127: subnormal results
        rows[1, dim:] = 255  # NaN scale
        rows[2, dim:] = 254  # 2^127: overflow to inf
        rows[3, :dim] = 0x80  # all -0
    elif codec == "int8":
        for r, s in enumerate([np.nan, np.inf, 2.0**-149, -0.0, 3.4e38]):
            rows[r, dim:dim + 4] = np.frombuffer(np.float32(s).tobytes(), np.uint8)
        rows[5, :dim] = 0x80  # -128
    elif codec == "bf16":
        rows[0, :8] = np.frombuffer(np.array([0x7FC0, 0xFF80, 0x8000, 0x0001], "<u2").tobytes(), np.uint8)
    else:
        ties = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x807F8000], "<u4").view("<f4")  # bf16 RNE edges
        edges = np.concatenate([np.array([np.nan, -np.inf, -0.0, 1e-45], "<f4"), ties])
        rows[0, :32] = np.frombuffer(edges.tobytes(), np.uint8)


def random_ids(n: int, seed: int) -> np.ndarray:
    """ids [n, 3] with duplicates, both ends of every head, one whole position repeated."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, r, n) for r in HEAD_ROWS], axis=-1)
    ids[0] = 0
    ids[-1] = HEAD_ROWS - 1
    ids[-2] = ids[1]
    ids[3:6, 0] = 7
    return ids


def assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact equality (NaN payloads aside): signed zeros, subnormals and infinities all count."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    iview = torch.int32 if got.dtype == torch.float32 else torch.int16
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(want))
    assert torch.equal(got.view(iview)[~nan], want.view(iview)[~nan])


@pytest.fixture(scope="module")
def regions() -> dict[tuple[str, int], Region]:
    return {(c, d): Region(c, d, seed=d) for c in CODECS for d in (32, 64, 256)}


# --- fused gather + dequant -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dim", [32, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gather_matches_reference(regions, codec, dim, dtype):
    r = regions[(codec, dim)]
    ids = random_ids(7, seed=dim)  # 21 rows: a tail for every block size below
    ids[1] = [0, 1, 2]  # the planted rows (global 0..3 are in head 0)
    ids[2, 0] = 3
    for block_rows in (8, None):
        got = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, dtype=dtype, block_rows=block_rows,
                             backend="triton")
        assert_bits(got, r.expect(ids + OFFSETS, dtype))


@pytest.mark.parametrize("codec,dim", [("int8", 33), ("int8", 36), ("fp8_e4m3", 96), ("bf16", 24)])
def test_gather_odd_dims_and_alignments(codec, dim):
    """D not a power of two; int8 scales at unaligned offsets (row_bytes 37: no alignment at all)."""
    r = Region(codec, dim, seed=5)
    assert r.layout.align in (1, 2, 4, 8, 16)
    ids = random_ids(5, seed=1)
    got = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, block_rows=4, backend="triton")
    assert_bits(got, r.expect(ids + OFFSETS, torch.float32))


@pytest.mark.parametrize("codec", CODECS)
def test_gather_from_a_table_file(tmp_path, codec):
    """The layout read from a real table file: rows straddle no page and the trailer is skipped."""
    m = TableManifest(codec=codec, dim=64, head_rows=(40, 9, 70), page_size=1024)
    create_table(tmp_path / "t.tgram", m, random_values(64, seed=3), progress=False)
    t = TableFile.open(tmp_path / "t.tgram")
    data = t.read_data()
    ids = np.array([[0, 0, 0], [39, 8, 69], [17, 3, 33], [17, 3, 33]])
    got = gather_dequant(torch.from_numpy(data).to(DEV), ids, RowLayout.of(m), t.head_offsets, t.head_rows,
                         dtype=torch.bfloat16, backend="triton")
    lay = RowLayout.of(m)
    glob = (ids + t.head_offsets).reshape(-1)
    raw = np.stack([data[lay.row_offset(g):lay.row_offset(g) + lay.row_bytes] for g in glob])
    assert_bits(got, get_codec(codec).decode(raw, 64, torch.bfloat16).reshape(4, 3, 64))


def test_torch_backend_matches(regions):
    r = regions[("fp8_e4m3", 64)]
    ids = random_ids(6, seed=2)
    a = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, backend="torch")
    b = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, backend="triton")
    assert_bits(a, b)
    assert_bits(a, r.expect(ids + OFFSETS, torch.float32))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("codec,dim", [("fp8_e4m3", 256), ("int8", 33), ("fp32", 32)])
def test_copy_rows_gives_the_encoded_bytes(codec, dim, backend):
    """The raw row copy (the GPU benchmark's limit for a gather) moves each row's bytes unchanged, tail included."""
    from tiergram.kernels.gather import copy_rows_unchecked

    r = Region(codec, dim, seed=4)
    ids = random_ids(5, seed=3)
    out = torch.empty(ids.size * r.layout.row_bytes, dtype=torch.uint8, device=DEV)
    copy_rows_unchecked(r.data, torch.from_numpy(ids.reshape(-1)).to(DEV), torch.from_numpy(OFFSETS).to(DEV), out,
                        r.layout, block_rows=4, backend=backend)
    want = r.rows[(ids + OFFSETS).reshape(-1)]
    assert np.array_equal(out.view(-1, r.layout.row_bytes).cpu().numpy(), want)


def test_shapes_out_and_empty(regions):
    r = regions[("int8", 32)]
    ids = random_ids(6, seed=4).reshape(2, 3, 3)
    out = torch.full((2, 3, 3, 32), 7.0, device=DEV)
    assert gather_dequant(r.data, torch.from_numpy(ids).to(DEV), r.layout, OFFSETS, HEAD_ROWS, out=out) is out
    assert_bits(out, r.expect(ids + OFFSETS, torch.float32))
    empty = gather_dequant(r.data, np.zeros((0, 3), np.int64), r.layout, OFFSETS, HEAD_ROWS, device=DEV)
    assert tuple(empty.shape) == (0, 3, 32)


# --- bounds are checked before launch -----------------------------------------------------------------


@pytest.mark.parametrize("head,bad", [(0, -1), (0, 37), (1, 50), (2, 13), (2, 2**40), (1, -(2**63))])
@pytest.mark.parametrize("where", ["host", "device"])
def test_out_of_range_ids_refused_before_launch(regions, head, bad, where):
    r = regions[("fp8_e4m3", 32)]
    ids = np.zeros((4, 3), np.int64)
    ids[2, head] = bad
    out = torch.full((4, 3, 32), 7.0, device=DEV)
    arg = ids if where == "host" else torch.from_numpy(ids).to(DEV)
    with pytest.raises(IndexError, match=f"row id {bad} out of range for head {head} .*at position 2"):
        gather_dequant(r.data, arg, r.layout, OFFSETS, HEAD_ROWS, out=out, backend="triton")
    assert bool((out == 7.0).all())  # nothing ran


def test_bad_arguments_refused(regions):
    r = regions[("fp32", 32)]
    ids = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match="data holds"):
        gather_dequant(r.data[:100], ids, r.layout, OFFSETS, HEAD_ROWS)
    with pytest.raises(ValueError, match="one id per head"):
        gather_dequant(r.data, np.zeros((2, 2), np.int64), r.layout, OFFSETS, HEAD_ROWS)
    with pytest.raises(ValueError, match="uint8"):
        gather_dequant(r.data.view(torch.int8), ids, r.layout, OFFSETS, HEAD_ROWS)
    with pytest.raises(ValueError, match="4-byte boundary"):
        gather_dequant(r.data[1:], ids, r.layout, OFFSETS, HEAD_ROWS)
    with pytest.raises(ValueError, match="dtype"):
        gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, out=torch.empty(2, 3, 31, device=DEV))
    with pytest.raises(ValueError, match="rows of 16 bytes"):
        RowLayout("fp32", 4, 16, 40, 512)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        pick_backend(DEV, "cuda-graph")


# --- cache probe + gather ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_cached_gather_hits_misses_and_fill(regions, codec, dtype):
    r = regions[(codec, 64)]
    rb, s = r.layout.row_bytes, 6
    decoy = Region(codec, 64, seed=99)  # cache rows differ from the table: a hit must come from the cache
    cache = torch.zeros((s, rb), dtype=torch.uint8, device=DEV)
    cache[:3] = torch.from_numpy(decoy.rows[:3]).to(DEV)
    ids = random_ids(5, seed=7)  # [5, 3] = 15 ids
    slots = np.full(15, -1, np.int64)
    slots[[0, 4, 9]] = [0, 1, 2]
    fill = np.full(15, -1, np.int64)
    fill[[1, 7]] = [4, 5]
    got = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache, slots=slots, fill=fill, dtype=dtype,
                         block_rows=4, backend="triton")
    want = r.expect(ids + OFFSETS, dtype).reshape(15, 64)
    want[[0, 4, 9]] = decoy.codec.decode(decoy.rows[:3], 64, dtype)
    assert_bits(got.reshape(15, 64), want)
    glob = (ids + OFFSETS).reshape(-1)
    assert np.array_equal(cache[4].cpu().numpy(), r.rows[glob[1]])
    assert np.array_equal(cache[5].cpu().numpy(), r.rows[glob[7]])
    assert np.array_equal(cache[:3].cpu().numpy(), decoy.rows[:3])  # hits are never written
    ref_cache = torch.zeros_like(cache)
    ref_cache[:3] = cache[:3]
    ref = torch.empty(15, 64, dtype=dtype, device=DEV)
    gather_dequant_torch(r.data, torch.from_numpy(ids).to(DEV), torch.from_numpy(OFFSETS).to(DEV), r.layout, ref,
                         ref_cache, torch.from_numpy(slots).to(DEV), torch.from_numpy(fill).to(DEV))
    assert_bits(ref, want)
    assert torch.equal(ref_cache, cache)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_cached_gather_without_fill_writes_nothing(regions, as_tensor):
    """fill=None: misses are read from the table and the cache is left alone (the kernel once wrote each miss into
    cache row `id`, out of bounds for a cache smaller than a head). Slots given as tensors are accepted too."""
    r = regions[("fp8_e4m3", 32)]
    cache = torch.zeros((64, r.layout.row_bytes), dtype=torch.uint8, device=DEV)  # > any id: a stray write lands
    cache[:2] = 9
    ids = random_ids(5, seed=11)
    slots = np.full(15, -1, np.int64)
    slots[[2, 6]] = [0, 1]
    arg = torch.from_numpy(slots).to(DEV) if as_tensor else slots
    got = gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache, slots=arg, block_rows=4,
                         backend="triton")
    want = r.expect(ids + OFFSETS, torch.float32).reshape(15, 32)
    want[[2, 6]] = r.codec.decode(np.full((2, r.layout.row_bytes), 9, np.uint8), 32, torch.float32)
    assert_bits(got.reshape(15, 32), want)
    assert bool((cache[:2] == 9).all()) and not bool(cache[2:].any())
    if as_tensor:
        fill = torch.full((15,), -1, dtype=torch.int64, device=DEV)
        fill[0] = 5
        gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache, slots=arg, fill=fill, backend="triton")
        assert np.array_equal(cache[5].cpu().numpy(), r.rows[ids[0, 0] + OFFSETS[0]])


def test_cuda_device_without_index_is_the_current_gpu(monkeypatch):
    """device='cuda' must compare equal to the tensors' cuda:N, or every check of a device refuses them."""
    from tiergram.kernels.gather import _kernel_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _kernel_device("cuda", None, None, None) == torch.device("cuda", 0)
    assert _kernel_device(torch.device("cuda", 0), None, None, None) == torch.device("cuda", 0)
    assert _kernel_device(None, None, np.zeros((1, 3)), torch.empty(1)) == torch.device("cpu")


def test_cached_gather_refuses_bad_slots(regions):
    r = regions[("bf16", 32)]
    cache = torch.zeros((4, r.layout.row_bytes), dtype=torch.uint8, device=DEV)
    ids = np.zeros((2, 3), np.int64)
    for bad, match in [(np.array([0, 1, 2, 3, 4, -1]), r"-1\.\.3"), (np.array([-2, 0, 0, 0, 0, 0]), r"-1\.\.3"),
                       (np.zeros(5, np.int64), "one slot per id")]:
        with pytest.raises(ValueError, match=match):
            gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache, slots=bad)
        with pytest.raises(ValueError, match=match.replace("slots", "fill")):
            gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache, slots=np.full(6, -1), fill=bad)
    with pytest.raises(ValueError, match="cache must be"):
        gather_dequant(r.data, ids, r.layout, OFFSETS, HEAD_ROWS, cache=cache[:, 1:], slots=np.full(6, -1))


# --- compiled for a GPU, without one -------------------------------------------------------------------

_COMPILE_SM90 = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tiergram.kernels import RowLayout
from tiergram.kernels.gather import _next_pow2, default_block_rows
from tiergram.kernels.triton_kernels import gather_kernel

names = gather_kernel.arg_names
done = 0
for codec, dim in [("fp32", 64), ("bf16", 24), ("int8", 33), ("fp8_e4m3", 256), ("fp8_e4m3", 96)]:
    for packed in (False, True):  # a table's pages; a staging buffer (rows_per_page 1, one head: constexpr 1s)
        rb = RowLayout.packed(codec, dim).row_bytes
        lay = RowLayout.packed(codec, dim) if packed else RowLayout(codec, dim, rb, (4096 - 8) // rb, 4096)
        for cache, bf16 in [(False, True), (True, True)] + ([] if packed else [(False, False), (True, False)]):
            sig = {p: "*u8" if p in ("data", "cache") else "*i64" for p in names[:7]}
            sig["out"] = "*bf16" if bf16 else "*fp32"
            ints = dict(n_rows=1000, n_heads=1 if packed else 3, rows_per_page=lay.rows_per_page,
                        page_size=lay.page_size, row_bytes=lay.row_bytes)
            bd = _next_pow2(dim)
            consts = dict(D=dim, BLOCK_D=bd, BLOCK_S=max(1, bd // 32), BLOCK_R=default_block_rows(dim),
                          CODEC=lay.codec_id, ALIGN=lay.align, HAS_CACHE=cache, OUT_BF16=bf16)
            consts.update({k: v for k, v in ints.items() if v == 1})
            sig.update({k: "i32" for k, v in ints.items() if v != 1})
            sig.update({k: "constexpr" for k in consts})
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
            src = ASTSource(fn=gather_kernel, signature=sig, attrs=attrs,
                            constexprs={(names.index(k),): v for k, v in consts.items()})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert "ld.global" in k.asm["ptx"]
            done += 1
print("compiled", done)
"""


@pytest.mark.skipif(GPU, reason="on a GPU every test above compiles the kernel for real")
def test_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter accepts code the compiler refuses (types, layouts, constexpr use): compile every codec,
    with and without the cache, both outputs, page and packed layouts (fewer), for an H100/H200 target (PTX, then ptxas
    as Triton ships it), so a compile error shows up here rather than in the one GPU run."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {e}")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled 30" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# --- GPU only -------------------------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("codec", CODECS)
def test_uva_gather_from_registered_host_memory(regions, codec):
    from tiergram.tiers.device import PinnedHost

    r = regions[(codec, 256)]
    host = r.data.cpu().numpy().copy()
    pinned = PinnedHost(host, DEV)
    try:
        assert pinned.registered and pinned.tensor.is_pinned() and pinned.tensor.data_ptr() == host.ctypes.data
        ids = random_ids(64, seed=3)
        got = gather_dequant(pinned.tensor, ids, r.layout, OFFSETS, HEAD_ROWS, device=DEV, dtype=torch.bfloat16)
        assert got.is_cuda
        assert_bits(got, r.expect(ids + OFFSETS, torch.bfloat16))
    finally:
        pinned.close()


@gpu_only
def test_torch_backend_refuses_uva(regions):
    from tiergram.tiers.device import PinnedHost

    r = regions[("fp32", 32)]
    pinned = PinnedHost(r.data.cpu().numpy().copy(), DEV)
    try:
        with pytest.raises(ValueError, match="torch backend"):
            gather_dequant(pinned.tensor, np.zeros((1, 3), np.int64), r.layout, OFFSETS, HEAD_ROWS, device=DEV,
                           backend="torch")
    finally:
        pinned.close()
