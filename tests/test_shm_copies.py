"""Shared /dev/shm table copies: owner-only, named per user, never a planted file or link, verified before reuse
(a damaged or half-written copy is made again), and removed by `tiergram table shm --clean`."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch
from test_store import Table, bits

from tiergram.cli import main
from tiergram.format import TableFile
from tiergram.store import TieredTable
from tiergram.tiers.host import SHM_DIR, shared_copies, shared_name

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture
def table(tmp_path):
    t = Table(tmp_path / "shm.tgram", "fp8_e4m3", head_rows=(300, 120), page_size=4096, seed=7)
    shm = SHM_DIR / shared_name(TableFile.open(t.path))
    yield t, shm
    shm.unlink(missing_ok=True)


def served_right(t: Table) -> None:
    ids = Table.random_ids(t, (8, 16), seed=3)
    with TieredTable(t.path, shared=True) as tt:
        assert np.array_equal(bits(tt.lookup(ids)), bits(t.expect(ids, torch.float32)))


def test_the_copy_is_owner_only_and_named_per_user(table):
    t, shm = table
    assert f"-{os.getuid()}-" in shm.name
    served_right(t)
    st = shm.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    assert shm in shared_copies()


def test_a_damaged_or_half_written_copy_is_made_again(table):
    t, shm = table
    served_right(t)
    tf = TableFile.open(t.path)
    with open(shm, "r+b") as f:  # one flipped byte in page 2 of the copy
        f.seek(tf.data_offset + 2 * 4096 + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    ino = shm.stat().st_ino
    served_right(t)  # found by the page checksums, replaced, and the rows are right
    assert TableFile.open(shm).verify() == [] and shm.stat().st_ino != ino
    os.truncate(shm, tf.data_offset + 4096)  # as a copy cut short
    served_right(t)
    assert shm.stat().st_size == tf.data_offset + tf.manifest.data_bytes


def test_a_planted_link_or_shared_file_is_refused(table, tmp_path):
    t, shm = table
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    shm.symlink_to(target)
    with pytest.raises(OSError, match="cannot be used as a shared table copy"):
        TieredTable(t.path, shared=True)
    assert target.read_bytes() == b"x"  # nothing written through the link
    shm.unlink()
    shm.write_bytes(t.path.read_bytes())
    shm.chmod(0o644)  # readable by others: could have been written by a process of another user's group
    with pytest.raises(OSError, match="not a private file"):
        TieredTable(t.path, shared=True)


def test_table_shm_clean_removes_this_users_copies(table, capsys):
    t, shm = table
    served_right(t)
    leftover = shm.with_name(shm.name + ".tmp-deadbeef")  # as left by a process killed mid-copy
    leftover.write_bytes(b"partial")
    assert main(["table", "shm"]) == 0
    assert shm.name in capsys.readouterr().out
    assert main(["table", "shm", "--clean"]) == 0
    assert not shm.exists() and not leftover.exists()
    assert "removed" in capsys.readouterr().out
