"""Per-layer evaluation against an independent full-vocabulary computation from transformers' hidden states."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lenses import Lens, LogitLens, TunedLens
from lenses.evaluation import evaluate, evaluate_windows, per_layer
from lenskit.io.data import TokenStream


@pytest.fixture
def windows():
    return torch.randint(0, 101, (5, 12), generator=torch.Generator().manual_seed(7))


def tuned_lens(model, seed=0):
    lens = TunedLens(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lens


def reference(hf_model, lens, windows):
    """Per (layer, window): KL(final||lens), CE, entropy, top-1 agreement and prediction depth, written out
    longhand with torch.nn.functional on transformers' hidden states."""
    out = hf_model(windows, output_hidden_states=True)
    final = out.logits.log_softmax(-1)
    n = hf_model.config.n_layer
    hidden = list(out.hidden_states[:n])
    per_layer_logp, rows = [], {}
    for l in range(n + 1):
        if l == n:
            logp = final
        else:
            t = lens.translators[l]
            h = hidden[l] + hidden[l] @ t.weight.T + t.bias
            logp = hf_model.lm_head(hf_model.transformer.ln_f(h)).log_softmax(-1)
        per_layer_logp.append(logp)
        kl = F.kl_div(logp, final, log_target=True, reduction="none").sum(-1)  # KL(final || lens)
        ce = F.cross_entropy(logp[:, :-1].transpose(1, 2), windows[:, 1:], reduction="none")
        ent = torch.distributions.Categorical(logits=logp).entropy()
        agree = (logp.argmax(-1) == final.argmax(-1)).float()
        rows[l] = dict(kl=kl.mean(1), ce=ce.mean(1), entropy=ent.mean(1), top1_agree=agree.mean(1))
    # prediction depth per token, by brute force
    tops = torch.stack([lp.argmax(-1) for lp in per_layer_logp])  # [layer, batch, pos]
    depth = torch.full(tops.shape[1:], n)
    for l in range(n, -1, -1):
        ok = (tops[l:] == tops[n]).all(0)
        depth = torch.where(ok, torch.full_like(depth, l), depth)
    return rows, depth


def test_every_metric_matches_a_longhand_reference(model, hf_model, windows):
    tuned = tuned_lens(model)
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "tuned": tuned}, windows, batch=2, progress=False)
    n = model.cfg.n_layers
    assert len(tidy) == 2 * (n + 1) * len(windows)
    logit_as_tuned = TunedLens(model)  # zero translators: the reference's logit lens
    for name, lens in (("tuned", tuned), ("logit", logit_as_tuned)):
        ref, depth = reference(hf_model, lens, windows)
        got = tidy[tidy.lens == name]
        for l in range(n + 1):
            rows = got[got.layer == l].sort_values("window")
            for metric, values in ref[l].items():
                torch.testing.assert_close(torch.tensor(rows[metric].values, dtype=torch.float32), values.float(),
                                           atol=2e-5, rtol=1e-4, msg=f"{name} {metric} layer {l}")
            settled = (depth <= l).float().mean(1)
            torch.testing.assert_close(torch.tensor(rows["settled"].values, dtype=torch.float32), settled)
        table = per_layer(tidy)
        assert table.attrs["prediction_depth"][name] == pytest.approx(depth.float().mean().item(), abs=1e-6)


def test_table_columns_final_row_and_bits_per_byte(model, hf_model, windows):
    stream = TokenStream(windows.flatten(), n_bytes=150, provenance={})
    table = evaluate(model, [LogitLens(model), tuned_lens(model)], stream, ctx=12, progress=False)
    for col in ("layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned", "entropy_logit", "entropy_tuned",
                "kl_logit_bpb", "ce_tuned_bpb", "settled_tuned", "top1_agree_logit"):
        assert col in table.columns
    assert table["layer"].tolist() == list(range(model.cfg.n_layers + 1))
    last = table.iloc[-1]
    assert last["kl_logit"] == pytest.approx(0, abs=1e-6) and last["kl_tuned"] == pytest.approx(0, abs=1e-6)
    logits = hf_model(windows).logits
    model_ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()
    assert last["ce_logit"] == pytest.approx(model_ce, rel=1e-5) and last["settled_tuned"] == 1.0
    # bits per byte: nats/token x tokens / (bytes x ln 2), with this stream's 60 tokens over 150 bytes
    assert table["ce_tuned_bpb"].tolist() == pytest.approx((table["ce_tuned"] * 60 / (150 * math.log(2))).tolist())
    assert table.attrs["n_tokens"] == 60 and table.attrs["n_windows"] == 5


