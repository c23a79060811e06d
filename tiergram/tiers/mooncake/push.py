"""Writing and removing a table in Mooncake Store: pages first, the manifest object last as the commit marker."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format import TableFile, TableFormatError
from tiergram.format.manifest import PAGE_TRAILER_BYTES
from tiergram.tiers.aligned import aligned_empty
from tiergram.tiers.mooncake.client import (
    MAX_KEYS_PER_CALL,
    OBJECT_NOT_FOUND,
    Caller,
    connect,
    error_name,
    fetch_manifest,
    fetch_manifest_blob,
    manifest_key,
    page_key,
    parse_manifest_blob,
    release_client,
    replicate_config,
    shared_client,
    table_uri,
)

PUSH_CHUNK_PAGES = 1024
DIGEST_CHUNK_PAGES = 1 << 16  # pages whose trailers are hashed at a time


def page_digest(table: TableFile) -> bytes:
    """SHA-256 of every page's trailer (its index and CRC-32C) in page order: the pages' contents in 32 bytes."""
    m = table.manifest
    digest = hashlib.sha256()
    pages = np.memmap(table.path, np.uint8, "r", offset=table.data_offset, shape=(m.n_pages, m.page_size))
    for lo in range(0, m.n_pages, DIGEST_CHUNK_PAGES):
        digest.update(np.ascontiguousarray(pages[lo:lo + DIGEST_CHUNK_PAGES, -PAGE_TRAILER_BYTES:]).tobytes())
    return digest.digest()


def manifest_blob(table: TableFile) -> bytes:
    """A table's manifest object: file size (u64 LE), the file's bytes up to data_offset, its page_digest."""
    with open(table.path, "rb") as f:
        head = f.read(table.data_offset)
    return struct.pack("<Q", table.data_offset + table.manifest.data_bytes) + head + page_digest(table)


def describe_blob(blob: bytes) -> str:
    """'N bytes, pages digest HEX' of a manifest object (what tells two tables of one manifest apart)."""
    try:
        _, data_offset = parse_manifest_blob(blob, "manifest object")
    except TableFormatError:
        return f"a {len(blob)}-byte object that is no table's manifest"
    digest = blob[8 + data_offset:]
    return f"{struct.unpack_from('<Q', blob)[0]} bytes, pages digest {digest.hex()[:16] if digest else 'none'}"


def push_table(path: str | os.PathLike, master: str, name: str | None = None, *, replace: bool = False,
               replicas: int = 1, progress: bool = True, store: Any = None,
               timeout_s: float = 60.0) -> str:
    """Put a table file into Mooncake Store as `name` (default: its stem), pages verified, the manifest object last
    as the commit marker; returns its URI. An existing copy is refused (FileExistsError) unless `replace`."""
    table = TableFile.open(path)
    m = table.manifest
    name = name or Path(path).stem
    if "/" in name or not name:
        raise ValueError(f"table name {name!r} must be one non-empty path segment")
    owns = store is None
    if store is None:
        store = connect(master)
    caller = Caller(timeout_s)
    try:
        mk = manifest_key(name)
        exists = caller(store.is_exist, mk)
        if exists < 0:
            raise ConnectionError(f"Mooncake could not check {mk}: {error_name(exists)}")
        if exists == 1:
            if not replace:
                raise FileExistsError(f"Mooncake at {master} already holds table {name!r} "
                                      f"(pass --replace to overwrite it)")
            old, _ = fetch_manifest(store, name, timeout_s=timeout_s)
            rc = caller(store.remove, mk, True)  # the marker goes first: readers stop opening the old copy
            if rc not in (0, OBJECT_NOT_FOUND):
                raise ConnectionError(f"could not remove {mk}: {error_name(rc)}")
            _remove_pages(store, caller, name, old.n_pages)
        # pages left by an interrupted push (no marker) would make every put fail with OBJECT_ALREADY_EXISTS
        _remove_pages(store, caller, name, m.n_pages)
        _put_pages(store, caller, table, name, replicas, progress)
        rc = caller(store.put, mk, manifest_blob(table), replicate_config(replicas))
        if rc != 0:
            _remove_pages(store, caller, name, m.n_pages)
            raise ConnectionError(f"could not write {mk}: {error_name(rc)}")
    finally:
        caller.close()
        if owns:
            store.close()
    return table_uri(master, name)


def pushed_name(path: str | os.PathLike, blob: bytes) -> str:
    """The name ensure_pushed gives table file `path`: its stem and a digest of `blob`, its size and mtime."""
    st = Path(path).stat()
    return f"{Path(path).stem}-{hashlib.sha256(blob + f'{st.st_size}:{st.st_mtime_ns}'.encode()).hexdigest()[:12]}"


def ensure_pushed(path: str | os.PathLike, master: str, *, progress: bool = False) -> str:
    """The URI of table file `path` in the store at master, pushed first when absent; a stored copy whose manifest
    object (size, header, pages digest) differs from the file's is refused (ValueError), not reused."""
    table = TableFile.open(path)
    local = manifest_blob(table)
    name = pushed_name(path, local)
    store = shared_client(master)  # the table opened next reuses it
    try:
        try:
            stored = fetch_manifest_blob(store, name)
        except FileNotFoundError:
            push_table(path, master, name, progress=progress, store=store)
        else:
            if stored != local:
                raise ValueError(f"Mooncake at {master} holds table {name!r} ({describe_blob(stored)}), which is not "
                                 f"{path} ({describe_blob(local)}): not reused; replace it with `tiergram table push "
                                 f"{path} --master {master} --name {name} --replace`")
    finally:
        release_client(store)
    return table_uri(master, name)


