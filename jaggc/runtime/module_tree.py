"""A module's submodules, parameters and buffers, listed once and reused while they are the same objects.

A per-step loop declares one trajectory per sample or minibatch, and every trajectory needs the module's
tree: the ledger's parameters and canaries, the state reader's submodules, the devices its generators
live on, the tap's trained parameters. Walked afresh (``named_parameters()``, ``modules()``: recursive
generators with a memo set and name prefixes) that is several walks per trajectory, a third of
jaggc's bookkeeping on the digits DiT (docs/fewsteps.md, "Bookkeeping").

``module_tree(module)`` keeps the last listing per module and hands it out again while every module in
it still holds the same children, parameters and buffers (by identity, each module's three dicts
compared entry by entry: every dict's size and every entry read in C, no recursion). Anything that changes the tree changes one of
those dicts: an adapter injected (peft sets new submodules), a parameter replaced
(``module.weight = nn.Parameter(...)``, ``_parameters[name] = ...``), FSDP's swaps between sharded and
unsharded parameters, a buffer reassigned. Then it is listed again. What the listing does not hold is
read fresh by its users: ``requires_grad`` (``trainable``), devices.
"""

from __future__ import annotations

import weakref
from itertools import chain
from operator import attrgetter, is_

from torch import nn


class ModuleTree:
    """One listing of ``module``'s tree (module docstring)."""

    __slots__ = ("modules", "named_parameters", "buffers", "_sizes", "_entries", "__weakref__")

    def __init__(self, module: nn.Module):
        self.modules: list[nn.Module] = list(module.modules())
        self.named_parameters: list[tuple[str, nn.Parameter]] = list(module.named_parameters())
        self.buffers = list(module.buffers())
        # every module's three dicts' sizes and entries, in order, for ``current``
        self._sizes, self._entries = _listing(self.modules)

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters]

    def trainable(self) -> list[nn.Parameter]:
        """The parameters that require grad now (read now: a loop may freeze or unfreeze between uses)."""
        return [p for _, p in self.named_parameters if p.requires_grad]

    def current(self) -> bool:
        """Whether a walk now would list the same objects (module docstring)."""
        sizes, entries = _listing(self.modules)
        # by identity (map over operator.is_): no ``==``, which a tensor would answer elementwise
        return sizes == self._sizes and all(map(is_, entries, self._entries))


_DICTS = attrgetter("_modules", "_parameters", "_buffers")


def _listing(modules: list[nn.Module]) -> tuple[list[int], list]:
    """The sizes of the modules' ``_modules``, ``_parameters`` and ``_buffers`` dicts, and their entries,
    read in C (a Python loop over a DiT's modules was most of a trajectory's check)."""
    dicts = list(chain.from_iterable(map(_DICTS, modules)))
    return list(map(len, dicts)), list(chain.from_iterable(map(dict.values, dicts)))


_TREES: "weakref.WeakKeyDictionary[nn.Module, ModuleTree]" = weakref.WeakKeyDictionary()


def module_tree(module: nn.Module) -> ModuleTree:
    """``module``'s tree: the last listing while it is current, else a new one."""
    try:
        tree = _TREES.get(module)
    except TypeError:                 # not weak-referenceable (a wrapper of partitions): list it
        return ModuleTree(module)
    if tree is None or not tree.current():
        tree = ModuleTree(module)
        _TREES[module] = tree
    return tree


__all__ = ["ModuleTree", "module_tree"]
