"""The planner: predict each placement's serving front from hardware and model specs (docs/planner.md)."""

from tiergram.plan.model import (
    DiskSpec,
    EngramGeometry,
    Front,
    HardwareSpec,
    Limit,
    ModelSpec,
    MoeGeometry,
    Placement,
    Point,
    Workload,
    concurrency_limit,
    predict_front,
    predict_point,
)
from tiergram.plan.specs import SpecError, load_hardware, load_model

__all__ = ["DiskSpec", "EngramGeometry", "Front", "HardwareSpec", "Limit", "ModelSpec", "MoeGeometry", "Placement",
           "Point", "SpecError", "Workload", "concurrency_limit", "load_hardware", "load_model", "predict_front",
           "predict_point"]
