"""Table files: one self-describing, page-checksummed file per Engram layer (docs/table-format.md)."""

from tiergram.format.create import create_random_table, create_table, matrix_values, random_values
from tiergram.format.manifest import CODEC_IDS, TableFormatError, TableManifest, codec_row_bytes
from tiergram.format.reader import TableFile
from tiergram.format.writer import PageFiller, RowSource, write_pages, write_table

__all__ = ["CODEC_IDS", "PageFiller", "RowSource", "TableFile", "TableFormatError", "TableManifest", "codec_row_bytes",
           "create_random_table", "create_table", "matrix_values", "random_values", "write_pages", "write_table"]
