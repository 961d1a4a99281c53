"""Ablations, checked against plain torch hooks on transformers' GPT-2 (the independent reference)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from families import every_family

from lenskit.intervene.interventions import (
    Attn,
    Block,
    Head,
    Mlp,
    Neurons,
    ablation_hooks,
    mean_activations,
    merge_sites,
    resample_indices,
    target_sites,
)
from lenskit.observe.resid import late_writes

ATOL = 1e-5


@contextmanager
def torch_hooks(registrations):
    """Register plain torch hooks [(module, kind, fn)] and always remove them."""
    handles = []
    try:
        for module, kind, fn in registrations:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(fn))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def hf_logits(hf_model, tokens, registrations=()):
    with torch_hooks(registrations):
        return hf_model(tokens).logits


def c_proj_input_edit(edit):
    """A pre-hook on a c_proj (attention or MLP) that rewrites its input [batch, pos, features]."""
    def pre(module, args):
        x = args[0].clone()
        edit(x)
        return (x, *args[1:])
    return pre


def replace_output(value_fn):
    """A forward hook on an hf attn (returns a tuple) or mlp (returns a tensor) that replaces its output."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (value_fn(output[0]), *output[1:])
        return value_fn(output)
    return hook


@torch.no_grad()
def hf_capture(hf_model, tokens, module, kind):
    """What `module` receives (kind='pre') or returns (kind='out') on `tokens`."""
    seen = {}
    def pre(m, args):
        seen["x"] = args[0].clone()
    def out(m, args, output):
        seen["x"] = (output[0] if isinstance(output, tuple) else output).clone()
    with torch_hooks([(module, "pre" if kind == "pre" else "out", pre if kind == "pre" else out)]):
        hf_model(tokens)
    return seen["x"]


def d_head(hf_model):
    return hf_model.config.n_embd // hf_model.config.n_head


# ---------------------------------------------------------------------------------------- zero
def test_head_zero_matches_zeroing_its_slice_of_c_proj_input(model, hf_model, tokens):
    dh = d_head(hf_model)
    h = hf_model.transformer.h
    def zero_heads(heads):
        def edit(x):
            for hd in heads:
                x[..., hd * dh:(hd + 1) * dh] = 0
        return c_proj_input_edit(edit)
    expected = hf_logits(hf_model, tokens, [(h[1].attn.c_proj, "pre", zero_heads([2])),
                                            (h[2].attn.c_proj, "pre", zero_heads([0, 3]))])
    ours = model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, [Head(1, 2), Head(2, [0, 3])]))
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert (ours - model(tokens)).abs().max() > 1e-3  # the ablation did something


def test_neurons_zero_matches_zeroing_mlp_c_proj_input(model, hf_model, tokens):
    def edit(x):
        x[..., [5, 7, 100]] = 0
    expected = hf_logits(hf_model, tokens, [(hf_model.transformer.h[0].mlp.c_proj, "pre", c_proj_input_edit(edit))])
    ours = model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, Neurons(0, [5, 7, 100])))
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert (ours - model(tokens)).abs().max() > 1e-4


@pytest.mark.parametrize("target, module", [(Attn(1), "attn"), (Mlp(2), "mlp")])
def test_sublayer_zero_matches_zeroing_hf_sublayer_output(model, hf_model, tokens, target, module):
    sub = getattr(hf_model.transformer.h[target.layer], module)
    expected = hf_logits(hf_model, tokens, [(sub, "out", replace_output(torch.zeros_like))])
    ours = model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, [target]))
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_block_zero_skips_the_block(model, hf_model, tokens):
    skip = lambda module, args, output: args[0]  # noqa: E731 - the block's output is its input
    expected = hf_logits(hf_model, tokens, [(hf_model.transformer.h[1], "out", skip)])
    logits, cache = model.run_with_cache(tokens, fwd_hooks=ablation_hooks(model, Block(1)))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(cache["resid_post", 1], cache["resid_pre", 1])  # exactly, not approximately
    assert not torch.equal(cache["resid_post", 0], cache["resid_pre", 0])  # other blocks still write


