"""Gradient-fidelity measurement for JAGG on the user's own loss: the estimators and ``calibrate``
(the studies that use them live in ``jaggc_studies.fidelity``)."""

from .estimators import Estimate, Recording, Setting, estimate, record

__all__ = ["Estimate", "Recording", "Setting", "estimate", "record", "calibrate"]


def __getattr__(name):
    if name == "calibrate":
        from .calibrate import calibrate

        return calibrate
    raise AttributeError(name)
