"""The source tree's layering: private torch APIs only in ``jaggc/_compat/``, imports that point down
the layers (``MAY_IMPORT``; the compiler never imports the studies), and no import cycles.

* Private torch: a torch upgrade that moves a private name should cost one file. Checked three
  ways on jaggc/, passes/ and verify/ (outside the ``_compat`` package): the text ``torch._`` and dotted
  private paths (``torch.fx._symbolic_trace``), ``from torch.x import _y`` imports, and the private
  attributes of torch objects that jaggc reads (``PRIVATE_TORCH_ATTRIBUTES``). The exceptions are
  listed in ``_compat``'s docstring (``DOCUMENTED_EXCEPTIONS`` must appear there).
* Import cycles, statically: the graph of jaggc-internal module-level imports (imports inside
  functions are lazy and allowed) must be acyclic; and no two modules may import each other at
  all (imports inside functions and under ``TYPE_CHECKING`` counted, and a call of another module's
  private method on an object: ``probe.guard._finished``). ``passes/`` and ``verify/`` are the packages
  ``jaggc.passes`` and ``jaggc.verify`` (pyproject's ``package-dir``).
* Import cycles, for real: every module imports without error as the first jaggc module of a fresh
  interpreter (``first_import_failures``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import jaggc._compat

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "jaggc" / "_compat"          # a package, one module per concern
COMPAT_FILES = sorted(COMPAT.glob("*.py"))


def _package_dirs() -> dict[str, Path]:
    """Package name -> folder, as pyproject's [tool.setuptools.package-dir] installs them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


PACKAGE_DIRS = _package_dirs()


def source_modules() -> dict[str, Path]:
    """Every module of jaggc (passes/ and verify/ under their installed names) -> its file."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = source_modules()


# ---------------------------------------------------------------------------------------------
# private torch APIs

# Attributes of torch objects that are private (an underscore) but not under a ``torch._`` path,
# so the text check cannot see them; each has a named wrapper in _compat.
PRIVATE_TORCH_ATTRIBUTES = {
    "_version": "version_counter",                  # Tensor._version
    "_orig_mod": "compiled_inner_module",           # torch.compile's OptimizedModule
    "_compiled_call_impl": "MODULE_CALL_SLOT",      # nn.Module.__call__'s slot
    "_call_impl": "module_call_impl",
    "_forward_hooks": "module_hook_keys",
    "_forward_pre_hooks": "module_hook_keys",
    "_codegen": "copy_input_codegen",               # fx.Graph's pytree codegen
    "_execution_engine": "queue_backward_callback",  # autograd's engine queue
    # FSDP's gradient storage (FSDP1 FlatParamHandle/FlatParameter, FSDP2 FSDPState/FSDPParam)
    **dict.fromkeys(("_handle", "_params", "_saved_grad_shard", "_local_shard", "_use_orig_params",
                     "_use_sharded_grad_views", "_use_unsharded_grad_views", "_get_fsdp_state",
                     "_fsdp_param_groups", "_unsharded_param", "_param_fqn"), "fsdp_gradient_slots"),
}

# Text that matches ``torch._`` but is public: Python's dunders (``torch.__version__``,
# ``torch.__file__``, ``Function.__dict__``). Each example must be named in _compat's docstring.
DOCUMENTED_EXCEPTIONS = ("torch.__version__", "torch.__file__")

_PRIVATE_PATH = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\.(_\w+)")


def _outside_compat() -> dict[str, Path]:
    return {name: path for name, path in MODULES.items() if path not in COMPAT_FILES}


def private_torch_uses(path: Path) -> list[str]:
    """``file:line: what`` for every private torch name ``path`` uses."""
    found = []
    text = path.read_text()
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for lineno, line in enumerate(text.splitlines(), 1):
        for match in _PRIVATE_PATH.finditer(line):
            if not re.fullmatch(r"__\w+__", match.group(1)):   # a dunder is public
                found.append(f"{rel}:{lineno}: {match.group(0)}")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            found += [f"{rel}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRIBUTES:
            found.append(f"{rel}:{node.lineno}: .{node.attr} (use _compat.{PRIVATE_TORCH_ATTRIBUTES[node.attr]})")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_TORCH_ATTRIBUTES:
            found.append(f"{rel}:{node.lineno}: {node.value!r} (use _compat.{PRIVATE_TORCH_ATTRIBUTES[node.value]})")
    return found


def test_private_torch_apis_only_in_compat():
    found = [use for path in _outside_compat().values() for use in private_torch_uses(path)]
    assert not found, "private torch APIs outside jaggc/_compat/ (add a named wrapper there):\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_private_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""\
        import torch._dynamo
        from torch.fx.graph import _PyTreeCodeGen
        x = torch.utils._pytree.tree_map
        v = p._version
        slot = "_compiled_call_impl"
        ok = torch.__version__, torch.autograd.Function.__dict__
    """))
    lines = sorted({int(use.split(":")[1]) for use in private_torch_uses(bad)})
    assert lines == [1, 2, 3, 4, 5], private_torch_uses(bad)


