"""lenskit.pieces.weights: TransformerLens's weight views, owned by each block's attention and MLP and stacked over
layers, on every family. The views are checked as identities: they recompute what the modules computed."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from fixtures import close

import lenskit
from lenskit import HookedTransformer, ModelConfig
from lenskit.pieces.absent import NoMLP
from lenskit.pieces.layers import MLP

TOKENS = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))


def act(cfg: ModelConfig, pre: torch.Tensor, mlp: torch.nn.Module | None = None) -> torch.Tensor:
    """The MLP's activation, from the config (SiLU for SwiGLU, ReLU, the config's GELU otherwise); Apertus's xIELU
    has learned scalars per block, so it is the block's own (checked against transformers' in tests/test_apertus.py)."""
    if cfg.activation == "xielu":
        assert mlp is not None, "xIELU's scalars are the block's: pass its MLP"
        return mlp.act(pre)
    if cfg.activation == "relu":
        return F.relu(pre)
    if cfg.activation == "relu2":  # Nemotron-H's squared ReLU
        return F.relu(pre).square()
    return F.silu(pre) if cfg.mlp in ("swiglu", "swiglu_fused") else F.gelu(pre, approximate=cfg.gelu_approximate)


def mlp_layers(model: HookedTransformer) -> list[int]:
    """The blocks that have an MLP: all but Nemotron-H's mixer-only blocks."""
    return [l for l, block in enumerate(model.blocks) if not isinstance(block.mlp, NoMLP)]


def mlp_io(model: HookedTransformer, tokens: torch.Tensor) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Each MLP's input and output [batch, pos, d_model] by block (whatever the block form), and the MLP hooks."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [model.blocks[l].mlp.register_forward_hook(
        lambda mod, args, out, l=l: seen.__setitem__(l, (args[0], out))) for l in mlp_layers(model)]
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=lambda name: ".mlp.hook_" in name)
    finally:
        for handle in handles:
            handle.remove()
    return seen, cache


def test_shapes(family_model):
    model = family_model.model
    if model.cfg.moe.n_experts is not None:
        pytest.skip("a mixture of experts' MLP views are per expert: tests/test_moe.py checks them")
    c = model.cfg
    gated = c.mlp != "gelu"
    usual = [l for l in mlp_layers(model) if c.d_mlp_of(l) == c.d_mlp]
    if len(mlp_layers(model)) < c.n_layers:  # Nemotron-H's mixer-only blocks have no MLP: no stack
        with pytest.raises(ValueError, match=r"model.W_in cannot stack .* are mixer-only \(no MLP\) layers"):
            model.W_in
    elif len(usual) < c.n_layers:  # Gemma 4's kv-sharing blocks' MLPs are twice as wide (double_wide_mlp): no stack
        with pytest.raises(ValueError, match=r"model.W_in cannot stack .* their shapes differ"):
            model.W_in
        for l in range(c.n_layers):
            assert model.blocks[l].mlp.W_in.shape == model.blocks[l].mlp.W_gate.shape == (c.d_model, c.d_mlp_of(l))
    mlp = {name: (None if getattr(model.blocks[usual[0]].mlp, name) is None else
                  torch.stack([getattr(model.blocks[l].mlp, name) for l in usual])) if len(usual) < c.n_layers
           else getattr(model, name) for name in ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out")}
    m = len(usual)
    assert mlp["W_in"].shape == (m, c.d_model, c.d_mlp)
    assert mlp["W_out"].shape == (m, c.d_mlp, c.d_model)
    assert mlp["b_in"].shape == (m, c.d_mlp) and mlp["b_out"].shape == (m, c.d_model)
    if gated:
        assert mlp["W_gate"].shape == (m, c.d_model, c.d_mlp) and mlp["b_gate"].shape == (m, c.d_mlp)
    else:
        assert mlp["W_gate"] is None and mlp["b_gate"] is None
    headed = [l for l in range(c.n_layers) if c.has_heads(l)]  # Qwen 3.5's linear blocks, Nemotron-H's Mamba-2 and MLP blocks have no heads
    if len(headed) < c.n_layers:
        kind = re.escape(model.blocks[next(l for l in range(c.n_layers) if l not in headed)].attn.LAYER_TYPE)
        with pytest.raises(ValueError, match=rf"model.W_Q cannot stack .* are {kind} layers"):
            model.W_Q
    for l in (l for l in headed if c.kv_source(l) is not None):  # Gemma 4's kv sharing: the keys are another block's
        with pytest.raises(ValueError, match=rf"block {l} has no key or value weights: it reads block {c.kv_source(l)}'s"):
            model.blocks[l].attn.W_K
    headed = [l for l in headed if c.kv_source(l) is None]
    if c.attention.full_d_head is not None:  # Gemma 4's full blocks have wider heads: no stack, each block has its own views
        with pytest.raises(ValueError, match=r"model.W_Q cannot stack .* their shapes differ"):
            model.W_Q
        headed = [l for l in headed if c.d_head_of(l) == c.d_head]
        wide = next(l for l in range(c.n_layers) if c.d_head_of(l) != c.d_head)
        a, w = model.blocks[wide].attn, c.attention.full_d_head
        assert a.W_Q.shape == a.W_K.shape == a.W_V.shape == (c.n_heads, c.d_model, w) and a.W_O.shape == (c.n_heads, w, c.d_model)
    attn = {name: torch.stack([getattr(model.blocks[l].attn, name) for l in headed]) if len(headed) < c.n_layers
            else getattr(model, name) for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")}
    n = len(headed)
    assert attn["W_Q"].shape == attn["W_K"].shape == attn["W_V"].shape == (n, c.n_heads, c.d_model, c.d_head)
    assert attn["b_Q"].shape == attn["b_K"].shape == attn["b_V"].shape == (n, c.n_heads, c.d_head)
    assert attn["W_O"].shape == (n, c.n_heads, c.d_head, c.d_model) and attn["b_O"].shape == (n, c.d_model)
    for l, block in enumerate(model.blocks):  # the stacks are the blocks' own views
        assert isinstance(block.mlp, MLP) == (l in mlp_layers(model))
        for name in ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out"):
            if l in usual:
                view = getattr(block.mlp, name)
                assert (view is None) if name in ("W_gate", "b_gate") and not gated else torch.equal(view, mlp[name][usual.index(l)])
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
            if l in headed:
                assert torch.equal(getattr(block.attn, name), attn[name][headed.index(l)])


def test_mlp_views_reproduce_the_mlp(family_model):
    """mlp(x) == act(x @ W_gate + b_gate) * (x @ W_in + b_in) @ W_out + b_out (gated), or
    act(x @ W_in + b_in) @ W_out + b_out (GELU), from the MLP's own input, and each hook in between."""
    model = family_model.model
    if model.cfg.moe.n_experts is not None:
        pytest.skip("a mixture of experts' MLP views are per expert: tests/test_moe.py checks them")
    c = model.cfg
    seen, cache = mlp_io(model, TOKENS)
    # every block's MLP ran, but for Nemotron-H's mixer-only blocks, which have none
    assert sorted(seen) == mlp_layers(model) == [l for l in range(c.n_layers) if not c.block.one_sublayer or c.layer_type(l) == "mlp"]
    for l, (x, out) in seen.items():
        m = model.blocks[l].mlp  # its views are the stacks' rows (test_shapes); Gemma 4's may be wider
        linear = x @ m.W_in + m.b_in  # [batch, pos, d_mlp]
        if m.W_gate is None:
            close(linear, cache[f"blocks.{l}.mlp.hook_pre"])
            post = act(c, linear, m)
        else:
            gate = x @ m.W_gate + m.b_gate
            close(gate, cache[f"blocks.{l}.mlp.hook_pre"])
            close(linear, cache[f"blocks.{l}.mlp.hook_pre_linear"])
            post = act(c, gate) * linear
        close(post, cache[f"blocks.{l}.mlp.hook_post"])
        close(post @ m.W_out + m.b_out, out)


def test_attention_views_reproduce_q_k_v(family_model):
    """hook_q == x @ W_Q + b_Q per head, and k, v per query head (kv heads repeated), from attention's input."""
    model = family_model.model
    c = model.cfg
    seen = []
    handles = [block.attn.register_forward_hook(lambda mod, args, out: seen.append((args[0], out))) for block in model.blocks]
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(TOKENS, names_filter=lambda name: name.endswith(("hook_q", "hook_k", "hook_v", "hook_z")))
    finally:
        for handle in handles:
            handle.remove()
    for l, (x, out) in enumerate(seen):
        if not c.has_heads(l):  # Qwen 3.5's Gated DeltaNet, Nemotron-H's Mamba-2 have no heads' views (tests/test_deltanet.py)
            continue
        group = c.n_heads // c.n_kv_heads_of(l)  # Gemma 4's full blocks have their own kv heads
        a = model.blocks[l].attn  # its views are the stacks' rows (test_shapes)
        if c.mla.kv_lora_rank is not None:  # latent attention (DeepSeek V3): W_O only, per-head W_Q/W_K/W_V refused
            for view in ("W_Q", "W_K", "W_V", "b_Q"):
                with pytest.raises(ValueError, match=f"latent attention \\(DeepSeek V3\\) has no per-head {view}") as e:
                    getattr(a, view)
                assert "\n" not in str(e.value)
            close(torch.einsum("bphd,hdm->bpm", cache["z", l], a.W_O) + a.b_O, out)
            continue
        close(torch.einsum("bpm,hmd->bphd", x, a.W_Q) + a.b_Q, cache["q", l])
        if c.kv_source(l) is not None:  # Gemma 4's kv sharing: its k and v are block kv_source's (test_gemma4.py)
            close(torch.einsum("bphd,hdm->bpm", cache["z", l], a.W_O) + a.b_O, out)
            continue
        for w, b, short in [(a.W_K, a.b_K, "k"), (a.W_V, a.b_V, "v")]:
            close(torch.einsum("bpm,hmd->bphd", x, w) + b, cache[short, l].repeat_interleave(group, dim=2))
        close(torch.einsum("bphd,hdm->bpm", cache["z", l], a.W_O) + a.b_O, out)


def test_mlp_views_match_transformers_parameters(family_model):
    """W_in is the ungated input (up_proj, c_fc, dense_h_to_4h), W_gate the gate; Phi-3's are gate_up's halves."""
    family, hf, model = family_model.family, family_model.hf, family_model.model
    if model.cfg.moe.n_experts is not None:
        pytest.skip("a mixture of experts' MLP views are per expert: tests/test_moe.py checks them")
    layers = hf.transformer.h if family == "gpt2" else hf.gpt_neox.layers if family == "gpt_neox" else hf.model.layers
    for l, layer in enumerate(layers):
        if family == "nemotron_h":  # one sublayer per layer: the MLP layers' mixer is the MLP (up_proj in, down_proj out)
            if layer.block_type != "mlp":
                continue
            ours, mlp = model.blocks[l].mlp, layer.mixer
            assert ours.W_gate is None and torch.equal(ours.W_in, mlp.up_proj.weight.T) and torch.equal(ours.b_in, mlp.up_proj.bias)
            assert torch.equal(ours.W_out, mlp.down_proj.weight.T) and torch.equal(ours.b_out, mlp.down_proj.bias)
            continue
        mlp = layer.mlp
        if family == "gpt2":  # Conv1D weights are already x @ W
            assert torch.equal(model.W_in[l], mlp.c_fc.weight) and torch.equal(model.b_in[l], mlp.c_fc.bias)
            assert torch.equal(model.W_out[l], mlp.c_proj.weight) and torch.equal(model.b_out[l], mlp.c_proj.bias)
        elif family == "gpt_neox":
            assert torch.equal(model.W_in[l], mlp.dense_h_to_4h.weight.T) and torch.equal(model.b_in[l], mlp.dense_h_to_4h.bias)
            assert torch.equal(model.W_out[l], mlp.dense_4h_to_h.weight.T)
        elif family == "apertus":  # an ungated MLP (xIELU): up_proj in, down_proj out, no biases
            ours = model.blocks[l].mlp
            assert ours.W_gate is None and torch.equal(ours.W_in, mlp.up_proj.weight.T)
            assert torch.equal(ours.W_out, mlp.down_proj.weight.T) and not ours.b_in.any() and not ours.b_out.any()
        else:
            if family == "phi3":
                gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)  # [gate rows | up rows], as Phi3MLP splits it
            else:
                gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
            ours = model.blocks[l].mlp  # a block's own views (Gemma 4's kv-sharing blocks' are wider)
            assert torch.equal(ours.W_gate, gate.T) and torch.equal(ours.W_in, up.T)
            assert torch.equal(ours.W_out, mlp.down_proj.weight.T)
            assert not ours.b_in.any() and not ours.b_gate.any() and not ours.b_out.any()


def test_phi3_views_are_views_of_gate_up():
    """FusedSwiGLU's W_gate / W_in share gate_up's storage, so an edit of the parameter shows in them."""
    cfg = ModelConfig.from_name("phi-3-mini").replace(n_layers=1, d_model=32, n_heads=4, d_mlp=24, d_vocab=50, n_ctx=32)
    mlp = HookedTransformer(cfg).blocks[0].mlp
    with torch.no_grad():
        mlp.gate_up.weight[0, 0] = 7.0  # the first gate row
        mlp.gate_up.weight[24, 1] = 8.0  # the first up row
    assert mlp.W_gate[0, 0] == 7.0 and mlp.W_in[1, 0] == 8.0
    assert mlp.W_gate.data_ptr() == mlp.gate_up.weight.data_ptr()


@pytest.mark.parametrize("mlp", ["gelu", "swiglu", "geglu", "swiglu_fused"])
def test_mlp_biases_enter_the_views(mlp):
    """With mlp_bias (no family fixture has gated-MLP biases), b_gate and b_in are the biases the forward adds."""
    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=32, d_mlp=24, mlp=mlp, mlp_bias=True,
                      activation="gelu_pytorch_tanh")
    model = HookedTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    assert model.b_in.abs().min() > 0 and model.b_out.abs().min() > 0
    assert mlp == "gelu" or model.b_gate.abs().min() > 0
    seen, _ = mlp_io(model, TOKENS)
    for l, (x, out) in seen.items():
        linear = x @ model.W_in[l] + model.b_in[l]
        post = act(cfg, linear) if mlp == "gelu" else act(cfg, x @ model.W_gate[l] + model.b_gate[l]) * linear
        close(post @ model.W_out[l] + model.b_out[l], out)


def test_absent_biases_read_as_zeros():
    cfg = lenskit.PRESETS["llama-3.2-1b"].replace(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=32)
    model = HookedTransformer(cfg)
    for name in ("b_in", "b_gate", "b_out", "b_Q", "b_K", "b_V", "b_O"):
        assert not getattr(model, name).any(), name