def test_refuses_a_lens_built_for_another_model(model, windows):
    from conftest import make_hf_gpt2

    import lenskit

    other = lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=2))
    with pytest.raises(ValueError, match="another model object"):
        evaluate_windows(model, [LogitLens(other)], windows, progress=False)


class _Masked(Lens):
    """A lens that computes logits its own way: the logit lens with the first ten tokens impossible (logit
    -inf), so its entropy has 0 * log 0 terms."""

    def forward(self, h: torch.Tensor, l: int) -> torch.Tensor:
        logits = LogitLens(self.model)(h, l).clone()
        logits[..., :10] = -math.inf
        return logits


def test_zero_mass_tokens_give_finite_entropy_and_infinite_kl(model, windows):
    lens = _Masked(model)
    tidy = evaluate_windows(model, {"masked": lens}, windows, progress=False)
    with torch.no_grad():
        final, cache = model.run_with_cache(windows)
        logits = lens(cache["blocks.1.hook_resid_pre"], 1)
    from lenses import metrics

    row = tidy[(tidy.layer == 1)].sort_values("window")
    assert row["entropy"].tolist() == pytest.approx(metrics.entropy(logits).mean(-1).tolist(), rel=1e-5)
    assert all(math.isinf(v) and v > 0 for v in row["kl"])  # the model gives those tokens mass; the lens none


def metrics_reference(model, lens, windows):
    """Per (layer, window) kl, ce, entropy, top1_agree from `lenses.metrics` on the lens's full logits."""
    from lenses import metrics
    from lenskit.observe.stream import streams

    locations = streams(model.cfg.n_layers)
    with torch.no_grad():  # caching only the streams, as evaluation does: in bfloat16 a cached attention rounds otherwise
        final, cache = model.run_with_cache(windows, names_filter=[s.hook_name(model.cfg.n_layers) for s in locations])
        out = {}
        for l, s in enumerate(locations):
            logits = lens(cache.stream(s), s)
            out[l] = dict(kl=metrics.forward_kl(final, logits).mean(-1),
                          ce=metrics.cross_entropy(logits[:, :-1], windows[:, 1:]).mean(-1),
                          entropy=metrics.entropy(logits).mean(-1),
                          top1_agree=(logits.argmax(-1) == final.argmax(-1)).float().mean(-1))
    return out


def gpt2_with_unembed_bias():
    from conftest import make_hf_gpt2

    import lenskit

    model = lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=3))
    model.unembed.bias = torch.nn.Parameter(torch.randn(model.cfg.d_vocab, generator=torch.Generator().manual_seed(4)))
    return model


def gpt2_with_tied_top():
    """Tokens 3 and 5 share a row of the unembedding and a large bias: every lens's maximum is a tie."""
    model = gpt2_with_unembed_bias()
    with torch.no_grad():
        model.unembed.weight[5] = model.unembed.weight[3]
        model.unembed.bias[[3, 5]] = 10.0
    return model


def family(name):
    from families import family_model_of

    return family_model_of(name).model


def bf16_gpt2():
    from conftest import make_hf_gpt2

    import lenskit

    return lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=5).to(torch.bfloat16))


@pytest.mark.parametrize("build", [
    lambda: family("gpt2"),    # no unembedding bias
    gpt2_with_unembed_bias,
    gpt2_with_tied_top,        # top-1 ties: the first maximum, as argmax
    lambda: family("llama"),   # RMSNorm, untied
    bf16_gpt2,                 # bfloat16 logits, the statistics in float32
    lambda: family("gemma2"),  # a final soft-cap
], ids=["gpt2", "unembed-bias", "tied-top", "llama", "bf16", "gemma2-softcap"])
def test_every_readout_case_matches_metrics(build, windows, monkeypatch):
    from lenses import evaluation

    model = build()
    # chunks of 7 rows: many chunks, the last one partial, rows of one window split across chunks
    monkeypatch.setattr(evaluation, "chunk_rows", lambda readout, buffers: 7)
    windows = windows % model.cfg.d_vocab
    lenses = {"logit": LogitLens(model), "tuned": tuned_lens(model)}
    # one batch: a bfloat16 forward pass rounds differently with the batch's shape, and the reference runs all windows
    tidy = evaluate_windows(model, lenses, windows, batch=len(windows), progress=False)
    for name, lens in lenses.items():
        ref = metrics_reference(model, lens, windows)
        got = tidy[tidy.lens == name]
        for l, values in ref.items():
            rows = got[got.layer == l].sort_values("window")
            for metric, want in values.items():
                torch.testing.assert_close(torch.tensor(rows[metric].values, dtype=torch.float64), want.double(),
                                           rtol=1e-5, atol=2e-6,
                                           msg=f"{name} {metric} layer {l}")