def test_documented_exceptions_are_in_the_compat_docstring():
    doc = jaggc._compat.__doc__
    assert all(f"``{name}``" in doc for name in DOCUMENTED_EXCEPTIONS), doc


def test_every_compat_name_is_used():
    """A name in _compat that nobody uses is a private API kept alive for nothing."""
    defined = set()
    for path in COMPAT_FILES:
        tree = ast.parse(path.read_text())
        defined |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined = {name for name in defined if not name.startswith("_")}
    users = "\n".join(p.read_text() for p in _outside_compat().values())
    unused = sorted(name for name in defined if not re.search(rf"\b{name}\b", users))
    assert not unused, f"jaggc/_compat names nobody in jaggc/, passes/, verify/ uses: {unused}"


def test_compat_is_one_module_per_concern_each_named_in_its_docstring():
    """The package's docstring names each of its modules; each module opens with the idea it holds;
    callers import from ``jaggc._compat`` itself (its ``__all__`` re-exports every public name)."""
    doc = jaggc._compat.__doc__
    for path in COMPAT_FILES:
        if path.name != "__init__.py":
            assert f"``{path.stem}``" in doc, path.stem
            assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no opening docstring"
    public = {n.name for path in COMPAT_FILES for n in ast.parse(path.read_text()).body
              if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}
    assert public <= set(jaggc._compat.__all__)


# ---------------------------------------------------------------------------------------------
# import cycles, statically


def _module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: the module body, including ``if``
    / ``try`` / ``with`` blocks and class bodies, but not function bodies nor ``if TYPE_CHECKING:``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                stack += node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                stack += handler.body


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _all_imports(tree: ast.Module):
    """Every import statement, those inside functions (lazy) included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_edges(module: str, *, lazy: bool = False) -> set[str]:
    """The jaggc modules ``module`` runs at import time: each imported module, the packages above
    it (their ``__init__`` runs first) except those above ``module`` itself (already running),
    and for ``from P import x`` the submodule ``P.x`` where x is one. ``lazy=True`` adds the
    imports inside functions (what the module may import when it runs)."""
    own_parents = set(_with_parents(module)[:-1])
    edges: set[str] = set()

    def add(target: str, explicit: bool) -> None:
        for name in _with_parents(target):
            if name in MODULES and (name not in own_parents or (explicit and name == target)):
                edges.add(name)

    tree = ast.parse(MODULES[module].read_text())
    for node in (_all_imports(tree) if lazy else _module_level_imports(tree)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, explicit=True)
            continue
        if node.level:
            base = _package_of(module).split(".")
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
        # ``from P import x`` reads P's namespace unless every name is a submodule of P
        add(target, explicit=len(submodules) < len(node.names))
        for sub in submodules:
            add(sub, explicit=True)
    edges.discard(module)
    return edges


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_its_path():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_relative_imports_resolve_to_modules():
    assert "jaggc._compat" in import_edges("jaggc.frontends.fx")            # from .. import _compat
    assert "jaggc.runtime" in import_edges("jaggc.passes.context")          # from ..runtime import ...
    assert "jaggc.frontends.value_reads" in import_edges("jaggc.frontends.fx")  # from .value_reads import ...
    assert "jaggc.frontends" not in import_edges("jaggc.frontends.fx")      # its own package: running
    assert "jaggc_studies.digits" in import_edges("jaggc_studies.fidelity.study", lazy=True)
    assert "jaggc.passes.context" in import_edges("jaggc.passes.pipeline")  # passes/ is jaggc.passes


def test_no_import_cycles():
    graph = {module: import_edges(module) for module in MODULES}
    cycle = import_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


# ---------------------------------------------------------------------------------------------
# no two modules that reach each other: any import (module level, inside functions, under
# TYPE_CHECKING) and any reach-back into another module's private method counts


def private_methods() -> dict[str, str]:
    """Private method name -> its module, for the names defined (as methods) in one module only."""
    owners: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef):
                for node in cls.body:
                    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_")
                            and not node.name.startswith("__")):
                        owners.setdefault(node.name, set()).add(module)
    return {name: next(iter(mods)) for name, mods in owners.items() if len(mods) == 1}


def reach_backs(module: str, tree: ast.Module, methods: dict[str, str]) -> set[str]:
    """The modules whose private methods ``module`` calls on an object not its own (``probe.guard._finished``):
    a dependency no import statement shows."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (owner := methods.get(node.attr)) not in (None, module):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(owner)
    return found


