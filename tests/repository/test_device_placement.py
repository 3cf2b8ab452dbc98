"""Where jaggc makes a tensor, and where its collectives run: a static rule over the source.

On a GPU, a tensor jaggc makes without a device lands on the CPU, and the first op that meets the
module's CUDA tensors fails ("Expected all tensors to be on the same device"), or a collective under
NCCL refuses it ("No backend type associated with device type cpu"). The CPU-only suite cannot see
that by running (tests/device_standin.py sees it where a test drives the path), so every tensor
factory call in jaggc/ and passes/ either names its device (``device=...``; the ``*_like``
factories take their argument's) or is in ``HOST_SIDE``: a tensor that lives on the host by design
(a declaration's timesteps, a report's table, a generator's draw that is moved after), with why.
And every collective goes through ``jaggc/runtime/collectives.py``, which puts its tensor on the
device the process group serves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# verify/ is left out: the verifier's proofs run on the CPU in float64 by design (fields it builds itself)
SOURCES = [p for folder in ("jaggc", "passes") for p in sorted((ROOT / folder).rglob("*.py"))]
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "randn", "rand",
             "randint", "randperm", "eye", "normal"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all", "gather", "scatter", "reduce"}

#: (file relative to the root, function) -> why its device-less factory is on the host by design
HOST_SIDE = {
    ("jaggc/steps/plan.py", "declared_times"): "the declared timesteps: host values the plan is made of",
    ("jaggc/steps/run.py", "_read_declaration_with_lookup"): "the declaration's values as read on the host (its bits)",
    ("jaggc/report_view.py", "*"): "a report's tables, drawn on the host",
    ("jaggc/report_build.py", "*"): "a report's tables, drawn on the host",
    ("jaggc/grpo.py", "flow_grpo_advantages"): "indexes of a prompt's samples, from a host list",
    ("jaggc/grpo.py", "_rewards"): "the rewards as given: as_tensor keeps a tensor's device, a list's is the host",
    ("jaggc/fidelity/estimators.py", "random3"): "a random pick of a step from a CPU generator, read as an int",
    ("jaggc/fidelity/estimators.py", "subsample"): "a random pick of steps from a CPU generator, read as ints",
    ("jaggc/fidelity/estimators.py", "estimate"): "a seed drawn from a CPU generator, read as an int",
    ("jaggc/runtime/weights.py", "sample"): "a basis's random knot picks from its own CPU generator, read as numbers",
    ("jaggc/runtime/deferred.py", "run"): "a 0-element graph anchor: no data, never an operand of a device op",
    ("jaggc/steps/tap.py", "tap_output"): "a 0-element graph anchor: no data, never an operand of a device op",
    ("jaggc/runtime/guard_probe.py", "sharded_flat"): "the empty flat vector of a module without slots (0 elements)",
    ("jaggc/runtime/rollout_cache.py", "_fingerprints"): "host inputs' row hashes (blake2b), moved to the device only "
                                                         "for a call that mixes host and device inputs",
    ("jaggc/runtime/rollout_cache.py", "_weights"): "hash weights drawn once from a CPU generator, moved to the device",
    ("jaggc/models.py", "sd3_conditioning"): "drawn on the CPU generator, then moved to the model's device",
    ("jaggc/models.py", "flux_conditioning"): "drawn on the CPU generator, then moved to the model's device",
}


def _calls(path: Path):
    """(function name, call node) of every call in ``path``, with its enclosing function's name."""
    tree = ast.parse(path.read_text())
    stack: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            stack.append(node.name)
            self.generic_visit(node)
            stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            out.append((stack[-1] if stack else "<module>", node))
            self.generic_visit(node)

    out: list = []
    Visitor().visit(tree)
    return out


def _name(func) -> tuple[str, str] | None:
    """("torch", "zeros") for ``torch.zeros(...)``, ("dist", "all_reduce") for ``dist.all_reduce(...)``."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id, func.attr
    return None


def _allowed(rel: str, function: str) -> bool:
    return (rel, function) in HOST_SIDE or (rel, "*") in HOST_SIDE


def test_every_tensor_factory_names_its_device_or_is_host_side_by_design():
    offenders = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for function, call in _calls(path):
            name = _name(call.func)
            if name is None or name[0] != "torch" or name[1] not in FACTORIES:
                continue
            if any(k.arg == "device" for k in call.keywords) or _allowed(rel, function):
                continue
            offenders.append(f"{rel}:{call.lineno} torch.{name[1]}(...) in {function}()")
    assert not offenders, (
        "tensor factories without device= (a CPU tensor beside the module's CUDA ones on a GPU); name the "
        "device, or add the call to HOST_SIDE with why it lives on the host:\n  " + "\n  ".join(offenders))


def test_every_collective_goes_through_the_served_device_helper():
    offenders = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        if rel == "jaggc/runtime/collectives.py":
            continue
        for function, call in _calls(path):
            name = _name(call.func)
            if name is not None and name[0] == "dist" and name[1] in COLLECTIVES:
                offenders.append(f"{rel}:{call.lineno} dist.{name[1]}(...) in {function}()")
    assert not offenders, (
        "collectives outside jaggc/runtime/collectives.py (its helpers put the tensor on the device the group "
        "serves: NCCL takes CUDA tensors only):\n  " + "\n  ".join(offenders))


def test_the_host_side_list_names_calls_that_exist():
    """An entry whose call is gone (moved, given a device) is dropped from the list, not kept stale."""
    present = set()
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for function, call in _calls(path):
            name = _name(call.func)
            if name is not None and name[0] == "torch" and name[1] in FACTORIES \
                    and not any(k.arg == "device" for k in call.keywords):
                present.add((rel, function))
                present.add((rel, "*"))
    assert set(HOST_SIDE) <= present, sorted(set(HOST_SIDE) - present)
