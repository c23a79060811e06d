"""The Engram nn.Module and the tables it reads rows from."""

from tiergram.engram.module import Engram, EngramConfig, RMSNorm, ShortConv
from tiergram.engram.tables import RowSource, RowSourceTable, TrainableTable, check_row_ids

__all__ = [
    "Engram",
    "EngramConfig",
    "RMSNorm",
    "RowSource",
    "RowSourceTable",
    "ShortConv",
    "TrainableTable",
    "check_row_ids",
]
