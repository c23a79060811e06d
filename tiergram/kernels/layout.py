"""RowLayout: where encoded rows sit in a data region and how they are encoded (docs/table-format.md)."""

from __future__ import annotations

from dataclasses import dataclass

from tiergram.codecs import get_codec


@dataclass(frozen=True)
class RowLayout:
    """Global row g lives at byte (g // rows_per_page) * page_size + (g % rows_per_page) * row_bytes."""

    codec: str
    dim: int
    row_bytes: int
    rows_per_page: int
    page_size: int

    def __post_init__(self) -> None:
        want = get_codec(self.codec).row_bytes(self.dim)  # ValueError on a bad codec or dim
        if self.row_bytes != want:
            raise ValueError(f"codec {self.codec} with dim {self.dim} has {want}-byte rows, not {self.row_bytes}")
        if self.rows_per_page < 1 or self.rows_per_page * self.row_bytes > self.page_size:
            raise ValueError(f"{self.rows_per_page} rows of {self.row_bytes} bytes do not fit a "
                             f"{self.page_size}-byte page")

    @classmethod
    def of(cls, manifest) -> RowLayout:
        """The layout of a table file's data region (a TableManifest)."""
        return cls(manifest.codec, manifest.dim, manifest.row_bytes, manifest.rows_per_page, manifest.page_size)

    @classmethod
    def packed(cls, codec: str, dim: int) -> RowLayout:
        """Rows back to back, as in a staging buffer uint8 [n, row_bytes]."""
        rb = get_codec(codec).row_bytes(dim)
        return cls(codec, dim, rb, 1, rb)

    @property
    def codec_id(self) -> int:
        return get_codec(self.codec).codec_id

    def row_offset(self, g: int) -> int:
        """Byte offset of global row g."""
        return (g // self.rows_per_page) * self.page_size + (g % self.rows_per_page) * self.row_bytes

    def bytes_needed(self, n_rows: int) -> int:
        """Bytes a data region must hold for rows 0 .. n_rows-1 to be readable."""
        return 0 if n_rows <= 0 else self.row_offset(n_rows - 1) + self.row_bytes

    @property
    def align(self) -> int:
        """The largest power of two (at most 16) dividing every row's start offset."""
        a = 16
        while a > 1 and (self.row_bytes % a or self.page_size % a):
            a //= 2
        return a
