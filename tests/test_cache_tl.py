"""ActivationCache's TransformerLens methods held beside TransformerLens 4.3's bridge cache on the same checkpoint (a
tiny GPT-2): processed weights (`fold_ln`, centring, value biases folded) against the bridge's default processing,
and raw weights against the unprocessed bridge. Same arguments, labels, shapes and numbers; where lenskit applies a
norm's gain that TransformerLens leaves out (raw weights), the difference is pinned exactly."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from fixtures import close
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit
from lenskit import ActivationCache
from lenskit.observe.slices import Slice

pytestmark = pytest.mark.slow  # boots the bridge, twice

PROCESSING = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
RAW = {k: False for k in PROCESSING}
TOKENS = torch.tensor([[50256, 464, 3797, 3332, 319, 262, 2603], [50256, 40, 588, 4695, 290, 2042, 13]])


close = partial(close, atol=1e-5)  # the shared check, tighter: both sides run the same processed weights


@pytest.fixture(scope="module", params=["processed", "raw"])
def pair(request):
    """(processed?, our model, our cache, the bridge's cache): our cache without hook_result, as a plain run gives."""
    processed = request.param == "processed"
    folder = tiny_gpt2_folder()
    bridge = boot_bridge(folder, **({} if processed else RAW))
    model = lenskit.HookedTransformer.from_pretrained(folder, **(PROCESSING if processed else RAW))
    with torch.no_grad():
        theirs_logits, theirs = bridge.run_with_cache(TOKENS)
        logits, ours = model.run_with_cache(TOKENS)
    close(logits, theirs_logits, atol=1e-4)
    return processed, model, ours, theirs


def theirs_of(value):
    """`value` for the bridge: our Slice as TransformerLens's own."""
    from transformer_lens.utilities import Slice as TLSlice

    return TLSlice(None if value.mode == "identity" else value.slice) if isinstance(value, Slice) else value


def both(pair, method, *args, **kwargs):
    """`cache.method(*args, **kwargs)` on both caches, under no_grad."""
    _, _, ours, theirs = pair
    with torch.no_grad():
        return (getattr(ours, method)(*args, **kwargs),
                getattr(theirs, method)(*map(theirs_of, args), **{k: theirs_of(v) for k, v in kwargs.items()}))


def same(pair, method, *args, **kwargs):
    ours, theirs = both(pair, method, *args, **kwargs)
    if isinstance(theirs, tuple):
        assert ours[1] == theirs[1]
        ours, theirs = ours[0], theirs[0]
    assert ours.shape == theirs.shape
    close(ours, theirs)


def gain_of(model, layer, mlp_input=False):
    norm = model.ln_final if layer in (None, model.cfg.n_layers) else getattr(model.blocks[layer], "ln2" if mlp_input else "ln1")
    return norm.weight.detach()


POS = [None, -1, (1, 4), [0, 2, 5], Slice((0, 7, 3)), torch.tensor(2)]


# ------------------------------------------------------------------------------------------ keys
KEYS = [("attn", 0), ("pattern", 0, "attn"), ("scale", 1, "ln1"), ("resid_pre", -1), ("normalized", 1, "ln2"),
        ("q", 0), ("k", -1, "a"), ("embed", None), ("pos_embed", None), ("scale", None), ("attn_scores", 1),
        ("resid_post", torch.tensor(1)), ("z", torch.tensor(-2)), ("mlp_out", 1, "b"), ("pre", 0, "mlp"),
        "embed", "pos_embed", "k1", "scale0ln1", "pattern1", "blocks.0.hook_resid_mid", "normalized"]


@pytest.mark.parametrize("key", KEYS, ids=map(repr, KEYS))
def test_transformerlens_shorthand_reads_the_same_activation(pair, key):
    processed = pair[0]
    if "normalized" in repr(key) and not processed:
        pytest.skip("a raw norm's hook_normalized keeps its gain and bias in lenskit (see apply_ln_to_stack)")
    same(pair, "__getitem__", key)


def test_transformerlens_constructor_order_and_cache_dict(pair):
    _, model, ours, _ = pair
    rebuilt = ActivationCache(dict(ours.cache_dict), model)  # TransformerLens's order
    assert rebuilt.n_layers == model.cfg.n_layers and rebuilt.model is model and rebuilt.has_batch_dim
    assert rebuilt.cache_dict.keys() == ours.cache_dict.keys() and ours.cache_dict is ours._store
    keyword = ActivationCache(cache_dict=dict(ours.cache_dict), model=model, has_batch_dim=True)
    close(keyword.accumulated_resid(apply_ln=True), ours.accumulated_resid(apply_ln=True))
    assert ActivationCache({}, 4).n_layers == 4 and ActivationCache({}, n_layers=4, model=model).model is model
    with pytest.raises(TypeError, match="pass the model once"):
        ActivationCache({}, model, model)
    with pytest.raises(TypeError, match="needs n_layers or the model"):
        ActivationCache({})
    with pytest.raises(TypeError, match="n_layers .an int. or the model"):
        ActivationCache({}, "3")


# ------------------------------------------------------------------------------------- the stream
@pytest.mark.parametrize("layer, incl_mid, mlp_input, pos_slice",
                         [(None, False, False, None), (-1, True, False, -1), (0, False, True, (1, 4)),
                          (1, True, True, [0, 2, 5]), (2, False, False, Slice(-2)), (1, False, False, torch.tensor(3))])
def test_accumulated_resid(pair, layer, incl_mid, mlp_input, pos_slice):
    processed, model, ours, theirs = pair
    kw = dict(incl_mid=incl_mid, pos_slice=pos_slice, mlp_input=mlp_input, return_labels=True)
    same(pair, "accumulated_resid", layer, **kw)
    final = layer in (None, -1, model.cfg.n_layers)
    if processed or final:  # the final stream's norm is recomputed in full, gain and bias, by both
        same(pair, "accumulated_resid", layer, apply_ln=True, **kw)
    else:  # at an earlier block's input TransformerLens divides by the cached scale only; lenskit applies the gain too
        with torch.no_grad():
            stack, _ = ours.accumulated_resid(layer, apply_ln=True, **kw)
            bare, _ = theirs.accumulated_resid(layer, apply_ln=True, **kw)
        close(stack, bare * gain_of(model, layer, mlp_input))


@pytest.mark.parametrize("layer, mlp_input, mode, incl_embeds, pos_slice",
                         [(None, False, "all", True, None), (0, False, "all", True, -1), (1, True, "attn", True, (2, 6)),
                          (2, False, "mlp", False, [1, 3]), (0, True, "all", False, Slice([4])), (1, False, "attn", False, None)])
def test_decompose_resid(pair, layer, mlp_input, mode, incl_embeds, pos_slice):
    processed, model, ours, theirs = pair
    kw = dict(mlp_input=mlp_input, mode=mode, pos_slice=pos_slice, incl_embeds=incl_embeds, return_labels=True)
    same(pair, "decompose_resid", layer, **kw)
    ln, bare = both(pair, "decompose_resid", layer, apply_ln=True, **kw)
    close(ln[0], bare[0] * (1 if processed else gain_of(model, layer, mlp_input)))


@pytest.mark.parametrize("layer, mlp_input", [(None, False), (0, True), (1, False), (1, True)])
def test_apply_ln_to_stack(pair, layer, mlp_input):
    processed, model, ours, theirs = pair
    stack = ours.decompose_resid(layer, mlp_input=mlp_input)
    factor = 1 if processed else gain_of(model, layer, mlp_input)
    for kw in [{}, dict(batch_slice=1), dict(batch_slice=(0, 1)), dict(batch_slice=[1, 0])]:
        ln, bare = both(pair, "apply_ln_to_stack", stack, layer, mlp_input, **kw)
        close(ln, bare * factor)
    last = stack[:, :, -1]
    ln, bare = both(pair, "apply_ln_to_stack", last, layer, mlp_input, pos_slice=-1)
    close(ln, bare * factor)
    if layer is None:  # the final norm recomputed per component: whole, gain and bias, in both
        same(pair, "apply_ln_to_stack", stack, layer, recompute_ln=True)


# ------------------------------------------------------------------------------------ heads and neurons
def test_compute_head_results(pair):
    _, model, ours, theirs = pair
    assert "blocks.0.attn.hook_result" not in ours
    with torch.no_grad():
        ours.compute_head_results()
        theirs.compute_head_results()
    for l in range(model.cfg.n_layers):
        close(ours["result", l], theirs["result", l])
        close(ours["result", l].sum(-2) + model.blocks[l].attn.b_O.detach(), ours["attn_out", l])


@pytest.mark.parametrize("layer, incl_remainder, pos_slice, apply_ln",
                         [(-1, False, None, False), (None, True, -1, True), (1, True, (0, 3), False),
                          (2, False, [6, 1], True), (1, False, Slice(0), True)])
def test_stack_head_results(pair, layer, incl_remainder, pos_slice, apply_ln):
    processed, model, _, _ = pair
    kw = dict(return_labels=True, incl_remainder=incl_remainder, pos_slice=pos_slice)
    same(pair, "stack_head_results", layer, **kw)
    ln, bare = both(pair, "stack_head_results", layer, apply_ln=apply_ln, **kw)
    close(ln[0], bare[0] * (1 if processed or not apply_ln else gain_of(model, layer)))


@pytest.mark.parametrize("layer, neuron_slice, pos_slice", [(0, None, None), (1, (3, 40), -1), (-1, [5, 2], (1, 3)),
                                                            (1, 7, [0, 6])])
def test_get_neuron_results(pair, layer, neuron_slice, pos_slice):
    direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for project in (None, direction, torch.stack([direction, -2 * direction], 1)):
        same(pair, "get_neuron_results", layer, neuron_slice, pos_slice, project)


@pytest.mark.parametrize("layer, pos_slice, neuron_slice, incl_remainder, mlp_input",
                         [(None, None, None, False, False), (1, -1, (0, 30), True, False), (1, (2, 5), [9, 4], True, True),
                          (1, None, 3, False, True), (0, [1], None, False, False)])
def test_stack_neuron_results(pair, layer, pos_slice, neuron_slice, incl_remainder, mlp_input):
    processed, model, _, _ = pair
    direction = torch.randn(64, generator=torch.Generator().manual_seed(1))
    kw = dict(pos_slice=pos_slice, neuron_slice=neuron_slice, return_labels=True, incl_remainder=incl_remainder,
              mlp_input=mlp_input)
    for project, apply_ln in itertools.product((None, direction, torch.stack([direction, direction ** 2], 1)), (False, True)):
        if apply_ln and not processed:
            continue  # the gain again: pinned by the decompositions above
        same(pair, "stack_neuron_results", layer, apply_ln=apply_ln, project_output_onto=project, **kw)


@pytest.mark.parametrize("layer, mlp_input, expand_neurons, pos_slice",
                         [(None, False, True, None), (1, True, True, -1), (0, False, False, (0, 4)), (2, False, False, [3]),
                          (0, True, True, None), (1, False, True, Slice([6, 0]))])
def test_get_full_resid_decomposition(pair, layer, mlp_input, expand_neurons, pos_slice):
    processed, model, ours, _ = pair
    direction = torch.randn(64, generator=torch.Generator().manual_seed(2))
    kw = dict(mlp_input=mlp_input, expand_neurons=expand_neurons, pos_slice=pos_slice, return_labels=True)
    for project, apply_ln in itertools.product((None, direction, torch.stack([direction, -direction], 1)), (False, True)):
        if apply_ln and not processed:
            continue
        same(pair, "get_full_resid_decomposition", layer, apply_ln=apply_ln, project_output_onto=project, **kw)
    stack = ours.get_full_resid_decomposition(layer, mlp_input, expand_neurons, pos_slice=pos_slice)
    target = ours["resid_mid", layer] if mlp_input else ours.stream(model.cfg.n_layers if layer is None else layer)
    close(stack.sum(0), Slice(pos_slice).apply(target, -2))


# ------------------------------------------------------------------------------------- logit attributions
def test_logit_attrs(pair):
    processed, model, ours, theirs = pair
    stack = ours.decompose_resid()
    answers, wrong = TOKENS[:, 3], TOKENS[:, 4]
    cases = [(" the", None), (262, 3797), (torch.tensor(464), None), (answers, wrong), (TOKENS, TOKENS.flip(-1)),
             (TOKENS[0], None)]  # a [pos] tensor: its length is not the batch size
    for tokens, incorrect in cases:
        ours_attrs, theirs_attrs = both(pair, "logit_attrs", stack, tokens, incorrect)
        assert ours_attrs.shape == theirs_attrs.shape
        if processed:
            close(ours_attrs, theirs_attrs)
    # Direct: through the final norm (gain included) at its cached scale, dotted with the token's unembedding.
    centred = stack - stack.mean(-1, keepdim=True)
    expected = (centred / ours["ln_final.hook_scale"] * gain_of(model, None)) @ model.W_U[:, 262].detach()
    close(ours.logit_attrs(stack, 262), expected)
    # One position and one sequence: the slices say which the stack holds.
    last = stack[:, :, -1]
    ours_attrs, theirs_attrs = both(pair, "logit_attrs", last, answers, pos_slice=-1)
    assert ours_attrs.shape == theirs_attrs.shape == (stack.shape[0], 2)
    ours_attrs, theirs_attrs = both(pair, "logit_attrs", last, 262, pos_slice=-1, batch_slice=1)
    assert ours_attrs.shape == theirs_attrs.shape == (stack.shape[0],)
    if processed:
        close(ours_attrs, theirs_attrs)
    with pytest.raises(ValueError, match="same shape"):
        ours.logit_attrs(stack, answers, 262)


# ----------------------------------------------------------------------------------- batches, stacking
def test_stack_activation(pair):
    for args in [("pattern",), ("attn", 1), ("scale", -1, "ln1"), ("q", None), ("resid_post", 2, None), ("post",)]:
        same(pair, "stack_activation", *args)


@pytest.mark.parametrize("batch_slice", [1, (0, 1), [1, 0], Slice(0), torch.tensor(1), None])
def test_apply_slice_to_batch_dim(pair, batch_slice):
    _, _, ours, theirs = pair
    sliced, theirs_sliced = both(pair, "apply_slice_to_batch_dim", batch_slice)
    assert sliced.has_batch_dim == theirs_sliced.has_batch_dim
    assert ours.has_batch_dim and len(ours["hook_embed"]) == 2  # the original is unchanged
    for name in ("hook_embed", "blocks.1.attn.hook_pattern", "ln_final.hook_scale"):
        close(sliced[name], theirs_sliced[name])
    with torch.no_grad():
        close(sliced.decompose_resid(apply_ln=True), theirs_sliced.decompose_resid(apply_ln=True) *
              (1 if pair[0] else gain_of(pair[1], None)))


def test_one_sequence_without_its_batch_axis(pair):
    processed, model, _, _ = pair
    with torch.no_grad():
        logits, ours = model.run_with_cache(TOKENS[:1], remove_batch_dim=True)
    assert not ours.has_batch_dim and logits.shape[0] == 1 and ours["hook_embed"].shape == (7, 64)
    theirs = pair[3].apply_slice_to_batch_dim(0)  # the bridge's run of both sequences, cut to the first
    single = (processed, model, ours, theirs)
    same(single, "accumulated_resid", apply_ln=True, return_labels=True)
    same(single, "stack_head_results", incl_remainder=True, pos_slice=-1)
    same(single, "stack_neuron_results", 1, neuron_slice=(0, 8), incl_remainder=True)
    same(single, "get_full_resid_decomposition", expand_neurons=False, return_labels=True)
    if processed:
        same(single, "logit_attrs", ours.decompose_resid(), TOKENS[0])
    with pytest.raises(ValueError, match="batch size 2"):
        model.run_with_cache(TOKENS, remove_batch_dim=True)
