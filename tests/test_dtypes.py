"""bf16 and fp16: the forward, cache, lenses, interventions and tuned-lens training in half precision, with
every lens readout and metric computed in float32; and loading that keeps a same-dtype checkpoint mapped."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_family
from lens_fixtures import write_text_folder, write_tiny_model
from references import autograd_kl

import lenskit
from lenses import LogitLens, Trajectory, TunedLens, metrics
from lenses.training import Recipe, collect_streams, train
from lenses.training.step import TranslatedStreams, kl_step
from lenskit import HookedTransformer, Stream
from lenskit.intervene.interventions import Head, Mlp, ablation_hooks
from lenskit.io.data import load_token_stream

HALF = [torch.bfloat16, torch.float16]


def tokens_for(d_vocab: int, batch=2, pos=12, seed=0):
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_forward_is_as_close_to_fp32_as_transformers_half(family, dtype):
    """Both libraries in half precision against fp32 transformers: ours errs no more than theirs (plus rounding)."""
    hf = make_hf_family(family)
    tokens = tokens_for(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(tokens).logits
        theirs = hf.to(dtype)(tokens).logits.float()
        ours = HookedTransformer.from_hf(hf)
        assert ours.embed.weight.dtype == dtype
        out = ours(tokens)
    assert out.dtype == dtype
    err, their_err = (out.float() - ref).abs().max().item(), (theirs - ref).abs().max().item()
    assert err <= 2 * their_err + 2e-2, (err, their_err)


@pytest.mark.parametrize("dtype", HALF)
def test_half_cache_and_logit_lens_read_out_in_float32(model, dtype):
    half = HookedTransformer.from_hf(make_hf_family("llama").to(dtype))
    tokens = tokens_for(half.cfg.d_vocab)
    logits, cache = half.run_with_cache(tokens)
    assert all(v.dtype == dtype for v in cache.values())
    lens = LogitLens(half)
    final = lens.decode(cache, half.cfg.n_layers)
    assert final.dtype == torch.float32  # the readout's logits come out in float32 for the metrics
    # The model's own readout (on the whole batch; here on the cached stream): equal up to half-precision rounding.
    assert torch.allclose(final, logits.float(), rtol=1e-2, atol=1e-2 * logits.float().abs().max().item())
    early = lens.decode(cache, 1)
    kl = metrics.forward_kl(logits, early)
    assert kl.dtype == torch.float32 and torch.isfinite(kl).all() and (kl >= -1e-5).all()


@pytest.mark.parametrize("dtype", HALF)
def test_metrics_upcast_half_logits_to_float32(dtype):
    """The same numbers as computing on the float32 copy of the half-precision logits: no half-precision softmax."""
    g = torch.Generator().manual_seed(0)
    p, q = (torch.randn(5, 300, generator=g) * 4).to(dtype), (torch.randn(5, 300, generator=g) * 4).to(dtype)
    for fn in (metrics.kl_divergence, metrics.js_divergence, metrics.soft_cross_entropy):
        got, want = fn(p, q), fn(p.float(), q.float())
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(metrics.entropy(p), metrics.entropy(p.float()))
    # A half-precision log-softmax would be visibly worse: the fp32 path matches float64 to ~1e-6.
    exact = metrics.kl_divergence(p.double(), q.double())
    assert (metrics.kl_divergence(p, q).double() - exact).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", HALF)
def test_half_interventions_run_and_change_the_output(dtype):
    half = HookedTransformer.from_hf(make_hf_family("gpt2").to(dtype))
    tokens = tokens_for(half.cfg.d_vocab)
    clean = half(tokens)
    ablated = half.run_with_hooks(tokens, fwd_hooks=ablation_hooks(half, [Head(1, 2), Mlp(0)]))
    assert ablated.dtype == dtype and torch.isfinite(ablated.float()).all()
    assert not torch.equal(clean, ablated)
    mean = half.run_with_hooks(tokens, fwd_hooks=ablation_hooks(half, Mlp(1), "mean", reference=tokens_for(half.cfg.d_vocab, seed=1)))
    assert mean.dtype == dtype and not torch.equal(clean, mean)


def test_bf16_logit_lens_kl_within_1e2_nats_of_fp32(default_model_path):
    """The embedded model loaded in bf16: the logit-lens KL within 1e-2 nats of fp32's, over all layers and positions
    and for every layer past the embedding. The embedding stream's KL (about 20 nats: a tied unembedding reads
    each token back as itself) moves by ~0.02 nats from the weights' own bf16 rounding; it is held to 0.5%."""
    text = "import os\nimport sys\n\ndef main(argv):\n    path = os.path.join(argv[1], 'data')\n    return path\n"
    kls = {}
    for dtype in ("float32", "bfloat16"):
        model = HookedTransformer.from_pretrained(default_model_path, dtype=dtype)
        assert model.embed.weight.dtype == lenskit.io.loading.parse_dtype(dtype)
        traj = Trajectory.from_prompt(LogitLens(model), text)
        kls[dtype] = traj.kl_to_final[:, 0]  # [layer, pos]
    diff = kls["bfloat16"] - kls["float32"]
    per_layer = diff.mean(-1).abs()
    assert diff.mean().abs() < 1e-2 and per_layer[1:].max() < 1e-2, per_layer
    assert per_layer[0] < 5e-3 * kls["float32"][0].mean(), per_layer
    assert kls["float32"][0].mean() > 0.5  # the early layers are far from the final: the check is not vacuous


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = HookedTransformer.from_pretrained(write_tiny_model(root / "model"), dtype="bfloat16")
    return model, load_token_stream([write_text_folder(root / "data", n=120)], model.tokenizer)


