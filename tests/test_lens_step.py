"""The fast training step equals plain autograd through `forward_kl`: losses, gradients, and whole runs."""

from __future__ import annotations

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model
from references import autograd_kl

import lenses.training
import lenskit
from lenses import TunedLens
from lenses.metrics import forward_kl
from lenses.training import Recipe, collect_streams, train
from lenses.training.step import TranslatedStreams, kl_step, readout_kl_and_grad
from lenskit.io.data import load_token_stream
from lenskit.pieces.readout import Readout

CTX = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = lenskit.HookedTransformer.from_pretrained(write_tiny_model(root / "model"))
    data = write_text_folder(root / "data", n=120)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, load_token_stream([data], model.tokenizer)


def random_lens(model, resid_mid: bool, bias_only: bool = False) -> TunedLens:
    lens = TunedLens(model, resid_mid=resid_mid, bias_only=bias_only)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return lens


def grads(lens) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in lens.named_parameters()}
    lens.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("bias_only", [False, True])
@pytest.mark.parametrize("chunk_tokens", [None, 7])  # one chunk; several, the last one short
def test_step_matches_autograd_through_forward_kl(tiny, chunk_tokens, bias_only):
    model, stream = tiny
    lens = random_lens(model, resid_mid=True, bias_only=bias_only)
    tokens = stream.windows(CTX)[:3]  # [3, CTX]: 48 tokens
    streams, final = collect_streams(lens, tokens)
    reference = autograd_kl(lens, streams, final)  # [2 * n_layers]
    (reference.sum() * 0.25).backward()
    expected = grads(lens)
    kl = kl_step(TranslatedStreams(lens), model.readout, streams, final, scale=0.25, chunk_tokens=chunk_tokens)
    got = grads(lens)
    assert kl.shape == (2 * model.cfg.n_layers,) and kl.dtype == torch.float64
    torch.testing.assert_close(kl, reference.double(), rtol=1e-5, atol=1e-5)
    for k in expected:
        assert expected[k].abs().max() > 0, k  # every translator, mid ones too, gets a gradient
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-7, msg=k)


def test_target_tokens_of_zero_probability_add_nothing():
    torch.manual_seed(0)
    unembed = torch.nn.Linear(8, 20, bias=True)
    normed = torch.randn(2, 5, 8)
    final = torch.randn(5, 20)
    final[:, :7] = -1e4  # these tokens' target probability underflows to exactly 0 in float32
    assert (final.log_softmax(-1).exp()[:, :7] == 0).all()
    kl, grad = readout_kl_and_grad(normed, final, Readout(torch.nn.Identity(), unembed, None), chunk_tokens=2)
    expected = torch.stack([forward_kl(final, unembed(normed[s])).sum() for s in range(2)])
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(kl, expected.double(), rtol=1e-5, atol=1e-5)
    leaf = normed.clone().requires_grad_(True)
    torch.stack([forward_kl(final, unembed(leaf[s])).sum() for s in range(2)]).sum().backward()
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-4, atol=1e-6)


def test_rows_where_the_lens_gives_the_targets_top_token_almost_nothing():
    # lens rows whose q at the target's top-1 token is below 1e-30 (or 0): still exact
    torch.manual_seed(1)
    unembed = torch.nn.Linear(8, 20, bias=False)
    with torch.no_grad():
        unembed.weight[3] = -40.0  # token 3: logit -40 x sum(normed)
    normed = torch.rand(2, 6, 8) + 0.5  # positive, so token 3's lens logit is about -40 x 8 = -320
    final = torch.randn(6, 20)
    final[:, 3] = 30.0  # the target's top-1 token, every position
    q_top = torch.softmax(unembed(normed), -1)[..., 3]
    assert (q_top < 1e-30).all()
    kl, grad = readout_kl_and_grad(normed, final, Readout(torch.nn.Identity(), unembed, None), chunk_tokens=4)
    leaf = normed.clone().requires_grad_(True)
    expected = torch.stack([forward_kl(final, unembed(leaf[s])).sum() for s in range(2)])
    expected.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(kl, expected.detach().double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-4, atol=1e-5)


def reference_kl_step(translate, readout, streams, final, scale, chunk_tokens=None):
    """Plain autograd through the whole readout and `forward_kl`, stream by stream."""
    per_stream = autograd_kl(translate.lens, streams, final)
    (per_stream.sum() * scale).backward()
    return per_stream.detach().double()


@pytest.mark.parametrize("resid_mid", [False, True])
def test_training_produces_the_same_lens_as_plain_autograd(tiny, monkeypatch, resid_mid):
    model, stream = tiny
    recipe = Recipe(steps=15, ctx=CTX, tokens_per_step=8 * CTX, micro_batch_tokens=4 * CTX, lr=0.5, seed=2)
    fast = train(TunedLens(model, resid_mid=resid_mid), stream, recipe, progress=False)
    monkeypatch.setattr(lenses.training, "kl_step", reference_kl_step)
    slow = train(TunedLens(model, resid_mid=resid_mid), stream, recipe, progress=False)
    history_fast, history_slow = torch.tensor(fast.info["loss_history"]), torch.tensor(slow.info["loss_history"])
    assert history_slow[-1].mean() < 0.9 * history_slow[0].mean()  # it trained, so the match means something
    # Nats per token, each stream, each step, logged rounded to 6 decimals (the bar is 1e-4).
    torch.testing.assert_close(history_fast, history_slow, rtol=1e-3, atol=2e-6)
    for k, v in slow.state_dict().items():  # weights of size up to ~0.2 after 15 steps; seen apart by 3e-8
        torch.testing.assert_close(fast.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
