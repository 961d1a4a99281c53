"""JacobianLens: the fit against torch.autograd.functional.jacobian on every family, J = I as the logit lens,
streams it covers, the intervention hooks against hand computations, and bad input.

Files, the reference format, TransformerLens, the hub, resuming and torchrun: test_jacobian_files.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_gpt2
from families import FAMILY_BUILDERS, build_family_model

import lenskit
from lenses import JacobianLens, LogitLens
from lenskit import Stream


def reference_jacobian(model, prompts, s, skip, exclude_last):
    """The estimator from its definition, independently of the fit's batched cotangents: the full Jacobian
    [pos, d_model, pos, d_model] of the last block's output with respect to stream s (replaced through a hook) by
    torch.autograd.functional.jacobian on the whole prompt, summed over target positions t' in V, averaged over
    source positions t in V, then over prompts."""
    n = model.cfg.n_layers
    name = Stream(s).hook_name(n)
    total = 0
    for p in prompts:
        p = p[None]
        _, cache = model.run_with_cache(p, names_filter=[name])

        def final(h, p=p):
            with model.hooks([(name, lambda x, hook: h[None])]):
                return model(p, stop_at_layer=n)[0]  # [pos, d_model]

        jac = torch.autograd.functional.jacobian(final, cache[name][0], vectorize=True)  # [pos, d, pos, d]
        end = p.shape[1] - 1 if exclude_last else p.shape[1]
        total = total + jac[skip:end, :, skip:end, :].sum(0).mean(1)  # [d_out, d_in]
    return total / len(prompts)


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
def test_fit_is_the_averaged_jacobian_on_every_family(family):
    model = build_family_model(family).model.to(torch.float64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.d_vocab, (n,), generator=g) for n in (9, 7)]  # unequal: each counts once
    settings = [(True, None)] + ([(False, [0, 2])] if family == "gpt2" else [])
    for exclude_last, streams in settings:
        # dim_batch 5 does not divide d_model 32: the last pass is a partial one.
        lens = JacobianLens.fit(model, prompts, skip_first_positions=2, exclude_last=exclude_last, streams=streams,
                                dim_batch=5, progress=False)
        assert lens.streams == (streams or list(range(model.cfg.n_layers)))
        assert lens.matrix(0).dtype == torch.float64 and lens.info["estimator"]["n_prompts"] == 2
        for s in lens.streams:
            expected = reference_jacobian(model, prompts, s, 2, exclude_last)
            # Gemma's norms compute in float32 even in a float64 model (as transformers' do): 1e-7 there, 1e-15 elsewhere.
            assert relative_error(lens.matrix(s), expected) < 1e-6, (family, s, exclude_last)


def test_the_identity_is_the_logit_lens_exactly(model, tokens):
    n, d = model.cfg.n_layers, model.cfg.d_model
    lens, logit = JacobianLens(model, {s: torch.eye(d) for s in range(n)}), LogitLens(model)
    _, cache = model.run_with_cache(tokens)
    for s in range(n + 1):
        h = cache.stream(s)
        assert torch.equal(lens(h, s), logit(h, s)), s
    assert torch.equal(lens.matrix(n), torch.eye(d)) and lens.reads_as_model(Stream(n))
    assert not lens.reads_as_model(Stream(1))


def test_transform_is_h_times_J_transposed_and_keeps_the_streams_dtype(model, tokens):
    d = model.cfg.d_model
    g = torch.Generator().manual_seed(2)
    J = torch.randn(d, d, generator=g) / d ** 0.5
    lens = JacobianLens(model, {1: J})
    _, cache = model.run_with_cache(tokens)
    h = cache.stream(1)
    torch.testing.assert_close(lens.transform_hidden(h, Stream(1)), torch.einsum("ij,bpj->bpi", J, h))
    # A float32 lens on a bf16 model: J applied in float32, the result cast back, read out by the bf16 model.
    bf16 = lenskit.HookedTransformer.from_hf(make_hf_gpt2()).to(torch.bfloat16)
    on_bf16 = JacobianLens(bf16, {1: J})
    assert on_bf16.matrix(1).dtype == torch.float32
    hb = h.to(torch.bfloat16)
    assert torch.equal(on_bf16(hb, 1), bf16.readout.logits((hb.float() @ J.T).to(torch.bfloat16)))


def test_covers_fitted_streams_and_the_last_and_names_them_elsewhere(model, tokens):
    n, d = model.cfg.n_layers, model.cfg.d_model
    lens = JacobianLens(model, {1: torch.eye(d)})
    assert lens.streams == [1]
    assert lens.covers(Stream(1)) and lens.covers(Stream(n)) and lens.covers(Stream(0, "resid_post"))  # = stream 1
    assert not lens.covers(Stream(0)) and not lens.covers(Stream(2)) and not lens.covers(Stream(1, "resid_mid"))
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(ValueError, match=r"^this Jacobian lens has no matrix for resid_pre\.0: it covers streams \[1\]") as err:
        lens(cache.stream(0), 0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no matrix for resid_mid.1"):
        lens.matrix(Stream(1, "resid_mid"))
    with pytest.raises(ValueError, match="keyed by stream 0..2 \\(stream 3 is the identity\\)"):
        JacobianLens(model, {n: torch.eye(d)})
    with pytest.raises(ValueError, match=r"must be a floating \[32, 32\] tensor.*\(32, 31\)"):
        JacobianLens(model, {0: torch.eye(d)[:, :-1]})


def test_fit_leaves_the_model_as_it_was_also_when_it_raises(tokens):
    model = lenskit.HookedTransformer.from_hf(make_hf_gpt2())
    model.train()
    model.ln_final.weight.requires_grad_(False)  # a parameter the caller froze stays frozen
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with torch.no_grad():  # the fit needs gradients and takes them, whatever the caller's mode
        lens = JacobianLens.fit(model, tokens, skip_first_positions=2, progress=False)
    assert lens.info["estimator"] == {"skip_first_positions": 2, "exclude_last": True, "n_prompts": 3,
                                      "n_tokens": 3 * 17, "n_skipped": 0}
    assert model.training and {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())

    calls = []

    def fail_on_second(x, hook):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    remove = model.hook_dict["hook_embed"].add_hook(fail_on_second)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            JacobianLens.fit(model, tokens, skip_first_positions=2, progress=False)
    finally:
        remove()
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    assert model.training and {name: p.requires_grad for name, p in model.named_parameters()} == flags


def test_short_prompts_are_skipped_and_none_long_enough_says_what_is_needed(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=g) for n in (17, 20, 5)]
    with pytest.warns(UserWarning, match=r"skipping 2 of 3 prompts shorter than 18 tokens.*prompts \[0, 2\]"):
        lens = JacobianLens.fit(model, prompts, progress=False)  # skip_first_positions=16: 18 tokens needed
    only = JacobianLens.fit(model, prompts[1:2], progress=False)
    assert torch.equal(lens.matrix(1), only.matrix(1)) and lens.info["estimator"]["n_skipped"] == 2
    with pytest.raises(ValueError, match=r"^no prompt is long enough.*at least 18 tokens \(skip_first_positions \+ 2\), "
                                         r"and the longest of the 2 given has 17") as err:
        JacobianLens.fit(model, torch.zeros(2, 17, dtype=torch.long), progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"at least 17 tokens \(skip_first_positions \+ 1\)"):
        JacobianLens.fit(model, torch.zeros(2, 16, dtype=torch.long), exclude_last=False, progress=False)
    with pytest.raises(ValueError, match="stream 3 \\(after the last block\\) is the identity and is never fitted"):
        JacobianLens.fit(model, torch.zeros(1, 20, dtype=torch.long), streams=[3], progress=False)
    with pytest.raises(ValueError, match="tokens must be \\[n, pos\\] ids"):
        JacobianLens.fit(model, torch.zeros(20, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        JacobianLens.fit(model, torch.full((1, 20), 101), progress=False)


# ------------------------------------------------------------------ lens vectors and interventions
@pytest.fixture
def random_lens(model):
    g = torch.Generator().manual_seed(4)
    d = model.cfg.d_model
    return JacobianLens(model, {s: torch.eye(d) + torch.randn(d, d, generator=g) / d ** 0.5 for s in range(model.cfg.n_layers)})


def edited_stream(model, tokens, hooks, s):
    """The stream at s as the rest of the model sees it (the cache sees the hooks' edits), and the logits."""
    name = Stream(s).hook_name(model.cfg.n_layers)
    logits, cache = model.run_with_cache(tokens, names_filter=[name], fwd_hooks=hooks)
    return cache[name], logits


def replaced_logits(model, tokens, s, h):
    return model.run_with_hooks(tokens, fwd_hooks=[(Stream(s).hook_name(model.cfg.n_layers), lambda x, hook: h)])


def test_lens_vectors_are_rows_of_the_unembedding_times_J(model, random_lens):
    J, W_U = random_lens.matrix(2), model.unembed.weight.detach()
    vectors = random_lens.lens_vectors(2, [5, 7])
    expected = torch.stack([sum(W_U[t, i] * J[i] for i in range(model.cfg.d_model)) for t in (5, 7)])  # sum_i W_U[t,i] J[i,:]
    torch.testing.assert_close(vectors, expected)
    assert torch.equal(random_lens.lens_vectors(model.cfg.n_layers, 5)[0], W_U[5])  # J = I at the last stream
    with pytest.raises(ValueError, match=r"token 101 is not an id in the vocabulary \[0, 101\)"):
        random_lens.lens_vectors(2, 101)


def test_lens_vectors_take_one_token_strings():
    from tiny_tokenizer import make_model_with_tokenizer

    model = make_model_with_tokenizer()
    lens = JacobianLens(model, {1: torch.eye(model.cfg.d_model) * 2})
    token = model.to_str_tokens(model.to_tokens("return a"))[0]
    assert torch.equal(lens.lens_vectors(1, token), lens.lens_vectors(1, model.to_single_token(token)))
    with pytest.raises(ValueError, match="exactly one token"):
        lens.lens_vectors(1, "return a + b")


def test_steering_adds_alpha_times_the_unit_lens_vector(model, tokens, random_lens):
    s, token, alpha = 1, 5, 3.0
    clean, _ = edited_stream(model, tokens, [], s)  # cached alone, as with the hooks (a full cache runs eager attention)
    v = model.unembed.weight[token].detach() @ random_lens.matrix(s)
    expected = clean + alpha * v / torch.sqrt((v * v).sum())
    edited, logits = edited_stream(model, tokens, random_lens.steering_hooks(s, token, alpha), s)
    torch.testing.assert_close(edited, expected)
    torch.testing.assert_close(logits, replaced_logits(model, tokens, s, expected))
    # Only the positions asked for; negative ones count from the end. `with model.hooks` composes the same way.
    hooks = random_lens.steering_hooks(s, token, alpha, positions=[2, -1])
    edited, _ = edited_stream(model, tokens, hooks, s)
    at = [2, tokens.shape[1] - 1]
    torch.testing.assert_close(edited[:, at], expected[:, at])
    rest = [p for p in range(tokens.shape[1]) if p not in at]
    assert torch.equal(edited[:, rest], clean[:, rest])
    with model.hooks(hooks):
        inside = model(tokens)
    assert torch.equal(inside, model.run_with_hooks(tokens, fwd_hooks=hooks)) and not torch.equal(inside, model(tokens))


def test_ablation_projects_the_span_out(model, tokens, random_lens):
    s, ids = 2, [5, 7, 9]
    clean = edited_stream(model, tokens, [], s)[0].double()
    V = (model.unembed.weight[ids].detach() @ random_lens.matrix(s)).double()  # [3, d_model]
    projection = V.T @ torch.linalg.solve(V @ V.T, V)  # onto span(V), from the normal equations
    expected = clean - clean @ projection
    edited, logits = edited_stream(model, tokens, random_lens.ablation_hooks(s, ids), s)
    torch.testing.assert_close(edited.double(), expected, atol=1e-5, rtol=1e-5)
    assert (edited.double() @ V.T).abs().max() < 1e-4 * clean.abs().max() * V.abs().max()
    torch.testing.assert_close(logits, replaced_logits(model, tokens, s, edited))


def test_swap_exchanges_the_two_coordinates(model, tokens, random_lens):
    s, source, target = 1, 5, 7
    clean = edited_stream(model, tokens, [], s)[0].double()
    V = (model.unembed.weight[[source, target]].detach() @ random_lens.matrix(s)).double()  # [2, d_model]

    def coords(h):  # least-squares coordinates of h in span(V): (V V^T)^-1 V h
        return torch.linalg.solve(V @ V.T, (h @ V.T).unsqueeze(-1)).squeeze(-1)

    c = coords(clean)
    expected = clean + (c.flip(-1) - c) @ V
    edited, logits = edited_stream(model, tokens, random_lens.swap_hooks(s, source, target), s)
    torch.testing.assert_close(edited.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(coords(edited.double()), c.flip(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, replaced_logits(model, tokens, s, edited))
    doubled, _ = edited_stream(model, tokens, random_lens.swap_hooks(s, source, target, alpha=2.0), s)
    torch.testing.assert_close(doubled.double(), clean + 2 * (c.flip(-1) - c) @ V, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="source and target are the same token"):
        random_lens.swap_hooks(s, 5, 5)
    with pytest.raises(ValueError, match="no matrix for resid_pre.2"):
        JacobianLens(model, {1: torch.eye(model.cfg.d_model)}).swap_hooks(2, 5, 7)


def test_compensated_float32_sums_hold_the_float64_sum():
    """Kahan's sum in float32 (the fit's accumulator on devices without fast float64) against float64 and against
    a plain float32 sum: 10,000 additions of 0.1 + noise to 1e4."""
    from lenses.jacobian_fit import Sum

    g = torch.Generator().manual_seed(0)
    parts = 0.1 + 1e-3 * torch.randn(10_000, 4, 4, generator=g, dtype=torch.float64)
    exact = 1e4 + parts.sum(0)
    kahan, plain = Sum((4, 4), torch.float32, "cpu"), torch.full((4, 4), 1e4, dtype=torch.float32)
    kahan.add(torch.full((4, 4), 1e4))
    for x in parts:
        kahan.add(x.float())
        plain += x.float()
    kahan_error = ((kahan.value() - exact).abs().max() / exact.abs().max()).item()
    plain_error = ((plain.double() - exact).abs().max() / exact.abs().max()).item()
    assert kahan_error < 2e-8 < plain_error / 10, (kahan_error, plain_error)  # one float32 rounding, not thousands


def test_a_float32_fit_with_compensated_sums_matches_the_float64_fit(model, monkeypatch):
    """The fit summed on the device in float32 with Kahan's compensation (as on a consumer GPU) against the float64
    CPU fit of the same prompts."""
    from lenses import jacobian_fit

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.cfg.d_vocab, (6, 10), generator=g)
    want = JacobianLens.fit(model, prompts, skip_first_positions=2, progress=False)
    monkeypatch.setattr(jacobian_fit, "accumulator_dtype", lambda model: torch.float32)
    got = JacobianLens.fit(model, prompts, skip_first_positions=2, progress=False)
    for s in want.streams:
        assert relative_error(got.matrix(s), want.matrix(s)) < 1e-6, s
