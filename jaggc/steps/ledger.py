"""What jaggc must notice between a trainer's steps: parameters and ``.grad`` changed by someone else.

A window's joint backward runs when its last step's gradient arrives; until then the steps whose
backward already ran have contributed nothing to ``.grad`` (their gradient is *withheld*), and its
knot graphs hold the parameters they were computed with. So between two steps of an open window
nothing may change the parameters (a knot's graph would backpropagate through other values than its
forward saw, an interior step re-run would compute another function), and while a gradient is
withheld whatever the loop does to ``.grad`` must be known: a ``zero_grad`` drops the withheld steps
in the unchanged loop; a ``clip_grad_norm_``, a GradScaler's ``unscale_`` or a hand-written scaling
reads or scales a gradient that lacks them.

The ledger keeps the state both were in when jaggc last looked (before each step, and at the end of
every backward of the loop: ``Stepwise.after_backward``), and says what changed since:

* parameters: each one's in-place version and storage (an optimizer step, ``p.add_``,
  ``load_state_dict``). A write through ``p.data`` bumps no version and is not seen;
* ``.grad``: each trainable parameter's gradient by its storage (the tensor, or the tensor a view
  was taken of: FSDP1 with ``use_orig_params=True`` hands out new views of one flat gradient in
  every forward, which is no write), address and in-place version. A change is a *reset* when every
  trainable gradient is then empty (None, or zero in every bit: ``zero_grad`` with
  ``set_to_none`` True or False), else a *write*.

A reset of gradients that were None already, or a clip of gradients that are zero, changes nothing
one can see. So while a gradient is withheld, one gradient per module (its smallest trainable
parameter's: a canary) is made visible (``GradMarks``): a None becomes a tensor of negative zeros,
an all-zero gradient is negated in place to negative zeros. Negative zero adds as zero (``-0.0 + x == x`` bit for bit, ``+0.0`` included), so
whatever accumulates into a mark gives what it gives into None or zeros; but ``zero_grad`` empties
it (None, or ``+0.0``), while any scaling (a clip's, ``unscale_``'s, a hand-written ``mul_``) keeps
the sign bit: a write. When nothing is withheld any more, the marks nothing wrote into are taken back
(None again, or ``+0.0``), so the loop's ``.grad`` is the unchanged loop's, None where it has None.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .._compat import TripFlag, lay_tripwire, lift_tripwire, local_shard, version_counter, version_counters
from ..runtime.module_tree import module_tree


@dataclass(frozen=True)
class GradChange:
    """What happened to ``.grad`` since the last snapshot: ``reset`` (a zero_grad) or ``written``
    (an in-place write that is no zero_grad), with the first parameter it was seen on."""

    kind: str
    name: str


class GradKeys:
    """Every trainable gradient as the ledger last saw it: which exist, and for those their storage's
    owner (weakly), address and in-place version. The ledger looks at every trainable gradient three
    times per step; one Python object per gradient and look was most of its cost, so plain tensors'
    keys are read and compared list by list in C (``map`` over attribute getters), and only sharded
    gradients (DTensors, FSDP2) go one by one."""

    __slots__ = ("where", "roots", "ptrs", "versions", "plain")

    def __init__(self, grads: list):
        self.where, present, plain = _present(grads)
        self.plain = plain                       # every gradient a plain tensor (no DTensor)
        if plain:
            roots, self.ptrs, self.versions = _plain_roots(present), _ptrs(present), version_counters(present)
        else:
            roots, self.ptrs, self.versions = (list(x) for x in zip(*map(_key_parts, present))) if present \
                else ([], [], [])
        self.roots = list(map(weakref.ref, roots))

    def same(self, grads: list) -> bool:
        """Whether ``grads`` are the gradients of this look, unwritten."""
        where, present, plain = _present(grads)
        if where != self.where:
            return False
        if plain:
            return (_ptrs(present) == self.ptrs and version_counters(present) == self.versions
                    and all(map(operator.is_, map(weakref.ref.__call__, self.roots), _plain_roots(present))))
        return all(map(self._same_at, range(len(present)), present))

    def differing(self, grads: list) -> list[int]:
        """The positions whose gradient is not this look's (the slow path, once something changed)."""
        out, k = [], 0
        for i, (was, g) in enumerate(zip(self.where, grads)):
            if not was:
                if g is not None:
                    out.append(i)
                continue
            if g is None or not self._same_at(k, g):
                out.append(i)
            k += 1
        return out

    def _same_at(self, k: int, grad: torch.Tensor) -> bool:
        root, ptr, version = _key_parts(grad)
        return self.roots[k]() is root and self.ptrs[k] == ptr and self.versions[k] == version


