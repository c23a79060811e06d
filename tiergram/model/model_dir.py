"""A model directory read once: its config.json, model config, table files, tokenizer and hashing, passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tiergram.model.checkpoint import hasher_of, load_tokenizer_of, read_config
from tiergram.model.config import ModelConfig
from tiergram.model.export import exported_tables, table_filename


@dataclass
class ModelDir:
    """A trained or exported model directory, its config.json parsed once (`open`)."""

    path: Path
    config: dict[str, Any] = field(repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> ModelDir:
        """Read DIR/config.json (FileNotFoundError / ValueError naming the directory when it is not a model's)."""
        return cls(Path(path), read_config(path))

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config["model"])

    @property
    def engram_layers(self) -> list[int]:
        """The blocks with an Engram layer, in order (none for a model without Engram)."""
        engram = self.model_config.engram
        return [] if engram is None else sorted(engram.layers)

    @property
    def exported(self) -> bool:
        """An exported directory: its tables are table files, listed in config.json."""
        return self.config.get("tables") is not None

    def table_path(self, layer: int, codec: str) -> Path:
        """One layer's table file of a codec: the name config.json lists, else the name `export` writes."""
        return self.path / exported_tables(self.config).get(codec, {}).get(layer, table_filename(layer, codec))

    @cached_property
    def tokenizer(self) -> Any:
        """The directory's tokenizers.Tokenizer, or None."""
        return load_tokenizer_of(self.path)

    @cached_property
    def hasher(self) -> Any:
        """The saved n-gram hasher (checked against the tokenizer), or None for a model without Engram."""
        return hasher_of(self.config, self.tokenizer)
