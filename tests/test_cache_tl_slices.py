"""lenskit's `Slice` against TransformerLens 4.3's on the same inputs (mode, what it selects, indices), `pos_slice`
taking it wherever the cache takes a slice, and the cache's small TransformerLens habits (keys, autodiff, batches)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import transformer_lens_4_3

from lenskit import ActivationCache
from lenskit.observe.slices import Slice, apply_slice

INPUTS = [None, 0, -1, 3, (2,), (1, 5), (1, 6, 2), (None, None, 3), slice(2, None), [4, 0, 2], range(1, 4),
          torch.tensor([1, 3]), torch.tensor(2), np.array([0, 5]), np.int64(4), torch.tensor([True, False] * 3 + [True])]


@pytest.fixture(scope="module")
def TLSlice():
    transformer_lens_4_3()
    from transformer_lens.utilities import Slice as theirs

    return theirs


@pytest.mark.parametrize("given", INPUTS, ids=[repr(i)[:30] for i in INPUTS])
def test_slice_selects_what_transformer_lens_selects(TLSlice, given):
    x = torch.arange(2 * 7 * 3).reshape(2, 7, 3)
    ours = Slice(given)
    theirs_input = list(given) if isinstance(given, range) else given  # TransformerLens takes no range
    theirs = TLSlice(theirs_input)
    assert ours.mode == theirs.mode
    for dim in (1, -2):
        assert torch.equal(ours.apply(x, dim), theirs.apply(x, dim))
        assert torch.equal(apply_slice(x, given, dim), theirs.apply(x, dim))
        assert torch.equal(apply_slice(x, ours, dim), theirs.apply(x, dim))
    assert np.array_equal(ours.indices(7), theirs.indices(7))
    assert Slice(ours).mode == ours.mode and Slice.unwrap(ours) is ours
    assert np.array_equal(Slice.unwrap(theirs_input).indices(7), TLSlice.unwrap(theirs_input).indices(7))


def test_slice_refuses_what_it_cannot_read():
    for bad, match in [(3.5, "a slice is None, an int"), ("1:3", "a slice is None"), (True, "a slice is None"),
                       ([[0, 1]], "1-d list of ints"), (torch.tensor([0.5]), "1-d list of ints")]:
        with pytest.raises(TypeError, match=match):
            Slice(bad)
    with pytest.raises(ValueError, match="needs max_ctx"):
        Slice((1, 3)).indices()
    assert Slice([]).indices(7).tolist() == [] and Slice([]).apply(torch.ones(2, 7), 1).shape == (2, 0)
    assert Slice(5).indices().tolist() == [5] and repr(Slice((1, 3))) == "Slice(slice(1, 3, None), mode='slice')"


@pytest.fixture(scope="module")
def run(model):
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.run_with_cache(tokens)


def test_every_pos_slice_parameter_takes_a_slice(model, run):
    _, cache = run
    calls = {
        "accumulated_resid": lambda s: cache.accumulated_resid(pos_slice=s, apply_ln=True),
        "decompose_resid": lambda s: cache.decompose_resid(pos_slice=s, apply_ln=True),
        "stack_head_results": lambda s: cache.stack_head_results(pos_slice=s, incl_remainder=True, apply_ln=True),
        "stack_neuron_results": lambda s: cache.stack_neuron_results(2, pos_slice=s, neuron_slice=Slice((0, 9))),
        "get_neuron_results": lambda s: cache.get_neuron_results(1, neuron_slice=Slice(3), pos_slice=s),
        "get_full_resid_decomposition": lambda s: cache.get_full_resid_decomposition(pos_slice=s, apply_ln=True),
    }
    with torch.no_grad():
        for name, call in calls.items():
            for given in (-1, (1, 5), [0, 6]):
                assert torch.equal(call(Slice(given)), call(given)), name
        stack = cache.decompose_resid(pos_slice=Slice(-1))
        assert torch.equal(cache.apply_ln_to_stack(stack, pos_slice=Slice(-1), batch_slice=Slice(1)),
                           cache.apply_ln_to_stack(stack, pos_slice=-1, batch_slice=1))
        assert torch.equal(cache.logit_attrs(stack, 5, pos_slice=Slice(-1)), cache.logit_attrs(stack, 5, pos_slice=-1))


def test_key_shorthand(model, run):
    _, cache = run
    n = model.cfg.n_layers
    expected = {("attn", 1): "blocks.1.attn.hook_pattern", ("attn", torch.tensor(1)): "blocks.1.attn.hook_pattern",
                ("embed", None): "hook_embed", ("pos_embed", None): "hook_pos_embed", ("scale", None): "ln_final.hook_scale",
                ("normalized", None, None): "ln_final.hook_normalized", ("scale", 2, "ln1"): "blocks.2.ln1.hook_scale",
                ("pattern", 0, "attn"): "blocks.0.attn.hook_pattern", ("resid_pre", -1): f"blocks.{n - 1}.hook_resid_pre",
                ("normalized", -2, "ln2"): f"blocks.{n - 2}.ln2.hook_normalized", ("q", np.int64(0)): "blocks.0.attn.hook_q",
                ("mlp_post", 1): "blocks.1.mlp.hook_post", ("key", torch.tensor(-1)): f"blocks.{n - 1}.attn.hook_k",
                ("k1", None): "blocks.1.attn.hook_k", "k1": "blocks.1.attn.hook_k", "scale": "ln_final.hook_scale"}
    for key, name in expected.items():
        assert cache[key] is cache[name], key
    with pytest.raises(ValueError, match="layer_type 'ln1' or 'ln2'"):
        cache["scale", 1]
    with pytest.raises(ValueError, match="takes no layer"):
        cache["embed", 0]
    with pytest.raises(TypeError, match="layer must be an int"):
        cache["attn", torch.tensor([0, 1])]
    with pytest.raises(IndexError, match="out of range"):
        cache["attn", torch.tensor(n)]


def test_toggle_autodiff_sets_the_global_switch(run):
    _, cache = run
    before = torch.is_grad_enabled()
    try:
        with pytest.warns(UserWarning, match="global state: gradients are now off"):
            cache.toggle_autodiff()
        assert not torch.is_grad_enabled()
        with pytest.warns(UserWarning, match="now on"):
            cache.toggle_autodiff(True)
        assert torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(before)


def test_batch_slices_and_remove_batch_dim(model, run):
    _, cache = run
    one = cache.apply_slice_to_batch_dim(1)
    assert not one.has_batch_dim and torch.equal(one["hook_embed"], cache["hook_embed"][1])
    assert one.model is model and one.n_layers == cache.n_layers
    with pytest.raises(ValueError, match="no batch axis"):
        one.apply_slice_to_batch_dim(0)
    kept = cache.apply_slice_to_batch_dim([1])
    assert kept.has_batch_dim and torch.equal(kept.remove_batch_dim(1)["hook_embed"], one["hook_embed"])
    with pytest.raises(ValueError, match="batch size 2"):
        cache.apply_slice_to_batch_dim((0, 1)).remove_batch_dim(batch_size=2)
    tokens = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, single = model.run_with_cache(tokens, remove_batch_dim=True)
        _, batched = model.run_with_cache(tokens)
    assert logits.shape[0] == 1 and not single.has_batch_dim
    assert torch.equal(single["resid_post", -1], batched["resid_post", -1][0])
    with torch.no_grad():
        _, plain = model.run_with_cache(tokens, return_cache_object=False, remove_batch_dim=True)
    assert type(plain) is dict and plain.keys() == single.cache_dict.keys()
    assert all(torch.equal(plain[k], v) for k, v in single.items())
    built = ActivationCache(dict(batched.cache_dict), model, has_batch_dim=True).remove_batch_dim()
    assert torch.equal(built.accumulated_resid(apply_ln=True), single.accumulated_resid(apply_ln=True))


METHODS = ["accumulated_resid", "decompose_resid", "stack_head_results", "apply_ln_to_stack", "logit_attrs",
           "get_full_resid_decomposition", "stack_neuron_results", "get_neuron_results", "stack_activation",
           "compute_head_results", "apply_slice_to_batch_dim", "remove_batch_dim", "to", "toggle_autodiff", "__init__"]


@pytest.mark.parametrize("method", METHODS)
def test_arguments_are_transformer_lens_s_in_its_order(method):
    """TransformerLens's parameters, names and defaults, are ours in the same order (lenskit may add some after)."""
    import inspect

    transformer_lens_4_3()
    from transformer_lens import ActivationCache as Theirs

    def params(cls):
        return [(p.name, p.default) for p in inspect.signature(getattr(cls, method)).parameters.values()][1:]

    theirs, ours = params(Theirs), params(ActivationCache)
    if method == "__init__":  # (cache_dict, model, has_batch_dim): lenskit's second place also takes the model
        assert [n for n, _ in ours] == ["cache_dict", "n_layers", "model", "has_batch_dim"]
        return
    assert [n for n, _ in ours[:len(theirs)]] == [n for n, _ in theirs]
    for (name, default), (_, expected) in zip(ours, theirs):
        assert default == expected or (default is None and expected is inspect.Parameter.empty and name == "device"), name
