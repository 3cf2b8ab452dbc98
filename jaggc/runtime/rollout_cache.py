"""The on-policy fast path: interior step outputs taken from the rollout instead of re-computed.

GRPO samples a trajectory with the DiT (no grad), then trains on the stored states. On the first
inner step the parameters are still the rollout's, so the DiT output of every interior step of a
window is the velocity the rollout already computed: JAGG then needs no interior forward at all,
only the knot forward and the joint backward ((2 + 4)F per window instead of (W + 4)F).

``RolloutCache`` records the rollout's DiT calls, one row per sample, keyed by a fingerprint of every
input of that sample (state, timestep, conditioning rows, shared tensors, non-tensor arguments),
so a training batch may regroup and reorder the rollout's samples and steps (Flow-GRPO shuffles
both; classifier-free guidance tiles ``[uncond; cond]``). The call is read as the DiT's ``forward``
binds it (``canonical_call``), so a keyword passed by position, or a default passed explicitly
(``joint_attention_kwargs=None`` in Flow-GRPO's sampler, absent in its training call), is the same
call. A lookup returns an output only if every row is found AND the DiT's parameters and buffers
are exactly those of the recording: each one's in-place version counter (bumped by optimizer steps
and any in-place write) and identity are compared, and a mismatch drops the cache, so the runtime
falls back to real forwards. An engine whose optimizer writes the parameters without bumping their
version counters (DeepSpeed's ZeRO-1/2: fp32 copies written back through ``.data`` and collectives)
has its optimizer's steps counted instead (``Engine.optimizer_generation``); its ``engine.module`` does
not lead to the engine, so a cache of it needs ``engine=`` (``jaggc.stepwise`` passes its own) and
refuses without. A recording made after the parameters changed starts the cache anew
(the next rollout).

The fingerprint is computed where the inputs are, without copying them to the host: what is no
tensor data (the call's structure, non-tensor arguments, each tensor's dtype and row shape, which
inputs are batched) is the host key of a table of rows; the data of each row, as 16-bit words (bytes
where a row has an odd number of them: equal bits, not equal values, so ``-0.0`` is not ``0.0``),
gives three independent universal hashes ``Σ w_i x_i mod (2^31 - 1)`` with random weights per input
(two distinct rows agree in all three with probability 2^-93). A recording keeps its rows'
fingerprints on the device (no host read); a lookup compares the call's rows with the table's there
and reads the matching row indices (one host read of ``batch`` integers per lookup, which the
stepwise path shares with its own pending flags). At SD3.5-Medium's size (1024²: a 16×128×128 fp32
latent, 333×4096 bf16 text embeddings: 3.7 MB a row) this replaces a device-to-host copy of the
inputs and a blake2b over them (some 30 ms for a batch of 8 on one CPU core) by a few elementwise
passes on the device; the hash weights take 2 bytes of device memory per input byte (a few dozen MB).
Inputs on the CPU, where no device waits, get a blake2b digest of each row's bytes instead (faster
there), as three words of the same table.

A row is also keyed by what decides the output besides inputs and parameters
(``function_state.py``): peft adapters' state, the train/eval flag of the modules whose output
depends on it (dropout with p > 0, batch norm, a forward that reads ``self.training``) and the
autocast state. A reference call recorded under ``disable_adapter()`` never answers a lookup made
with the adapter on; a rollout in ``eval()`` answers a training call in ``train()`` when no module
computes differently in the two. Live dropout or batch statistics make a call no function of its
inputs: it is neither recorded nor served. ``strict_state=True`` keys rows by the whole module
state instead (every train flag; the intercept fallback's recording, which replays one loss call).

Off-policy serving (``first_order=True``, first_order.py): the rows outlive the parameters they were
recorded at, as long as every change since is an optimizer's. The owner reports each optimizer step of
the module (``before_optimizer_step`` / ``after_optimizer_step``): a parameter written by anything else
between them taints the recording (the rows are dropped at the next look), and after more than
``max_optimizer_steps`` steps they are not served. ``stale_prepare`` then looks rows up as
``prepare`` does, and each table indexes the rollout's passes (rollout_passes.py), so that the knots'
rows of a training call's samples are found, with their inputs.

``max_bytes`` bounds the memory the rows hold (the outputs, on their device); a call that would
exceed it is not recorded (``stats.skipped_rows``), and ``nbytes`` / ``stats.bytes_per_row`` say what
it holds.
"""

