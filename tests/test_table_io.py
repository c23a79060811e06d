"""Creating and verifying large tables: disk-speed random init, free-space refusal, interrupted writes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tiergram.format.writer as writer_mod
from tiergram.codecs import get_codec
from tiergram.format import TableFile, TableManifest, create_random_table

V41 = dict(codec="fp8_e4m3", dim=256)


def decoded_rows(path: Path) -> np.ndarray:
    t = TableFile.open(path)
    m = t.manifest
    data = t.read_data().reshape(m.n_pages, m.page_size)
    rows = data[:, : m.rows_per_page * m.row_bytes].reshape(-1, m.row_bytes)[: m.total_rows]
    return get_codec(m.codec).decode(rows, m.dim).numpy()


@pytest.mark.parametrize("chunk_pages", [None, 1, 7])
def test_fast_random_table_is_sound_deterministic_and_normal(tmp_path, monkeypatch, chunk_pages):
    m = TableManifest(head_rows=(700, 301, 5), page_size=4096, **V41)  # 15 rows/page, last page partly filled
    ref = create_random_table(tmp_path / "ref.tgt", m, seed=5, std=0.02, progress=False)
    monkeypatch.setattr(writer_mod, "_CHUNK_PAGES", chunk_pages)
    path = create_random_table(tmp_path / "t.tgt", m, seed=5, std=0.02, progress=False)
    assert path.read_bytes() == ref.read_bytes()  # the bytes depend on the seed, not on how the file is chunked
    assert TableFile.open(path).verify() == []
    v = decoded_rows(path)
    assert v.shape == (1006, 256) and not np.isnan(v).any()
    assert abs(float(v.std()) - 0.02) < 0.001 and abs(float(v.mean())) < 0.001
    assert len({r.tobytes() for r in v}) == 1006  # no two rows alike
    t = TableFile.open(path)
    last = t.read_data().reshape(m.n_pages, m.page_size)[-1]
    used = (m.total_rows - (m.n_pages - 1) * m.rows_per_page) * m.row_bytes
    assert not last[used:m.page_size - 8].any()  # padding after the last row is zeros
    other = create_random_table(tmp_path / "s.tgt", m, seed=6, std=0.02, progress=False)
    assert other.read_bytes() != path.read_bytes()


def test_verify_finds_a_flipped_byte_in_a_fast_table(tmp_path):
    m = TableManifest(head_rows=(3000,), **V41)
    path = create_random_table(tmp_path / "t.tgt", m, progress=False)
    t = TableFile.open(path)
    with open(path, "r+b") as f:
        f.seek(t.data_offset + 77 * m.page_size + 1000)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    assert TableFile.open(path).verify() == [77]


def test_a_table_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    m = TableManifest(head_rows=(1000,) * 4, **V41)
    need = m.encode()[1] + m.data_bytes
    monkeypatch.setattr(writer_mod, "free_bytes", lambda d: 100_000)
    with pytest.raises(OSError, match=rf"t\.tgt: the table needs {need:,} bytes .* but .* has 100,000 bytes"):
        create_random_table(tmp_path / "t.tgt", m, progress=False)
    assert os.listdir(tmp_path) == []


def test_cli_refuses_a_table_too_big_for_the_disk(tmp_path, capsys):
    from tiergram.cli import main

    free = writer_mod.free_bytes(tmp_path)
    rows = free // 264 + 10_000  # more bytes than the file system has free
    rc = main(["table", "create", str(tmp_path / "big.tgt"), "--heads", "1", "--rows-per-head", str(rows),
               "--dim", "256", "--quiet"])
    err = capsys.readouterr().err
    # the free space moves while other jobs write: check the message's shape, not the figure
    assert rc != 0 and re.search(r"the table needs [\d,]+ bytes .* has [\d,]+ bytes \([\d.]+ GiB\) free", err)
    assert os.listdir(tmp_path) == []


SLOW_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from tiergram.format import TableManifest, write_table
    import tiergram.format.writer as w
    w._CHUNK_PAGES = 1
    m = TableManifest(codec="int8", dim=16, head_rows=(2000,), page_size=512)
    def rows(start, n):
        print("chunk", start, flush=True)
        time.sleep(0.05)
        return np.zeros((n, 20), np.uint8)
    write_table(sys.argv[1], m, rows, progress=False)
    print("done", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_create_leaves_no_file_under_the_final_name(tmp_path, sig):
    final = tmp_path / "t.tgram"
    # a child inherits an ignored SIGINT (from a shell's background job, or a test before this one that ignored it
    # in this process) and Python then keeps it ignored: give the writer the default, as a terminal's Ctrl-C finds it
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(final)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(3):  # a few chunks in: the temp file exists and holds data
            assert proc.stdout.readline().startswith("chunk")
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    names = os.listdir(tmp_path)
    assert "t.tgram" not in names
    if sig == signal.SIGKILL:  # nothing runs after kill -9: the temp stays, and the next writer removes it
        assert len(names) == 1 and names[0].startswith("t.tgram.tmp-")
        m = TableManifest(head_rows=(20,), **V41)
        create_random_table(final, m, progress=False)
        assert os.listdir(tmp_path) == ["t.tgram"]
    else:  # SIGTERM and Ctrl-C remove it on the way out
        assert names == []


def test_bench_table_reports_ratios_and_leaves_nothing(tmp_path):
    from tiergram.bench import table_io

    r = table_io.run(0.02, tmp_path, progress=False)
    assert r["table_bytes"] > 0.019 * 2**30 and r["create"] > 0 and r["verify"] > 0 and r["zeros_limit"] > 0
    assert r["create_ratio"] == pytest.approx(r["create"] / ((r["write_limit_before"] + r["write_limit_after"]) / 2))
    assert r["open_read_bytes"] < 64 << 10  # the open reads the header and manifest, not the data
    assert "x the read limit" in table_io.report(r)
    assert os.listdir(tmp_path) == []
