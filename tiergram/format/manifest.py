"""The table manifest: geometry, codec and provenance of one table file, with its derived fields checked."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiergram import _native

FORMAT_NAME = "tiergram-table"
FORMAT_VERSION = 1
MAGIC = b"TIERGRAM"
HEADER_BYTES = 32
PAGE_TRAILER_BYTES = 8
CODEC_IDS = {"fp32": 0, "bf16": 1, "int8": 2, "fp8_e4m3": 3}


def _is_int(v: Any) -> bool:
    """A JSON integer: bool is an int subclass in Python but not an integer in a manifest."""
    return isinstance(v, int) and not isinstance(v, bool)


REQUIRED_FIELDS = ("codec", "dim", "row_bytes", "page_size", "rows_per_page", "heads", "total_rows", "n_pages",
                   "data_offset")
FIELD_TYPES = {  # each field's check and what it expects: required ones always, optional ones unless null
    **dict.fromkeys(("dim", "row_bytes", "page_size", "rows_per_page", "total_rows", "n_pages", "data_offset"),
                    (_is_int, "an integer")),
    "codec": (lambda v: isinstance(v, str), "a string"), "layer_id": (_is_int, "an integer or null"),
    "hashing": (lambda v: isinstance(v, dict), "an object or null"),
    "provenance": (lambda v: isinstance(v, dict), "an object"),
}

class TableFormatError(ValueError):
    """A table file or manifest that breaks the format; the message names the file and the problem."""


def codec_row_bytes(codec: str, dim: int) -> int:
    """Encoded bytes of one row; TableFormatError for an unknown codec or a dim it cannot encode."""
    if codec not in CODEC_IDS:
        raise TableFormatError(f"unknown codec {codec!r} (valid: {', '.join(CODEC_IDS)})")
    # a row must fit a page (page_size is a u32), so larger dims are refused before the native u64 product
    n = _native.codec_row_bytes(CODEC_IDS[codec], int(dim)) if 0 < dim < 2**32 else 0
    if n == 0:
        raise TableFormatError(f"codec {codec} cannot encode rows of dim {dim}")
    return n


@dataclass(frozen=True)
class TableManifest:
    """Everything a reader needs to find and decode any row; see docs/table-format.md."""

    codec: str
    dim: int
    head_rows: tuple[int, ...]
    page_size: int = 4096
    layer_id: int | None = None
    hashing: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ps = self.page_size
        if ps < 512 or ps > 2**31 or ps & (ps - 1):  # the header holds page_size as a u32
            raise TableFormatError(f"page_size {ps} is not a power of two in 512..2^31")
        if not self.head_rows or any(int(n) <= 0 for n in self.head_rows):
            raise TableFormatError(f"heads must each have at least one row, got {list(self.head_rows)}")
        if self.row_bytes + PAGE_TRAILER_BYTES > ps:
            raise TableFormatError(f"a {self.row_bytes}-byte row does not fit a {ps}-byte page")

    @property
    def row_bytes(self) -> int:
        return codec_row_bytes(self.codec, self.dim)

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.codec]

    @property
    def rows_per_page(self) -> int:
        return (self.page_size - PAGE_TRAILER_BYTES) // self.row_bytes

    @property
    def n_heads(self) -> int:
        return len(self.head_rows)

    @property
    def head_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.head_rows)[:-1]]))

    @property
    def total_rows(self) -> int:
        return int(sum(self.head_rows))

    @property
    def n_pages(self) -> int:
        return -(-self.total_rows // self.rows_per_page)

    @property
    def data_bytes(self) -> int:
        return self.n_pages * self.page_size

    def to_json(self, data_offset: int) -> dict[str, Any]:
        """The manifest object written to the file (docs/table-format.md, 'Manifest')."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "codec": self.codec,
            "dim": self.dim,
            "row_bytes": self.row_bytes,
            "page_size": self.page_size,
            "rows_per_page": self.rows_per_page,
            "heads": [{"rows": int(n), "row_offset": o}
                      for n, o in zip(self.head_rows, self.head_offsets, strict=True)],
            "total_rows": self.total_rows,
            "n_pages": self.n_pages,
            "data_offset": data_offset,
            "layer_id": self.layer_id,
            "hashing": self.hashing,
            "provenance": self.provenance,
        }

    def encode(self) -> tuple[bytes, int]:
        """(manifest JSON bytes, data_offset): data starts at the first page boundary after the manifest."""
        body = b""
        data_offset = self.page_size
        for _ in range(3):  # data_offset is inside the JSON; its digits can move the boundary once at most
            body = json.dumps(self.to_json(data_offset), sort_keys=True).encode()
            need = -(-(HEADER_BYTES + len(body)) // self.page_size) * self.page_size
            if need == data_offset:
                break
            data_offset = need
        return body, data_offset

    @classmethod
    def from_json(cls, obj: Any, where: str) -> tuple[TableManifest, int]:
        """Parse and cross-check a manifest object; returns (manifest, data_offset)."""

        def bad(msg: str) -> TableFormatError:
            return TableFormatError(f"{where}: manifest {msg}")

        if not isinstance(obj, dict):
            raise bad("is not a JSON object")
        if obj.get("format") != FORMAT_NAME:
            raise bad(f"field 'format' is {obj.get('format')!r}, expected {FORMAT_NAME!r}")
        version = obj.get("version")
        if not _is_int(version) or version != FORMAT_VERSION:  # the integer 1: not true, not 1.0
            raise bad(f"field 'version' is {version!r}; this reader knows version {FORMAT_VERSION}")
        for key in REQUIRED_FIELDS:
            if key not in obj:
                raise bad(f"lacks field {key!r}")
        for key, (ok, expected) in FIELD_TYPES.items():
            if (key in REQUIRED_FIELDS or obj.get(key) is not None) and not ok(obj.get(key)):
                raise bad(f"field {key!r} is {obj.get(key)!r}, expected {expected}")
        heads = obj["heads"]
        if not isinstance(heads, list) or not all(isinstance(h, dict) and _is_int(h.get("rows")) for h in heads):
            raise bad("field 'heads' must be a list of {'rows': N, 'row_offset': O}")
        try:
            m = cls(codec=obj["codec"], dim=obj["dim"], head_rows=tuple(h["rows"] for h in heads),
                    page_size=obj["page_size"], layer_id=obj.get("layer_id"), hashing=obj.get("hashing"),
                    provenance=obj.get("provenance") or {})
        except TableFormatError as e:
            raise bad(str(e)) from None
        derived = m.to_json(obj["data_offset"])
        for key in ("row_bytes", "rows_per_page", "total_rows", "n_pages"):
            if obj[key] != derived[key]:
                raise bad(f"field {key!r} is {obj[key]!r} but the geometry gives {derived[key]}")
        for i, (h, want) in enumerate(zip(heads, derived["heads"], strict=True)):
            if h.get("row_offset") != want["row_offset"]:
                raise bad(f"head {i} row_offset is {h.get('row_offset')!r}, expected {want['row_offset']}")
        data_offset = obj["data_offset"]
        if data_offset <= 0 or data_offset % m.page_size:
            raise bad(f"field 'data_offset' {data_offset!r} is not a positive multiple of the page size")
        return m, data_offset

    def replace(self, **changes: Any) -> TableManifest:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