def _present(grads: list) -> tuple[tuple, list, bool]:
    """(which gradients exist, those gradients, whether all are plain tensors), read in C."""
    where = tuple(map(operator.is_not, grads, itertools.repeat(None)))
    present = list(itertools.compress(grads, where))
    return where, present, set(map(type, present)) <= _PLAIN_TYPES


def _plain_roots(grads: list) -> list:
    """Each plain gradient's storage owner: the tensor, or the one it is a view of (FSDP1's
    ``use_orig_params`` views of a flat gradient)."""
    bases = list(map(_BASE, grads))
    if bases.count(None) == len(bases):
        return grads
    return [g if b is None else b for g, b in zip(grads, bases)]


def _key_parts(grad: torch.Tensor) -> tuple:
    """(the storage's owner, the address, ``_version``) of one gradient, a DTensor's by its local shard."""
    local = grad if type(grad) in _PLAIN else local_shard(grad)
    base = local._base
    version = version_counter(local) if local is grad else (version_counter(grad), version_counter(local))
    return (base if base is not None and grad is local else grad), local.data_ptr(), version


_BASE = operator.attrgetter("_base")
_GRAD = operator.attrgetter("grad")


def _ptrs(tensors: list) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))


class Ledger:
    def __init__(self, module: nn.Module, *, watch_grads: bool = True, tree=None):
        # the module's tree as last listed while unchanged (module_tree.py; ``tree``: that listing as just
        # checked); ZeRO-3's partitions walked
        tree = tree if tree is not None else module_tree(module) if isinstance(module, nn.Module) else None
        self.named = list(tree.named_parameters if tree is not None else module.named_parameters())
        # DeepSpeed ZeRO-2 keeps the gradient in its own partitions and empties ``.grad`` after every
        # backward (runtime/engines.py): there ``.grad`` says nothing and is not watched
        self.trainable = [(n, p) for n, p in self.named if p.requires_grad] if watch_grads else []
        self._trainable_params = [p for _, p in self.trainable]
        self.marks = GradMarks(self.trainable, _canaries_of(tree, module, self.trainable))
        # FSDP2's gradients (DTensors) are also compared by value at their canaries: a foreach op
        # (clip_grad_norm_'s multiply, an optimizer's foreach zero_grad) writes their local shards and
        # bumps no version of either (torch 2.13). A copy per canary shard, small (module docstring)
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        params = [p for _, p in self.named]
        self._plain = params if all(type(p) in _PLAIN for p in params) else None
        self.params = self._param_state()
        self.grads = self._grad_state()

    def _param_state(self):
        if self._plain is not None:             # plain tensors: both read in C (a look per step and tensor)
            return list(zip(version_counters(self._plain), map(torch.Tensor.data_ptr, self._plain)))
        return [(version_counter(p), _local(p).data_ptr()) for _, p in self.named]

    def _grad_state(self) -> GradKeys:
        keys = GradKeys(self._grads())
        self.values = {}
        if not keys.plain:
            for i in self.marks.canaries:
                g = self.trainable[i][1].grad
                if g is not None and _local(g) is not g:
                    self.values[i] = (g, _local(g).detach().clone())
        return keys

    def _grads(self) -> list:
        return list(map(_GRAD, self._trainable_params))

    def _written_in_place(self) -> str | None:
        """The first canary whose sharded gradient (a DTensor) holds other values than at the snapshot
        though no version moved: one host read for them all."""
        kept = [(i, g, copy) for i, (g, copy) in self.values.items() if self.trainable[i][1].grad is g]
        if not kept:
            return None
        flags = torch.stack([_local(g).ne(copy).any().to(copy.device) for _, g, copy in kept]).tolist()
        return next((self.trainable[i][0] for (i, _, _), f in zip(kept, flags) if f), None)

    def snapshot(self) -> None:
        """Accept the parameters and gradients as they are now."""
        self.params = self._param_state()
        self.grads = self._grad_state()
        self.marks.flag.tripped = False

    def snapshot_grads(self) -> None:
        self.grads = self._grad_state()
        self.marks.flag.tripped = False

    def changed_parameter(self) -> str | None:
        """The name of the first parameter written since the snapshot, or None."""
        now = self._param_state()
        if now == self.params:
            return None
        return next((n for (n, _), a, b in zip(self.named, self.params, now) if a != b), None)

    def grad_change(self) -> GradChange | None:
        """How ``.grad`` changed since the snapshot (module docstring), or None. A reset empties
        every trainable gradient; any other change (a clip, a scaling, a reset of some gradients
        only, another tensor put in a ``.grad``) is a write."""
        grads = self._grads()
        changed = [] if self.grads.same(grads) else [self.trainable[i][0] for i in self.grads.differing(grads)]
        if not changed and self.marks.flag.tripped:
            # a canary's sharded gradient was read or written by an op that bumps no version (a clip)
            changed = [f"{self.trainable[self.marks.canaries[0]][0]} ({self.marks.flag.what})"]
        if not changed:
            written = self._written_in_place()
            if written is None:
                return None
            changed = [written]
        emptied = all(_all_bits_zero_each([p.grad for _, p in self.trainable if p.grad is not None]))
        return GradChange("reset" if emptied else "written", changed[0])

    # --- while a gradient is withheld ---------------------------------------------------------
    def withholding(self, withheld: bool) -> None:
        """Mark every trainable gradient while some step's gradient is withheld, take the marks back
        once none is (module docstring); then accept ``.grad`` as it is."""
        if withheld:
            if self.marks.active and not self.values and not self.marks.flag.tripped and self.grads.same(self._grads()):
                # every gradient as the last look saw it, which was after the marks were made: they are in
                # place (a mark is known by its tensor and version), and a new look would see the same
                return
            self.marks.mark()
        else:
            self.marks.unmark()
        self.snapshot_grads()


