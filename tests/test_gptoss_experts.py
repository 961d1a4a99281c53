"""gpt-oss's clamped SwiGLU experts and top-k-then-softmax router (lenskit.pieces.moe; the interleaved gate_up from
lenskit.families.gpt_oss), against transformers' GptOssExperts and GptOssTopKRouter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from golden import max_diff

from lenskit import ModelConfig
from lenskit.families.gpt_oss import split_gate_up
from lenskit.pieces.moe import clamped_swiglu as _clamped_swiglu
from lenskit.pieces.moe import topk_softmax

ALPHA, LIMIT = ModelConfig.moe.swiglu_alpha, ModelConfig.moe.swiglu_limit  # our defaults, which must be gpt-oss's


def clamped_swiglu(gate, up):
    return _clamped_swiglu(gate, up, ALPHA, LIMIT)


def top_k_then_softmax(logits, k):
    weights, indices = topk_softmax(logits, k)
    return indices, weights

D_MODEL, D_MLP, N_EXPERTS, TOP_K, TOKENS = 16, 12, 6, 2, 40


@pytest.fixture(scope="module")
def hf_mlp():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(hidden_size=D_MODEL, intermediate_size=D_MLP, num_local_experts=N_EXPERTS,
                                    num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    mlp = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 1.0)  # unit weights: many gate/up values pass the limit of 7, so the clamps matter
    assert (mlp.experts.alpha, mlp.experts.limit) == (ALPHA, LIMIT)  # our defaults are gpt-oss's
    return mlp


def test_clamped_swiglu_by_hand():
    gate = torch.tensor([-9.0, -1.0, 0.0, 2.0, 7.0, 12.0])
    up = torch.tensor([-12.0, -7.0, 0.0, 3.0, 7.5, 100.0])
    want = [(min(max(u, -7.0), 7.0) + 1) * min(g, 7.0) / (1 + torch.exp(torch.tensor(-1.702 * min(g, 7.0))).item())
            for g, u in zip(gate.tolist(), up.tolist())]
    assert max_diff(clamped_swiglu(gate, up), torch.tensor(want)) <= 1e-6
    assert clamped_swiglu(gate, up)[-1] == clamped_swiglu(torch.tensor(7.0), torch.tensor(7.0))  # both clamped
    assert clamped_swiglu(torch.tensor(-9.0), torch.tensor(0.0)) != clamped_swiglu(torch.tensor(-7.0), torch.tensor(0.0))


def test_activation_equals_transformers_apply_gate(hf_mlp):
    gate_up = torch.randn(5, 2 * D_MLP, generator=torch.Generator().manual_seed(1)) * 6
    assert torch.equal(clamped_swiglu(*split_gate_up(gate_up)), hf_mlp.experts._apply_gate(gate_up))


def test_experts_equal_transformers_given_routing(hf_mlp):
    """Each expert's output from our activation, grouped by expert and weighted, is GptOssExperts' output."""
    experts = hf_mlp.experts
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])  # [tokens, k]
    weights = torch.rand(TOKENS, TOP_K, generator=g).softmax(-1)
    with torch.no_grad():
        want = experts(x, indices, weights)
        got = torch.zeros_like(x)
        for e in range(N_EXPERTS):
            token, slot = torch.where(indices == e)
            gate_up = x[token] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]  # [n, 2 * d_mlp]
            out = clamped_swiglu(*split_gate_up(gate_up)) @ experts.down_proj[e] + experts.down_proj_bias[e]  # [n, d_model]
            got.index_add_(0, token, out * weights[token, slot, None])
        gate, _ = split_gate_up(x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0])
    assert (gate > LIMIT).any()  # the clamp took part
    assert max_diff(got, want) <= 1e-5


def test_router_equals_transformers(hf_mlp):
    router = hf_mlp.router
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want_logits, want_weights, want_indices = router(x)
        logits = F.linear(x, router.weight, router.bias)  # [tokens, expert]
        indices, weights = top_k_then_softmax(logits, TOP_K)
    assert torch.equal(logits, want_logits)
    assert torch.equal(indices, want_indices) and max_diff(weights, want_weights) <= 1e-7
    assert indices.shape == weights.shape == (TOKENS, TOP_K)
    assert max_diff(weights.sum(-1), torch.ones(TOKENS)) <= 1e-6
    # the softmax is over the chosen k alone: not the full softmax's share of them
    full = logits.softmax(-1).gather(-1, indices)
    assert (full.sum(-1) < 1 - 1e-2).any() and max_diff(weights, full / full.sum(-1, keepdim=True)) <= 1e-6


def test_mlp_end_to_end_equals_transformers(hf_mlp):
    x = torch.randn(2, 7, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = hf_mlp(x)
        flat = x.reshape(-1, D_MODEL)
        indices, weights = top_k_then_softmax(F.linear(flat, hf_mlp.router.weight, hf_mlp.router.bias), TOP_K)
        e = hf_mlp.experts
        got = torch.zeros_like(flat)
        for k in range(TOP_K):  # the dense reference: every token through its k-th expert, weighted
            w = e.gate_up_proj[indices[:, k]]  # [tokens, d_model, 2 * d_mlp]
            gate_up = torch.einsum("td,tdm->tm", flat, w) + e.gate_up_proj_bias[indices[:, k]]
            out = torch.einsum("tm,tmd->td", clamped_swiglu(*split_gate_up(gate_up)), e.down_proj[indices[:, k]])
            got += (out + e.down_proj_bias[indices[:, k]]) * weights[:, k, None]
    torch.testing.assert_close(got.view_as(x), want, rtol=1e-5, atol=1e-5)  # outputs reach ~100: fp32's relative rounding
