"""Table files (docs/table-format.md): layout checked from the document alone, refusals, crash safety."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_bounds import error_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram import _native
from tiergram.codecs import get_codec
from tiergram.format import TableFile, TableFormatError, TableManifest, create_table, matrix_values, write_table
from tiergram.format import reader as reader_mod
from tiergram.format import writer as writer_mod
from tiergram.tiers import HostTier

CODECS = ["fp32", "bf16", "int8", "fp8_e4m3"]
# row_bytes straight from the document's codec table, not from the code under test
DOC_ROW_BYTES = {"fp32": lambda d: 4 * d, "bf16": lambda d: 2 * d, "int8": lambda d: d + 4,
                 "fp8_e4m3": lambda d: d + d // 32}
HEADER = struct.Struct("<8sIIQII")


# --- an independent CRC-32C (Castagnoli, reflected, init/final xor 0xFFFFFFFF) -------------------


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c_py(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def native_crc(data: bytes) -> int:
    return _native.crc32c(np.frombuffer(data, dtype=np.uint8))


def test_crc32c_check_value():
    assert crc32c_py(b"123456789") == 0xE3069283
    assert native_crc(b"123456789") == 0xE3069283
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 63, 64, 65, 1000, 4092):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert native_crc(data) == crc32c_py(data), n


# --- helpers ---------------------------------------------------------------------------------------


def table_values(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """float32 [n, dim]: normal values with per-row scales over many decades, plus an all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)) * np.exp2(rng.integers(-20, 20, (n, 1)))
    x[n // 2] = 0.0
    return x.astype(np.float32)


def make_table(path: Path, codec: str, dim: int, head_rows: tuple[int, ...], page_size: int = 4096,
               seed: int = 0, **kw) -> tuple[Path, np.ndarray, TableManifest]:
    values = table_values(sum(head_rows), dim, seed)
    m = TableManifest(codec=codec, dim=dim, head_rows=head_rows, page_size=page_size, **kw)
    create_table(path, m, matrix_values(values), progress=False)
    return path, values, m


def read_header(path: Path) -> tuple[tuple, dict, bytes]:
    blob = path.read_bytes()
    fields = HEADER.unpack_from(blob, 0)
    return fields, json.loads(blob[32:32 + fields[3]]), blob


def rewrite_header(path: Path, obj: dict | bytes | None = None, *, version: int = 1, page_size: int | None = None,
                   magic: bytes = b"TIERGRAM") -> None:
    """Replace header + manifest with correct checksums (keeping the data region as it is)."""
    (_, _, ps, _, _, _), old, blob = read_header(path)
    data_offset = old["data_offset"]
    body = obj if isinstance(obj, bytes) else json.dumps(old if obj is None else obj, sort_keys=True).encode()
    assert 32 + len(body) <= data_offset, "test manifest must fit the existing header area"
    head = struct.pack("<8sIIQI", magic, version, ps if page_size is None else page_size, len(body),
                       native_crc(body))
    head += struct.pack("<I", native_crc(head))
    path.write_bytes(head + body + b"\0" * (data_offset - 32 - len(body)) + blob[data_offset:])


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def bits(t: torch.Tensor) -> np.ndarray:
    """Bit patterns of a float tensor, so -0.0/+0.0 and NaN payloads count."""
    t = t.contiguous()
    return (t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)).numpy()