from __future__ import annotations

import bisect
import weakref
import contextlib
import functools
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._compat import local_shard, tree_flatten, tree_unflatten, version_counter, zero12_managed
from .calls import DitCall, batch_size, batched_time, get_time, resolve_time_arg, set_time
from ..errors import JaggUnsupportedError
from .engines import EngineKind, engine_of
from .function_state import FunctionStateReader
from .module_state import output_key, unwrap
from .module_tree import module_tree
from .rollout_passes import PassIndex


def parameter_versions(dit: nn.Module, params: list[torch.Tensor] | None = None) -> tuple:
    """Identity and in-place version of every parameter and buffer (what a recorded output was
    computed with). ``params``: the parameters as the tensors that last (``Engine.lasting_parameters``:
    FSDP2's sharded DTensors), each with its local shard's version beside its own (an optimizer's
    foreach step may write the shard alone)."""
    tree = module_tree(dit)            # listed once while unchanged (module_tree.py)
    if params is None:
        return tuple((id(t), version_counter(t)) for t in (*tree.parameters, *tree.buffers))
    return tuple((id(t), version_counter(t), version_counter(local_shard(t))) for t in (*params, *tree.buffers))


_UNREAD = object()


@dataclass
class RolloutCacheStats:
    hits: int = 0           # calls served from the cache
    misses: int = 0         # calls that needed a forward
    invalidations: int = 0  # times the parameters had changed since the recording
    recorded_rows: int = 0  # rows recorded since the cache was last cleared
    skipped_rows: int = 0   # rows not recorded: max_bytes reached
    bytes_per_row: int = 0  # bytes of one recorded row (the last recorded)
    first_order_served: int = 0  # whole-loss interior steps served off-policy (first_order.py)


