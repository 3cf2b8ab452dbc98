"""Where in the user's code something happened: the one rule every error message uses.

An error names the user's line, not jaggc's or torch's. A frame is *internal* when it belongs to
torch or to jaggc's compiler machinery (``INTERNAL_MODULES``: the frontends, the runtime, the
passes, the graph ops, the api): live frames are judged by their module's ``__name__``, recorded
frames (tracebacks, Dynamo's stack, an fx node's ``stack_trace``) by whether their file is one of
those modules' files. Never by a piece of the path: a user's project in a folder named ``jaggc``
(the default name of a clone) keeps its locations. The helpers users call inside their losses
(``jaggc.grpo``, ``jaggc.verify``'s losses) are not internal: their lines are worth naming.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import linecache
import os
import re
from typing import Iterable

INTERNAL_MODULES = ("torch", "jaggc.frontends", "jaggc.runtime", "jaggc.steps", "jaggc.passes", "jaggc.api", "jaggc.graph_ops",
                    "jaggc._compat", "jaggc.backends", "jaggc.options", "jaggc.source")


def is_internal_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in INTERNAL_MODULES)


@functools.lru_cache(maxsize=1)
def _internal_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders, files) of the internal modules, as real paths. Computed on first use, when jaggc
    is imported (``find_spec`` of a submodule imports its parent)."""
    folders, files = [], []
    for name in INTERNAL_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            folders += [os.path.join(os.path.realpath(p), "") for p in spec.submodule_search_locations]
        elif spec.origin:
            files.append(os.path.realpath(spec.origin))
    return tuple(folders), tuple(files)


@functools.lru_cache(maxsize=4096)
def is_internal_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    folders, files = _internal_paths()
    return real in files or real.startswith(folders)


def user_frame(frame=None):
    """The innermost live frame, from ``frame`` (default: the caller's) outwards, whose module is
    not internal; None if there is none."""
    frame = inspect.currentframe().f_back if frame is None else frame
    while frame is not None:
        if not is_internal_module(frame.f_globals.get("__name__", "")):
            return frame
        frame = frame.f_back
    return None


def frame_location(frame) -> str:
    """``file:line`` of a live frame; "" for None."""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def frame_traceback_line(frame) -> str:
    """``frame`` in traceback format (what fx's ``stack_trace`` holds and ``node_location`` reads)."""
    if frame is None:
        return ""
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {text}\n'


def user_locations(frames: Iterable[tuple[str, int]]) -> list[str]:
    """``file:line`` of the recorded (filename, line) frames that are not internal, in order."""
    return [f"{f}:{line}" for f, line in frames if not is_internal_file(str(f))]


def traceback_location(exc: BaseException) -> str:
    """``file:line`` of the innermost user frame of an exception's traceback; "" if none."""
    import traceback

    found = user_locations((f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__))
    return found[-1] if found else ""


def node_location(node) -> str:
    """``file:line`` of the user code that made an fx node (its ``stack_trace``); "" if unknown."""
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    locations = user_locations((f, int(line)) for f, line in found)
    return locations[-1] if locations else ""


def stack_location(frames) -> str:
    """Where a recorded stack (outermost first; objects with ``filename``/``lineno``, as Dynamo's
    ``real_stack``) left the user's code: the loss's own line, followed by ``(in file:line)`` of
    the innermost user frame when that is inside a function the loss calls; "" if unknown."""
    found = user_locations((getattr(f, "filename", ""), getattr(f, "lineno", 0)) for f in frames or ())
    if not found:
        return ""
    return found[0] if found[-1] == found[0] else f"{found[0]} (in {found[-1]})"


__all__ = ["INTERNAL_MODULES", "frame_location", "frame_traceback_line", "is_internal_file", "is_internal_module",
           "node_location", "stack_location", "traceback_location", "user_frame", "user_locations"]
