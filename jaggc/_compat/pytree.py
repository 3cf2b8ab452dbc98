"""pytree: torch's own flattening of nested arguments (what Dynamo and FX use), so jaggc's DitCall
flattening agrees with theirs; ``torch.utils._pytree`` has no public alias in torch 2.x."""

from __future__ import annotations

import torch.utils._pytree as _pytree

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr
