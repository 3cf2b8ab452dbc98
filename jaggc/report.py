"""The inspection report of a compiled loss: stages, diffs, the window table, graph exports."""

from __future__ import annotations

import difflib
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import fx
from .node_meta import CALL, WINDOW


@dataclass
class WindowRow:
    window: int
    steps: list[int]
    mode: str
    knots: list[int]
    basis: str
    timesteps: list[float]
    backward_before: int   # DiT backward passes of the uncompiled loss (one per step)
    backward_after: int    # after the rewrite (one joint pass per JAGG window)
    score: float | None = None   # routing score of the latest run (routed windows only)
    autocast: str = "off"        # the autocast state its calls run in ("cpu bfloat16", ...)

    def roles(self) -> str:
        if self.mode not in ("jagg", "jagg:σ-exact", "routed", "routed:jagg"):
            return "exact per step"
        return " ".join("K" if i in self.knots else "i" for i in range(len(self.steps)))


@dataclass
class Report:
    """What a compiled loss did on its latest capture (``compiled.report``; ``jaggc.explain``): the
    capture path, the graph after every pass (``stages``, ``stage(name)``, ``diff``), one row per
    window (its steps, mode, knots, basis, DiT backward passes), the notes and refusals met on the
    way, and ``table()`` / ``to_dot()`` / ``render_condensed()`` to read them."""

    path: str                              # "dynamo", "fx", "intercept" or "uncompiled"
    stages: list = field(default_factory=list)
    windows: list[WindowRow] = field(default_factory=list)
    graph_module: fx.GraphModule | None = None
    traces: int = 0
    notes: list[str] = field(default_factory=list)
    reference_calls: int = 0
    capture_failures: list[str] = field(default_factory=list)   # capture="auto": why earlier paths failed
    guarded_reads: int = 0    # FX: tensor values read as Python numbers, re-checked every call
    splits: list[str] = field(default_factory=list)              # split_cfg_batches: the calls split
    lowmem_buffer_bytes: int | None = None   # backward="lowmem": this rank's gradient buffer, latest run
    # the autocast state of every DiT call, trained and reference: "step 3: cpu bfloat16",
    # "reference (file:line): off", ... (graph paths and intercept)
    call_autocast: list[str] = field(default_factory=list)
    trained_calls: int = 0    # grad-enabled calls of the DiT (0: nothing was rewritten)
    guard: str | None = None  # jagg_compile(guard=...): the guard's summary (runtime/guard.py)

    # --- stages -----------------------------------------------------------------------------
    def stage(self, name: str) -> str:
        for s in self.stages:
            if s.name == name or s.name.startswith(name):
                return s.code
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def diff(self, a: str | None = None, b: str | None = None) -> str:
        """Unified diff between two stages (default: first capture vs final graph)."""
        a = a or self.stages[0].name
        b = b or self.stages[-1].name
        return "".join(difflib.unified_diff(self.stage(a).splitlines(True), self.stage(b).splitlines(True),
                                            fromfile=a, tofile=b))

    # --- table ------------------------------------------------------------------------------
    @property
    def backward_before(self) -> int:
        return sum(w.backward_before for w in self.windows)

    @property
    def backward_after(self) -> int:
        return sum(w.backward_after for w in self.windows)

    def table(self) -> str:
        scored = any(w.mode.startswith("routed") for w in self.windows)
        autocast = any(w.autocast != "off" for w in self.windows)
        head = ["window", "steps", "mode", "roles", "weights", "timesteps", "DiT bwd before->after"]
        head[3:3] = ["score"] if scored else []
        head[-1:-1] = ["autocast"] if autocast else []
        rows = []
        for w in self.windows:
            ts = ", ".join(f"{t:.4g}" for t in w.timesteps) if w.timesteps else "(not run yet)"
            row = [str(w.window), f"{w.steps[0]}-{w.steps[-1]}", w.mode, w.roles(), w.basis or "-", ts,
                   f"{w.backward_before} -> {w.backward_after}"]
            row[3:3] = [f"{w.score:.3f}" if w.score is not None else "-"] if scored else []
            row[-1:-1] = [w.autocast] if autocast else []
            rows.append(row)
        rows.append(["total"] + [""] * (len(head) - 2) + [f"{self.backward_before} -> {self.backward_after}"])
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip()
        lines = [fmt(head), fmt(["-" * wd for wd in widths])] + [fmt(r) for r in rows]
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        return {
            "path": self.path, "traces": self.traces, "windows": len(self.windows),
            "backward_before": self.backward_before, "backward_after": self.backward_after,
            "reference_calls": self.reference_calls, "notes": list(self.notes),
            "capture_failures": list(self.capture_failures), "guarded_reads": self.guarded_reads,
            "splits": list(self.splits), "call_autocast": list(self.call_autocast),
            "trained_calls": self.trained_calls,
        }

    def __str__(self) -> str:
        lines = [f"jaggc report: capture path = {self.path}, traces = {self.traces}"
                 + (f", guarded value reads = {self.guarded_reads}" if self.guarded_reads else "")]
        lines += [f"not captured by {reason}" for reason in self.capture_failures]
        if self.splits:
            lines.append(f"split {len(self.splits)} DiT call(s) by batch slice: " + self.splits[0]
                         + (f" (and {len(self.splits) - 1} more)" if len(self.splits) > 1 else ""))
        lines += [f"note: {n}" for n in self.notes]
        if any(not entry.endswith(": off") for entry in self.call_autocast):
            lines.append("DiT calls under autocast: " + "; ".join(self.call_autocast))
        if self.windows:
            lines.append(self.table())
        if self.guard:
            lines.append(self.guard)
        return "\n".join(lines)

    # --- graph exports ----------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        if self.graph_module is None:
            return g
        for node in self.graph_module.graph.nodes:
            site = CALL.get(node)
            g.add_node(node.name, op=node.op, target=_target_name(node), window=WINDOW.get(node),
                       role=getattr(site, "role", None), step=getattr(site, "step", None))
            for inp in node.all_input_nodes:
                g.add_edge(inp.name, node.name)
        return g

    def to_dot(self) -> str:
        """Graphviz DOT text with one cluster per window (no Graphviz needed to produce it)."""
        g = self.to_networkx()
        lines = ["digraph jagg {", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
        by_window: dict[Any, list[str]] = {}
        for name, data in g.nodes(data=True):
            by_window.setdefault(data.get("window"), []).append(name)
        for w, names in by_window.items():
            indent = "  "
            if w is not None:
                lines.append(f"  subgraph cluster_window_{w} {{")
                lines.append(f'    label="window {w}"; style=rounded; color=blue;')
                indent = "    "
            for name in names:
                data = g.nodes[name]
                label = f"{name}\\n{data['target']}"
                style = ', style=filled, fillcolor="#cfe2ff"' if data.get("window") is not None else ""
                lines.append(f'{indent}"{name}" [label="{label}"{style}];')
            if w is not None:
                lines.append("  }")
        for a, b in g.edges():
            lines.append(f'  "{a}" -> "{b}";')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def render(self, path: str) -> str:
        """Write the graph as SVG (needs Graphviz's ``dot``) or, without it, as DOT text."""
        dot_text = self.to_dot()
        exe = shutil.which("dot")
        if exe is None or not str(path).endswith(".svg"):
            out = str(path) if not str(path).endswith(".svg") else str(path)[:-4] + ".dot"
            with open(out, "w") as f:
                f.write(dot_text)
            return out
        subprocess.run([exe, "-Tsvg", "-o", str(path)], input=dot_text.encode(), check=True)
        return str(path)

    def render_condensed(self, path_stem: str, name: str = "") -> list[str]:
        """The condensed picture (one column per trained DiT call, the windows as boxes, each
        step's glue as one node): ``path_stem.png`` and ``.svg`` with matplotlib, else the text
        view in ``path_stem.txt``. Returns the paths written (``jaggc.report_view``, ``jaggc.report_drawing``)."""
        from .report_drawing import write_condensed
        from .report_view import condensed_view

        return write_condensed(condensed_view(self, name=name), str(path_stem))


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", str(t))
