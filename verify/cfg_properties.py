"""The CFG split (passes/split_batch.py) as a property: the split gradient is the unsplit one.

``cfg_split_identity`` (exact, float64): a loss calls the DiT once per step on n ∈ {2, 3}
concatenated variants of the state, chunks the output and gives each chunk a role drawn at random —
with gradient, ``.detach()``ed, used only under ``torch.no_grad()`` (a logged statistic), or unused
(at least one chunk with gradient, at least one without). Compiled with the split (the default) and
with ``split_batches=False``, on a curved field (JAGG is not exact there, so nothing but the split
is compared), at random windows, step counts and capture paths: loss values and gradients must
agree to rounding, and the split must have happened.
"""

from __future__ import annotations

import jaggc
import torch
from hypothesis import strategies as st

from .fields import CurvedField
from .harness import DT, PropertyResult, _gen, rel_err, run_exact_property

ROLES = ("grad", "detach", "nograd_use", "unused")


def cfg_loss(dit, zs, ts, g, layout):
    total = 0.0
    n = len(layout)
    for k in range(zs.shape[0]):
        out = dit(torch.cat([zs[k] * (1 + 0.3 * i) for i in range(n)]), torch.cat([ts[k]] * n))
        parts = out.chunk(n)
        v = 0.0
        for i, role in enumerate(layout):
            if role == "grad":
                v = v + (i + 1.0) * parts[i]
            elif role == "detach":
                v = v + 0.5 * parts[i].detach()
            elif role == "nograd_use":
                with torch.no_grad():
                    total = total + parts[i].abs().mean()
        total = total + (v * g[k]).sum()
    return total


@st.composite
def _case(draw):
    n = draw(st.sampled_from([2, 3]))
    layout = list(draw(st.lists(st.sampled_from(ROLES), min_size=n, max_size=n)))
    layout[draw(st.integers(0, n - 1))] = "grad"
    if all(r == "grad" for r in layout):
        layout[(layout.index("grad") + 1) % n] = draw(st.sampled_from(ROLES[1:]))
    window = draw(st.integers(2, 4))
    return dict(layout=tuple(layout), window=window, steps=draw(st.integers(window, 6)),
                capture=draw(st.sampled_from(["fx", "dynamo"])), s=draw(st.integers(0, 2**16)))


def _check(case, seed) -> float:
    from ..api import jagg_compile

    torch.compiler.reset()   # each example compiles twice, new shapes each time: keep under Dynamo's recompile limit

    g = _gen(seed, case["s"])
    field = CurvedField(3, seed=case["s"] % 97)
    T, B = case["steps"], 2
    t = torch.sort(torch.rand(T, generator=g, dtype=DT), descending=True).values * 0.9 + 0.05
    args = (field, torch.randn(T, B, 3, generator=g, dtype=DT), torch.stack([t, t * 0.95], 1),
            torch.randn(T, B, 3, generator=g, dtype=DT), case["layout"])
    results = []
    for split in (True, False):
        compiled = jagg_compile(cfg_loss, window=case["window"], capture=case["capture"], options=jaggc.Options(split_batches=split))
        for p in field.parameters():
            p.grad = None
        loss = compiled(*args)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.reshape(-1) for p in field.parameters()]),
                        compiled.report.splits))
    (loss_s, grad_s, splits), (loss_u, grad_u, _) = results
    if len(splits) != T:
        raise AssertionError(f"{len(splits)} of {T} calls split for layout {case['layout']}")
    return max(rel_err(grad_s, grad_u), float((loss_s - loss_u).abs()) / max(float(loss_u.abs()), 1.0))


def cfg_split_identity(examples: int, seed: int = 0) -> PropertyResult:
    return run_exact_property("cfg_split_identity", _case(), _check, examples, seed)


PROPERTIES = {"cfg_split_identity": cfg_split_identity}
