"""The serving engine: continuous batching over a paged KV cache, Engram tables placed per layer (docs/engine.md)."""

from tiergram.engine.budget import Budget
from tiergram.engine.config import DegradePolicy, EngineConfig, Placement, SamplingParams, serving_torch_threads
from tiergram.engine.llm_engine import LLMEngine, QueueFullError
from tiergram.engine.metrics import EngineMetrics
from tiergram.engine.sequence import RequestOutput

__all__ = ["Budget", "DegradePolicy", "EngineConfig", "EngineMetrics", "LLMEngine", "Placement", "QueueFullError",
           "RequestOutput", "SamplingParams", "serving_torch_threads"]
