"""deepspeed: the ZeRO optimizer internals a stepwise window needs (runtime/engines.py says why).
DeepSpeed stays optional: nothing here imports it; the engine is recognised by its class name."""

from __future__ import annotations

from torch import nn


def is_deepspeed_engine(module: nn.Module) -> bool:
    """Whether ``module`` is a ``deepspeed.DeepSpeedEngine`` (or a subclass: the pipeline engine)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__)


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitioned (each carries ``ds_status``: gathered by
    hooks of the forward, released after it), also where the loop holds ``engine.module``."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


def zero_ready_buckets(engine: nn.Module) -> None:
    """ZeRO-1/2 ready their gradient buckets (``setup_buckets``, no public name) when a backward's
    first parameter gradient arrives, and the engine's end of backward reduces them: a backward in
    which none arrives must ready them as that first gradient would (idempotent within a backward)."""
    engine.optimizer.setup_buckets()


def zero_torch_optimizer(engine: nn.Module):
    """The torch optimizer a ZeRO optimizer steps on its fp32 partitions (``.optimizer``), or None."""
    return getattr(engine.optimizer, "optimizer", None)


__all__ = ["is_deepspeed_engine", "zero3_partitioned", "zero_ready_buckets", "zero_torch_optimizer"]
