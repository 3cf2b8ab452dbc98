"""The one place where jaggc touches private or unstable PyTorch APIs.

Everything here is marked backward-incompatible (or private) upstream; keeping it in one module
means a PyTorch upgrade that moves one of them costs one file.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as _pytree

TreeSpec = _pytree.TreeSpec
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