class GradMarks:
    """The negative-zero marks on the trainable gradients (module docstring). Not every gradient
    needs one: ``zero_grad``, a clip, ``unscale_`` and a scaling loop touch every gradient of the
    modules they cover, so one canary per module (the smallest trainable parameter it owns: a bias,
    a norm's weight, a LoRA matrix) shows them, at a fraction of the model's gradient memory and
    time (a full model's marks cost a memset of every gradient per trajectory)."""

    def __init__(self, trainable: list[tuple[str, torch.Tensor]], canaries: list[int] | None = None):
        self.trainable = trainable
        self.canaries = list(range(len(trainable))) if canaries is None else canaries
        # FSDP2: the canaries' DTensor gradients carry a tripwire while marked (_compat/tripwire.py): a
        # clip or a foreach write of them bumps no version and may change no value
        self.flag = TripFlag()
        self.laid: list[torch.Tensor] = []
        self.made: dict[int, tuple[torch.Tensor, int]] = {}      # a None made a mark: (mark, its version)
        # a gradient multiplied in place by its sign (-1 where it was all +0.0: negated; else 1): (it,
        # its version, the sign, on its device: decided there, with no host read)
        self.negated: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    @torch.no_grad()
    def mark(self) -> None:
        unknown = []
        for i in self.canaries:
            p = self.trainable[i][1]
            g = p.grad
            if g is None:
                p.grad = mark = torch.full_like(p, -0.0)
                self.made[i] = (mark, _version(mark))
            elif not self._is_mark(i, g):
                unknown.append((i, g))
        # an all-zero gradient is negated, any other multiplied by 1 (the same bits), as decided on its
        # device: no host read (a read per window would stop the CPU until the GPU caught up)
        for (i, g), zero in zip(unknown, _all_bits_zero_flags([g for _, g in unknown])):
            local = _local(g)
            sign = 1 - 2 * zero.to(local.dtype)
            local.mul_(sign)
            self.negated[i] = (g, _version(g), sign)
        for i in self.canaries:
            g = self.trainable[i][1].grad
            if g is not None and lay_tripwire(g, self.flag):
                self.laid.append(g)

    @torch.no_grad()
    def unmark(self) -> None:
        """Take back the marks nothing wrote into since they were made."""
        for g in self.laid:
            lift_tripwire(g)
        self.laid.clear()
        self.flag.tripped = False
        for i, (mark, version) in self.made.items():
            p = self.trainable[i][1]
            if p.grad is mark and _version(mark) == version:
                p.grad = None
        for i, (g, version, sign) in self.negated.items():
            p = self.trainable[i][1]
            if p.grad is g and _version(g) == version:
                _local(g).mul_(sign)
        self.made.clear()
        self.negated.clear()

    @property
    def active(self) -> bool:
        """Whether marks are made (and not yet taken back)."""
        return bool(self.made or self.negated)

    def _is_mark(self, i: int, g: torch.Tensor) -> bool:
        for table in (self.made, self.negated):
            entry = table.get(i)
            if entry is not None and entry[0] is g and _version(g) == entry[1]:
                return True
        return False


_CANARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # ModuleTree -> (trainable ids, canaries)


def _canaries_of(tree, module, trainable: list[tuple[str, torch.Tensor]]) -> list[int]:
    """``_canaries`` of the module, kept while its tree is the same listing and the same parameters train (a
    ledger is made per trajectory; the walk over every module's parameters is most of its cost)."""
    if tree is None:
        return _canaries(list(module.modules()), trainable)
    ids = tuple(id(p) for _, p in trainable)
    kept = _CANARIES.get(tree)
    if kept is None or kept[0] != ids:
        kept = _CANARIES[tree] = (ids, _canaries(tree.modules, trainable))
    return list(kept[1])


def _canaries(modules: list[nn.Module], trainable: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Per module that owns trainable parameters, the index (in ``trainable``) of its smallest."""
    if not trainable:
        return []
    index = {id(p): i for i, (_, p) in enumerate(trainable)}
    out = set()
    for m in modules:
        own = [p for p in m._parameters.values() if p is not None and id(p) in index]
        if own:
            out.add(index[id(min(own, key=lambda p: p.numel()))])
    return sorted(out) or list(range(len(trainable)))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _all_bits_zero_flags(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per gradient, a 0-d bool on its (local shard's) device: every element is ``+0.0``."""
    return [~f for f in _nonzero_flags(grads)]


def _nonzero_flags(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    flags = []
    for g in grads:
        local = _local(g)
        if local.numel() == 0:
            flags.append(torch.zeros((), dtype=torch.bool, device=local.device))
        elif local.is_complex() or local.element_size() not in _BITS:
            flags.append(local.ne(0).any())
        else:
            flags.append(local.view(_BITS[local.element_size()]).any())
    return flags


def _all_bits_zero_each(grads: list[torch.Tensor]) -> list[bool]:
    """Whether every element of each gradient is ``+0.0`` (a negative zero has its sign bit set), in
    one host read per device."""
    if not grads:
        return []
    flags = _nonzero_flags(grads)
    by_device: dict = {}
    for k, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(k)
    out = [False] * len(grads)
    for ks in by_device.values():
        for k, nonzero in zip(ks, torch.stack([flags[k] for k in ks]).tolist()):
            out[k] = not nonzero
    return out


def _version(grad: torch.Tensor):
    """A gradient's in-place version. A DTensor's (FSDP2) is its own and its local shard's together:
    FSDP2 accumulates into the local tensor, which bumps no version of the DTensor around it, while an
    in-place op on the DTensor (``mul_``, ``zero_``, a clip without foreach) bumps the DTensor's and not
    the local shard's (torch 2.13). A foreach op on DTensors (``clip_grad_norm_``) bumps neither: the
    canaries' tripwire sees it (``GradMarks``, _compat/tripwire.py)."""
    local = _local(grad)
    return version_counter(local) if local is grad else (version_counter(grad), version_counter(local))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's sharded parameters and gradients) local shard, else the tensor: each
    rank checks its own shard, with no collective."""
    if type(t) in _PLAIN:        # the common case, without a failing attribute look-up per tensor
        return t
    return local_shard(t)


_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)


__all__ = ["GradChange", "GradKeys", "GradMarks", "Ledger"]
