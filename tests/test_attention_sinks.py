"""Attention sinks (gpt-oss): a learned per-head logit in each softmax's denominator, against transformers' GptOssAttention."""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures import unchanged_copy
from golden import max_diff

from lenskit import ModelConfig
from lenskit.pieces.attention import Attention

N_LAYERS, D_MODEL, N_HEADS, N_KV, D_HEAD, WINDOW = 4, 32, 4, 2, 8, 3
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)


def our_config(**changes) -> ModelConfig:
    fields = dict(n_layers=N_LAYERS, d_model=D_MODEL, n_heads=N_HEADS, n_kv_heads=N_KV, d_head=D_HEAD, d_vocab=50, n_ctx=64,
                  norm="rmsnorm", mlp="swiglu", positional="rotary", rotary_base=150000.0, rope_type="yarn",
                  rope_factor=32.0, rope_original_n_ctx=4096, rope_truncate=False, fused_qkv=False, attn_sinks=True,
                  layer_types=("sliding", "full") * (N_LAYERS // 2), sliding_window=WINDOW)
    return ModelConfig(**{**fields, **changes})


@pytest.fixture(scope="module")
def reference():
    """A tiny GptOssModel (eager, fp32) with sinks and biases far from zero; per block, its attention's input and output."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL, intermediate_size=16, head_dim=D_HEAD,
                                    num_attention_heads=N_HEADS, num_key_value_heads=N_KV, vocab_size=50, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=WINDOW, rope_parameters=dict(YARN),
                                    max_position_embeddings=131072)
    cfg._attn_implementation = "eager"
    hf = transformers.GptOssModel(cfg).eval()
    assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    with torch.no_grad():
        for layer in hf.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # some heads' sinks dominate, some are negligible
            for name, p in layer.self_attn.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    seen = {}

    def grab(i):
        def hook(module, args, kwargs, out):
            seen[i] = (kwargs["hidden_states"].detach().clone(), out[0].detach().clone())
        return hook

    handles = [layer.self_attn.register_forward_hook(grab(i), with_kwargs=True) for i, layer in enumerate(hf.layers)]
    try:
        with torch.no_grad():
            hf(torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1)))  # 9 > WINDOW: the window bites
    finally:
        for h in handles:
            h.remove()
    return hf, seen


def ours(hf, i: int, cfg: ModelConfig | None = None) -> Attention:
    h = hf.layers[i].self_attn
    attn = Attention(cfg or our_config(), i).eval()
    attn.load_state_dict({"qkv.q.weight": h.q_proj.weight, "qkv.q.bias": h.q_proj.bias, "qkv.k.weight": h.k_proj.weight,
                          "qkv.k.bias": h.k_proj.bias, "qkv.v.weight": h.v_proj.weight, "qkv.v.bias": h.v_proj.bias,
                          "out.weight": h.o_proj.weight, "out.bias": h.o_proj.bias, "sinks": h.sinks})
    return attn


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_both_paths_equal_transformers(reference, layer):
    hf, seen = reference
    attn = ours(hf, layer)
    x, want = seen[layer]
    patterns = []
    with torch.no_grad():
        fused = attn(x)  # no hooks: the fused kernel, with the sink as an extra key
        remove = attn.hook_pattern.add_hook(lambda t, hook: patterns.append(t) or t.clone())
        try:
            eager = attn(x)  # a hooked internal: the eager path
        finally:
            remove()
    assert patterns, "the hooked run did not take the eager path"
    assert max_diff(fused, want) <= 1e-5 and max_diff(eager, want) <= 1e-5
    assert max_diff(fused, eager) <= 1e-5


def test_sinks_change_the_output(reference):
    hf, seen = reference
    x, want = seen[1]
    with torch.no_grad():
        plain = Attention(our_config(attn_sinks=False), 1).eval()
        state = ours(hf, 1).state_dict()
        del state["sinks"]
        plain.load_state_dict(state)
        assert max_diff(plain(x), want) > 1e-3  # without the sink the output is another function


@pytest.mark.parametrize("layer", [0, 1])
def test_pattern_and_sink_sum_to_one(reference, layer):
    hf, seen = reference
    attn = ours(hf, layer)
    x, _ = seen[layer]
    got = {}
    removes = [attn.hook_pattern.add_hook(lambda t, hook: got.__setitem__("pattern", t)),
               attn.hook_sink.add_hook(lambda t, hook: got.__setitem__("sink", t))]
    try:
        with torch.no_grad():
            attn(x)
    finally:
        for remove in removes:
            remove()
    pattern, sink = got["pattern"], got["sink"]
    assert pattern.shape == (2, N_HEADS, 9, 9) and sink.shape == (2, N_HEADS, 9)
    assert max_diff(pattern.sum(-1) + sink, torch.ones_like(sink)) <= 1e-6
    assert (pattern.sum(-1) < 1).all() and (sink > 0).all()
    if layer == 0:  # sliding: no weight beyond the window
        far = ~torch.ones(9, 9, dtype=torch.bool).tril().triu(-(WINDOW - 1))
        assert (pattern[..., far] == 0).all()
    # the sink's share by hand: exp(sink) over exp(sink) plus the real keys' exp(scores)
    remove = attn.hook_attn_scores.add_hook(lambda t, hook: got.__setitem__("scores", t))
    try:
        with torch.no_grad():
            attn(x)
    finally:
        remove()
    scores = got["scores"].double()
    s = attn.sinks.detach().double()[:, None]
    want = s.exp() / (s.exp() + scores.exp().sum(-1))
    assert max_diff(sink, want) <= 1e-6


def test_sink_gradient_flows_through_the_fused_path(reference):
    hf, seen = reference
    attn = ours(hf, 1)
    x, _ = seen[1]
    attn(x).sum().backward()
    fused_grad = attn.sinks.grad.clone()
    attn.sinks.grad = None
    remove = attn.hook_pattern.add_hook(unchanged_copy)  # the eager path
    try:
        attn(x).sum().backward()
    finally:
        remove()
    assert fused_grad.abs().max() > 0
    assert max_diff(fused_grad, attn.sinks.grad) <= 1e-5


def test_sink_parameter_and_hook_exist_only_when_chosen():
    with_sinks, without = Attention(our_config(), 0), Attention(our_config(attn_sinks=False), 0)
    assert with_sinks.sinks.shape == (N_HEADS,) and hasattr(with_sinks, "hook_sink")
    assert not hasattr(without, "sinks") and not hasattr(without, "hook_sink")
    with pytest.raises(ValueError, match="attn_sinks"):
        our_config(attn_sinks=1)
