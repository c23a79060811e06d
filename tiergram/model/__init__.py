"""The reference Engram LM: config, model, data, training, evaluation, export, generation, checkpoints."""

from tiergram.model.config import EngramSettings, ModelConfig, preset, small_config, tiny_config
from tiergram.model.model import EngramLM, Past, make_hasher

__all__ = ["EngramLM", "EngramSettings", "ModelConfig", "Past", "make_hasher", "preset", "small_config",
           "tiny_config"]
