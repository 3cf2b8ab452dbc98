"""An accelerator stand-in for a CPU-only machine: tensors that claim another device and hold CPU data.

What a GPU would refuse, seen without one (``../shared/docs/background/device-standin.md`` has what
was measured before choosing this):

- ``StandIn``: a wrapper tensor subclass whose device reads ``meta`` and whose data is a plain CPU
  tensor. Every op unwraps, runs on the CPU data and wraps its tensor outputs again; an op that meets
  a plain CPU tensor of ``dim() > 0`` beside a stand-in raises CUDA's "Expected all tensors to be on
  the same device" (CUDA takes a 0-dim CPU tensor beside CUDA ones, a CPU scalar, so those pass).
- ``on_standin_device()``: a dispatch mode under which a factory asked for the ``meta`` device
  (``torch.zeros(n, device=p.device)``, ``torch.tensor(v, device=...)``, ``x.to(p.device)``) makes a
  stand-in with real CPU data, where torch would make a data-less meta tensor. It also counts the host
  reads of device data (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, ``nonzero``) made by a
  frame of a given package: the host syncs a GPU would make (``HostReads``).
- ``standin_module(m)``: ``m`` with every parameter and buffer a stand-in (its device reads meta).

The stand-in is slow (each op in Python); use it on tiny models only.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

STANDIN = torch.device("meta")
_aten = torch.ops.aten
# ops whose result is read on the host (a device-to-host copy and a stream sync on a GPU)
_HOST_READS = {_aten._local_scalar_dense.default: "item", _aten.nonzero.default: "nonzero",
               _aten.is_nonzero.default: "bool", _aten.equal.default: "equal"}


_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


class DeviceMixError(RuntimeError):
    pass


class StandIn(torch.Tensor):
    """A tensor on the stand-in device (module docstring); ``.data_cpu`` is its CPU data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        assert type(data) is torch.Tensor and data.device.type == "cpu", type(data)
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                  device=STANDIN, requires_grad=requires_grad,
                                                  storage_offset=data.storage_offset())
        out.data_cpu = data
        return out

    def __repr__(self):
        return f"StandIn({self.data_cpu!r})"

    # torch refuses these on a subclass; a CUDA tensor has them, as a device-to-host copy
    def tolist(self):
        _record_host_read("tolist")
        return self.data_cpu.tolist()

    # torch makes a list index a tensor on self's device, out of any mode's sight (a data-less meta
    # tensor here): take it to a CPU index tensor first, which CUDA indexing accepts too
    def __getitem__(self, index):
        return super().__getitem__(_host_index(index))

    def __setitem__(self, index, value):
        return super().__setitem__(_host_index(index), value)

    def numpy(self, *args, **kwargs):
        _record_host_read("numpy")
        return self.data_cpu.numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_no_mix(func, args, kwargs)
        if func is _aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            # .cpu() / .to("cpu"): a plain host tensor (a device-to-host copy)
            _record_host_read("cpu")
            return func(args[0].data_cpu, **kwargs)
        if func in _HOST_READS:
            _record_host_read(_HOST_READS[func])
        if func is _aten.copy_.default and not isinstance(args[0], StandIn):
            # a copy into a host tensor (legal across devices, as on CUDA): a device-to-host copy
            _record_host_read("cpu")
            return args[0].copy_(args[1].data_cpu, *args[2:], **kwargs)
        if func is _aten.detach.default or func is _aten.alias.default:
            return StandIn(func(args[0].data_cpu))
        unwrapped_args, unwrapped_kwargs = tree_map(_unwrap, (args, kwargs))
        if "device" in unwrapped_kwargs and unwrapped_kwargs["device"] is not None \
                and torch.device(unwrapped_kwargs["device"]).type == "meta":
            unwrapped_kwargs["device"] = torch.device("cpu")
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func in _HOST_READS:
            return out
        return _rewrap_like_inplace(func, args, out)


def _unwrap(x):
    if isinstance(x, torch.Tensor) and type(x) is torch.Tensor and x.device.type == "meta":
        raise RuntimeError("device_standin: a data-less meta tensor reached a stand-in op (a tensor made on the "
                           "stand-in device out of the harness' sight); extend the harness")
    return x.data_cpu if isinstance(x, StandIn) else x