def every_dependency(module: str, methods: dict[str, str]) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    return import_edges(module, lazy=True) | reach_backs(module, tree, methods)   # lazy: every import statement


def mutual_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})


def test_no_two_modules_import_each_other():
    methods = private_methods()
    graph = {module: every_dependency(module, methods) for module in MODULES}
    pairs = mutual_pairs(graph)
    assert not pairs, ("modules that import (or reach into) each other; pass what one needs as arguments, or move "
                       "what both need below them:\n" + "\n".join(f"{a} <-> {b}" for a, b in pairs))


def test_the_pair_check_sees_type_checking_imports_and_reach_backs(tmp_path, monkeypatch):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaggc.b import Owner\n")
    b.write_text("import jaggc.a\nclass Owner:\n    def _finished(self):\n        pass\n")
    monkeypatch.setitem(MODULES, "jaggc.a", a)
    monkeypatch.setitem(MODULES, "jaggc.b", b)
    assert mutual_pairs({m: every_dependency(m, {}) for m in ("jaggc.a", "jaggc.b")}) == [("jaggc.a", "jaggc.b")]
    a.write_text("def done(probe):\n    probe.owner._finished()\n")         # no import, a reach-back
    methods = {"_finished": "jaggc.b"}
    assert mutual_pairs({m: every_dependency(m, methods) for m in ("jaggc.a", "jaggc.b")}) == [("jaggc.a", "jaggc.b")]
    assert mutual_pairs({"jaggc.a": set(), "jaggc.b": {"jaggc.a"}}) == []


# ---------------------------------------------------------------------------------------------
# the direction of imports: each layer imports only the layers below it

# Layer of a module: the first entry of LAYER_PREFIXES that names it or a package above it.
LAYER_PREFIXES = {
    "jaggc.errors": "errors", "jaggc.source": "source", "jaggc.backward_modes": "modes", "jaggc._compat": "compat",
    "jaggc.runtime": "runtime", "jaggc.config": "vocabulary", "jaggc.call_site": "vocabulary",
    "jaggc.graph_ops": "graph_ops", "jaggc.node_meta": "graph_ops", "jaggc.alias_roots": "graph_ops",
    "jaggc.frontends": "frontends", "jaggc.passes": "passes",
    "jaggc.backends": "backends", "jaggc.report_view": "report", "jaggc.report_drawing": "report", "jaggc.report_build": "report",
    "jaggc.report": "report", "jaggc.fidelity": "fidelity", "jaggc.grpo": "helpers",
    "jaggc.models": "helpers", "jaggc.testing": "helpers", "jaggc.api": "api", "jaggc.session": "api", "jaggc.verify": "verify",
    "jaggc.cli": "cli", "jaggc.steps": "steps", "jaggc_studies": "studies", "jaggc": "package",
}
_BASE = {"errors", "compat", "source", "modes"}
# layer -> the layers it may import (lazily too). Nothing of the compiler may import the studies;
# the runtime, which runs inside autograd, knows nothing of graphs, frontends or passes.
MAY_IMPORT = {
    "errors": set(),
    "source": set(),
    "compat": {"errors"},
    "modes": {"errors"},      # backward_modes.py: the mode symbols and their one table
    "helpers": _BASE,
    "runtime": _BASE,
    # config.py, call_site.py: what the frontends, passes and report name (CompileConfig, CallSite, Window)
    "vocabulary": _BASE | {"runtime"},
    "graph_ops": _BASE | {"runtime", "vocabulary"},
    "frontends": _BASE | {"runtime", "graph_ops", "vocabulary"},
    "passes": _BASE | {"runtime", "graph_ops", "vocabulary"},
    "backends": _BASE | {"runtime", "graph_ops", "vocabulary"},
    "report": _BASE | {"runtime", "graph_ops", "frontends", "vocabulary"},
    "fidelity": _BASE | {"runtime", "frontends", "vocabulary"},
    "api": _BASE | {"runtime", "vocabulary", "graph_ops", "frontends", "passes", "backends", "report", "package"},
    # the per-step path (jaggc.steps): the window runtime's pieces and the options, no graph
    "steps": _BASE | {"runtime", "package"},
    # options.py reads the capture paths from the frontend registry (frontends/registry.py)
    "package": _BASE | {"runtime", "api", "report", "fidelity", "steps", "frontends"},
    "verify": _BASE | {"runtime", "vocabulary", "api", "report", "helpers", "package", "passes", "frontends",
                       "graph_ops"},
    "cli": {"verify"},
    "studies": {"errors", "compat", "source", "modes", "runtime", "vocabulary", "graph_ops", "frontends", "api",
                "report", "fidelity", "helpers", "package", "verify", "studies", "passes", "backends", "steps"},
}
COMPILER_LAYERS = set(MAY_IMPORT) - {"studies"}


