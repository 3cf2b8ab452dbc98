"""Error types raised by jaggc.

Every refusal names what is wrong (the step, node or input) and how to fix it. Callers can catch
``JaggError`` for all of them; the subclasses also derive from the builtin exception a generic
caller would expect (``ValueError`` for bad values, ``TypeError`` for bad types).
"""

from __future__ import annotations


class JaggError(Exception):
    """Base class of every error jaggc raises on purpose."""


class JaggInputError(JaggError, ValueError):
    """An input (state, timestep, option, shape, dtype, device) that jaggc must refuse."""


class JaggTypeError(JaggError, TypeError):
    """An input of a type jaggc cannot handle (e.g. a DiT output it cannot split)."""


class JaggUnsupportedError(JaggError):
    """Code or a configuration that jaggc cannot prove safe to rewrite."""


class JaggGraphError(JaggUnsupportedError):
    """A captured graph that violates a precondition of the JAGG rewrite."""


def where(step: int | None = None, input_name: str | None = None) -> str:
    """Format a location for error messages: ``step 3, input 'timestep'``."""
    parts = []
    if step is not None:
        parts.append(f"step {step}")
    if input_name is not None:
        parts.append(f"input {input_name!r}")
    return ", ".join(parts) if parts else "the call"