# ---------------------------------------------------------------------------------------- mean
def test_mean_ablation_of_heads_and_block_matches_hf(model, hf_model, tokens):
    reference = torch.randint(0, 101, (5, 20), generator=torch.Generator().manual_seed(7))
    h, dh = hf_model.transformer.h, d_head(hf_model)
    mean_z = hf_capture(hf_model, reference, h[0].attn.c_proj, "pre").mean((0, 1))  # [n_embd] = heads x d_head
    mean_attn = hf_capture(hf_model, reference, h[2].attn, "out").mean((0, 1))
    mean_mlp = hf_capture(hf_model, reference, h[2].mlp, "out").mean((0, 1))
    def edit(x):
        x[..., 1 * dh:2 * dh] = mean_z[1 * dh:2 * dh]
    expected = hf_logits(hf_model, tokens, [
        (h[0].attn.c_proj, "pre", c_proj_input_edit(edit)),
        (h[2].attn, "out", replace_output(lambda o: mean_attn.expand_as(o))),
        (h[2].mlp, "out", replace_output(lambda o: mean_mlp.expand_as(o))),
    ])
    hooks = ablation_hooks(model, [Head(0, 1), Block(2)], mode="mean", reference=reference)
    torch.testing.assert_close(model.run_with_hooks(tokens, fwd_hooks=hooks), expected, atol=ATOL, rtol=0)
    # a dataset (list of token tensors of different lengths) pools over every token the same way
    dataset = [reference[:2], reference[2], reference[3:, :11]]
    means = mean_activations(model, ["blocks.2.hook_mlp_out"], dataset)
    rows = torch.cat([hf_capture(hf_model, r.reshape(-1, r.shape[-1]), h[2].mlp, "out").flatten(0, 1) for r in dataset])
    torch.testing.assert_close(means["blocks.2.hook_mlp_out"], rows.mean(0), atol=1e-6, rtol=0)


def test_per_position_mean_of_neurons_matches_hf(model, hf_model, tokens):
    reference = torch.randint(0, 101, (4, 20), generator=torch.Generator().manual_seed(3))
    c_proj = hf_model.transformer.h[1].mlp.c_proj
    mean_post = hf_capture(hf_model, reference, c_proj, "pre").mean(0)  # [pos, d_mlp]
    pos = tokens.shape[1]
    def edit(x):
        x[..., [3, 9]] = mean_post[:pos, [3, 9]]
    expected = hf_logits(hf_model, tokens, [(c_proj, "pre", c_proj_input_edit(edit))])
    hooks = ablation_hooks(model, Neurons(1, [3, 9]), mode="mean", reference=reference, per_position=True)
    torch.testing.assert_close(model.run_with_hooks(tokens, fwd_hooks=hooks), expected, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="positions"):
        model.run_with_hooks(torch.zeros(1, 21, dtype=torch.long), fwd_hooks=hooks)


def test_per_position_mean_over_sequences_of_different_lengths(model, hf_model):
    g = torch.Generator().manual_seed(9)
    dataset = [torch.randint(0, 101, (2, 12), generator=g), torch.randint(0, 101, (20,), generator=g)]
    attn = hf_model.transformer.h[1].attn
    outs = [hf_capture(hf_model, r.reshape(-1, r.shape[-1]), attn, "out") for r in dataset]  # [b, pos, d_model]
    expected = torch.stack([torch.cat([o[:, p] for o in outs if o.shape[1] > p]).mean(0) for p in range(20)])
    got = mean_activations(model, ["blocks.1.hook_attn_out"], dataset, per_position=True)["blocks.1.hook_attn_out"]
    assert got.shape == (20, model.cfg.d_model)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@every_family
@pytest.mark.parametrize("target", [Block(1), Attn(0), Mlp(2), Head(1, [0, 3]), Neurons(2, [1, 2, 3])])
def test_mean_over_the_input_itself_is_a_no_op(model, tokens, target):
    if isinstance(target, Neurons) and model.cfg.is_moe_layer(target.layer):  # experts, not neurons (test_moe_ablation.py)
        with pytest.raises(ValueError, match="is a mixture of experts"):
            ablation_hooks(model, target, mode="mean", reference=tokens)
        return
    one = tokens[:1]
    clean = model(one)
    # per position, the mean over a batch of one is the input's own activation: nothing changes
    hooks = ablation_hooks(model, target, mode="mean", reference=one, per_position=True)
    assert torch.equal(model.run_with_hooks(one, fwd_hooks=hooks), clean)
    # pooled over positions it is not, but an ablation at position p cannot reach positions before p
    p = 9
    pooled = ablation_hooks(model, target, mode="mean", reference=one, positions=p)
    ablated = model.run_with_hooks(one, fwd_hooks=pooled)
    assert torch.equal(ablated[:, :p], clean[:, :p])
    assert (ablated[:, p] - clean[:, p]).abs().max() > 1e-5


# ------------------------------------------------------------------------------------ resample
def test_resample_matches_hf_with_the_drawn_rows(model, hf_model, tokens):
    reference = torch.randint(0, 101, (6, 20), generator=torch.Generator().manual_seed(11))
    seed = 4
    rows = resample_indices(len(reference), len(tokens), seed)
    pos = tokens.shape[1]
    h, dh = hf_model.transformer.h, d_head(hf_model)
    z_ref = hf_capture(hf_model, reference, h[2].attn.c_proj, "pre")[rows, :pos]
    attn_ref = hf_capture(hf_model, reference, h[0].attn, "out")[rows, :pos]
    mlp_ref = hf_capture(hf_model, reference, h[0].mlp, "out")[rows, :pos]
    def edit(x):
        x[..., 3 * dh:4 * dh] = z_ref[..., 3 * dh:4 * dh]
    expected = hf_logits(hf_model, tokens, [
        (h[2].attn.c_proj, "pre", c_proj_input_edit(edit)),
        (h[0].attn, "out", replace_output(lambda o: attn_ref)),
        (h[0].mlp, "out", replace_output(lambda o: mlp_ref)),
    ])
    hooks = ablation_hooks(model, [Block(0), Head(2, 3)], mode="resample", reference=reference, seed=seed)
    torch.testing.assert_close(model.run_with_hooks(tokens, fwd_hooks=hooks), expected, atol=ATOL, rtol=0)


