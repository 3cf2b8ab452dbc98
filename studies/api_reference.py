"""Write docs/api.md: every public name of jaggc (``jaggc.__all__``), ``jaggc.grpo``, ``jaggc.models``,
``jaggc.verify`` and ``jaggc.testing``, with its signature and the first line of its docstring.

    python -m jaggc_studies.api_reference --out docs/api.md

tests/repository/test_docs.py regenerates it and fails when the committed page differs, so a changed
signature or docstring cannot leave the reference stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re

MODULES = ("jaggc", "jaggc.grpo", "jaggc.models", "jaggc.verify", "jaggc.testing")
INTRO = {
    "jaggc": "The compiler: decorate a loss, its settings, its report, the window runtime, the errors.",
    "jaggc.grpo": "Reference GRPO math for flow models: step policies, PPO-clip, advantages, schedules.",
    "jaggc.models": "Small real diffusers DiTs built from configs (random init) and their inputs.",
    "jaggc.verify": "The verifier: check your own loss, velocity fields with known Jacobians, properties.",
    "jaggc.testing": "Testing a trainer's loss on a CPU the way it runs on a GPU.",
}


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:   # a module without __all__: its own functions and classes, no underscore
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == module.__name__]
    return sorted(names)


def first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    paragraph = doc.split("\n\n")[0]
    return " ".join(paragraph.split())


def _clean(text: str) -> str:
    # object reprs carry memory addresses: keep the name only
    return re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"\1()", re.sub(r" at 0x[0-9a-f]+", "", text))


def signature(obj) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return ""


def entry(qualified: str, obj) -> str:
    if inspect.isclass(obj):
        kind = "dataclass" if dataclasses.is_dataclass(obj) else "class"
        head = f"### `{qualified}{signature(obj)}` ({kind})"
    elif callable(obj):
        head = f"### `{qualified}{signature(obj)}`"
    else:
        head = f"### `{qualified}` = `{_clean(repr(obj))[:80]}`"
    line = first_line(obj) if (inspect.isclass(obj) or callable(obj)) else ""
    return head + ("\n\n" + line if line else "") + "\n"


def render() -> str:
    parts = ["# API reference\n",
             "Generated from the docstrings by `python -m jaggc_studies.api_reference --out docs/api.md`; "
             "`tests/repository/test_docs.py` keeps it in sync. How to use these: [usage.md](usage.md).\n"]
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(f"## `{name}`\n\n{INTRO[name]}\n")
        for attr in public_names(module):
            parts.append(entry(f"{name}.{attr}", getattr(module, attr)))
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="write the API reference page")
    parser.add_argument("--out", default="docs/api.md", help="the markdown file to write")
    args = parser.parse_args(argv)
    with open(args.out, "w") as f:
        f.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