def test_tuned_lens_on_bf16_model_has_fp32_translators_and_matches_autograd(tiny_bf16):
    """lens_step's hand-written KL and gradient on a bf16 model equal plain autograd through the lens."""
    model, stream = tiny_bf16
    lens = TunedLens(model)
    assert all(p.dtype == torch.float32 for p in lens.parameters())
    with torch.no_grad():
        for p in lens.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    tokens = stream.windows(16)[:4]
    streams, final = collect_streams(lens, tokens)
    kl = kl_step(TranslatedStreams(lens), model.readout, streams, final, scale=1.0)
    fast = [p.grad.clone() for p in lens.parameters()]
    lens.zero_grad()
    ref = autograd_kl(lens, streams, final)
    ref.sum().backward()
    assert torch.allclose(kl.float(), ref.detach(), rtol=2e-2, atol=1e-2)
    for a, p in zip(fast, lens.parameters()):
        assert a.dtype == torch.float32
        assert torch.allclose(a, p.grad, rtol=5e-2, atol=5e-2 * p.grad.abs().max().item())


def test_tuned_lens_trains_on_bf16_model(tiny_bf16):
    model, stream = tiny_bf16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lens = train(TunedLens(model), stream, Recipe(steps=20, ctx=16, tokens_per_step=8 * 16, lr=0.5), progress=False)
    history = lens.info["loss_history"]
    assert all(late < early for early, late in zip(history[0], history[-1]))
    assert all(p.dtype == torch.float32 for p in lens.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert lens(stream.windows(16)[:1].new_zeros(1, 3, model.cfg.d_model, dtype=torch.bfloat16), 0).dtype == torch.float32


def test_gpt2_same_dtype_checkpoint_stays_memory_mapped(tmp_path, monkeypatch):
    """GPT-2's Conv1D weights are stored [in, out]; they are used as transposed views of the mapped file, not copies."""
    import lenskit.io.loading

    folder = tmp_path / "m"
    hf = make_hf_family("gpt2").to(torch.bfloat16)
    hf.save_pretrained(folder)
    read = {}
    real = lenskit.io.loading.read_safetensors
    monkeypatch.setattr(lenskit.io.loading, "read_safetensors", lambda f: read.update(real(f)) or read)
    model = HookedTransformer.from_pretrained(folder, dtype=torch.bfloat16)
    stored = read["transformer.h.0.mlp.c_fc.weight"]
    assert model.blocks[0].mlp.fc_in.weight.data_ptr() == stored.data_ptr()
    assert model.blocks[1].attn.qkv.weight.data_ptr() == read["transformer.h.1.attn.c_attn.weight"].data_ptr()
    assert torch.equal(model.blocks[0].mlp.fc_in.weight, stored.T)
    tokens = tokens_for(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.allclose(model(tokens).float(), hf(tokens).logits.float(), atol=5e-2)


def test_check_finite_opt_out(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    make_hf_family("llama").save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(lenskit.CheckpointError, match="NaN or inf"):
        HookedTransformer.from_pretrained(folder)
    model = HookedTransformer.from_pretrained(folder, check_finite=False)
    assert model.blocks[1].mlp.fc_in.weight.isnan().any()


def test_stream_objects_decode_in_half(model):
    half = HookedTransformer.from_hf(make_hf_family("gpt2").to(torch.bfloat16))
    _, cache = half.run_with_cache(tokens_for(half.cfg.d_vocab))
    out = LogitLens(half).decode(cache, Stream(1, "mlp_out"))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
