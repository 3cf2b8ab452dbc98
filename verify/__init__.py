"""jaggc's verifier (installed as ``jaggc.verify``): velocity fields with known Jacobian structure,
the sympy algebra, the exactness properties and counterexample searches, and ``check_loss``, which
validates ``@jagg_compile`` on a user's own loss (``loss_check.py``)."""

from .loss_check import LossCheck, assert_loss_exact, check_loss

__all__ = ["LossCheck", "assert_loss_exact", "check_loss"]