@dataclass
class RolloutCache:
    """Records a DiT's no-grad calls during a rollout; serves them back while parameters are unchanged.

    ``time_arg``/``unbatched`` follow ``WindowOptions`` (where the timestep is; which tensor inputs
    are shared rather than batched); ``max_bytes``: at most this many bytes of recorded outputs
    (None: no bound); ``strict_state``: key rows by the whole module state (module docstring)."""

    dit: nn.Module
    time_arg: str | int | None = None
    unbatched: tuple[str, ...] = ("img_ids", "txt_ids")
    max_bytes: int | None = None
    strict_state: bool = False
    first_order: bool = False
    max_optimizer_steps: int = 8
    min_sigma: float = 0.5           # first_order: a window reaching a lower σ is not served (stepwise_settings.py)
    max_served_error: float = 0.25   # first_order: the guard's bound on served outputs (steps/served_probe.py)
    engine: Any = None               # the DiT's engine where the DiT does not lead to it: DeepSpeed's (the engine
                                     # or its Engine entry, runtime/engines.py), whose engine.module the loop calls
    stats: RolloutCacheStats = field(default_factory=RolloutCacheStats)
    # private state, not constructor arguments: (state, host key) -> _Table of rows, the parameter
    # versions the rows were recorded at, the bytes held
    _rows: dict = field(default_factory=dict, init=False, repr=False)
    _versions: tuple | None = field(default=None, init=False, repr=False)
    _bytes: int = field(default=0, init=False, repr=False)
    _reader: FunctionStateReader | None = field(default=None, init=False, repr=False)
    # first_order: the parameter versions the optimizer steps since the recording left, their number,
    # and whether anything else wrote a parameter
    _explained: tuple | None = field(default=None, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _tainted: bool = field(default=False, init=False, repr=False)
    # the DiT's engine entry (runtime/engines.py); None: not read yet (read at the first use after each clear())
    _engine: Any = field(default=None, init=False, repr=False)
    # inside versions_held: the versions read (_UNREAD: not yet); None outside
    _held: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.first_order:
            # the optimizer steps since the recording, counted by the global optimizer hooks
            # (optimizer_hook.py) for every optimizer that steps this module's parameters
            self._watch = _OptimizerWatch(self)

    def engine_entry(self):
        """The DiT's engine entry: ``engine``'s where given, else the one the DiT leads to. Refused where the
        DiT is a module DeepSpeed's ZeRO manages whose engine is not given (its steps would go unseen)."""
        if self._engine is None:
            given = self.engine
            engine = engine_of(given) if isinstance(given, nn.Module) else given if given is not None else engine_of(self.dit)
            if engine.kind is EngineKind.NONE and zero12_managed(unwrap(self.dit)):
                raise JaggUnsupportedError(
                    "a RolloutCache of the module a DeepSpeed ZeRO engine manages (engine.module): ZeRO's optimizer writes "
                    "its steps into the parameters without bumping their version counters, so the cache could serve "
                    "outputs of parameters the optimizer has moved since. Pass the engine: RolloutCache(engine.module, "
                    "engine=engine, ...) (jaggc.stepwise(engine, rollout_cache=...) does this itself)")
            self._engine = engine
        return self._engine

    @contextlib.contextmanager
    def versions_held(self):
        """Within it, the parameters' versions are read once: one DiT call's bookkeeping asks several times
        (on-policy, off-policy, a knot's rows), and nothing between those asks writes a parameter (the
        per-step path wraps each call: steps/stepwise_install.py). Nested: the outer one holds."""
        if self._held is not None:
            yield
            return
        self._held = _UNREAD
        try:
            yield
        finally:
            self._held = None

    def _versions_now(self) -> tuple:
        """``parameter_versions`` of the DiT, through its engine's lasting parameters where its engine swaps
        them (FSDP2), with its engine optimizer's step count where that writes the parameters unseen
        (DeepSpeed's ZeRO: ``Engine.optimizer_generation``); inside ``versions_held``, read once."""
        if self._held is not None and self._held is not _UNREAD:
            return self._held
        versions = self._read_versions()
        if self._held is _UNREAD:
            self._held = versions
        return versions

    def _read_versions(self) -> tuple:
        engine = self.engine_entry()
        versions = parameter_versions(self.dit, engine.lasting_parameters(self.dit) if engine.swaps_parameters else None)
        generation = engine.optimizer_generation()
        return versions if generation is None else versions + (("engine optimizer steps", generation),)

    def __len__(self) -> int:
        return sum(t.rows for t in self._rows.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the recorded outputs the cache holds."""
        return self._bytes

    @contextlib.contextmanager
    def record(self, clear: bool = True):
        """Record every no-grad call of ``dit`` made inside the context (the rollout); ``clear=False``
        adds to what was recorded before (with unchanged parameters)."""
        if clear:
            self.clear()

        def on_forward(module, args, kwargs, output):
            if not torch.is_grad_enabled():
                self.record_call(DitCall(tuple(args), dict(kwargs)), output)

        on_forward._jaggc_observer = True   # module_state ignores it: it changes no output
        handle = self.dit.register_forward_hook(on_forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def clear(self) -> None:
        self._rows.clear()
        self._versions = None
        self._bytes = 0
        self._reader = None
        self.stats.recorded_rows = 0
        self._explained, self._steps, self._tainted = None, 0, False
        self._engine = None

    # --- off-policy serving: the optimizer steps since the recording ---------------------------
    def before_optimizer_step(self) -> None:
        """An optimizer step of the module's parameters is about to run: whatever changed them since the
        recording or the last step must have been an optimizer step, else the rows are tainted."""
        if self.first_order and self._versions is not None and not self._tainted:
            if self._versions_now() != (self._explained or self._versions):
                self._tainted = True

    def after_optimizer_step(self) -> None:
        if self.first_order and self._versions is not None and not self._tainted:
            self._explained = self._versions_now()
            self._steps += 1

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps since the recording (first_order)."""
        return self._steps

    def serves_stale(self) -> bool:
        """True while the rows may be served first-order: every change of the parameters since the
        recording an optimizer step's, at most ``max_optimizer_steps`` of them (module docstring)."""
        if not self.first_order or self._versions is None or not self._rows or self._tainted:
            return False
        if self._steps == 0 or self._steps > self.max_optimizer_steps:
            return False
        return self._versions_now() == self._explained

    # --- the state a row is valid in -----------------------------------------------------------
    def _state(self):
        """(key, reusable): what the output depends on besides inputs and parameters, now."""
        if self.strict_state:
            return output_key(self.dit), True
        if self._reader is None:
            self._reader = FunctionStateReader(self.dit)
        state = self._reader.read()
        return state, state.reusable

    def valid(self) -> bool:
        """True while the parameters are exactly the recording's (else the cache is dropped)."""
        if self._versions is None or not self._rows:
            return False
        if self._versions_now() != self._versions:
            if self.serves_stale():
                return False          # kept for off-policy serving (stale_prepare), not served as on-policy
            self.stats.invalidations += 1
            self.clear()
            return False
        return True

    def record_call(self, call: DitCall, output: Any) -> bool:
        """Record the rows of one no-grad call and its output; False if nothing was recorded (the
        state makes the output no function of the inputs, or ``max_bytes`` is reached). A call
        made after the parameters changed since the last recording starts the cache anew."""
        versions = self._versions_now()
        if versions != self._versions:
            self.clear()
            self._versions = versions
        state, reusable = self._state()
        if not reusable:
            return False
        batch = batch_size(call)
        leaves, spec = tree_flatten(output)
        batched = [isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == batch for x in leaves]
        row_bytes = sum(x[0].numel() * x.element_size() for x, b in zip(leaves, batched) if b)
        if self.max_bytes is not None and self._bytes + batch * row_bytes > self.max_bytes:
            self.stats.skipped_rows += batch
            return False
        # one copy per output leaf; the rows are views of it
        leaves = [x.detach().clone() if b else x for x, b in zip(leaves, batched)]
        key, prints = self._fingerprints(call)
        table = self._rows.get((state, key))
        if table is None:
            table = self._rows[(state, key)] = _Table()
            if self.first_order:
                time_arg = resolve_time_arg(call, self.time_arg)
                canonical = canonical_call(self.dit, call)
                # the state: diffusers' hidden_states, else the forward's first argument
                state_arg = "hidden_states" if "hidden_states" in canonical.kwargs else _canonical_name(self.dit, call, 0)
                table.passes = PassIndex(time_arg=_canonical_name(self.dit, call, time_arg), state_arg=state_arg)
        if table.passes is not None:
            table.passes.add(canonical_call(self.dit, call), table.rows, batch)
        table.add(prints, leaves, batched, spec)
        self._bytes += batch * row_bytes
        self.stats.recorded_rows += batch
        self.stats.bytes_per_row = row_bytes
        return True

    def lookup(self, call: DitCall) -> Any | None:
        """The recorded output of ``call`` (rows reassembled in the call's order), or None."""
        pending = self.prepare(call)
        return None if pending is None else self.finish(pending, pending.rows.tolist())

    def prepare(self, call: DitCall) -> "PendingLookup | None":
        """A lookup up to its one host read: None where the host knows it misses (parameters changed,
        a state that is no function of the inputs, no row of the call's structure); else the matching
        row of each sample on the device (``rows``: -1 where none), for ``finish`` once read."""
        if not self.valid():
            self.stats.misses += 1
            return None
        state, reusable = self._state()
        if not reusable:
            self.stats.misses += 1
            return None
        key, prints = self._fingerprints(call)
        table = self._rows.get((state, key))
        if table is None:
            self.stats.misses += 1
            return None
        return PendingLookup(table, table.match(prints))

    def stale_prepare(self, call: DitCall) -> "PendingLookup | None":
        """``prepare`` for off-policy serving: the rows recorded before the optimizer steps since
        (``serves_stale``), None where they may not be served or the host knows the call misses."""
        if not self.serves_stale():
            return None
        state, reusable = self._state()
        if not reusable:
            return None
        key, prints = self._fingerprints(call)
        table = self._rows.get((state, key))
        if table is None or table.passes is None:
            return None
        return PendingLookup(table, table.match(prints))

    def finish(self, pending: "PendingLookup", rows: list) -> Any | None:
        """The output of a prepared lookup, given its ``rows`` as read on the host."""
        if any(r < 0 for r in rows):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return pending.table.output(rows)

    # --- rows ---------------------------------------------------------------------------------
    def _fingerprints(self, call: DitCall) -> tuple[str, torch.Tensor]:
        """The call's host key (everything but tensor data) and one fingerprint per sample over all of
        that sample's inputs, (batch, 3) int64 on the inputs' device (module docstring)."""
        batch = batch_size(call)
        time_arg = resolve_time_arg(call, self.time_arg)
        # a scalar timestep and its per-sample expansion are the same call
        call = batched_time(call, time_arg)
        call = set_time(call, time_arg, get_time(call, time_arg).to(torch.float64))
        call = canonical_call(self.dit, call)
        flat, spec = tree_flatten((call.args, call.kwargs))
        key = [repr(spec)]
        total, host, on_host = None, [[0] * _HASHES for _ in range(batch)], False
        for slot, leaf in enumerate(flat):
            if isinstance(leaf, torch.Tensor):
                rowwise = leaf.ndim >= 1 and leaf.shape[0] == batch and not self._is_unbatched(call, leaf)
                key.append(repr((slot, rowwise, leaf.dtype, tuple(leaf.shape[1:] if rowwise else leaf.shape))))
                h = _hash_rows(leaf.detach(), batch if rowwise else 1, slot)
                if isinstance(h, list):
                    on_host = True
                    for b in range(batch):
                        host[b] = [x + y for x, y in zip(host[b], h[b if rowwise else 0])]
                else:
                    total = h if total is None else total + h.to(total.device)      # (1, 3) broadcasts
            else:
                key.append(repr(leaf))
        if on_host or total is None:
            # (a host-to-device copy only for a call that mixes host and device inputs)
            host_part = torch.tensor([[x % _PRIME for x in row] for row in host], dtype=torch.int64)
            total = host_part if total is None else total + host_part.to(total.device)
        return "\x00".join(key), (total % _PRIME).expand(batch, _HASHES)

    def _is_unbatched(self, call: DitCall, leaf: torch.Tensor) -> bool:
        return any(call.kwargs.get(name) is leaf for name in self.unbatched)


def _canonical_name(dit: nn.Module, call: DitCall, arg: str | int) -> str | int:
    """The name ``canonical_call`` gives the argument ``arg`` (a position or a name) of ``call``."""
    if isinstance(arg, str):
        return arg
    signature = _forward_signature(type(unwrap(dit)))
    if signature is None:
        return arg
    names = [n for n, p in signature.parameters.items()
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][1:]
    return names[arg] if arg < len(names) else arg


def canonical_call(dit: nn.Module, call: DitCall) -> DitCall:
    """``call`` as the DiT's own ``forward`` binds it: every argument by name, defaults filled in
    (the innermost module of a DDP/FSDP/peft wrapper: its ``forward`` has the real signature). A
    call the signature does not bind is returned as it is."""
    signature = _forward_signature(type(unwrap(dit)))
    if signature is None:
        return call
    try:
        bound = signature.bind(None, *call.args, **call.kwargs)
    except TypeError:
        return call
    bound.apply_defaults()
    kwargs = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            kwargs.update({f"*{i}": v for i, v in enumerate(value)})
        else:
            kwargs[name] = value
    return DitCall((), dict(sorted(kwargs.items())))


@functools.lru_cache(maxsize=None)
def _forward_signature(cls: type) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


@dataclass
class PendingLookup:
    """A prepared lookup (``RolloutCache.prepare``): its table and, per sample, the index of the
    matching row on the device (-1: none)."""

    table: "_Table"
    rows: torch.Tensor


class _OptimizerWatch:
    """Forwards the global optimizer hooks to a first-order cache (held by it; it holds the cache weakly).
    Where the DiT's engine writes a step's parameters after torch's post-hook fired (DeepSpeed's ZeRO
    optimizer: the torch optimizer steps fp32 copies, then ZeRO writes them back), the step's end is
    the engine optimizer's (``Engine.after_optimizer_step``)."""

    def __init__(self, cache: "RolloutCache"):
        from .optimizer_hook import register_after_optimizer_step, register_before_optimizer_step

        self.cache = weakref.ref(cache)
        self.engine = cache.engine_entry()
        self.engine_ends_steps = self.engine.after_optimizer_step(self._engine_stepped)
        register_before_optimizer_step(self)
        register_after_optimizer_step(self)

    def _mine(self, optimizer) -> "RolloutCache | None":
        cache = self.cache()
        return cache if cache is not None and self.engine.steps(optimizer, cache.dit) else None

    def before_optimizer_step(self, optimizer) -> None:
        cache = self._mine(optimizer)
        if cache is not None:
            cache.before_optimizer_step()

    def after_optimizer_step(self, optimizer) -> None:
        cache = self._mine(optimizer)
        if cache is not None and not self.engine_ends_steps:
            cache.after_optimizer_step()

    def _engine_stepped(self) -> None:
        cache = self.cache()
        if cache is not None:
            cache.after_optimizer_step()


class _Table:
    """The recorded rows of one call structure: their fingerprints (on the device) and outputs, in
    recording order (a row recorded again is found at its latest recording)."""

    def __init__(self):
        self.passes: PassIndex | None = None        # first_order: the rollout's passes (rollout_passes.py)
        self.prints: list[torch.Tensor] = []        # (b, 3) per recorded call
        self.outputs: list[tuple] = []              # (leaves, batched, spec) per recorded call
        self.starts: list[int] = []                 # the first row index of each recorded call
        self.rows = 0
        self._all: torch.Tensor | None = None       # the fingerprints concatenated (cached)

    def add(self, prints: torch.Tensor, leaves: list, batched: list, spec) -> None:
        self.prints.append(prints)
        self.outputs.append((leaves, batched, spec))
        self.starts.append(self.rows)
        self.rows += prints.shape[0]
        self._all = None

    def match(self, prints: torch.Tensor) -> torch.Tensor:
        """Per row of ``prints``, the latest recorded row with the same fingerprint, or -1 (on the device)."""
        if self._all is None:
            self._all = torch.cat([p.to(self.prints[0].device) for p in self.prints])
        table = self._all.to(prints.device)
        same = (prints[:, None, :] == table[None]).all(-1)                # (batch, rows)
        index = torch.arange(table.shape[0], device=prints.device)
        return torch.where(same, index, torch.full_like(index, -1)).amax(1)

    def output(self, rows: list[int]) -> Any:
        picked = []
        for r in rows:
            k = bisect.bisect_right(self.starts, r) - 1
            picked.append((self.outputs[k], r - self.starts[k]))
        (leaves, batched, spec), _ = picked[0]
        out = [torch.stack([o[0][i][j] for o, j in picked]) if batched[i] else leaves[i] for i in range(len(leaves))]
        return tree_unflatten(out, spec)


_PRIME = 2**31 - 1          # the hashes' modulus: a word (< 2^16) times a weight (< 2^31) fits int64
_HASHES = 3                 # independent hashes per row (module docstring)
_weights_cache: dict = {}


def _hash_rows(t: torch.Tensor, rows: int, slot: int) -> torch.Tensor:
    """(rows, 3) int64: ``Σ w_i x_i mod p`` over each row's 16-bit words (bytes if a row has an odd
    number of them), with random weights per input slot and row length (module docstring)."""
    data = t.reshape(rows, -1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    if data.is_complex():
        data = torch.view_as_real(data).reshape(rows, -1)
    data = data.contiguous()
    if data.numel() and data.stride(-1) != 1:        # size-1 dims expanded (stride 0) count as contiguous
        data = torch.empty(data.shape, dtype=data.dtype, device=data.device).copy_(data)
    if type(data) is torch.Tensor and data.device.type == "cpu":
        # on the host nothing waits for a device: a digest of the bytes is faster than the hashes
        raw = data.view(torch.uint8).reshape(rows, -1).numpy()
        words = [[int.from_bytes(d[k:k + 8], "little") % _PRIME for k in (0, 8, 16)]
                 for d in (hashlib.blake2b(r.tobytes(), digest_size=24).digest() for r in raw)]
        return words                                  # host integers, (rows, 3): summed on the host
    if data.shape[1] * data.element_size() % 2 == 0 and data.element_size() > 1:
        words = data.view(torch.int16).to(torch.int64) & 0xFFFF
    else:
        words = data.view(torch.uint8).to(torch.int64)
    weights = _weights(slot, words.shape[1], words.device)
    return torch.stack([((words * weights[k]) % _PRIME).sum(1) for k in range(_HASHES)], 1)


def _weights(slot: int, n: int, device: torch.device) -> torch.Tensor:
    """The hash weights of one input slot and row length, (3, n) int64 in [1, p), on ``device``
    (drawn once, from a generator seeded by slot and length: every cache hashes alike)."""
    key = (slot, n, device)
    w = _weights_cache.get(key)
    if w is None:
        g = torch.Generator().manual_seed(random.Random(f"jaggc-rollout-{slot}-{n}").getrandbits(62))
        w = torch.randint(1, _PRIME, (_HASHES, n), generator=g, dtype=torch.int64).to(device)
        _weights_cache[key] = w
    return w