class _OwnLogits(Lens):
    """A lens of the other kind (its own forward, like a patchscope) that happens to compute the logit lens."""

    def forward(self, h, s):
        return LogitLens(self.model)(h, s)


def test_a_lens_with_its_own_forward_takes_the_same_path(model, windows):
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "own": _OwnLogits(model)}, windows, progress=False)
    a, b = tidy[tidy.lens == "logit"].reset_index(drop=True), tidy[tidy.lens == "own"].reset_index(drop=True)
    for metric in ("kl", "ce", "entropy", "top1_agree", "settled"):
        assert a[metric].tolist() == b[metric].tolist(), metric  # bit-identical: one path, the same logits


@pytest.mark.parametrize("cols", [4096, 50257, 300, 255, 1000, 100])
def test_first_max_is_argmax(cols):
    from lenses.metrics import first_max

    f = torch.randn(64, cols, generator=torch.Generator().manual_seed(cols))
    f[3, 7] = f[3, cols - 9] = 1e3  # a tie between two blocks: the first wins
    f[5, -1] = 1e3                  # the maximum in a short last block
    f[6] = 0.0                      # every column ties
    f[8, 50] = float("nan")         # NaN counts as the maximum, as in argmax
    f[9, 10:20] = 2e3               # a tie inside one block
    assert torch.equal(first_max(f), f.argmax(-1))


def test_a_model_evaluated_can_still_be_trained_through(windows):
    # evaluation must not leave inference-mode tensors in the model's caches (a rotary family's cos/sin tables)
    model = family("llama")
    windows = windows % model.cfg.d_vocab
    evaluate_windows(model, [LogitLens(model)], windows, batch=len(windows), progress=False)
    model.zero_grad(set_to_none=True)
    model(windows).float().logsumexp(-1).mean().backward()
    assert model.embed.weight.grad is not None and torch.isfinite(model.embed.weight.grad).all()


@pytest.mark.slow
def test_memory_stays_bounded_on_a_128k_vocabulary_and_16_layers():
    """The bound in lenses/evaluation.py's BUFFERS comment, measured in a fresh process: a 16-layer model
    with a 128,256-token vocabulary, two lenses, 2 x 256 tokens. One buffer a chunk of all 512 tokens would make
    4 buffers x 512 x 128,256 x 4 bytes = 1 GB (all the logits, 17 layers of them, 8.9 GB per lens); the CPU's
    chunks of 32 rows (lenses/chunks.py) need 4 x 32 x 128,256 x 4 bytes = 63 MiB."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import resource, sys, torch
        import lenskit
        from lenses import LogitLens, TunedLens
        from lenses.evaluation import evaluate_windows
        cfg = lenskit.ModelConfig(n_layers=16, d_model=16, n_heads=2, d_vocab=128256, n_ctx=256, tie_word_embeddings=True)
        model = lenskit.HookedTransformer(cfg)
        windows = torch.randint(0, cfg.d_vocab, (2, 256), generator=torch.Generator().manual_seed(0))
        lenses = {"logit": LogitLens(model), "tuned": TunedLens(model)}
        evaluate_windows(model, lenses, windows[:1, :8], batch=1, progress=False)  # warm up allocator and kernels
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tidy = evaluate_windows(model, lenses, windows, batch=2, progress=False)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert len(tidy) == 2 * 17 * 2 and tidy["kl"].notna().all()
        print((after - before) / 1024)  # MiB the peak rose by
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    risen = float(out.stdout.strip().splitlines()[-1])
    assert risen < 300, f"evaluation's peak memory rose by {risen:.0f} MiB; the chunks should bound it near 125 MiB"