@every_family
def test_resample_is_deterministic_by_seed(model, tokens):
    reference = torch.randint(0, 101, (8, 20), generator=torch.Generator().manual_seed(5))
    run = lambda seed: model.run_with_hooks(  # noqa: E731
        tokens, fwd_hooks=ablation_hooks(model, Attn(1), mode="resample", reference=reference, seed=seed))
    assert torch.equal(run(0), run(0))
    assert torch.equal(resample_indices(8, 3, 0), resample_indices(8, 3, 0))
    other = next(s for s in range(1, 50) if not torch.equal(resample_indices(8, 3, s), resample_indices(8, 3, 0)))
    assert not torch.allclose(run(0), run(other))


# ------------------------------------------------------------------------- composition, errors
@every_family
def test_hooks_compose_with_cache_and_context_and_are_removed(model, tokens):
    clean = model(tokens)
    dense = next((l for l in (1, 2) if model.cfg.has_mlp(l)), 1)  # Nemotron-H: block 2 is its MLP block
    neurons = not model.cfg.is_moe_layer(dense)  # a mixture of experts has no neurons
    headed = next(l for l in range(model.cfg.n_layers) if model.cfg.has_heads(l))  # Qwen 3.5, Nemotron-H, Granite 4: block 1
    neuron = 4
    if neurons:  # one that fires at position 1 in every row of the clean run (a ReLU MLP's often do not)
        _, clean_cache = model.run_with_cache(tokens, names_filter=f"blocks.{dense}.mlp.hook_post")
        neuron = int((clean_cache["post", dense][:, 1] != 0).all(0).nonzero()[0])
    hooks = ablation_hooks(model, [Head(headed, [1, 2])] + [Neurons(dense, neuron)] * neurons, positions=[0, 5])
    with model.hooks(hooks):
        inside = model(tokens)
    _, cache = model.run_with_cache(tokens, fwd_hooks=hooks)
    z = cache["z", headed]  # [batch, pos, head, d_head]
    assert torch.equal(z[:, [0, 5]][:, :, [1, 2]], torch.zeros_like(z[:, [0, 5]][:, :, [1, 2]]))
    assert (z[:, 1].abs() > 0).all() and (z[:, :, 0].abs() > 0).all()
    assert not neurons or ((cache["post", dense][:, [0, 5], neuron] == 0).all()
                           and (cache["post", dense][:, 1, neuron] != 0).all())
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=hooks), inside)
    assert torch.equal(model(tokens), clean)  # nothing stayed attached
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


@every_family
def test_targets_merge_per_hook_point(model):
    sites = merge_sites([*target_sites(model, Head(1, 0)), *target_sites(model, Head(1, [2, 0])),
                         *target_sites(model, Attn(1)), *target_sites(model, Block(1))])
    late = [(f"blocks.1.hook_{w}", None) for w in late_writes(model.hook_dict, 1)]  # Gemma 4's rescale_out
    assert sorted((s.name, s.units) for s in sites) == sorted([
        ("blocks.1.attn.hook_z", (0, 2)), ("blocks.1.hook_attn_out", None), ("blocks.1.hook_mlp_out", None), *late])
    assert target_sites(model, Block(-1))[0].name == "blocks.2.hook_attn_out"


def test_errors_name_the_bad_layer_head_or_neuron(model, tokens):
    with pytest.raises(IndexError, match=r"layer 3 is out of range.*3 blocks"):
        ablation_hooks(model, [Head(3, 0)])
    with pytest.raises(IndexError, match=r"head 4 is out of range.*4 heads"):
        ablation_hooks(model, [Block(0), Head(1, [0, 4])])
    with pytest.raises(IndexError, match=r"neuron 128 is out of range"):
        ablation_hooks(model, Neurons(0, [1, 128]))
    with pytest.raises(ValueError, match="unknown ablation mode"):
        ablation_hooks(model, Block(0), mode="noise")
    with pytest.raises(ValueError, match="needs reference tokens"):
        ablation_hooks(model, Block(0), mode="mean")
    with pytest.raises(TypeError, match="ablation target"):
        ablation_hooks(model, ["blocks.0"])
    with pytest.raises(ValueError, match="reference rows only 5"):
        model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, Attn(0), mode="resample", reference=tokens[:, :5]))
    with pytest.raises(IndexError, match="position 17 is out of range"):
        model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, Attn(0), positions=17))
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
