"""torch.fx and fake tensors while jaggc traces a loss: the patches a symbolic trace installs, the
grad-mode and autocast switches Dynamo records as graph nodes, FX's pytree codegen, fake modes, and
the real value behind a Dynamo placeholder."""

from __future__ import annotations

import torch


# --- torch.fx: running real code in the middle of a symbolic trace ---------------------------

def fx_patches_reverted():
    """While torch.fx traces, ``nn.Module.__call__`` (and autowrapped functions) are patched to
    record nodes; code run to compute an example value must see the real ones."""
    return torch.fx._symbolic_trace._maybe_revert_all_patches()


# --- grad mode as a graph node ---------------------------------------------------------------
# Dynamo records ``with torch.no_grad()`` as calls of this function; the FX frontend and the
# grad-mode pass emit the same nodes so that one rule reads both.

SET_GRAD_ENABLED = torch._C._set_grad_enabled

# --- autocast regions as graph nodes ----------------------------------------------------------
# Dynamo records ``with torch.autocast(...)`` as a pair of calls of these functions (the enter
# returns the context, the exit takes it); the mode pass reads them to learn each node's autocast
# state and replaces them by jaggc's absolute switches (graph_ops.set_autocast).

DYNAMO_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
DYNAMO_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def copy_input_codegen(src, dst) -> None:
    """Give fx.Graph ``dst`` the argument handling of ``src`` (FX's pytree codegen for
    ``concrete_args`` with containers), so both take the same call arguments; ``dst`` returns its
    output as it is."""

    from torch.fx.graph import _PyTreeCodeGen

    codegen = src._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        codegen = _PyTreeCodeGen(codegen.pytree_info._replace(out_spec=None))
    dst.set_codegen(codegen)


def fake_mode_suspended():
    """Run real tensor code while a FakeTensorMode is active (the FX frontend's value reads)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def traced_input_value(node):
    """The real value a Dynamo graph's placeholder stood for when Dynamo traced it (a parameter the
    loss read is lifted to an input; the effects analysis must know it is one). Dynamo keeps it in
    ``node.meta["grapharg"]``, a private structure; None for other graphs."""
    arg = node.meta.get("grapharg")
    try:
        return arg.example if arg is not None else None
    except Exception:  # noqa: BLE001 - the example is a weak reference that may be gone
        return None


def new_fake_mode(*, allow_non_fake_inputs: bool):
    """A fresh FakeTensorMode: the FX frontend's example values (shapes and dtypes while tracing)
    come from running the loss's ops on fake tensors; torch has no public fake-tensor API."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def is_fake(t) -> bool:
    """A fake tensor (a capture is learning shapes), not real data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