def layer_of(module: str) -> str:
    for prefix, layer in LAYER_PREFIXES.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise KeyError(f"{module}: no layer in LAYER_PREFIXES (add it)")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """``a -> b (layer -> layer)`` for every edge the direction table forbids."""
    bad = []
    for module, targets in sorted(edges.items()):
        own = layer_of(module)
        for target in sorted(targets):
            if (other := layer_of(target)) != own and other not in MAY_IMPORT[own]:
                bad.append(f"{module} -> {target} ({own} -> {other})")
    return bad


def test_every_module_has_a_layer_and_every_layer_a_rule():
    assert {layer_of(m) for m in MODULES} <= set(MAY_IMPORT)
    assert all(targets <= set(MAY_IMPORT) for targets in MAY_IMPORT.values())


def test_imports_point_down_the_layers():
    edges = {module: import_edges(module, lazy=True) for module in MODULES}
    bad = upward_imports(edges)
    assert not bad, "imports against the direction table (MAY_IMPORT):\n" + "\n".join(bad)


def test_the_direction_check_fails_on_an_upward_import():
    assert upward_imports({"jaggc.runtime.window": {"jaggc.passes.rewrite"}}) == [
        "jaggc.runtime.window -> jaggc.passes.rewrite (runtime -> passes)"]
    assert upward_imports({"jaggc.fidelity.calibrate": {"jaggc_studies.digits.trainer"}})
    assert upward_imports({"jaggc.api": {"jaggc_studies.bench"}})
    assert not upward_imports({"jaggc_studies.bench.runner": {"jaggc.api", "jaggc.runtime"}})


def test_the_compiler_reaches_no_study_module():
    """The installed compiler, lazy imports included, never runs a module of jaggc_studies."""
    graph = {m: import_edges(m, lazy=True) for m in MODULES}
    reached, todo = set(), [m for m in MODULES if layer_of(m) in COMPILER_LAYERS]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    studies = sorted(m for m in reached if layer_of(m) == "studies")
    assert not studies, f"the compiler's imports reach the studies: {studies}"


def test_importing_the_compiler_loads_no_study_module():
    code = ("import sys, importlib, jaggc, jaggc.cli, jaggc.verify, jaggc.fidelity.calibrate, jaggc.passes;"
            "jaggc.cli.build_parser.__name__;"
            "print(sorted(m for m in sys.modules if m.startswith('jaggc_studies')))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------------------------
# import cycles, for real: each module first in a fresh interpreter

# One child process per chunk of modules. It forks a scout that imports every jaggc module and
# reports which other modules (torch's subsystems, diffusers, ...) that loaded; the child imports
# those, then forks once per module of its chunk, and each fork imports its module as the first
# jaggc module it has ever seen. A fork is a fresh interpreter as far as jaggc goes (sys.modules
# holds no jaggc module), at a tenth of a second instead of the seconds torch's own imports take.
_CHILD = textwrap.dedent("""\
    import importlib, os, sys, traceback

    def in_fork(body):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                out, code = body(), 0
            except BaseException:
                out, code = traceback.format_exc(), 1
            os.write(w, out.encode())
            os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        return os.waitpid(pid, 0)[1] == 0, out

    def is_jaggc(name):
        return name.split(".")[0] in ("jaggc", "jaggc_studies")

    every, mine = sys.argv[1].split(","), sys.argv[2].split(",")

    def scout():
        for module in every:
            importlib.import_module(module)
        return ",".join(m for m in list(sys.modules) if not is_jaggc(m))

    ok, loaded = in_fork(scout)
    for name in loaded.split(",") if ok else ():
        try:
            importlib.import_module(name)
        except BaseException:
            pass
    assert not [m for m in sys.modules if is_jaggc(m)], "a jaggc module was imported before the checks"
    failed = []
    for module in mine:
        ok, out = in_fork(lambda: importlib.import_module(module).__name__ and "")
        if not ok:
            failed.append(f"{module}:\\n{out}")
    print("\\n".join(failed))
    sys.exit(1 if failed else 0)
""")


def first_import_failures(modules: list[str], chunks: int = 2) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, ",".join(modules), ",".join(modules[i::chunks])],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(chunks)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    return [out for p, out in zip(procs, outputs) if p.returncode != 0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter():
    failures = first_import_failures(sorted(MODULES))
    assert not failures, "modules that fail when imported first:\n" + "\n".join(failures)
