"""The on-policy fast path: interior step outputs taken from the rollout instead of re-computed.

GRPO samples a trajectory with the DiT (no grad), then trains on the stored states. On the first
inner step the parameters are still the rollout's, so the DiT output of every interior step of a
window is the velocity the rollout already computed: JAGG then needs no interior forward at all,
only the knot forward and the joint backward ((2 + 4)F per window instead of (W + 4)F).

``RolloutCache`` records the rollout's DiT calls, one row per sample, keyed by a digest of every
input of that sample (state, timestep, conditioning rows, shared tensors, non-tensor arguments),
so a training batch may regroup and reorder the rollout's samples and steps (Flow-GRPO shuffles
both; classifier-free guidance tiles ``[uncond; cond]``). The call is read as the DiT's ``forward``
binds it (``canonical_call``), so a keyword passed by position, or a default passed explicitly
(``joint_attention_kwargs=None`` in Flow-GRPO's sampler, absent in its training call), is the same
call. A lookup returns an output only if every row is found AND the DiT's parameters and buffers
are exactly those of the recording: each one's in-place version counter (bumped by optimizer steps
and any in-place write) and identity are compared, and a mismatch drops the cache, so the runtime
falls back to real forwards. A recording made after the parameters changed starts the cache anew
(the next rollout). Lookups copy the inputs to host memory to hash them (one device sync per
interior call): still far cheaper than a DiT forward, but not free.

A row is also keyed by what decides the output besides inputs and parameters
(``function_state.py``): peft adapters' state, the train/eval flag of the modules whose output
depends on it (dropout with p > 0, batch norm, a forward that reads ``self.training``) and the
autocast state. A reference call recorded under ``disable_adapter()`` never answers a lookup made
with the adapter on; a rollout in ``eval()`` answers a training call in ``train()`` when no module
computes differently in the two. Live dropout or batch statistics make a call no function of its
inputs: it is neither recorded nor served. ``strict_state=True`` keys rows by the whole module
state instead (every train flag; the intercept fallback's recording, which replays one loss call).

``max_bytes`` bounds the memory the rows hold (the outputs, on their device); a call that would
exceed it is not recorded (``stats.skipped_rows``), and ``nbytes`` / ``stats.bytes_per_row`` say what
it holds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._compat import tree_flatten, tree_unflatten, version_counter
from .calls import DitCall, batch_size, batched_time, get_time, resolve_time_arg, set_time
from .function_state import FunctionStateReader
from .module_state import output_key, unwrap


def parameter_versions(dit: nn.Module) -> tuple:
    """Identity and in-place version of every parameter and buffer (what a recorded output was
    computed with)."""
    return tuple((id(t), version_counter(t)) for t in (*dit.parameters(), *dit.buffers()))


@dataclass
class RolloutCacheStats:
    hits: int = 0           # calls served from the cache
    misses: int = 0         # calls that needed a forward
    invalidations: int = 0  # times the parameters had changed since the recording
    recorded_rows: int = 0  # rows recorded since the cache was last cleared
    skipped_rows: int = 0   # rows not recorded: max_bytes reached
    bytes_per_row: int = 0  # bytes of one recorded row (the last recorded)


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
    stats: RolloutCacheStats = field(default_factory=RolloutCacheStats)
    # private state, not constructor arguments: (state, digest) -> (output leaves of one row, spec,
    # bytes), the parameter versions the rows were recorded at, the bytes held
    _rows: dict = field(default_factory=dict, init=False, repr=False)
    _versions: tuple | None = field(default=None, init=False, repr=False)
    _bytes: int = field(default=0, init=False, repr=False)
    _reader: FunctionStateReader | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self._rows)

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
        if parameter_versions(self.dit) != self._versions:
            self.stats.invalidations += 1
            self.clear()
            return False
        return True

    def record_call(self, call: DitCall, output: Any) -> bool:
        """Record the rows of one no-grad call and its output; False if nothing was recorded (the
        state makes the output no function of the inputs, or ``max_bytes`` is reached). A call
        made after the parameters changed since the last recording starts the cache anew."""
        versions = parameter_versions(self.dit)
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
        # one copy per output leaf; the rows are views of it (a clone per row costs more than the hash)
        leaves = [x.detach().clone() if b else x for x, b in zip(leaves, batched)]
        for b, key in enumerate(self._row_keys(call)):
            row = [x[b] if is_batched else x for x, is_batched in zip(leaves, batched)]
            previous = self._rows.get((state, key))
            self._bytes += row_bytes - (previous[2] if previous is not None else 0)
            self._rows[(state, key)] = (row, spec, row_bytes)
        self.stats.recorded_rows += batch
        self.stats.bytes_per_row = row_bytes
        return True

    def lookup(self, call: DitCall) -> Any | None:
        """The recorded output of ``call`` (rows reassembled in the call's order), or None."""
        if not self.valid():
            self.stats.misses += 1
            return None
        state, reusable = self._state()
        if not reusable:
            self.stats.misses += 1
            return None
        rows = []
        for key in self._row_keys(call):
            entry = self._rows.get((state, key))
            if entry is None:
                self.stats.misses += 1
                return None
            rows.append(entry)
        spec = rows[0][1]
        leaves = [torch.stack([r[0][i] for r in rows]) if isinstance(rows[0][0][i], torch.Tensor) else rows[0][0][i]
                  for i in range(len(rows[0][0]))]
        self.stats.hits += 1
        return tree_unflatten(leaves, spec)

    # --- rows ---------------------------------------------------------------------------------
    def _row_keys(self, call: DitCall) -> list[bytes]:
        """One digest per sample over all of that sample's inputs (module docstring)."""
        batch = batch_size(call)
        time_arg = resolve_time_arg(call, self.time_arg)
        # a scalar timestep and its per-sample expansion are the same call
        call = batched_time(call, time_arg)
        call = set_time(call, time_arg, get_time(call, time_arg).to(torch.float64))
        call = canonical_call(self.dit, call)
        flat, spec = tree_flatten((call.args, call.kwargs))
        shared = hashlib.blake2b(repr(spec).encode(), digest_size=16)
        batched = []     # (header of one row, (batch, row bytes) uint8 array)
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                host = leaf.detach().to("cpu").contiguous()
                if leaf.ndim >= 1 and leaf.shape[0] == batch and not self._is_unbatched(call, leaf):
                    header = repr((host.dtype, tuple(host.shape[1:]))).encode()
                    batched.append((header, _flat_bytes(host).reshape(batch, -1).numpy()))
                else:
                    shared.update(_tensor_bytes(host))
            else:
                shared.update(repr(leaf).encode())
        keys = []
        for b in range(batch):
            h = shared.copy()
            for header, rows in batched:
                h.update(header)
                h.update(rows[b])
            keys.append(h.digest())
        return keys

    def _is_unbatched(self, call: DitCall, leaf: torch.Tensor) -> bool:
        return any(call.kwargs.get(name) is leaf for name in self.unbatched)


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


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a host tensor as a flat uint8 tensor (a view where the layout allows)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:    # one element expanded from a scalar: stride 0
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # dtype and shape are part of the identity of a row: equal bytes of another dtype are another input
    return repr((t.dtype, tuple(t.shape))).encode() + _flat_bytes(t).numpy().tobytes()
