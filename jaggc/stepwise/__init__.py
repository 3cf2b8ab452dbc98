"""JAGG across a trainer's own per-step ``backward()`` calls (``jaggc.stepwise``; stepwise.py)."""

from .stepwise import STEPWISE_MODES, Stepwise, StepwiseCounts, StepwiseReport, Trajectory, stepwise

__all__ = ["STEPWISE_MODES", "Stepwise", "StepwiseCounts", "StepwiseReport", "Trajectory", "stepwise"]
