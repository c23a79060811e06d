"""The planner: predict each placement's serving front from hardware and model specs (docs/planner.md)."""
