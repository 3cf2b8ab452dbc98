"""The on-policy fast path: interior step outputs taken from the rollout instead of re-computed.

GRPO samples a trajectory with the DiT (no grad), then trains on the stored states. On the first
inner step the parameters are still the rollout's, so the DiT output of every interior step of a
window is the velocity the rollout already computed: JAGG then needs no interior forward at all,
only the knot forward and the joint backward ((2 + 4)F per window instead of (W + 4)F).

``RolloutCache`` records the rollout's DiT calls, one row per sample, keyed by a digest of every
input of that sample (state, timestep, conditioning rows, shared tensors, non-tensor arguments),
so a training batch may regroup and reorder the rollout's samples and steps (Flow-GRPO shuffles
both). A lookup returns an output only if every row is found AND the DiT's parameters are exactly
those of the recording: each parameter's in-place version counter (bumped by optimizer steps and
any in-place write) and identity are compared, and a mismatch drops the cache, so the runtime falls
back to real forwards. Lookups copy the inputs to host memory to hash them (one device sync per
interior call): still far cheaper than a DiT forward, but not free.

A row is also keyed by the DiT's module state (``module_state.py``: peft adapters enabled and
active, train/eval) and the autocast state: a reference call recorded under ``disable_adapter()`` never
answers a lookup made with the adapter on, though its inputs are the same.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._compat import tree_flatten, tree_unflatten, version_counter
from .calls import DitCall, batch_size, batched_time, get_time, resolve_time_arg, set_time
from .module_state import output_key


def parameter_versions(dit: nn.Module) -> tuple:
    return tuple((id(p), version_counter(p)) for p in dit.parameters())


@dataclass
class RolloutCacheStats:
    hits: int = 0           # interior calls served from the cache
    misses: int = 0         # interior calls that needed a forward
    invalidations: int = 0  # times the parameters had changed since the recording


@dataclass
class RolloutCache:
    """Records a DiT's no-grad calls during a rollout; serves them back while parameters are unchanged.

    ``time_arg``/``unbatched`` follow ``WindowOptions`` (where the timestep is; which tensor inputs
    are shared rather than batched)."""

    dit: nn.Module
    time_arg: str | int | None = None
    unbatched: tuple[str, ...] = ("img_ids", "txt_ids")
    stats: RolloutCacheStats = field(default_factory=RolloutCacheStats)
    # private state, not constructor arguments: (state, digest) -> (output leaves of one row, spec),
    # and the parameter versions the rows were recorded at
    _rows: dict = field(default_factory=dict, init=False, repr=False)
    _versions: tuple | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self._rows)

    @contextlib.contextmanager
    def record(self, clear: bool = True):
        """Record every no-grad call of ``dit`` made inside the context (the rollout); ``clear=False``
        adds to what was recorded before (with unchanged parameters)."""
        if clear or self._versions != parameter_versions(self.dit):
            self.clear()
        self._versions = parameter_versions(self.dit)

        def on_forward(module, args, kwargs, output):
            if torch.is_grad_enabled():
                return
            self._store(DitCall(tuple(args), dict(kwargs)), output)

        on_forward._jaggc_observer = True   # module_state ignores it: it changes no output
        handle = self.dit.register_forward_hook(on_forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def clear(self) -> None:
        self._rows.clear()
        self._versions = None

    def valid(self) -> bool:
        """True while the parameters are exactly the recording's (else the cache is dropped)."""
        if self._versions is None or not self._rows:
            return False
        if parameter_versions(self.dit) != self._versions:
            self.stats.invalidations += 1
            self.clear()
            return False
        return True

    def lookup(self, call: DitCall) -> Any | None:
        """The recorded output of ``call`` (rows reassembled in the call's order), or None."""
        if not self.valid():
            self.stats.misses += 1
            return None
        rows = []
        state = output_key(self.dit)
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
    def _store(self, call: DitCall, output: Any) -> None:
        batch = batch_size(call)
        leaves, spec = tree_flatten(output)
        state = output_key(self.dit)
        # one copy per output leaf; the rows are views of it (a clone per row costs more than the hash)
        leaves = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1
                  and leaf.shape[0] == batch else leaf for leaf in leaves]
        for b, key in enumerate(self._row_keys(call)):
            row = [leaf[b] if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1 and leaf.shape[0] == batch
                   else leaf for leaf in leaves]
            self._rows[(state, key)] = (row, spec)

    def _row_keys(self, call: DitCall) -> list[bytes]:
        """One digest per sample over all of that sample's inputs (module docstring)."""
        batch = batch_size(call)
        time_arg = resolve_time_arg(call, self.time_arg)
        # a scalar timestep and its per-sample expansion are the same call
        call = batched_time(call, time_arg)
        call = set_time(call, time_arg, get_time(call, time_arg).to(torch.float64))
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


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a host tensor as a flat uint8 tensor (a view where the layout allows)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:    # one element expanded from a scalar: stride 0
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # dtype and shape are part of the identity of a row: equal bytes of another dtype are another input
    return repr((t.dtype, tuple(t.shape))).encode() + _flat_bytes(t).numpy().tobytes()
