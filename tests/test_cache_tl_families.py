"""ActivationCache's TransformerLens methods on every family, as identities: heads and neurons sum to their sublayer's
write less its bias, the full decomposition sums to the stream, logit attributions sum to the final norm's logit;
and where a head or a neuron has no write of its own that reaches the stream (a norm after the sublayer, linear
attention, experts), a one-line refusal that names the block."""

from __future__ import annotations

import pytest
import torch
from families import every_family
from fixtures import close

ALL = lambda name: True  # noqa: E731 - hook_result too


def kinds(model):
    """Per block: (post-normed attention, post-normed MLP, linear attention, experts), from the modules themselves."""
    return [(hasattr(b, "ln1_post"), hasattr(b, "ln2_post"), hasattr(b.attn, "LAYER_TYPE"), model.cfg.is_moe_layer(l))
            for l, b in enumerate(model.blocks)]


def one_line(caught) -> str:
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    return message


@pytest.fixture
def run(model, tokens):
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        _, recorded = model.run_with_cache(tokens, names_filter=ALL)
    return cache, recorded


@every_family
def test_head_results_are_the_models_own_and_sum_to_the_attention_write(model, run):
    cache, recorded = run
    with torch.no_grad():
        cache.compute_head_results()
    for l, (attn_normed, _, linear, _) in enumerate(kinds(model)):
        name = f"blocks.{l}.attn.hook_result"
        if linear:
            assert name not in cache and name not in recorded
            continue
        close(cache[name], recorded[name])  # computed from z and W_O = what the model's hook saw
        if not attn_normed:
            close(cache[name].sum(-2) + model.blocks[l].attn.b_O.detach(), cache["attn_out", l])


@every_family
def test_neuron_results_sum_to_the_mlp_write_or_are_refused(model, run):
    cache, _ = run
    for l, (_, mlp_normed, _, experts) in enumerate(kinds(model)):
        if experts or mlp_normed or not model.cfg.has_mlp(l):  # Nemotron-H's mixer-only blocks have no MLP
            with pytest.raises(ValueError) as caught:
                cache.get_neuron_results(l)
            words = "mixture of experts" if experts else "ln2_post" if mlp_normed else "has no MLP"
            assert f"block {l}" in one_line(caught) and words in one_line(caught)
            continue
        with torch.no_grad():
            neurons = cache.get_neuron_results(l)  # [batch, pos, d_mlp, d_model]
        close(neurons.sum(-2) + model.blocks[l].mlp.b_out.detach(), cache["mlp_out", l])
        if all(not (k[1] or k[3]) and model.cfg.has_mlp(i) for i, k in enumerate(kinds(model)[:l])):  # every earlier
            # block has neurons too
            with torch.no_grad():
                stack = cache.stack_neuron_results(l + 1, neuron_slice=None)
            close(stack[-neurons.shape[-2]:], neurons.movedim(-2, 0))


@every_family
def test_full_decomposition_sums_to_the_stream_or_is_refused(model, run):
    cache, _ = run
    n = model.cfg.n_layers
    block_kinds = kinds(model)
    heads_ok = not any(attn_normed or linear for attn_normed, _, linear, _ in block_kinds)
    neurons_ok = heads_ok and not any(mlp_normed or experts for _, mlp_normed, _, experts in block_kinds)
    for expand, ok in ((True, neurons_ok), (False, heads_ok)):
        if not ok:
            with pytest.raises(ValueError) as caught:
                cache.get_full_resid_decomposition(expand_neurons=expand)
            assert "block" in one_line(caught)
            continue
        with torch.no_grad():
            stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
            mid = cache.get_full_resid_decomposition(1, mlp_input=True, expand_neurons=expand)
        assert len(labels) == stack.shape[0] and labels[-1] == "bias" and "embed" in labels
        close(stack.sum(0), cache.stream(n), atol=1e-4)
        close(mid.sum(0), cache["resid_mid", 1], atol=1e-4)


@every_family
def test_logit_attrs_sum_to_the_final_norms_logit(model, run, tokens):
    cache, _ = run
    with torch.no_grad():
        stack = cache.decompose_resid()
        attrs = cache.logit_attrs(stack, tokens[:, -1])  # [component, batch, pos]
        norm = model.ln_final
        bias = norm.bias.detach() if getattr(norm, "bias", None) is not None else 0.0
        expected = ((cache["ln_final.hook_normalized"] - bias) * model.W_U[:, tokens[:, -1]].T[:, None]).sum(-1)
    assert attrs.shape == stack.shape[:-1]
    close(attrs.sum(0), expected, atol=1e-4)
    lens = cache.accumulated_resid(apply_ln=True)
    close(lens[-1], cache["ln_final.hook_normalized"])


@every_family
def test_norms_at_a_block_input_sum_or_are_refused(model, run):
    cache, _ = run
    for mlp_input, norm in ((False, "ln1"), (True, "ln2")):
        module = getattr(model.blocks[1], norm, None)
        if mlp_input and model.cfg.parallel_block:  # GPT-NeoX: ln2 reads resid_pre, so nothing normalises resid_mid
            with pytest.raises(ValueError) as caught:
                cache.decompose_resid(1, mlp_input=True, apply_ln=True)
            assert "block 1 is a parallel block" in one_line(caught)
            continue
        if module is None:  # OLMo 2: the sublayers read the raw stream
            with pytest.raises(ValueError) as caught:
                cache.decompose_resid(1, mlp_input=mlp_input, apply_ln=True)
            assert f"block 1 has no {norm}" in one_line(caught)
            continue
        with torch.no_grad():
            stack = cache.accumulated_resid(1, mlp_input=mlp_input, apply_ln=True)
            parts = cache.decompose_resid(1, mlp_input=mlp_input, apply_ln=True)
        bias = module.bias.detach() if getattr(module, "bias", None) is not None else 0.0
        close(parts.sum(0) + bias, cache[f"blocks.1.{norm}.hook_normalized"], atol=1e-4)
        close(stack[-1] + bias, cache[f"blocks.1.{norm}.hook_normalized"], atol=1e-4)
