"""The 32-byte file header: magic, version, page size, manifest length and checksums."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from tiergram import _native
from tiergram.format.manifest import FORMAT_VERSION, HEADER_BYTES, MAGIC, TableFormatError, TableManifest

_HEADER = struct.Struct("<8sIIQII")  # magic, version, page_size, manifest_bytes, manifest_crc, header_crc


def _crc(data: bytes) -> int:
    return _native.crc32c(np.frombuffer(data, dtype=np.uint8))


def pack_header(manifest: TableManifest) -> tuple[bytes, int]:
    """Header + manifest + zero padding up to data_offset; returns (bytes, data_offset)."""
    body, data_offset = manifest.encode()
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, manifest.page_size, len(body), _crc(body), 0)[:28]
    head += struct.pack("<I", _crc(head))
    blob = head + body
    return blob + b"\0" * (data_offset - len(blob)), data_offset


def unpack_header(fd: int, path: str, file_bytes: int) -> tuple[TableManifest, int]:
    """Read and check the header and manifest of an open file; returns (manifest, data_offset)."""
    head = _pread_exact(fd, HEADER_BYTES, 0, path, "header")
    magic, version, page_size, manifest_len, manifest_crc, header_crc = _HEADER.unpack(head)
    if magic != MAGIC:
        raise TableFormatError(f"{path}: not a tiergram table (magic {magic!r}, expected {MAGIC!r})")
    if _crc(head[:28]) != header_crc:
        raise TableFormatError(f"{path}: header checksum mismatch (corrupt header)")
    if version != FORMAT_VERSION:
        raise TableFormatError(f"{path}: format version {version}; this reader knows version {FORMAT_VERSION}")
    if manifest_len <= 0 or HEADER_BYTES + manifest_len > file_bytes:
        raise TableFormatError(f"{path}: manifest of {manifest_len} bytes does not fit the {file_bytes}-byte file")
    body = _pread_exact(fd, manifest_len, HEADER_BYTES, path, "manifest")
    if _crc(body) != manifest_crc:
        raise TableFormatError(f"{path}: manifest checksum mismatch (corrupt manifest)")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableFormatError(f"{path}: manifest is not valid JSON ({e})") from None
    manifest, data_offset = TableManifest.from_json(obj, path)
    if manifest.page_size != page_size:
        raise TableFormatError(f"{path}: header page_size {page_size} disagrees with manifest {manifest.page_size}")
    smallest = -(-(HEADER_BYTES + manifest_len) // page_size) * page_size
    if data_offset != smallest:  # what every writer writes: the first page boundary after the manifest
        raise TableFormatError(f"{path}: data_offset {data_offset} is not the first page boundary after the "
                               f"{manifest_len}-byte manifest ({smallest})")
    want = data_offset + manifest.data_bytes
    if file_bytes != want:
        what = "truncated" if file_bytes < want else "has trailing bytes"
        raise TableFormatError(f"{path}: file {what}: {file_bytes} bytes, expected {want} "
                               f"({manifest.n_pages} pages of {manifest.page_size})")
    return manifest, data_offset


def _pread_exact(fd: int, n: int, offset: int, path: str, what: str) -> bytes:
    """n bytes at offset (pread looped over partial reads); TableFormatError when the file ends first."""
    parts, got = [], 0
    while got < n and (chunk := os.pread(fd, n - got, offset + got)):
        parts.append(chunk)
        got += len(chunk)
    if got != n:
        raise TableFormatError(f"{path}: file too short to hold its {what} ({got} of {n} bytes)")
    return b"".join(parts)
