"""Error types raised by jaggc.

Every refusal names what is wrong (the step, node or input) and how to fix it. Callers can catch
``JaggError`` for all of them; the subclasses also derive from the builtin exception a generic
caller would expect (``ValueError`` for bad values, ``TypeError`` for bad types).

Two kinds of "unsupported" are kept apart, because ``capture="auto"`` treats them differently:

- ``JaggCaptureError``: one capture path (FX, Dynamo) could not record the loss faithfully; another
  path may. ``auto`` tries the next path and says so.
- ``JaggGraphError`` and every other ``JaggUnsupportedError``: a final refusal. The loss breaks a
  precondition of the rewrite whatever captured it (a DiT input computed from an earlier DiT
  output, no DiT call); no other path is tried.

``JaggInternalError`` is a jaggc bug (a pass broke an invariant), never a statement about the
user's code; it is not a ``JaggUnsupportedError`` so no fallback hides it.
"""

from __future__ import annotations


def located(message: str, where: str = "") -> str:
    """``message`` prefixed by its location (``file:line: message``, ``step 3: message``); the
    message alone if the location is unknown. The one place that formats a refusal's location."""
    return f"{where}: {message}" if where else message


class JaggError(Exception):
    """Base class of every error jaggc raises on purpose. ``where``: the location the message is
    about (the user's ``file:line``, ``step 3``, a graph node); the message is prefixed with it."""

    def __init__(self, message: str = "", *args, where: str = ""):
        super().__init__(located(message, where), *args)
        self.where = where


class JaggInputError(JaggError, ValueError):
    """An input (state, timestep, option, shape, dtype, device) that jaggc must refuse."""


class JaggTypeError(JaggError, TypeError):
    """An input of a type jaggc cannot handle (e.g. a DiT output it cannot split)."""


class JaggUnsupportedError(JaggError):
    """Code or a configuration that jaggc cannot prove safe to rewrite (a final refusal)."""


class JaggGraphError(JaggUnsupportedError):
    """A captured graph that violates a precondition of the JAGG rewrite (a final refusal)."""


class JaggCaptureError(JaggUnsupportedError):
    """One capture path cannot record the loss faithfully; another path may (``capture="auto"``
    tries it). ``path`` names the path that failed, ``where`` the user's ``file:line`` if known."""

    def __init__(self, message: str, *, path: str = "", where: str = ""):
        super().__init__(message, where=where)
        self.path = path


class JaggInternalError(JaggError, RuntimeError):
    """A jaggc invariant failed: a bug in jaggc, to be reported, not worked around."""


def where(step: int | None = None, input_name: str | None = None) -> str:
    """Format a location for error messages: ``step 3, input 'timestep'``."""
    parts = []
    if step is not None:
        parts.append(f"step {step}")
    if input_name is not None:
        parts.append(f"input {input_name!r}")
    return ", ".join(parts) if parts else "the call"
