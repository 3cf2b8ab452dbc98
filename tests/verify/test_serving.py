"""Off-policy serving's first-order formula (runtime/first_order.py): the verifier's properties, and the
formula against a direct computation.

* ``first_order_serving`` holds to float64 roundoff (served outputs = the outputs after the parameter
  change, JAGG with the served outputs' upstream = the exact gradient) on the fields where it is exact;
* ``first_order_serving_curved`` finds and shrinks a case where it is not (an MLP field);
* the formula itself: served = recorded + (1 − λ)(v_a' − v_a) + λ(v_b' − v_b) per sample, by hand.
"""

from __future__ import annotations

import torch

from jaggc.runtime.first_order import serve_first_order
from jaggc.verify import serving_properties
from jaggc.verify.harness import TOL

EXAMPLES = 5


def test_served_outputs_are_exact_on_jaggs_exactness_class():
    r = serving_properties.first_order_serving(EXAMPLES, 0)
    assert r.kind == "exact" and r.passed, r.counterexample
    assert r.examples == EXAMPLES and r.max_rel_err < 1e-12


def test_a_curved_field_gives_a_shrunk_counterexample():
    r = serving_properties.first_order_serving_curved(EXAMPLES, 0)
    assert r.kind == "counterexample" and r.passed, r.detail
    assert r.counterexample is not None and r.counterexample.startswith("W=3, ")
    assert r.max_rel_err > TOL


def test_the_formula_by_hand_per_sample():
    g = torch.Generator().manual_seed(0)
    recorded, a0, a1, b0, b1 = (torch.randn(3, 4, 5, generator=g) for _ in range(5))
    lam = torch.tensor([0.2, 0.5, 0.9])
    weights = torch.stack([1 - lam, lam])                       # (K=2, B)
    served = serve_first_order(recorded, [a0, b0], [a1, b1], weights)
    for i in range(3):
        by_hand = recorded[i] + (1 - lam[i]) * (a1[i] - a0[i]) + lam[i] * (b1[i] - b0[i])
        torch.testing.assert_close(served[i], by_hand, rtol=1e-6, atol=1e-6)


def test_bf16_outputs_are_corrected_in_float32():
    g = torch.Generator().manual_seed(1)
    recorded = torch.randn(2, 8, generator=g).bfloat16()
    then = torch.randn(2, 8, generator=g).bfloat16()
    now = then + 1e-3                                           # below bf16's step near 1: lost in bf16 arithmetic
    served = serve_first_order(recorded, [then, then], [now.bfloat16(), now.bfloat16()],
                               torch.full((2, 2), 0.5))
    assert served.dtype == torch.bfloat16
    ref = (recorded.float() + (now.bfloat16().float() - then.float())).bfloat16()
    assert torch.equal(served, ref)
