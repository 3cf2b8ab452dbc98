"""Golden text of the final (rewritten) graph of two canonical losses.

The graphs are compared as generated code (``report.stages[-1].code``), normalised by
``normalise``: object addresses and file paths are masked, trailing spaces dropped, and the long
``jagg_window(...)`` call is broken at each step's (args, kwargs) so that a reviewer can read one
step per line. Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/compiler/test_compile_golden.py`` and
read the diff: every JAGG window must be one ``jagg_window`` node taking the window's W calls,
one ``getitem`` per step must feed that step's loss, and no trained ``dit_call`` may remain.
Besides the text, each test asserts that structure on the graph itself, so a re-accepted golden
cannot silently accept a wrong rewrite.
"""

from __future__ import annotations

import operator
import re

import expecttest
import torch

from jaggc_studies import example_losses
from jaggc import jagg_compile
from jaggc.graph_ops import dit_call, jagg_window
from jaggc.node_meta import CALL
from jaggc.verify.fields import AffineJacobianField

B = 2


def normalise(code: str) -> str:
    code = re.sub(r"0x[0-9a-fA-F]+", "0x?", code)
    code = re.sub(r"(?:[A-Za-z]:)?[\w./\\-]*[/\\]([\w.-]+\.py)", r"\1", code)   # paths -> file name
    lines = []
    for line in code.splitlines():
        line = line.rstrip()
        if "jagg_window(" in line:
            line = re.sub(r"\}\), (?=\(\()", "}),\n        ", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def affine_loss(dit, zs, ts, g, n: int):
    """The FX-friendly loss: int step count, explicit reduction dims."""
    total = 0.0
    for k in range(n):
        v = dit(zs[k], ts[k])
        total = total + (torch.exp(-(v * g[k]).sum(dim=1)) * ts[k]).mean()
    return total


def assert_rewritten(test: expecttest.TestCase, gm: torch.fx.GraphModule, windows: list[list[int]]):
    nodes = list(gm.graph.nodes)
    test.assertFalse([n for n in nodes if n.target is dit_call and CALL.of(n).step is not None])
    window_nodes = [n for n in nodes if n.target is jagg_window]
    test.assertEqual(len(window_nodes), len(windows))
    for node, steps in zip(window_nodes, windows):
        test.assertEqual(len(node.args[1]), len(steps))          # the W calls' (args, kwargs)
        reads = sorted(u for u in node.users if u.target is operator.getitem)
        test.assertEqual(sorted(u.args[1] for u in reads), list(range(len(steps))))
        test.assertEqual(sorted(CALL.of(u).step for u in reads), steps)
        for u in reads:
            test.assertTrue(u.users, f"{u.name}: a window output that feeds nothing")


class TestGolden(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()

    def test_affine_fx_window3_six_steps(self):
        field = AffineJacobianField(3, seed=0)
        g = torch.Generator().manual_seed(0)
        t = torch.linspace(1.0, 0.1, 6, dtype=torch.float64)
        ts = torch.stack([t, t * 0.9], 1)
        zs = torch.randn(6, B, 3, generator=g, dtype=torch.float64)
        gs = torch.randn(6, B, 3, generator=g, dtype=torch.float64)
        compiled = jagg_compile(affine_loss, window=3, capture="fx")
        compiled(field, zs, ts, gs, 6)
        report = compiled.report
        self.assertEqual([s.name for s in report.stages],
                         ["capture (fx)", "check_frontend", "tag_modes", "split_cfg_batches", "tag_modes",
                          "find_dit_calls", "check_independence", "assign_windows", "check_window_inputs",
                          "compute_weights", "rewrite_windows", "cleanup", "place_modes"])
        assert_rewritten(self, report.graph_module, [[0, 1, 2], [3, 4, 5]])
        self.assertExpectedInline(normalise(report.stages[-1].code), """\
def forward(self, dit_1, zs_1, ts_1, g_1, n_1):
    eq = n_1 == 6;  n_1 = None
    _assert = torch._assert(eq, 'n has been specialized to have value 6 but got another value');  eq = _assert = None
    getitem = zs_1[0]
    getitem_1 = ts_1[0]
    getitem_2 = g_1[0]
    getitem_3 = ts_1[0]
    getitem_4 = zs_1[1]
    getitem_5 = ts_1[1]
    getitem_6 = g_1[1]
    getitem_7 = ts_1[1]
    getitem_8 = zs_1[2]
    getitem_9 = ts_1[2]
    jagg_dit_2 = self.jagg_dit
    jagg_plan_0 = self.jagg_plan_0
    jagg_window = jaggc_graph_ops_jagg_window(jagg_dit_2, (((getitem, getitem_1), {}),
        ((getitem_4, getitem_5), {}),
        ((getitem_8, getitem_9), {})), jagg_plan_0);  jagg_dit_2 = getitem = getitem_1 = getitem_4 = getitem_5 = getitem_8 = getitem_9 = jagg_plan_0 = None
    getitem_24 = jagg_window[0]
    mul = getitem_24 * getitem_2;  getitem_24 = getitem_2 = None
    sum_1 = mul.sum(dim = 1);  mul = None
    neg = -sum_1;  sum_1 = None
    exp = torch.exp(neg);  neg = None
    mul_1 = exp * getitem_3;  exp = getitem_3 = None
    mean = mul_1.mean();  mul_1 = None
    add = 0.0 + mean;  mean = None
    getitem_25 = jagg_window[1]
    mul_2 = getitem_25 * getitem_6;  getitem_25 = getitem_6 = None
    sum_2 = mul_2.sum(dim = 1);  mul_2 = None
    neg_1 = -sum_2;  sum_2 = None
    exp_1 = torch.exp(neg_1);  neg_1 = None
    mul_3 = exp_1 * getitem_7;  exp_1 = getitem_7 = None
    mean_1 = mul_3.mean();  mul_3 = None
    add_1 = add + mean_1;  add = mean_1 = None
    getitem_26 = jagg_window[2];  jagg_window = None
    getitem_10 = g_1[2]
    mul_4 = getitem_26 * getitem_10;  getitem_26 = getitem_10 = None
    sum_3 = mul_4.sum(dim = 1);  mul_4 = None
    neg_2 = -sum_3;  sum_3 = None
    exp_2 = torch.exp(neg_2);  neg_2 = None
    getitem_11 = ts_1[2]
    mul_5 = exp_2 * getitem_11;  exp_2 = getitem_11 = None
    mean_2 = mul_5.mean();  mul_5 = None
    add_2 = add_1 + mean_2;  add_1 = mean_2 = None
    getitem_12 = zs_1[3]
    getitem_13 = ts_1[3]
    getitem_14 = g_1[3]
    getitem_15 = ts_1[3]
    getitem_16 = zs_1[4]
    getitem_17 = ts_1[4]
    getitem_18 = g_1[4]
    getitem_19 = ts_1[4]
    getitem_20 = zs_1[5];  zs_1 = None
    getitem_21 = ts_1[5]
    jagg_dit_5 = self.jagg_dit
    jagg_plan_1 = self.jagg_plan_1
    jagg_window_1 = jaggc_graph_ops_jagg_window(jagg_dit_5, (((getitem_12, getitem_13), {}),
        ((getitem_16, getitem_17), {}),
        ((getitem_20, getitem_21), {})), jagg_plan_1);  jagg_dit_5 = getitem_12 = getitem_13 = getitem_16 = getitem_17 = getitem_20 = getitem_21 = jagg_plan_1 = None
    getitem_27 = jagg_window_1[0]
    mul_6 = getitem_27 * getitem_14;  getitem_27 = getitem_14 = None
    sum_4 = mul_6.sum(dim = 1);  mul_6 = None
    neg_3 = -sum_4;  sum_4 = None
    exp_3 = torch.exp(neg_3);  neg_3 = None
    mul_7 = exp_3 * getitem_15;  exp_3 = getitem_15 = None
    mean_3 = mul_7.mean();  mul_7 = None
    add_3 = add_2 + mean_3;  add_2 = mean_3 = None
    getitem_28 = jagg_window_1[1]
    mul_8 = getitem_28 * getitem_18;  getitem_28 = getitem_18 = None
    sum_5 = mul_8.sum(dim = 1);  mul_8 = None
    neg_4 = -sum_5;  sum_5 = None
    exp_4 = torch.exp(neg_4);  neg_4 = None
    mul_9 = exp_4 * getitem_19;  exp_4 = getitem_19 = None
    mean_4 = mul_9.mean();  mul_9 = None
    add_4 = add_3 + mean_4;  add_3 = mean_4 = None
    getitem_29 = jagg_window_1[2];  jagg_window_1 = None
    getitem_22 = g_1[5];  g_1 = None
    mul_10 = getitem_29 * getitem_22;  getitem_29 = getitem_22 = None
    sum_6 = mul_10.sum(dim = 1);  mul_10 = None
    neg_5 = -sum_6;  sum_6 = None
    exp_5 = torch.exp(neg_5);  neg_5 = None
    getitem_23 = ts_1[5];  ts_1 = None
    mul_11 = exp_5 * getitem_23;  exp_5 = getitem_23 = None
    mean_5 = mul_11.mean();  mul_11 = None
    add_5 = add_4 + mean_5;  add_4 = mean_5 = None
    return add_5
""")

    def test_flow_grpo_sd3_dynamo_window4_four_steps(self):
        ex = example_losses.build_example("flow_grpo_sd3", num_steps=4, batch=B, seed=0)
        compiled = jagg_compile(ex.loss_fn, window=4, capture="dynamo")
        compiled(ex.model, ex.batch)
        report = compiled.report
        self.assertEqual(report.stages[0].name, "capture (dynamo)")
        assert_rewritten(self, report.graph_module, [[0, 1, 2, 3]])
        self.assertExpectedInline(normalise(report.stages[-1].code), """\
def forward(self, L_batch_timesteps_ : torch.Tensor, L_batch_latents_ : torch.Tensor, L_batch_prompt_embeds_ : torch.Tensor, L_batch_pooled_prompt_embeds_ : torch.Tensor, L_batch_sigmas_ : torch.Tensor, L_batch_sigmas_next_ : torch.Tensor, L_batch_next_latents_ : torch.Tensor, L_batch_sigma_max_ : torch.Tensor, L_batch_log_probs_ : torch.Tensor, L_batch_advantages_ : torch.Tensor):
    l_batch_timesteps_ = L_batch_timesteps_
    l_batch_latents_ = L_batch_latents_
    l_batch_prompt_embeds_ = L_batch_prompt_embeds_
    l_batch_pooled_prompt_embeds_ = L_batch_pooled_prompt_embeds_
    l_batch_sigmas_ = L_batch_sigmas_
    l_batch_sigmas_next_ = L_batch_sigmas_next_
    l_batch_next_latents_ = L_batch_next_latents_
    l_batch_sigma_max_ = L_batch_sigma_max_
    l_batch_log_probs_ = L_batch_log_probs_
    l_batch_advantages_ = L_batch_advantages_
    latents = l_batch_latents_[(slice(None, None, None), 0)]
    v = l_batch_timesteps_[(slice(None, None, None), 0)]
    getitem_3 = l_batch_sigmas_[(slice(None, None, None), 0)]
    getitem_4 = l_batch_sigmas_next_[(slice(None, None, None), 0)]
    getitem_5 = l_batch_next_latents_[(slice(None, None, None), 0)]
    sample = latents.float()
    prev_sample = getitem_5.float();  getitem_5 = None
    sigma = getitem_3.view(-1, 1, 1, 1);  getitem_3 = None
    sigma_prev = getitem_4.view(-1, 1, 1, 1);  getitem_4 = None
    dt = sigma_prev - sigma;  sigma_prev = None
    eq = sigma == 1
    where = torch.where(eq, l_batch_sigma_max_, sigma);  eq = None
    sub_1 = 1 - where;  where = None
    truediv = sigma / sub_1;  sub_1 = None
    sqrt = torch.sqrt(truediv);  truediv = None
    std_dev_t = sqrt * 0.7;  sqrt = None
    pow_1 = std_dev_t ** 2
    mul_1 = 2 * sigma
    truediv_1 = pow_1 / mul_1;  pow_1 = mul_1 = None
    mul_2 = truediv_1 * dt;  truediv_1 = None
    add = 1 + mul_2;  mul_2 = None
    mul_3 = sample * add;  sample = add = None
    pow_2 = std_dev_t ** 2
    sub_2 = 1 - sigma
    mul_4 = pow_2 * sub_2;  pow_2 = sub_2 = None
    mul_5 = 2 * sigma;  sigma = None
    truediv_2 = mul_4 / mul_5;  mul_4 = mul_5 = None
    add_1 = 1 + truediv_2;  truediv_2 = None
    mul_8 = -1 * dt
    sqrt_1 = torch.sqrt(mul_8);  mul_8 = None
    std = std_dev_t * sqrt_1;  std_dev_t = sqrt_1 = None
    detach = prev_sample.detach();  prev_sample = None
    pow_4 = std ** 2
    mul_10 = 2 * pow_4;  pow_4 = None
    log = torch.log(std);  std = None
    getitem_6 = l_batch_log_probs_[(slice(None, None, None), 0)]
    getitem_7 = l_batch_advantages_[(slice(None, None, None), 0)]
    advantages = torch.clamp(getitem_7, -5.0, 5.0);  getitem_7 = None
    neg_1 = -advantages
    neg_2 = -advantages;  advantages = None
    latents_1 = l_batch_latents_[(slice(None, None, None), 1)]
    v_1 = l_batch_timesteps_[(slice(None, None, None), 1)]
    getitem_11 = l_batch_sigmas_[(slice(None, None, None), 1)]
    getitem_12 = l_batch_sigmas_next_[(slice(None, None, None), 1)]
    getitem_13 = l_batch_next_latents_[(slice(None, None, None), 1)]
    sample_1 = latents_1.float()
    prev_sample_1 = getitem_13.float();  getitem_13 = None
    sigma_1 = getitem_11.view(-1, 1, 1, 1);  getitem_11 = None
    sigma_prev_1 = getitem_12.view(-1, 1, 1, 1);  getitem_12 = None
    dt_1 = sigma_prev_1 - sigma_1;  sigma_prev_1 = None
    eq_1 = sigma_1 == 1
    where_1 = torch.where(eq_1, l_batch_sigma_max_, sigma_1);  eq_1 = None
    sub_8 = 1 - where_1;  where_1 = None
    truediv_4 = sigma_1 / sub_8;  sub_8 = None
    sqrt_2 = torch.sqrt(truediv_4);  truediv_4 = None
    std_dev_t_1 = sqrt_2 * 0.7;  sqrt_2 = None
    pow_5 = std_dev_t_1 ** 2
    mul_14 = 2 * sigma_1
    truediv_5 = pow_5 / mul_14;  pow_5 = mul_14 = None
    mul_15 = truediv_5 * dt_1;  truediv_5 = None
    add_4 = 1 + mul_15;  mul_15 = None
    mul_16 = sample_1 * add_4;  sample_1 = add_4 = None
    pow_6 = std_dev_t_1 ** 2
    sub_9 = 1 - sigma_1
    mul_17 = pow_6 * sub_9;  pow_6 = sub_9 = None
    mul_18 = 2 * sigma_1;  sigma_1 = None
    truediv_6 = mul_17 / mul_18;  mul_17 = mul_18 = None
    add_5 = 1 + truediv_6;  truediv_6 = None
    mul_21 = -1 * dt_1
    sqrt_3 = torch.sqrt(mul_21);  mul_21 = None
    std_1 = std_dev_t_1 * sqrt_3;  std_dev_t_1 = sqrt_3 = None
    detach_1 = prev_sample_1.detach();  prev_sample_1 = None
    pow_8 = std_1 ** 2
    mul_23 = 2 * pow_8;  pow_8 = None
    log_1 = torch.log(std_1);  std_1 = None
    getitem_14 = l_batch_log_probs_[(slice(None, None, None), 1)]
    getitem_15 = l_batch_advantages_[(slice(None, None, None), 1)]
    advantages_1 = torch.clamp(getitem_15, -5.0, 5.0);  getitem_15 = None
    neg_4 = -advantages_1
    neg_5 = -advantages_1;  advantages_1 = None
    latents_2 = l_batch_latents_[(slice(None, None, None), 2)]
    v_2 = l_batch_timesteps_[(slice(None, None, None), 2)]
    getitem_19 = l_batch_sigmas_[(slice(None, None, None), 2)]
    getitem_20 = l_batch_sigmas_next_[(slice(None, None, None), 2)]
    getitem_21 = l_batch_next_latents_[(slice(None, None, None), 2)]
    sample_2 = latents_2.float()
    prev_sample_2 = getitem_21.float();  getitem_21 = None
    sigma_2 = getitem_19.view(-1, 1, 1, 1);  getitem_19 = None
    sigma_prev_2 = getitem_20.view(-1, 1, 1, 1);  getitem_20 = None
    dt_2 = sigma_prev_2 - sigma_2;  sigma_prev_2 = None
    eq_2 = sigma_2 == 1
    where_2 = torch.where(eq_2, l_batch_sigma_max_, sigma_2);  eq_2 = None
    sub_15 = 1 - where_2;  where_2 = None
    truediv_8 = sigma_2 / sub_15;  sub_15 = None
    sqrt_4 = torch.sqrt(truediv_8);  truediv_8 = None
    std_dev_t_2 = sqrt_4 * 0.7;  sqrt_4 = None
    pow_9 = std_dev_t_2 ** 2
    mul_27 = 2 * sigma_2
    truediv_9 = pow_9 / mul_27;  pow_9 = mul_27 = None
    mul_28 = truediv_9 * dt_2;  truediv_9 = None
    add_8 = 1 + mul_28;  mul_28 = None
    mul_29 = sample_2 * add_8;  sample_2 = add_8 = None
    pow_10 = std_dev_t_2 ** 2
    sub_16 = 1 - sigma_2
    mul_30 = pow_10 * sub_16;  pow_10 = sub_16 = None
    mul_31 = 2 * sigma_2;  sigma_2 = None
    truediv_10 = mul_30 / mul_31;  mul_30 = mul_31 = None
    add_9 = 1 + truediv_10;  truediv_10 = None
    mul_34 = -1 * dt_2
    sqrt_5 = torch.sqrt(mul_34);  mul_34 = None
    std_2 = std_dev_t_2 * sqrt_5;  std_dev_t_2 = sqrt_5 = None
    detach_2 = prev_sample_2.detach();  prev_sample_2 = None
    pow_12 = std_2 ** 2
    mul_36 = 2 * pow_12;  pow_12 = None
    log_2 = torch.log(std_2);  std_2 = None
    getitem_22 = l_batch_log_probs_[(slice(None, None, None), 2)]
    getitem_23 = l_batch_advantages_[(slice(None, None, None), 2)]
    advantages_2 = torch.clamp(getitem_23, -5.0, 5.0);  getitem_23 = None
    neg_7 = -advantages_2
    neg_8 = -advantages_2;  advantages_2 = None
    latents_3 = l_batch_latents_[(slice(None, None, None), 3)];  l_batch_latents_ = None
    v_3 = l_batch_timesteps_[(slice(None, None, None), 3)];  l_batch_timesteps_ = None
    jagg_dit_3 = self.jagg_dit
    jagg_plan_0 = self.jagg_plan_0
    jagg_window = jaggc_graph_ops_jagg_window(jagg_dit_3, (((), {'hidden_states': latents, 'timestep': v, 'encoder_hidden_states': l_batch_prompt_embeds_, 'pooled_projections': l_batch_pooled_prompt_embeds_, 'return_dict': False}),
        ((), {'hidden_states': latents_1, 'timestep': v_1, 'encoder_hidden_states': l_batch_prompt_embeds_, 'pooled_projections': l_batch_pooled_prompt_embeds_, 'return_dict': False}),
        ((), {'hidden_states': latents_2, 'timestep': v_2, 'encoder_hidden_states': l_batch_prompt_embeds_, 'pooled_projections': l_batch_pooled_prompt_embeds_, 'return_dict': False}),
        ((), {'hidden_states': latents_3, 'timestep': v_3, 'encoder_hidden_states': l_batch_prompt_embeds_, 'pooled_projections': l_batch_pooled_prompt_embeds_, 'return_dict': False})), jagg_plan_0);  jagg_dit_3 = latents = v = l_batch_prompt_embeds_ = l_batch_pooled_prompt_embeds_ = latents_1 = v_1 = latents_2 = v_2 = v_3 = jagg_plan_0 = None
    getitem_32 = jagg_window[0]
    flatten_output = jaggc_graph_ops_flatten_output(getitem_32);  getitem_32 = None
    noise_pred = flatten_output[0];  flatten_output = None
    model_output = noise_pred.float();  noise_pred = None
    mul_6 = model_output * add_1;  model_output = add_1 = None
    mul_7 = mul_6 * dt;  mul_6 = dt = None
    prev_sample_mean = mul_3 + mul_7;  mul_3 = mul_7 = None
    sub_3 = detach - prev_sample_mean;  detach = prev_sample_mean = None
    pow_3 = sub_3 ** 2;  sub_3 = None
    neg = -pow_3;  pow_3 = None
    truediv_3 = neg / mul_10;  neg = mul_10 = None
    sub_4 = truediv_3 - log;  truediv_3 = log = None
    log_prob = sub_4 - 0.9189385332046727;  sub_4 = None
    log_prob_1 = log_prob.mean(dim = (1, 2, 3));  log_prob = None
    sub_6 = log_prob_1 - getitem_6;  log_prob_1 = getitem_6 = None
    ratio = torch.exp(sub_6);  sub_6 = None
    unclipped_loss = neg_1 * ratio;  neg_1 = None
    clamp_1 = torch.clamp(ratio, 0.9, 1.1);  ratio = None
    clipped_loss = neg_2 * clamp_1;  neg_2 = clamp_1 = None
    maximum = torch.maximum(unclipped_loss, clipped_loss);  unclipped_loss = clipped_loss = None
    policy_loss = torch.mean(maximum);  maximum = None
    total = 0.0 + policy_loss;  policy_loss = None
    getitem_33 = jagg_window[1]
    flatten_output_1 = jaggc_graph_ops_flatten_output(getitem_33);  getitem_33 = None
    noise_pred_1 = flatten_output_1[0];  flatten_output_1 = None
    model_output_1 = noise_pred_1.float();  noise_pred_1 = None
    mul_19 = model_output_1 * add_5;  model_output_1 = add_5 = None
    mul_20 = mul_19 * dt_1;  mul_19 = dt_1 = None
    prev_sample_mean_1 = mul_16 + mul_20;  mul_16 = mul_20 = None
    sub_10 = detach_1 - prev_sample_mean_1;  detach_1 = prev_sample_mean_1 = None
    pow_7 = sub_10 ** 2;  sub_10 = None
    neg_3 = -pow_7;  pow_7 = None
    truediv_7 = neg_3 / mul_23;  neg_3 = mul_23 = None
    sub_11 = truediv_7 - log_1;  truediv_7 = log_1 = None
    log_prob_2 = sub_11 - 0.9189385332046727;  sub_11 = None
    log_prob_3 = log_prob_2.mean(dim = (1, 2, 3));  log_prob_2 = None
    sub_13 = log_prob_3 - getitem_14;  log_prob_3 = getitem_14 = None
    ratio_1 = torch.exp(sub_13);  sub_13 = None
    unclipped_loss_1 = neg_4 * ratio_1;  neg_4 = None
    clamp_3 = torch.clamp(ratio_1, 0.9, 1.1);  ratio_1 = None
    clipped_loss_1 = neg_5 * clamp_3;  neg_5 = clamp_3 = None
    maximum_1 = torch.maximum(unclipped_loss_1, clipped_loss_1);  unclipped_loss_1 = clipped_loss_1 = None
    policy_loss_1 = torch.mean(maximum_1);  maximum_1 = None
    total_1 = total + policy_loss_1;  total = policy_loss_1 = None
    getitem_34 = jagg_window[2]
    flatten_output_2 = jaggc_graph_ops_flatten_output(getitem_34);  getitem_34 = None
    noise_pred_2 = flatten_output_2[0];  flatten_output_2 = None
    model_output_2 = noise_pred_2.float();  noise_pred_2 = None
    mul_32 = model_output_2 * add_9;  model_output_2 = add_9 = None
    mul_33 = mul_32 * dt_2;  mul_32 = dt_2 = None
    prev_sample_mean_2 = mul_29 + mul_33;  mul_29 = mul_33 = None
    sub_17 = detach_2 - prev_sample_mean_2;  detach_2 = prev_sample_mean_2 = None
    pow_11 = sub_17 ** 2;  sub_17 = None
    neg_6 = -pow_11;  pow_11 = None
    truediv_11 = neg_6 / mul_36;  neg_6 = mul_36 = None
    sub_18 = truediv_11 - log_2;  truediv_11 = log_2 = None
    log_prob_4 = sub_18 - 0.9189385332046727;  sub_18 = None
    log_prob_5 = log_prob_4.mean(dim = (1, 2, 3));  log_prob_4 = None
    sub_20 = log_prob_5 - getitem_22;  log_prob_5 = getitem_22 = None
    ratio_2 = torch.exp(sub_20);  sub_20 = None
    unclipped_loss_2 = neg_7 * ratio_2;  neg_7 = None
    clamp_5 = torch.clamp(ratio_2, 0.9, 1.1);  ratio_2 = None
    clipped_loss_2 = neg_8 * clamp_5;  neg_8 = clamp_5 = None
    maximum_2 = torch.maximum(unclipped_loss_2, clipped_loss_2);  unclipped_loss_2 = clipped_loss_2 = None
    policy_loss_2 = torch.mean(maximum_2);  maximum_2 = None
    total_2 = total_1 + policy_loss_2;  total_1 = policy_loss_2 = None
    getitem_35 = jagg_window[3];  jagg_window = None
    flatten_output_3 = jaggc_graph_ops_flatten_output(getitem_35);  getitem_35 = None
    noise_pred_3 = flatten_output_3[0];  flatten_output_3 = None
    getitem_27 = l_batch_sigmas_[(slice(None, None, None), 3)];  l_batch_sigmas_ = None
    getitem_28 = l_batch_sigmas_next_[(slice(None, None, None), 3)];  l_batch_sigmas_next_ = None
    getitem_29 = l_batch_next_latents_[(slice(None, None, None), 3)];  l_batch_next_latents_ = None
    model_output_3 = noise_pred_3.float();  noise_pred_3 = None
    sample_3 = latents_3.float();  latents_3 = None
    prev_sample_3 = getitem_29.float();  getitem_29 = None
    sigma_3 = getitem_27.view(-1, 1, 1, 1);  getitem_27 = None
    sigma_prev_3 = getitem_28.view(-1, 1, 1, 1);  getitem_28 = None
    dt_3 = sigma_prev_3 - sigma_3;  sigma_prev_3 = None
    eq_3 = sigma_3 == 1
    where_3 = torch.where(eq_3, l_batch_sigma_max_, sigma_3);  eq_3 = l_batch_sigma_max_ = None
    sub_22 = 1 - where_3;  where_3 = None
    truediv_12 = sigma_3 / sub_22;  sub_22 = None
    sqrt_6 = torch.sqrt(truediv_12);  truediv_12 = None
    std_dev_t_3 = sqrt_6 * 0.7;  sqrt_6 = None
    pow_13 = std_dev_t_3 ** 2
    mul_40 = 2 * sigma_3
    truediv_13 = pow_13 / mul_40;  pow_13 = mul_40 = None
    mul_41 = truediv_13 * dt_3;  truediv_13 = None
    add_12 = 1 + mul_41;  mul_41 = None
    mul_42 = sample_3 * add_12;  sample_3 = add_12 = None
    pow_14 = std_dev_t_3 ** 2
    sub_23 = 1 - sigma_3
    mul_43 = pow_14 * sub_23;  pow_14 = sub_23 = None
    mul_44 = 2 * sigma_3;  sigma_3 = None
    truediv_14 = mul_43 / mul_44;  mul_43 = mul_44 = None
    add_13 = 1 + truediv_14;  truediv_14 = None
    mul_45 = model_output_3 * add_13;  model_output_3 = add_13 = None
    mul_46 = mul_45 * dt_3;  mul_45 = None
    prev_sample_mean_3 = mul_42 + mul_46;  mul_42 = mul_46 = None
    mul_47 = -1 * dt_3;  dt_3 = None
    sqrt_7 = torch.sqrt(mul_47);  mul_47 = None
    std_3 = std_dev_t_3 * sqrt_7;  std_dev_t_3 = sqrt_7 = None
    detach_3 = prev_sample_3.detach();  prev_sample_3 = None
    sub_24 = detach_3 - prev_sample_mean_3;  detach_3 = prev_sample_mean_3 = None
    pow_15 = sub_24 ** 2;  sub_24 = None
    neg_9 = -pow_15;  pow_15 = None
    pow_16 = std_3 ** 2
    mul_49 = 2 * pow_16;  pow_16 = None
    truediv_15 = neg_9 / mul_49;  neg_9 = mul_49 = None
    log_3 = torch.log(std_3);  std_3 = None
    sub_25 = truediv_15 - log_3;  truediv_15 = log_3 = None
    log_prob_6 = sub_25 - 0.9189385332046727;  sub_25 = None
    log_prob_7 = log_prob_6.mean(dim = (1, 2, 3));  log_prob_6 = None
    getitem_30 = l_batch_log_probs_[(slice(None, None, None), 3)];  l_batch_log_probs_ = None
    getitem_31 = l_batch_advantages_[(slice(None, None, None), 3)];  l_batch_advantages_ = None
    advantages_3 = torch.clamp(getitem_31, -5.0, 5.0);  getitem_31 = None
    sub_27 = log_prob_7 - getitem_30;  log_prob_7 = getitem_30 = None
    ratio_3 = torch.exp(sub_27);  sub_27 = None
    neg_10 = -advantages_3
    unclipped_loss_3 = neg_10 * ratio_3;  neg_10 = None
    neg_11 = -advantages_3;  advantages_3 = None
    clamp_7 = torch.clamp(ratio_3, 0.9, 1.1);  ratio_3 = None
    clipped_loss_3 = neg_11 * clamp_7;  neg_11 = clamp_7 = None
    maximum_3 = torch.maximum(unclipped_loss_3, clipped_loss_3);  unclipped_loss_3 = clipped_loss_3 = None
    policy_loss_3 = torch.mean(maximum_3);  maximum_3 = None
    total_3 = total_2 + policy_loss_3;  total_2 = policy_loss_3 = None
    truediv_16 = total_3 / 4;  total_3 = None
    return (truediv_16,)
""")


if __name__ == "__main__":
    expecttest.run_tests()


def test_restore_topological_order_moves_only_what_must_move():
    """A use placed before its input (what rewrite_windows leaves) is moved below it; every other
    node keeps its place; the nodes are relinked, not copied."""
    from torch import fx

    from jaggc.passes.rewrite import restore_topological_order

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.neg, (x,))
    b = graph.call_function(torch.sin, (x,))
    late = graph.call_function(torch.cos, (x,))
    graph.output((a, b, late))
    with graph.inserting_before(b):
        early_use = graph.call_function(torch.exp, (late,))   # reads `late` before it is defined
    nodes_before = set(graph.nodes)
    restore_topological_order(graph)
    graph.lint()
    assert set(graph.nodes) == nodes_before
    assert [n.name for n in graph.nodes] == ["x", "neg", "sin", "cos", "exp", "output"]
    assert early_use.args[0] is late
