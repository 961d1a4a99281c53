"""Splicing SAEs and transcoders into every family: with the error term the run is unchanged; without it the
hook's value is the reconstruction, equal to a hand splice through run_with_hooks; the SAE's own points are
cached and hookable inside the block only, and nothing is left behind after an exception."""

from __future__ import annotations

import pytest
import torch
from families import FAMILY_BUILDERS, family_model_of
from sae_files import rand

from lenskit.kv_cache import KVCache
from lenskit.saes import SAE, SAEConfig
from lenskit.saes.sae import SAE_POINTS

POINTS = [f"blocks.1.hook_resid_pre.{p}" for p in SAE_POINTS]


def relu_sae(d: int, hook: str = "blocks.1.hook_resid_pre", d_sae: int = 24, hook_out: str | None = None) -> SAE:
    w = {"W_enc": rand(d, d_sae, seed=1), "b_enc": rand(d_sae, seed=2) - 0.1, "W_dec": rand(d_sae, d, seed=3),
         "b_dec": rand(d, seed=4)}
    cfg = SAEConfig(d_in=d, d_sae=d_sae, architecture="relu", hook_name=hook, hook_name_out=hook_out,
                    apply_b_dec_to_input=hook_out is None)
    return SAE(cfg, w)


def hand(sae: SAE, x: torch.Tensor) -> torch.Tensor:
    w = dict(sae.named_parameters())
    x_in = x - w["b_dec"] if sae.cfg.apply_b_dec_to_input else x
    return torch.relu(x_in @ w["W_enc"] + w["b_enc"]) @ w["W_dec"] + w["b_dec"]


def toks(n: int = 7) -> torch.Tensor:
    return torch.arange(3, 3 + 2 * n).reshape(2, n) % 50 + 1


@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
@torch.no_grad()
def test_splice_every_family(family):
    model = family_model_of(family).model
    sae, t = relu_sae(model.cfg.d_model), toks()
    plain = model(t)
    with model.saes([sae]):
        logits, cache = model.run_with_cache(t)
        assert all(n in model.hook_dict for n in POINTS)
    torch.testing.assert_close(logits, plain, atol=1e-4 * max(1.0, plain.abs().max().item()), rtol=1e-4)
    x = cache["blocks.1.hook_resid_pre.hook_sae_input"]
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre.hook_sae_recons"], hand(sae, x))
    torch.testing.assert_close(cache[POINTS[1]], (x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    assert not any(n in model.hook_dict for n in POINTS)
    replaced = model.run_with_saes(t, saes=[sae], use_error_term=False)
    by_hand = model.run_with_hooks(t, fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: hand(sae, x))])
    torch.testing.assert_close(replaced, by_hand)
    assert (replaced - plain).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe", "qwen3_5_text"])
@torch.no_grad()
def test_splice_with_the_kv_cache(family):
    model = family_model_of(family).model
    sae, t = relu_sae(model.cfg.d_model), toks(6)
    with model.saes([sae], use_error_term=False):
        full = model(t)
        cache = KVCache(model.cfg, t.shape[0])
        steps = [model(t[:, :3], past_kv_cache=cache)] + [model(t[:, i : i + 1], past_kv_cache=cache) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_editing_feature_acts_moves_the_run_even_with_the_error_term():
    model = family_model_of("gpt2").model
    sae, t = relu_sae(model.cfg.d_model), toks()
    _, cache = model.run_with_cache(t, ["blocks.1.hook_resid_pre"])
    x = cache["blocks.1.hook_resid_pre"]
    f = torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    i = int(f.sum((0, 1)).argmax())

    def zero(acts, hook):
        acts = acts.clone()
        acts[..., i] = 0
        return acts

    with model.saes([sae]):
        got = model.run_with_hooks(t, fwd_hooks=[("blocks.1.hook_resid_pre.hook_sae_acts_post", zero)])
    want = model.run_with_hooks(t, fwd_hooks=[("blocks.1.hook_resid_pre",
                                               lambda x, hook: x - f[..., i : i + 1] * sae.W_dec[i])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_transcoder_splices_input_to_output():
    model = family_model_of("llama").model
    d = model.cfg.d_model
    tc = relu_sae(d, hook="blocks.0.ln2.hook_normalized", hook_out="blocks.0.hook_mlp_out")
    t = toks()
    plain = model(t)
    with model.saes([tc]):
        torch.testing.assert_close(model(t), plain, atol=1e-5, rtol=1e-5)
    seen = {}
    hooks = [("blocks.0.ln2.hook_normalized", lambda x, hook: seen.__setitem__("x", x)),
             ("blocks.0.hook_mlp_out", lambda y, hook: hand(tc, seen["x"]))]
    torch.testing.assert_close(model.run_with_saes(t, saes=[tc], use_error_term=False), model.run_with_hooks(t, fwd_hooks=hooks))


def test_hooks_removed_after_an_exception():
    model = family_model_of("gpt2").model
    sae = relu_sae(model.cfg.d_model)
    with pytest.raises(RuntimeError, match="inside"), model.saes([sae]):
        raise RuntimeError("inside")
    assert not any(n in model.hook_dict for n in POINTS)
    assert not any(hp.hook_fns() for hp in model.hook_dict.values())


def test_foreign_saes_refused_by_name():
    model = family_model_of("gpt2").model
    with pytest.raises(ValueError, match="d_model is 32"):
        model.saes([relu_sae(48)]).__enter__()
    with pytest.raises(KeyError, match="blocks.9.hook_resid_pre"):
        model.saes([relu_sae(32, hook="blocks.9.hook_resid_pre")]).__enter__()
    with pytest.raises(ValueError, match="two SAEs"):
        model.saes([relu_sae(32), relu_sae(32)]).__enter__()
    assert not any(n in model.hook_dict for n in POINTS)


def test_gradients_cross_the_splice_through_the_features_only():
    model = family_model_of("gpt2").model
    sae, t = relu_sae(model.cfg.d_model), toks()
    grads = {}

    def keep(g, hook):
        grads[hook.name] = g

    # mlp_out of block 0 is added to the stream just below the SAE: its gradient is the splice input's
    with model.saes([sae]), model.hooks(bwd_hooks=[("blocks.0.hook_mlp_out", keep)]):
        model(t)[:, -1, 5].sum().backward()
    g_in = grads["blocks.0.hook_mlp_out"]
    _, cache = model.run_with_cache(t, ["blocks.1.hook_resid_pre"])
    x = cache["blocks.1.hook_resid_pre"].detach().requires_grad_(True)
    f = torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    err = (x - (f @ sae.W_dec + sae.b_dec)).detach()
    out = model.run_with_hooks(t, fwd_hooks=[("blocks.1.hook_resid_pre", lambda h, hook: f @ sae.W_dec + sae.b_dec + err)])
    (want,) = torch.autograd.grad(out[:, -1, 5].sum(), x)
    torch.testing.assert_close(g_in, want, atol=1e-5, rtol=1e-4)
    model.zero_grad(set_to_none=True)
