"""`tiergram table create | info | verify`, run in-process through tiergram.cli.main."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_bounds import error_bound
from safetensors.torch import save_file

from tiergram.cli import main
from tiergram.codecs import get_codec
from tiergram.format import TableFile
from tiergram.store import TieredTable


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["table", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def raw_manifest(path: Path) -> dict:
    blob = path.read_bytes()
    mlen = struct.unpack_from("<Q", blob, 16)[0]
    return json.loads(blob[32:32 + mlen])


def all_rows(path: Path) -> np.ndarray:
    """float32 [N_total, D]: every row of every head, heads end to end, through the host tier."""
    tt = TieredTable(path)
    try:
        rows = []
        for h, n in enumerate(tt.manifest.head_rows):
            ids = np.zeros((n, tt.num_heads), np.int64)
            ids[:, h] = np.arange(n)
            rows.append(tt.lookup(ids)[:, h].numpy())
        return np.concatenate(rows)
    finally:
        tt.close()


def assert_close_to_source(path: Path, source: np.ndarray) -> None:
    codec = get_codec(TableFile.open(path).manifest.codec)
    got = all_rows(path).astype(np.float64)
    assert got.shape == source.shape
    err = np.abs(got - source.astype(np.float64))
    assert np.all(err <= error_bound(codec, source)), f"worst error/bound {np.max(err / error_bound(codec, source))}"


# --- create (random) -> info -> verify ---------------------------------------------------------------


def test_create_info_verify(tmp_path, capsys):
    path = tmp_path / "layer1.tgram"
    rc, out, err = run(capsys, "create", str(path), "--heads", "3", "--rows-per-head", "100", "--dim", "64",
                       "--codec", "fp8_e4m3", "--page-size", "1024", "--layer-id", "1", "--seed", "5", "--quiet")
    assert rc == 0, err
    assert out.strip() == f"wrote {path}: 3 heads, 300 rows of 66 B (fp8_e4m3, D=64), 20 pages"
    assert os.listdir(tmp_path) == ["layer1.tgram"]

    rc, out, err = run(capsys, "info", str(path))
    assert rc == 0, err
    for line in ("codec      fp8_e4m3, D=64, 66 B/row", "heads      3 (rows per head: 100)", "rows       300",
                 "pages      20 x 1024 B, 15 rows/page", "layer      1", "hashing    none"):
        assert line in out
    assert '"seed": 5' in out and '"tool": "tiergram table create"' in out

    rc, out, err = run(capsys, "info", str(path), "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info == raw_manifest(path)
    assert (info["codec"], info["dim"], info["row_bytes"], info["rows_per_page"], info["n_pages"], info["layer_id"]) \
        == ("fp8_e4m3", 64, 66, 15, 20, 1)
    assert info["heads"] == [{"rows": 100, "row_offset": 0}, {"rows": 100, "row_offset": 100},
                             {"rows": 100, "row_offset": 200}]
    assert info["provenance"] == {"tool": "tiergram table create", "init": "normal(0, 1.0^2)", "seed": 5}

    rc, out, err = run(capsys, "verify", str(path), "--quiet")
    assert (rc, out.strip(), err) == (0, f"{path}: all 20 pages sound", "")

    values = all_rows(path)  # the random init really is N(0, 1): not zeros, not constant
    assert values.shape == (300, 64) and abs(values.mean()) < 0.05 and 0.95 < values.std() < 1.05
    assert len(np.unique(values, axis=0)) == 300  # every row distinct


def test_create_is_deterministic_in_the_seed(tmp_path, capsys):
    args = ["--heads", "2", "--rows-per-head", "50,70", "--dim", "32", "--codec", "int8", "--quiet"]
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert run(capsys, "create", str(tmp_path / name), *args, "--seed", seed)[0] == 0
    a, b, c = ((tmp_path / n).read_bytes() for n in "abc")
    assert a == b and a != c
    assert TableFile.open(tmp_path / "a").manifest.head_rows == (50, 70)
    rows = all_rows(tmp_path / "c")
    assert 0.9 < rows.std() < 1.1


def test_create_with_std_and_default_codec(tmp_path, capsys):
    path = tmp_path / "t"
    assert run(capsys, "create", str(path), "--heads", "1", "--rows-per-head", "400", "--dim", "256",
               "--std", "0.01", "--quiet")[0] == 0
    m = TableFile.open(path).manifest
    assert (m.codec, m.row_bytes, m.page_size, m.rows_per_page) == ("fp8_e4m3", 264, 4096, 15)  # DeepSeek's row
    assert 0.009 < all_rows(path).std() < 0.011


@pytest.mark.parametrize("pages", [[2], [0, 7, 19]])
def test_verify_reports_bad_pages(tmp_path, capsys, pages):
    path = tmp_path / "t.tgram"
    assert run(capsys, "create", str(path), "--heads", "3", "--rows-per-head", "100", "--dim", "64",
               "--page-size", "1024", "--quiet")[0] == 0
    t = TableFile.open(path)
    with open(path, "r+b") as f:
        for p in pages:
            f.seek(t.data_offset + p * 1024 + 33)
            b = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b ^ 0x04]))
    rc, out, err = run(capsys, "verify", str(path), "--quiet")
    assert rc == 1 and out == ""
    assert err.strip() == f"{path}: {len(pages)} bad page(s): {' '.join(map(str, pages))}"
    rc, out, err = run(capsys, "info", str(path))  # the header is still fine: info works
    assert rc == 0


def test_info_and_verify_refuse_broken_files(tmp_path, capsys):
    missing = tmp_path / "missing.tgram"
    for action in ("info", "verify"):
        rc, out, err = run(capsys, action, str(missing))
        assert rc == 2 and err.startswith("tiergram: error:") and "missing.tgram" in err
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"GGUF" + bytes(5000))
    for action in ("info", "verify"):
        rc, out, err = run(capsys, action, str(foreign))
        assert rc == 2 and f"{foreign}: not a tiergram table" in err
    path = tmp_path / "t.tgram"
    assert run(capsys, "create", str(path), "--heads", "1", "--rows-per-head", "30", "--dim", "32", "--quiet")[0] == 0
    with open(path, "ab") as f:
        f.write(b"\0")
    rc, out, err = run(capsys, "verify", str(path))
    assert rc == 2 and "has trailing bytes" in err


# --- create --from-safetensors -----------------------------------------------------------------------


def source_matrix(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) * np.exp2(rng.integers(-6, 6, (n, 1)))).astype(np.float32)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "fp8_e4m3"])
def test_import_one_tensor_with_heads(tmp_path, capsys, codec):
    src = source_matrix(240, 64)
    st = tmp_path / "ckpt.safetensors"
    save_file({"engram.table": torch.from_numpy(src), "other": torch.zeros(3, 3)}, str(st))
    path = tmp_path / "t.tgram"
    rc, out, err = run(capsys, "create", str(path), "--from-safetensors", str(st), "--tensor", "engram.table",
                       "--heads", "4", "--codec", codec, "--page-size", "512", "--quiet")
    assert rc == 0, err
    m = TableFile.open(path).manifest
    assert (m.head_rows, m.dim, m.codec) == ((60, 60, 60, 60), 64, codec)
    assert m.provenance == {"tool": "tiergram table create", "source": str(st), "tensors": ["engram.table"]}
    assert_close_to_source(path, src)
    if codec == "fp32":
        assert np.array_equal(all_rows(path), src)


def test_fp8_tensor_is_refused_and_points_to_tiergram_import(tmp_path, capsys):
    st = tmp_path / "ckpt.safetensors"
    save_file({"layers.1.engram.embed.weight": torch.zeros(64, 32).to(torch.float8_e4m3fn)}, str(st))
    rc, _, err = run(capsys, "create", str(tmp_path / "t.tgram"), "--from-safetensors", str(st), "--tensor",
                     "layers.1.engram.embed.weight", "--heads", "2", "--quiet")
    assert rc == 2 and "is F8_E4M3, whose values need their block scales" in err and "tiergram import" in err
    assert not list(tmp_path.glob("t.tgram*"))


def test_import_one_tensor_with_uneven_rows_per_head(tmp_path, capsys):
    src = source_matrix(100, 32, seed=1)
    st = tmp_path / "ckpt.safetensors"
    save_file({"t": torch.from_numpy(src).to(torch.bfloat16)}, str(st))  # a bf16 checkpoint
    path = tmp_path / "t.tgram"
    rc, out, err = run(capsys, "create", str(path), "--from-safetensors", str(st), "--tensor", "t",
                       "--rows-per-head", "10,20,70", "--codec", "bf16", "--quiet")
    assert rc == 0, err
    assert TableFile.open(path).manifest.head_rows == (10, 20, 70)
    exact = torch.from_numpy(src).to(torch.bfloat16).float().numpy()
    assert np.array_equal(all_rows(path), exact)  # bf16 -> bf16 is lossless


def test_import_per_head_tensors(tmp_path, capsys):
    rows = (50, 37, 81)
    srcs = [source_matrix(n, 96, seed=h) for h, n in enumerate(rows)]
    st = tmp_path / "ckpt.safetensors"
    tensors = {f"emb.{h}": torch.from_numpy(s) for h, s in enumerate(srcs)}
    tensors["emb.x"] = torch.zeros(2, 96)  # not a head: the numbering stops at the first gap
    save_file(tensors, str(st))
    path = tmp_path / "t.tgram"
    rc, out, err = run(capsys, "create", str(path), "--from-safetensors", str(st), "--tensor", "emb.{head}",
                       "--codec", "fp8_e4m3", "--layer-id", "14", "--quiet")
    assert rc == 0, err
    assert "3 heads, 168 rows of 99 B (fp8_e4m3, D=96)" in out
    m = TableFile.open(path).manifest
    assert (m.head_rows, m.layer_id) == (rows, 14)
    assert m.provenance["tensors"] == ["emb.0", "emb.1", "emb.2"]
    assert_close_to_source(path, np.concatenate(srcs))
    assert run(capsys, "verify", str(path), "--quiet")[0] == 0

    # --heads and --rows-per-head that agree with the tensors are accepted
    rc, _, err = run(capsys, "create", str(tmp_path / "u.tgram"), "--from-safetensors", str(st), "--tensor",
                     "emb.{head}", "--heads", "3", "--rows-per-head", "50,37,81", "--dim", "96", "--quiet")
    assert rc == 0, err


def test_import_single_per_head_tensor_is_one_head(tmp_path, capsys):
    src = source_matrix(40, 32)
    st = tmp_path / "ckpt.safetensors"
    save_file({"head0.emb": torch.from_numpy(src)}, str(st))
    path = tmp_path / "t.tgram"
    rc, _, err = run(capsys, "create", str(path), "--from-safetensors", str(st), "--tensor", "head{head}.emb",
                     "--codec", "fp32", "--quiet")
    assert rc == 0, err
    assert TableFile.open(path).manifest.head_rows == (40,)
    assert np.array_equal(all_rows(path), src)


def test_import_reads_in_chunks_across_heads(tmp_path, capsys, monkeypatch):
    """Chunks of the writer that straddle per-head tensors take rows from both."""
    from tiergram.format import writer

    monkeypatch.setattr(writer, "_CHUNK_PAGES", 1)
    srcs = [source_matrix(n, 32, seed=10 + n) for n in (5, 23, 2, 9)]
    st = tmp_path / "ckpt.safetensors"
    save_file({f"h{h}": torch.from_numpy(s) for h, s in enumerate(srcs)}, str(st))
    path = tmp_path / "t.tgram"
    rc, _, err = run(capsys, "create", str(path), "--from-safetensors", str(st), "--tensor", "h{head}",
                     "--codec", "fp32", "--page-size", "512", "--quiet")  # 3 rows of 128 B per page
    assert rc == 0, err
    assert np.array_equal(all_rows(path), np.concatenate(srcs))


# --- errors: exit 2 with a message, no file written ---------------------------------------------------


@pytest.fixture
def ckpt(tmp_path) -> Path:
    st = tmp_path / "ckpt.safetensors"
    save_file({"table": torch.zeros(100, 48), "emb.0": torch.zeros(10, 64), "emb.1": torch.zeros(12, 32),
               "flat": torch.zeros(100), "e.0": torch.zeros(4, 64), "e.1": torch.zeros(4, 64)}, str(st))
    return st


ERRORS = [
    (["--from-safetensors", "{ckpt}", "--tensor", "nope", "--heads", "2"], "no tensor named 'nope'"),
    (["--from-safetensors", "{ckpt}", "--tensor", "x.{head}"], "no tensor matches 'x.{head}'"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--heads", "3", "--codec", "int8"],
     "has 100 rows; give --rows-per-head, or --heads that divides 100"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--codec", "int8"], "has 100 rows"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--rows-per-head", "30,30", "--codec", "int8"],
     "sum to 60, tensor 'table' has 100"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--heads", "4"],  # D=48 with the default fp8 codec
     "codec fp8_e4m3 cannot encode rows of dim 48"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--heads", "4", "--codec", "fp16"], "unknown codec 'fp16'"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--heads", "4", "--codec", "int8", "--dim", "64"],
     "--dim 64 disagrees with the tensor's D = 48"),
    (["--from-safetensors", "{ckpt}", "--tensor", "emb.{head}", "--codec", "int8"],
     "per-head tensors disagree on D: \\[32, 64\\]"),
    (["--from-safetensors", "{ckpt}", "--tensor", "flat", "--heads", "1"], "tensor 'flat' has shape \\[100\\]"),
    (["--from-safetensors", "{ckpt}", "--tensor", "e.{head}", "--heads", "3"],
     "--heads is 3 but 2 tensors match 'e.{head}'"),
    (["--from-safetensors", "{ckpt}", "--tensor", "e.{head}", "--rows-per-head", "4,5"],
     "--rows-per-head \\[4, 5\\] disagrees with the tensors' rows \\[4, 4\\]"),
    (["--from-safetensors", "{ckpt}", "--heads", "2"], "--from-safetensors needs --tensor NAME"),
    (["--from-safetensors", "{missing}", "--tensor", "table"], "no such safetensors file"),
    (["--heads", "2", "--rows-per-head", "10", "--dim", "48"], "codec fp8_e4m3 cannot encode rows of dim 48"),
    (["--heads", "2", "--rows-per-head", "10", "--dim", "100", "--codec", "fp8_e4m3"], "cannot encode rows of dim 100"),
    (["--heads", "2", "--rows-per-head", "10", "--dim", "64", "--codec", "fp4"], "unknown codec 'fp4'"),
    (["--heads", "2", "--rows-per-head", "10", "--dim", "0", "--codec", "int8"], "cannot encode rows of dim 0"),
    (["--heads", "0", "--rows-per-head", "10", "--dim", "64"], "--heads must be positive, got 0"),
    (["--heads", "-2", "--rows-per-head", "10", "--dim", "64"], "--heads must be positive, got -2"),
    (["--from-safetensors", "{ckpt}", "--tensor", "table", "--heads", "0", "--codec", "int8"],
     "--heads must be positive, got 0"),
    (["--heads", "2", "--rows-per-head", "10"], "random init needs --heads, --rows-per-head and --dim"),
    (["--rows-per-head", "10", "--dim", "64"], "random init needs"),
    (["--heads", "3", "--rows-per-head", "10,20", "--dim", "64"], "--rows-per-head lists 2 heads but --heads is 3"),
    (["--heads", "1", "--rows-per-head", "10", "--dim", "64", "--page-size", "3000"], "page_size 3000"),
    (["--heads", "1", "--rows-per-head", "10", "--dim", "1024", "--codec", "fp32"],
     "4096-byte row does not fit a 4096-byte page"),
]


@pytest.mark.parametrize("args,match", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_create_errors(tmp_path, capsys, ckpt, args, match):
    out_path = tmp_path / "out.tgram"
    argv = [{"{ckpt}": str(ckpt), "{missing}": str(tmp_path / "missing.st")}.get(a, a) for a in args]
    rc, out, err = run(capsys, "create", str(out_path), *argv, "--quiet")
    assert rc == 2 and out == ""
    assert err.startswith("tiergram: error: ")
    assert len(err.strip().splitlines()) == 1  # a message, not a traceback
    assert re.search(match, err), err
    assert not out_path.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]  # no temp file either


@pytest.mark.parametrize("bad", ["0", "-5", "abc", "10,x"])
def test_rows_per_head_must_be_positive_integers(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["table", "create", str(tmp_path / "t"), "--heads", "1", "--rows-per-head", bad, "--dim", "64"])
    assert e.value.code == 2
    assert "--rows-per-head" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