def remove_table(store: Any, name: str, *, timeout_s: float = 60.0) -> bool:
    """Remove table `name` (marker first, then pages); False when it was not there."""
    caller = Caller(timeout_s)
    try:
        try:
            manifest, _ = fetch_manifest(store, name, timeout_s=timeout_s)
        except FileNotFoundError:
            return False
        caller(store.remove, manifest_key(name), True)
        _remove_pages(store, caller, name, manifest.n_pages)
        return True
    finally:
        caller.close()


def table_keys(name: str, n_pages: int) -> list[str]:
    """Every key of a table: the manifest first, then the pages."""
    return [manifest_key(name)] + [page_key(name, p) for p in range(n_pages)]


def _remove_pages(store: Any, caller: Caller, name: str, n_pages: int) -> None:
    for lo in range(0, n_pages, MAX_KEYS_PER_CALL):
        keys = [page_key(name, p) for p in range(lo, min(lo + MAX_KEYS_PER_CALL, n_pages))]
        codes = caller(store.batch_remove, keys, True)
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            raise ConnectionError(f"could not remove {bad[0][0]}: {error_name(bad[0][1])}")


def _put_pages(store: Any, caller: Caller, table: TableFile, name: str, replicas: int, progress: bool) -> None:
    m = table.manifest
    ps = m.page_size
    buf = aligned_empty(PUSH_CHUNK_PAGES * ps)
    rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise ConnectionError(f"could not register the push buffer: {error_name(rc)}")
    cfg = replicate_config(replicas)
    try:
        with open(table.path, "rb", buffering=0) as f, tqdm(total=m.n_pages, unit="page", unit_scale=True,
                                                             disable=not progress, desc=f"pushing {name}") as bar:
            f.seek(table.data_offset)
            for p0 in range(0, m.n_pages, PUSH_CHUNK_PAGES):
                n = min(PUSH_CHUNK_PAGES, m.n_pages - p0)
                chunk = buf[: n * ps]
                if f.readinto(memoryview(chunk)) != chunk.size:
                    raise TableFormatError(f"{table.path}: short read at page {p0}")
                bad = _native.verify_pages(chunk, ps, p0)
                if bad:
                    raise TableFormatError(f"{table.path}: page {bad[0]} fails its checksum; not pushed")
                keys = [page_key(name, p) for p in range(p0, p0 + n)]
                codes = caller(store.batch_put_from, keys, [buf.ctypes.data + i * ps for i in range(n)],
                               [ps] * n, cfg)
                failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
                if failed:
                    _remove_pages(store, caller, name, m.n_pages)
                    raise ConnectionError(f"could not write {failed[0][0]} ({len(failed)} page(s) failed): "
                                          f"Mooncake {error_name(failed[0][1])}")
                bar.update(n)
    finally:
        store.unregister_buffer(buf.ctypes.data)
