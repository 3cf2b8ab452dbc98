"""JAGG across a trainer's own per-step ``backward()`` calls: ``jaggc.stepwise`` (stepwise.py), its plan, run, safety cases and ranks."""

from .stepwise import STEPWISE_MODES, Stepwise, StepwiseCounts, StepwiseReport, Trajectory, stepwise

__all__ = ["STEPWISE_MODES", "Stepwise", "StepwiseCounts", "StepwiseReport", "Trajectory", "stepwise"]
