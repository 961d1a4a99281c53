"""The layers and the init: GPT-2's N(0, 0.02) with 1/sqrt(2N) residual scaling, RMSNorm and SwiGLU models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from golden import max_diff

import lenskit
from lenskit import HookedTransformer, ModelConfig


# ---------------------------------------------------------------------- init
def test_fresh_model_uses_gpt2_init():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=4, d_model=128, n_heads=4, d_vocab=512, n_ctx=128)
    model = HookedTransformer(cfg)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    checked = 0
    for name, p in model.named_parameters():
        p = p.detach()
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln" in name or name.startswith("ln_final"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = resid_std if name.endswith(("attn.out.weight", "mlp.fc_out.weight")) else 0.02
            # The sample std of n >= 16k normal draws is within ~1% of the truth; allow 5%.
            assert abs(p.std().item() / want - 1) < 0.05, (name, p.std().item(), want)
            assert abs(p.mean().item()) < 0.1 * want, name
            checked += 1
    assert checked == 2 + 4 * cfg.n_layers  # embed, pos_embed (unembed is tied), qkv/out/fc_in/fc_out per block
    assert model.unembed.weight is model.embed.weight
    model.init_weights(residual_scaling=False)
    assert abs(model.blocks[0].attn.out.weight.std().item() / 0.02 - 1) < 0.05


def test_dropout_defaults_to_zero(model):
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(r == 0.0 for r in rates)


# --------------------------------------------------------- other architectures
@pytest.fixture(scope="module")
def rms_swiglu():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=61, n_ctx=32, d_mlp=48, norm="rmsnorm",
                      mlp="swiglu", norm_eps=1e-6)
    model = HookedTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name.startswith("ln_final"):
                p.add_(torch.randn_like(p) * 0.3)  # gains away from 1, so a missing weight shows
    return model


def test_rmsnorm_swiglu_model_runs(rms_swiglu):
    model = rms_swiglu
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(tokens)
        logits, cache = model.run_with_cache(tokens)
    assert plain.shape == (2, 9, 61) and torch.isfinite(plain).all()
    assert max_diff(plain, logits) <= 1e-5
    eps = model.cfg.norm_eps
    for i in range(model.cfg.n_layers):
        block = model.blocks[i]
        assert max_diff(cache["resid_post", i], cache["resid_pre", i] + cache["attn_out", i] + cache["mlp_out", i]) <= 1e-5
        x = cache["resid_mid", i].double()
        scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()  # no centring in RMSNorm
        assert max_diff(cache[f"blocks.{i}.ln2.hook_scale"], scale) <= 1e-6
        normed = x / scale * block.ln2.weight.detach().double()
        assert max_diff(cache[f"blocks.{i}.ln2.hook_normalized"], normed) <= 1e-5
        with torch.no_grad():
            h = cache[f"blocks.{i}.ln2.hook_normalized"]
            mlp = block.mlp
            want = (F.silu(h @ mlp.gate.weight.T) * (h @ mlp.fc_in.weight.T)) @ mlp.fc_out.weight.T
        assert max_diff(cache["mlp_out", i], want) <= 1e-5
    assert not hasattr(model.ln_final, "bias")


def test_rmsnorm_model_cannot_be_saved_in_hf_layout(rms_swiglu, tmp_path):
    with pytest.raises(ValueError, match="rmsnorm"):
        rms_swiglu.save_pretrained(tmp_path)


def test_public_api_names():
    for name in ("HookedTransformer", "ModelConfig", "ActivationCache", "HookPoint", "CheckpointError", "DEFAULT_MODEL"):
        assert hasattr(lenskit, name)


# ------------------------------------------------------------ family pieces
def test_llama3_frequencies_equal_transformers_at_published_shape():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lenskit.pieces.rotary import inverse_frequencies

    cfg = lenskit.ModelConfig.from_name("llama-3.1-8b")
    hf_cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    want, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(inverse_frequencies(cfg), want, atol=0, rtol=0)
    plain = inverse_frequencies(cfg.replace(rope_type="default"))
    assert (inverse_frequencies(cfg) < plain).any() and (inverse_frequencies(cfg) == plain).any()  # slow ones rescaled only


def test_sliding_window_mask_by_hand():
    from lenskit.pieces.attention import CausalMask, SlidingWindowMask

    got = SlidingWindowMask(3).allowed(5, torch.device("cpu")).int().tolist()
    assert got == [[1, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0],
                   [1, 1, 1, 0, 0],
                   [0, 1, 1, 1, 0],
                   [0, 0, 1, 1, 1]]  # each query sees itself and the 2 keys before it
    assert torch.equal(SlidingWindowMask(9).allowed(5, torch.device("cpu")), CausalMask().allowed(5, torch.device("cpu")))


def test_partial_rotary_leaves_the_other_dims_alone():
    from lenskit.pieces.rotary import Rotary

    cfg = lenskit.ModelConfig(n_layers=1, d_model=32, n_heads=2, d_vocab=5, n_ctx=8, positional="rotary", rotary_dim=4)
    x = torch.randn(1, 6, 2, 16)
    y = Rotary(cfg)(x)
    assert torch.equal(y[..., 4:], x[..., 4:]) and torch.equal(y[:, 0], x[:, 0])
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))  # a rotation keeps lengths
    assert (y[:, 1:, :, :4] - x[:, 1:, :, :4]).abs().max() > 1e-3
