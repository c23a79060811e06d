"""Study tools: gate probe, ablation, capacity accounting, pre-retrieval skip predictor (docs/findings.md)."""

from tiergram.analysis.predictor import SkipPredictor, fit_predictor

__all__ = ["SkipPredictor", "fit_predictor"]