def reference(codec: str, values: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    c = get_codec(codec)
    enc = c.encode(values)
    return enc, c.decode(enc, values.shape[1])


# --- round trip and layout -------------------------------------------------------------------------

GEOMETRIES = [  # codec, dim, page_size, head_rows
    ("fp32", 8, 512, (50, 13, 1)),
    ("fp32", 126, 512, (7, 3)),  # 504-byte rows + 8-byte trailer fill a 512-byte page exactly
    ("fp32", 64, 4096, (100,)),
    ("bf16", 3, 512, (200, 1, 77)),
    ("bf16", 64, 4096, (1000, 999)),
    ("int8", 1, 512, (300,)),
    ("int8", 100, 1024, (40, 41, 42, 43)),
    ("int8", 256, 4096, (64, 64)),
    ("fp8_e4m3", 32, 512, (31, 30)),
    ("fp8_e4m3", 256, 4096, (200, 100, 50)),  # DeepSeek's 264-byte row, 15 rows per page
    ("fp8_e4m3", 480, 512, (5, 4)),  # 495-byte rows: one per page
    ("fp8_e4m3", 64, 8192, (500,)),
]


@pytest.mark.parametrize("codec,dim,page_size,head_rows", GEOMETRIES,
                         ids=[f"{c}-d{d}-p{p}-h{len(h)}" for c, d, p, h in GEOMETRIES])
def test_round_trip_layout(tmp_path, codec, dim, page_size, head_rows):
    path, values, m = make_table(tmp_path / "t.tgram", codec, dim, head_rows, page_size, layer_id=3,
                                 hashing={"max_ngram": 3}, provenance={"by": "test"})
    assert os.listdir(tmp_path) == ["t.tgram"]  # no temp file left behind

    # (a) header and manifest, with every derived field computed from the document's rules
    (magic, version, ps, mlen, mcrc, hcrc), obj, blob = read_header(path)
    assert (magic, version, ps) == (b"TIERGRAM", 1, page_size)
    assert mcrc == crc32c_py(blob[32:32 + mlen]) and hcrc == crc32c_py(blob[:28])
    rb = DOC_ROW_BYTES[codec](dim)
    rpp = (page_size - 8) // rb
    total = sum(head_rows)
    n_pages = -(-total // rpp)
    offsets = [sum(head_rows[:h]) for h in range(len(head_rows))]
    data_offset = obj["data_offset"]
    assert data_offset % page_size == 0 and data_offset >= 32 + mlen
    assert blob[32 + mlen:data_offset] == b"\0" * (data_offset - 32 - mlen)
    assert len(blob) == data_offset + n_pages * page_size
    assert obj == {"format": "tiergram-table", "version": 1, "codec": codec, "dim": dim, "row_bytes": rb,
                   "page_size": page_size, "rows_per_page": rpp,
                   "heads": [{"rows": n, "row_offset": o} for n, o in zip(head_rows, offsets, strict=True)],
                   "total_rows": total, "n_pages": n_pages, "data_offset": data_offset, "layer_id": 3,
                   "hashing": {"max_ngram": 3}, "provenance": {"by": "test"}}

    t = TableFile.open(path)
    assert t.manifest == m and t.data_offset == data_offset and t.path == path
    assert list(t.head_offsets) == offsets and list(t.head_rows) == list(head_rows)
    assert (t.manifest.row_bytes, t.manifest.rows_per_page, t.manifest.n_pages) == (rb, rpp, n_pages)

    data = t.read_data()
    assert data.dtype == np.uint8 and data.tobytes() == blob[data_offset:]
    assert t.verify() == []

    # (b) every row, found by the documented page/offset arithmetic, holds the codec's encoding
    enc, ref = reference(codec, values)
    pages = data.reshape(n_pages, page_size)
    c = get_codec(codec)
    assert rpp * rb + 8 <= page_size  # (c) no row straddles a page or touches the trailer
    raw = np.stack([pages[g // rpp, (g % rpp) * rb:(g % rpp) * rb + rb] for g in range(total)])
    assert np.array_equal(raw, enc)
    assert np.array_equal(bits(c.decode(raw, dim)), bits(ref))
    # and the values are the input up to the codec's documented error
    err = np.abs(c.decode(raw, dim).numpy().astype(np.float64) - values.astype(np.float64))
    assert np.all(err <= error_bound(c, values))

    # (c) page trailers: the page index, then CRC-32C of everything before the checksum
    for p in range(n_pages):
        page = pages[p].tobytes()
        assert struct.unpack_from("<I", page, page_size - 8)[0] == p
        crc = struct.unpack_from("<I", page, page_size - 4)[0]
        assert crc == native_crc(page[:page_size - 4])
        if p in (0, n_pages - 1):
            assert crc == crc32c_py(page[:page_size - 4])
        used = min(rpp, total - p * rpp) * rb
        assert page[used:page_size - 8] == b"\0" * (page_size - 8 - used)  # padding after the last row


@pytest.mark.parametrize("chunk_pages", [1, 2, 3, 5])
def test_chunked_writes_give_the_same_file(tmp_path, monkeypatch, chunk_pages):
    """Rows written a few pages at a time (the last chunk and the last page partly filled) land in place."""
    whole, values, m = make_table(tmp_path / "whole.tgram", "fp8_e4m3", 64, (40, 33), 512)  # 7 rows/page
    monkeypatch.setattr(writer_mod, "_CHUNK_PAGES", chunk_pages)
    calls = []
    src = matrix_values(values)

    def logged(start: int, n: int) -> np.ndarray:
        calls.append((start, n))
        return src(start, n)

    chunked = create_table(tmp_path / "chunked.tgram", m, logged, progress=False)
    assert chunked.read_bytes() == whole.read_bytes()
    assert calls == [(g, min(7 * chunk_pages, 73 - g)) for g in range(0, 73, 7 * chunk_pages)]


def test_data_offset_grows_with_a_large_manifest(tmp_path):
    big = {"note": "x" * 5000}  # a manifest longer than one page pushes the data to the next boundary
    path, values, m = make_table(tmp_path / "t.tgram", "int8", 16, (10, 10), 512, provenance=big)
    t = TableFile.open(path)
    (_, _, _, mlen, _, _), obj, _ = read_header(path)
    assert t.data_offset == obj["data_offset"] == -(-(32 + mlen) // 512) * 512 > 5000
    assert t.manifest.provenance == big
    enc, _ = reference("int8", values)
    assert t.manifest.rows_per_page == 25  # all 20 rows of 20 bytes in page 0
    assert np.array_equal(t.read_data().reshape(-1, 512)[0, : 20 * 20].reshape(20, 20), enc)


def test_read_data_into_buffer(tmp_path):
    path, _, m = make_table(tmp_path / "t.tgram", "bf16", 64, (100,), 512)
    t = TableFile.open(path)
    buf = np.empty(m.data_bytes, dtype=np.uint8)
    assert t.read_data(buf) is buf
    assert buf.tobytes() == path.read_bytes()[t.data_offset:]
    with pytest.raises(ValueError, match="buffer must be uint8"):
        t.read_data(np.empty(m.data_bytes - 1, dtype=np.uint8))
    with pytest.raises(ValueError, match="buffer must be uint8"):
        t.read_data(np.empty(m.data_bytes, dtype=np.int8))


# --- the manifest on its own -----------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(codec="fp4", dim=64), "unknown codec 'fp4'"),
    (dict(codec="fp8_e4m3", dim=48), "cannot encode rows of dim 48"),
    (dict(codec="int8", dim=0), "cannot encode rows of dim 0"),
    (dict(codec="fp32", dim=2**62 + 1), "cannot encode rows of dim"),  # 4·D must not wrap around
    (dict(codec="fp32", dim=8, page_size=1000), "page_size 1000"),
    (dict(codec="fp32", dim=8, page_size=256), "page_size 256"),
    (dict(codec="fp32", dim=8, page_size=2**32), "page_size 4294967296"),
    (dict(codec="fp32", dim=200, page_size=512), "800-byte row does not fit a 512-byte page"),
    (dict(codec="fp32", dim=127, page_size=512), "508-byte row does not fit"),  # 508 + 8 > 512
    (dict(codec="fp32", dim=8, head_rows=()), "at least one row"),
    (dict(codec="fp32", dim=8, head_rows=(5, 0)), "at least one row"),
])
def test_manifest_rejects_bad_geometry(kw, match):
    kw.setdefault("head_rows", (10,))
    with pytest.raises(TableFormatError, match=match):
        TableManifest(**kw)


# --- refusals at open ------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path) -> Path:
    path, _, _ = make_table(tmp_path / "good.tgram", "fp8_e4m3", 64, (100, 60), 1024)
    TableFile.open(path)
    return path


def refuse(path: Path, match: str) -> str:
    with pytest.raises(TableFormatError, match=match) as e:
        TableFile.open(path)
    assert str(path) in str(e.value)
    return str(e.value)


def test_refuses_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tgram"):
        TableFile.open(tmp_path / "nope.tgram")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n" + bytes(5000), b"SQLite format 3\0" + bytes(100),
                                     b"tiergram" + bytes(4088), bytes(4096)])
def test_refuses_foreign_file(tmp_path, content):
    path = tmp_path / "foreign.bin"
    path.write_bytes(content)
    refuse(path, "not a tiergram table")


@pytest.mark.parametrize("cut", ["empty", 10, 31, 40, "manifest_end", "data_offset", "one_page_less", "one_byte_less"])
def test_refuses_truncated_file(good, cut):
    blob = good.read_bytes()
    (_, _, ps, mlen, _, _), obj, _ = read_header(good)
    n = {"empty": 0, "manifest_end": 32 + mlen - 1, "data_offset": obj["data_offset"],
         "one_page_less": len(blob) - ps, "one_byte_less": len(blob) - 1}.get(cut, cut)
    good.write_bytes(blob[:n])
    msg = refuse(good, "too short|does not fit|truncated")
    if isinstance(n, int) and n >= obj["data_offset"]:
        assert f"{n} bytes, expected {len(blob)}" in msg


@pytest.mark.parametrize("extra", [1, 8, 1024, 5000])
def test_refuses_trailing_bytes(good, extra):
    size = good.stat().st_size
    with open(good, "ab") as f:
        f.write(b"\0" * extra)
    msg = refuse(good, "trailing bytes")
    assert f"{size + extra} bytes, expected {size}" in msg


@pytest.mark.parametrize("offset", range(8, 32))
def test_refuses_corrupt_header_byte(good, offset):
    flip(good, offset, 0x10)
    refuse(good, "header checksum mismatch")


@pytest.mark.parametrize("offset", range(0, 8))
def test_refuses_corrupt_magic_byte(good, offset):
    flip(good, offset, 0x10)
    refuse(good, "not a tiergram table")


@pytest.mark.parametrize("where", [0, 1, "middle", "last"])
def test_refuses_corrupt_manifest_byte(good, where):
    (_, _, _, mlen, _, _), _, _ = read_header(good)
    pos = {"middle": mlen // 2, "last": mlen - 1}.get(where, where)
    flip(good, 32 + pos, 0x02)
    refuse(good, "manifest checksum mismatch")


def test_refuses_unknown_header_version(good):
    rewrite_header(good, version=2)
    refuse(good, "format version 2; this reader knows version 1")
    rewrite_header(good, version=0)
    refuse(good, "format version 0")


def test_refuses_header_page_size_disagreeing_with_manifest(good):
    rewrite_header(good, page_size=2048)
    refuse(good, "header page_size 2048 disagrees with manifest 1024")


def _edit(obj: dict, key: str, value) -> dict:
    obj = json.loads(json.dumps(obj))
    if key.startswith("heads."):
        _, i, k = key.split(".")
        obj["heads"][int(i)][k] = value(obj["heads"][int(i)][k]) if callable(value) else value
    elif value is None and key.startswith("-"):
        del obj[key[1:]]
    else:
        obj[key] = value(obj[key]) if callable(value) else value
    return obj


INCONSISTENT = [  # field, new value (or function of the old one), expected message
    ("rows_per_page", lambda v: v + 1, "'rows_per_page' is"),
    ("rows_per_page", lambda v: v - 1, "'rows_per_page' is"),
    ("row_bytes", lambda v: v + 1, "'row_bytes' is"),
    ("total_rows", lambda v: v - 1, "'total_rows' is"),
    ("n_pages", lambda v: v + 1, "'n_pages' is"),
    ("heads.1.row_offset", lambda v: v + 1, "head 1 row_offset is"),
    ("heads.0.row_offset", None, "head 0 row_offset is None"),
    ("heads.1.rows", lambda v: v + 1, "'total_rows' is"),
    ("dim", 96, "'row_bytes' is"),
    ("codec", "int8", "'row_bytes' is"),
    ("codec", "fp4", "unknown codec 'fp4'"),
    ("dim", 48, "cannot encode rows of dim 48"),
    ("page_size", 2048, "'rows_per_page' is"),
    ("page_size", 1000, "page_size 1000"),
    ("data_offset", 100, "'data_offset' 100 is not a positive multiple"),
    ("data_offset", 0, "'data_offset' 0 is not a positive multiple"),
    ("data_offset", lambda v: v + 1024, "data_offset .* is not the first page boundary after the"),
    ("heads", [], "at least one row"),
    ("heads", {"rows": 1}, "field 'heads' must be a list"),
    ("format", "safetensors", "field 'format' is 'safetensors'"),
    ("version", 2, "field 'version' is 2; this reader knows version 1"),
    ("version", True, "field 'version' is True; this reader knows version 1"),  # true == 1 in Python, not in JSON
    ("version", 1.0, "field 'version' is 1.0; this reader knows version 1"),
    ("-n_pages", None, "lacks field 'n_pages'"),
    ("-codec", None, "lacks field 'codec'"),
    # wrongly typed fields: refused with the file's name, never a bare TypeError or a silent int()
    ("dim", None, "field 'dim' is None, expected an integer"),
    ("dim", 64.5, "field 'dim' is 64.5, expected an integer"),
    ("dim", "64", "field 'dim' is '64', expected an integer"),
    ("page_size", True, "field 'page_size' is True, expected an integer"),
    ("rows_per_page", 15.0, "field 'rows_per_page' is 15.0, expected an integer"),
    ("codec", ["fp8_e4m3"], "field 'codec' is \\['fp8_e4m3'\\], expected a string"),
    ("heads.0.rows", "100", "field 'heads' must be a list"),
    ("heads.0.rows", None, "field 'heads' must be a list"),
    ("layer_id", "one", "field 'layer_id' is 'one'"),
    ("provenance", [1], "field 'provenance' is \\[1\\]"),
    ("hashing", 7, "field 'hashing' is 7"),
]


@pytest.mark.parametrize("key,value,match", INCONSISTENT, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(INCONSISTENT)])
def test_refuses_inconsistent_manifest(good, key, value, match):
    _, obj, _ = read_header(good)
    rewrite_header(good, _edit(obj, key, value))
    refuse(good, match)


@pytest.mark.parametrize("body,match", [(b"{not json", "not valid JSON"), (b"\xff\xfe{}", "not valid JSON"),
                                        (b"[1, 2]", "not a JSON object"), (b"null", "not a JSON object")])
def test_refuses_manifest_that_is_not_an_object(good, body, match):
    rewrite_header(good, body)
    refuse(good, match)


def test_refuses_data_offset_beyond_the_first_page_boundary(good):
    """A file whose size matches a later data_offset is still refused: data starts at the first boundary."""
    (_, _, ps, _, _, _), obj, blob = read_header(good)
    old = obj["data_offset"]
    obj["data_offset"] = old + ps
    body = json.dumps(obj, sort_keys=True).encode()
    head = struct.pack("<8sIIQI", b"TIERGRAM", 1, ps, len(body), native_crc(body))
    head += struct.pack("<I", native_crc(head))
    good.write_bytes(head + body + b"\0" * (old + ps - 32 - len(body)) + blob[old:])
    refuse(good, f"data_offset {old + ps} is not the first page boundary after the {len(body)}-byte manifest "
                 f"\\({old}\\)")


def test_unknown_manifest_keys_are_ignored(good):
    """docs/table-format.md: keys a reader does not know are ignored (writers may add their own)."""
    _, obj, _ = read_header(good)
    obj["written_by_a_newer_tool"] = {"anything": [1, 2]}
    rewrite_header(good, obj)
    assert TableFile.open(good).verify() == []


def test_rewritten_consistent_manifest_still_opens(good):
    """The helper itself: rewriting the same manifest with fresh checksums gives a sound file."""
    _, obj, _ = read_header(good)
    rewrite_header(good, obj)
    assert TableFile.open(good).verify() == []


# --- corrupt data pages ----------------------------------------------------------------------------


@pytest.fixture
def paged(tmp_path) -> tuple[Path, TableFile]:
    # 64-dim int8 rows (68 B), 7 rows per 512-byte page: 143 rows -> 21 pages
    path, _, m = make_table(tmp_path / "paged.tgram", "int8", 64, (100, 43), 512)
    t = TableFile.open(path)
    assert m.n_pages == 21
    return path, t


@pytest.mark.parametrize("chunk_pages", [4096, 1, 3, 7])
def test_verify_lists_exactly_the_bad_pages(paged, monkeypatch, chunk_pages):
    monkeypatch.setattr(reader_mod, "_CHUNK_PAGES", chunk_pages)
    path, t = paged
    ps, d0 = 512, t.data_offset
    flip(path, d0 + 2 * ps + 5)  # a row byte
    flip(path, d0 + 6 * ps + 490)  # zero padding after the last row
    flip(path, d0 + 9 * ps + ps - 8)  # the page index in the trailer
    flip(path, d0 + 13 * ps + ps - 1)  # the checksum itself
    flip(path, d0 + 20 * ps + 0, 0x80)  # the last page
    assert TableFile.open(path).verify() == [2, 6, 9, 13, 20]
    with pytest.raises(TableFormatError, match=r"5 corrupt page\(s\), checksum mismatch at page 2, 6, 9, 13, 20") as e:
        TableFile.open(path).read_data()
    assert str(path) in str(e.value)


def test_single_bad_page_named_by_read_data(paged):
    path, t = paged
    flip(path, t.data_offset + 4 * 512 + 100, 0xFF)
    assert t.verify() == [4]
    with pytest.raises(TableFormatError, match=r"1 corrupt page\(s\), checksum mismatch at page 4$"):
        t.read_data()
    with pytest.raises(TableFormatError, match="page 4"):
        HostTier(t)


def test_misdirected_pages_are_detected(paged):
    """Two whole pages swapped: each has a valid checksum but the wrong page index."""
    path, t = paged
    blob = bytearray(path.read_bytes())
    a, b = t.data_offset + 3 * 512, t.data_offset + 8 * 512
    blob[a:a + 512], blob[b:b + 512] = blob[b:b + 512], blob[a:a + 512]
    path.write_bytes(bytes(blob))
    assert t.verify() == [3, 8]


def test_many_bad_pages_are_abbreviated(tmp_path):
    path, _, m = make_table(tmp_path / "t.tgram", "fp32", 100, (60,), 512)  # one row per page
    t = TableFile.open(path)
    for p in range(0, 60, 2):
        flip(path, t.data_offset + p * 512 + 7)
    assert t.verify() == list(range(0, 60, 2))
    with pytest.raises(TableFormatError, match=r"30 corrupt page\(s\).*page 0, 2, 4,.*, 38, \.\.\. \(10 more\)"):
        t.read_data()


def test_file_shrunk_after_open_is_refused(paged):
    path, t = paged
    with open(path, "r+b") as f:
        f.truncate(t.data_offset + 10 * 512 + 100)
    assert t.verify() == list(range(10, 21))
    with pytest.raises(TableFormatError, match="short read at page 10"):
        t.read_data()


# --- crash safety ----------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def failing_source(codec: str, dim: int, fail_at_call: int, exc: BaseException | None = None):
    """A row source that encodes random rows, then raises on its `fail_at_call`-th call."""
    calls = []
    c = get_codec(codec)

    def rows(start: int, n: int) -> np.ndarray:
        calls.append((start, n))
        if len(calls) == fail_at_call:
            raise exc if exc is not None else Boom(f"source died at row {start}")
        return c.encode(table_values(n, dim, seed=start))

    return rows, calls


@pytest.mark.parametrize("fail_at_call", [1, 3])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, fail_at_call):
    monkeypatch.setattr(writer_mod, "_CHUNK_PAGES", 2)  # several chunks, so the failure is mid-file
    m = TableManifest(codec="fp8_e4m3", dim=64, head_rows=(50, 50), page_size=512)  # 7 rows/page: 15 pages
    rows, calls = failing_source("fp8_e4m3", 64, fail_at_call)
    with pytest.raises(Boom):
        write_table(tmp_path / "t.tgram", m, rows, progress=False)
    assert m.rows_per_page == 7 and m.n_pages == 15
    assert len(calls) == fail_at_call and calls[-1][0] == (fail_at_call - 1) * 2 * 7
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_existing_file(tmp_path, monkeypatch):
    path, values, _ = make_table(tmp_path / "t.tgram", "fp8_e4m3", 64, (100,), 512)
    before, st = path.read_bytes(), path.stat()
    monkeypatch.setattr(writer_mod, "_CHUNK_PAGES", 2)
    m = TableManifest(codec="bf16", dim=32, head_rows=(200, 200), page_size=512)
    for exc in (Boom("mid-write"), KeyboardInterrupt()):
        rows, calls = failing_source("bf16", 32, 2, exc)
        with pytest.raises(type(exc)):
            write_table(path, m, rows, progress=False)
        assert len(calls) == 2
    assert os.listdir(tmp_path) == ["t.tgram"]
    after = path.stat()
    assert path.read_bytes() == before and (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    t = TableFile.open(path)
    assert t.manifest.codec == "fp8_e4m3" and t.verify() == []


@pytest.mark.parametrize("bad", ["dtype", "shape", "count"])
def test_row_source_returning_wrong_rows_is_refused(tmp_path, bad):
    m = TableManifest(codec="int8", dim=16, head_rows=(40,), page_size=512)
    good_rows = get_codec("int8").encode(table_values(40, 16))

    def rows(start: int, n: int) -> np.ndarray:
        r = good_rows[start:start + n]
        return {"dtype": r.astype(np.int16), "shape": r[:, :-1], "count": r[:-1]}[bad]

    with pytest.raises(ValueError, match=r"row source returned .* expected uint8 \(40, 20\)"):
        write_table(tmp_path / "t.tgram", m, rows, progress=False)
    assert os.listdir(tmp_path) == []


def test_failed_rename_leaves_no_temp_file(tmp_path):
    """A write whose final name is taken by a directory fails without leaving its temp file behind."""
    (tmp_path / "t.tgram").mkdir()
    m = TableManifest(codec="fp32", dim=4, head_rows=(10,), page_size=512)
    with pytest.raises(OSError):
        create_table(tmp_path / "t.tgram", m, matrix_values(table_values(10, 4)), progress=False)
    assert os.listdir(tmp_path) == ["t.tgram"] and (tmp_path / "t.tgram").is_dir()


def test_write_goes_through_a_temp_file_then_replaces(tmp_path):
    path, _, _ = make_table(tmp_path / "t.tgram", "fp32", 4, (10,), 512)
    old_ino = path.stat().st_ino
    seen = []
    c = get_codec("int8")

    def rows(start: int, n: int) -> np.ndarray:
        seen.append(sorted(os.listdir(tmp_path)))
        return c.encode(table_values(n, 16, seed=7))

    m = TableManifest(codec="int8", dim=16, head_rows=(30,), page_size=512)
    write_table(path, m, rows, progress=False)
    assert len(seen[0]) == 2 and seen[0][0] == "t.tgram" and seen[0][1].startswith("t.tgram.tmp-")
    assert os.listdir(tmp_path) == ["t.tgram"] and path.stat().st_ino != old_ino
    assert TableFile.open(path).manifest == m


# --- property: any geometry round-trips through the host tier --------------------------------------


@st.composite
def geometries(draw):
    codec = draw(st.sampled_from(CODECS))
    dim = 32 * draw(st.integers(1, 12)) if codec == "fp8_e4m3" else draw(st.integers(1, 300))
    rb = DOC_ROW_BYTES[codec](dim)
    page_size = draw(st.sampled_from([ps for ps in (512, 1024, 2048, 4096) if rb + 8 <= ps]))
    head_rows = tuple(draw(st.lists(st.integers(1, 120), min_size=1, max_size=5)))
    return codec, dim, page_size, head_rows, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, deadline=None)
@given(geo=geometries())
def test_any_table_round_trips_through_host_tier(geo):
    codec, dim, page_size, head_rows, seed = geo
    with tempfile.TemporaryDirectory() as d:
        path, values, m = make_table(Path(d) / "h.tgram", codec, dim, head_rows, page_size, seed=seed)
        t = TableFile.open(path)
        assert t.manifest == m and t.verify() == []
        tier = HostTier(t)
    enc, ref = reference(codec, values)
    n, h = max(head_rows), len(head_rows)
    ids = np.stack([np.arange(n) % r for r in head_rows], axis=1).astype(np.int64)  # every row of every head
    glob = ids + np.asarray(m.head_offsets)
    out32 = torch.empty(n, h, dim)
    tier.gather(ids, out32)
    assert np.array_equal(bits(out32), bits(ref[glob]))
    out16 = torch.empty(n, h, dim, dtype=torch.bfloat16)
    tier.gather(ids, out16)
    assert np.array_equal(bits(out16), bits(ref[glob].to(torch.bfloat16)))
    raw = np.empty((n, h, m.row_bytes), dtype=np.uint8)
    tier.gather(ids, raw)
    assert np.array_equal(raw, enc[glob])
    tier.close()
