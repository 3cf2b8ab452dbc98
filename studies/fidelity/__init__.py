"""The fidelity studies: the bias study that chose the default, the routing study, the digits
calibration batches. The estimators and ``calibrate`` they use are the library's ``jaggc.fidelity``."""
