"""Gradient-fidelity measurement for JAGG: estimators, calibration, the digits study."""

from .estimators import Estimate, Recording, Setting, estimate, record

__all__ = ["Estimate", "Recording", "Setting", "estimate", "record", "calibrate"]


def __getattr__(name):
    if name == "calibrate":
        from .calibrate import calibrate

        return calibrate
    raise AttributeError(name)
