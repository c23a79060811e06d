"""Table files: one self-describing, page-checksummed file per Engram layer (docs/table-format.md)."""

from tiergram.format.create import create_table, matrix_values, random_values
from tiergram.format.manifest import CODEC_IDS, TableFormatError, TableManifest, codec_row_bytes
from tiergram.format.reader import TableFile
from tiergram.format.writer import RowSource, write_table

__all__ = ["CODEC_IDS", "RowSource", "TableFile", "TableFormatError", "TableManifest", "codec_row_bytes",
           "create_table", "matrix_values", "random_values", "write_table"]
