"""``module_tree``: one listing of a module's tree, reused while every module holds the same children,
parameters and buffers, listed again after any change (jaggc/runtime/module_tree.py)."""

from __future__ import annotations

import torch
from torch import nn

from jaggc.runtime.module_tree import module_tree


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)))


def _walk(m):
    return [id(x) for x in m.modules()], [(n, id(p)) for n, p in m.named_parameters()], [id(b) for b in m.buffers()]


def _listed(tree):
    return [id(x) for x in tree.modules], [(n, id(p)) for n, p in tree.named_parameters], [id(b) for b in tree.buffers]


def test_the_listing_is_reused_while_nothing_changed_and_equals_a_walk():
    m = _model()
    tree = module_tree(m)
    assert module_tree(m) is tree and _listed(tree) == _walk(m)
    m[0].weight.data.mul_(2)                       # values and in-place writes change no structure
    m.train(False)
    assert module_tree(m) is tree


def test_every_change_of_the_tree_lists_it_again():
    changes = [
        lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 3))),           # a parameter replaced
        lambda m: m[0]._parameters.__setitem__("bias", nn.Parameter(torch.zeros(4))),   # ... bypassing __setattr__
        lambda m: m[2].register_parameter("extra", nn.Parameter(torch.zeros(1))),       # a parameter added
        lambda m: setattr(m[2], "adapter", nn.Linear(2, 2)),                            # a submodule injected (peft)
        lambda m: m[2]._modules.__setitem__("0", nn.Linear(4, 2)),                      # a submodule swapped in place
        lambda m: setattr(m[2][1], "running_mean", torch.zeros(2)),                     # a buffer reassigned
        lambda m: delattr(m[1], "bias"),                                                # a parameter removed
    ]
    for change in changes:
        m = _model()
        tree = module_tree(m)
        change(m)
        again = module_tree(m)
        assert again is not tree and _listed(again) == _walk(m)


def test_trainable_is_read_at_each_use():
    m = _model()
    tree = module_tree(m)
    assert len(tree.trainable()) == 8
    m[0].weight.requires_grad_(False)
    assert module_tree(m) is tree and len(tree.trainable()) == 7
