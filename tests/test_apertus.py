"""Apertus's xIELU activation (lenskit.pieces.mlp.XIELU) against transformers' own `XIELUActivation` (its torch path,
the one it runs without the optional CUDA kernel), its hooks, where it is refused, and a tiny Apertus whose every
xIELU scalar is its own, at the logits and every residual write."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_hf_family
from golden import assert_golden, max_diff

from lenskit import HookedTransformer, ModelConfig
from lenskit.pieces.mlp import XIELU


def _pair(dtype: torch.dtype, seed: int) -> tuple[XIELU, torch.nn.Module]:
    """Ours and transformers' xIELU with the same random scalars (beta and eps too, as a checkpoint may store them)."""
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.alpha_p.add_(torch.randn(1, generator=g).to(dtype))
        theirs.alpha_n.add_(torch.randn(1, generator=g).to(dtype))
        theirs.beta.fill_(0.3 + 0.4 * torch.rand((), generator=g).item())
        theirs.eps.fill_(-0.05)
    ours = XIELU().to(dtype)
    ours.load_state_dict(theirs.state_dict())  # the checkpoint's names: alpha_p, alpha_n, beta, eps
    return ours, theirs


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 3)])
def test_xielu_is_transformers_torch_path(dtype, seed):
    ours, theirs = _pair(dtype, seed)
    # both branches, the eps clamp (between eps and 0), zero, large magnitudes
    x = torch.cat([torch.linspace(-8, 8, 401), torch.tensor([0.0, -0.01, -0.05, -0.06, 1e-7, -1e-7, 30.0, -30.0])]).to(dtype)
    with torch.no_grad():
        got, want = ours(x), theirs._xielu_python(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


def test_a_fresh_model_starts_xielu_where_transformers_does():
    """init_weights draws the projections, but each block's xIELU scalars start at transformers' own initial values."""
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=torch.float32)
    cfg = ModelConfig.from_name("apertus-8b").replace(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_mlp=48,
                                                      d_vocab=101)
    model = HookedTransformer(cfg)
    model.init_weights()
    for block in model.blocks:
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            assert torch.equal(getattr(block.mlp.act, name), getattr(theirs, name)), name


def test_xielu_by_hand():
    """The formula itself, not only agreement: x > 0 gives a_p x^2 + beta x, x <= 0 a_n (expm1(min(x, eps)) - x) + beta x."""
    act = XIELU(alpha_p=0.8, alpha_n=0.8, beta=0.5, eps=-1e-6)
    a_p, a_n, beta = 0.8, 0.8, 0.5  # the init is softplus^-1 of alpha_p and of alpha_n - beta
    x = torch.tensor([2.0, -1.0, -5e-7])
    with torch.no_grad():
        y = act(x)
    assert y[0].item() == pytest.approx(a_p * 4 + beta * 2, rel=1e-6)
    assert y[1].item() == pytest.approx(a_n * (torch.expm1(torch.tensor(-1.0)).item() + 1) - beta, rel=1e-6)
    assert y[2].item() == pytest.approx(a_n * (torch.expm1(torch.tensor(-1e-6)).item() + 5e-7) + beta * -5e-7, rel=1e-4)


def test_apertus_matches_transformers_with_every_block_its_own_scalars(tokens):
    hf = make_hf_family("apertus", seed=11)
    scalars = {n: p.item() for n, p in hf.named_parameters() if n.endswith(("alpha_p", "alpha_n"))}
    assert len(set(scalars.values())) == len(scalars) == 2 * hf.config.num_hidden_layers  # conftest perturbs each
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.activation == "xielu" and model.cfg.mlp == "gelu" and model.cfg.qk_norm
    for layer, block in enumerate(hf.model.layers):
        act = model.blocks[layer].mlp.act
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            assert torch.equal(getattr(act, name), getattr(block.mlp.act_fn, name)), (layer, name)
    assert_golden(model, hf, tokens)
    with torch.no_grad():  # the scalars matter: block 0's own reset to the init moves the logits
        before = model(tokens)
        model.blocks[0].mlp.act.alpha_p.fill_(0.0)
        assert max_diff(model(tokens), before) > 1e-4


def test_xielu_hooks_are_the_pre_and_post_activation(tokens):
    model = HookedTransformer.from_hf(make_hf_family("apertus", seed=12))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: ".mlp." in n)
        for layer in range(model.cfg.n_layers):
            mlp = model.blocks[layer].mlp
            pre, post = cache[f"blocks.{layer}.mlp.hook_pre"], cache[f"blocks.{layer}.mlp.hook_post"]
            assert pre.shape[-1] == model.cfg.d_mlp and (pre < 0).any() and (pre > 0).any()
            assert torch.equal(pre, mlp.fc_in(model.blocks[layer].ln2(cache_resid(model, tokens, layer))))
            assert torch.equal(post, mlp.act(pre))


def cache_resid(model, tokens, layer):
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == f"blocks.{layer}.hook_resid_mid")
    return cache[f"blocks.{layer}.hook_resid_mid"]


def test_xielu_is_refused_where_no_checkpoint_stores_it():
    base = ModelConfig.from_name("apertus-8b")
    with pytest.raises(ValueError, match=r"activation='xielu' is for the plain MLP \(mlp='gelu'\), got mlp='swiglu'"):
        dataclasses.replace(base, mlp="swiglu")
    gpt2 = make_hf_family("gpt2").config.to_dict() | {"activation_function": "xielu"}
    with pytest.raises(ValueError, match="activation_function='xielu' is not an activation lenskit builds"):
        ModelConfig.from_hf_config(gpt2)
    apertus = make_hf_family("apertus").config.to_dict() | {"hidden_act": "silu"}
    with pytest.raises(ValueError, match=r"hidden_act='silu' is not supported for model_type='apertus'; lenskit implements \['xielu'\]"):
        ModelConfig.from_hf_config(apertus)


def test_the_presets_are_the_published_configs():
    """ApertusConfig's defaults (rotary, norms, vocabulary, context, token ids) with each published shape read as the
    preset."""
    import transformers

    eight = ModelConfig.from_hf_config(transformers.ApertusConfig(num_key_value_heads=8, intermediate_size=21504).to_dict(),
                                       name="apertus-8b")
    assert eight == ModelConfig.from_name("apertus-8b")
    seventy = transformers.ApertusConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                         num_key_value_heads=8, intermediate_size=43008)
    assert ModelConfig.from_hf_config(seventy.to_dict(), name="apertus-70b") == ModelConfig.from_name("apertus-70b")