def _host_index(index):
    if isinstance(index, list):
        return torch.tensor(index, device="cpu")
    if isinstance(index, tuple):
        return tuple(torch.tensor(i, device="cpu") if isinstance(i, list) else i for i in index)
    return index


def _wrap(x):
    return StandIn(x) if type(x) is torch.Tensor else x


def _rewrap_like_inplace(func, args, out):
    schema = func._schema
    if schema.is_mutable and args and isinstance(args[0], StandIn) and out is args[0].data_cpu:
        return args[0]          # an in-place op returns its (stand-in) self
    return tree_map(_wrap, out)


def _check_no_mix(func, args, kwargs) -> None:
    if func is _aten.copy_.default:
        return              # copy_ crosses devices on CUDA too
    if func in _INDEXING:
        # CUDA takes host index tensors: only the indexed tensor and the values must be on the device
        args = (args[0],) + tuple(args[2:])
    flat = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not any(isinstance(x, StandIn) for x in flat):
        return
    mixed = [x for x in flat if not isinstance(x, StandIn) and x.device.type == "cpu" and x.dim() > 0]
    if mixed:
        raise DeviceMixError(
            f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 (stand-in) "
            f"and cpu! ({func}: a CPU tensor of shape {tuple(mixed[0].shape)})")


# --- host reads by a package's own frames ----------------------------------------------------------
class HostReads:
    """Counts host reads of stand-in data whose nearest non-torch frame is in ``package`` (a path)."""

    def __init__(self, package: Path):
        self.package = str(Path(package).resolve())
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()

    def record(self, kind: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and _is_torch_frame(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_filename.startswith(self.package):
            self.counts[kind] += 1
            self.sites[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {kind}"] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__).resolve())
_readers: list[HostReads] = []


def _is_torch_frame(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename == _THIS_FILE or filename.startswith("<")


def _record_host_read(kind: str) -> None:
    for reader in _readers:
        reader.record(kind)


@contextlib.contextmanager
def counting_host_reads(package: Path) -> Iterator[HostReads]:
    reads = HostReads(package)
    _readers.append(reads)
    try:
        yield reads
    finally:
        _readers.remove(reads)


class _StandInFactories(TorchDispatchMode):
    """Factories asked for the meta device make stand-ins holding CPU data (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, StandIn) for t in types):
            return func(*args, **kwargs)           # StandIn.__torch_dispatch__ handles it
        device = kwargs.get("device")
        to_standin = device is not None and torch.device(device).type == "meta"
        if func is _aten._to_copy.default and to_standin and isinstance(args[0], torch.Tensor):
            return StandIn(func(args[0], **{**kwargs, "device": torch.device("cpu")}))
        if to_standin:
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return tree_map(_wrap, out)
        return func(*args, **kwargs)


class _StandInTensorCtors(TorchFunctionMode):
    """``torch.tensor(data, device=<stand-in>)``: the tensor constructors build their tensor without
    a dispatch a mode could see, so they are caught a level above, as torch functions."""

    CTORS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in self.CTORS and device is not None and torch.device(device).type == "meta":
            return StandIn(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_standin_device() -> Iterator[None]:
    # the function mode is not active where autograd runs a backward's hooks: the constructors are also
    # replaced by name for the context (a call that reaches torch.tensor through the module attribute)
    originals = {ctor.__name__: ctor for ctor in _StandInTensorCtors.CTORS}

    def wrapped(original):
        def ctor(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                return StandIn(original(*args, **{**kwargs, "device": torch.device("cpu")}))
            return original(*args, **kwargs)
        return ctor

    try:
        for name, original in originals.items():
            setattr(torch, name, wrapped(original))
        with _StandInTensorCtors(), _StandInFactories():
            yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def standin(t: torch.Tensor) -> torch.Tensor:
    """``t`` (CPU) on the stand-in device."""
    return StandIn(t.detach().clone(), requires_grad=t.requires_grad)


def standin_module(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer a stand-in, in place (its device then reads meta)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(StandIn(p.detach().clone()), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = StandIn(b.detach().clone())
    return module


def to_cpu(x):
    """A stand-in's CPU data (other values unchanged), through nested containers."""
    return tree_map(lambda v: v.data_cpu if isinstance(v, StandIn) else v, x)


__all__ = ["DeviceMixError", "HostReads", "STANDIN", "StandIn", "counting_host_reads", "on_standin_device",
           "standin", "standin_module", "to_cpu"]
