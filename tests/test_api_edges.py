"""The edges of the Python API: each argument outside its domain is refused with one line that names it,
and each form that is allowed gives the right answer. Every rule runs on more than one model and more than
one value; the references are the model's own greedy decoding, the tokenizer's own decoding, the long-id
forward and the stream the per-head stack must sum to.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from families import family_model_of
from fixtures import random_tokens

from lenses.anatomy import decompose_resid, direct_logit_attribution
from lenskit import Stream
from lenskit.observe.cache import CacheKeyError
from lenskit.observe.resid import resid_parts

TWO = ["gpt2", "llama"]  # learned positions and LayerNorm; rotary, RMSNorm and GQA


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(2, 6, seed=2, high=300, low=3)


def one_line(error: pytest.ExceptionInfo) -> str:
    value = error.value
    message = value.args[0] if isinstance(value, KeyError) and value.args else str(value)
    assert "\n" not in message.strip(), message
    return message


# --------------------------------------------------------------------------------------- sampling arguments
BAD_DECODING = [
    (dict(do_sample=True, temperature=float("inf")), ValueError, "temperature"),
    (dict(do_sample=True, temperature=float("nan")), ValueError, "temperature"),
    (dict(do_sample=True, temperature=-0.5), ValueError, "temperature"),
    (dict(do_sample=True, temperature=True), ValueError, "temperature"),
    (dict(do_sample=True, temperature="1"), ValueError, "temperature"),
    (dict(do_sample=True, top_p=0), ValueError, "top_p"),
    (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
    (dict(do_sample=True, top_p=float("nan")), ValueError, "top_p"),
    (dict(do_sample=True, top_p=True), ValueError, "top_p"),
    (dict(do_sample=True, top_k=0), ValueError, "top_k"),
    (dict(do_sample=True, top_k=-3), ValueError, "top_k"),
    (dict(do_sample=True, top_k=2.5), ValueError, "top_k"),
    (dict(do_sample=True, top_k=True), ValueError, "top_k"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens"),
    (dict(do_sample="yes"), TypeError, "do_sample"),
    (dict(do_sample=True, generator=0), TypeError, "generator"),
]


@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("kwargs, error, word", BAD_DECODING, ids=[str(k) for k, _, _ in BAD_DECODING])
def test_decoding_arguments_outside_their_domain_are_refused(family, kwargs, error, word, tokens):
    model = family_model_of(family).model
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error) as caught:
        model.generate(tokens, **kwargs)
    message = one_line(caught)
    assert word in message and repr(kwargs[word]) in message


@pytest.mark.parametrize("family", TWO)
def test_decoding_arguments_at_the_edges_of_their_domain_work(family, tokens):
    model = family_model_of(family).model
    greedy = model.generate(tokens, 4)
    seeded = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    # A vanishing temperature is greedy (the logits are shifted before dividing, so none overflows to +inf).
    assert torch.equal(model.generate(tokens, 4, do_sample=True, temperature=1e-30, generator=seeded()), greedy)
    assert torch.equal(model.generate(tokens, 4, do_sample=True, temperature=np.float64(1e-30), generator=seeded()), greedy)
    assert torch.equal(model.generate(tokens, 4, do_sample=True, top_k=np.int64(1), generator=seeded()), greedy)
    huge_k = model.generate(tokens, 4, do_sample=True, top_k=10**6, top_p=1, generator=seeded())
    assert torch.equal(huge_k, model.generate(tokens, 4, do_sample=True, generator=seeded()))  # no cut at all


@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("do_sample", [False, True])
def test_nan_logits_stop_generation_with_one_line(family, do_sample, tokens):
    model = family_model_of(family).model
    with model.hooks([("ln_final.hook_normalized", lambda x, hook: x * float("nan"))]), \
            pytest.raises(ValueError) as caught:
        model.generate(tokens, 3, do_sample=do_sample)
    assert "logits at step 0 are NaN" in one_line(caught)


# --------------------------------------------------------------------------------------- cache keys
BAD_KEYS = [("resid_post", 1, "x", 4), ("resid_post",), (), 42, -1, None, 3.5, b"hook_embed", ["hook_embed"],
            frozenset({"hook_embed"})]


@pytest.fixture(scope="module", params=TWO)
def cache(request, tokens):
    with torch.no_grad():
        return family_model_of(request.param).model.run_with_cache(tokens)[1]


@pytest.mark.parametrize("key", BAD_KEYS, ids=[repr(k) for k in BAD_KEYS])
def test_a_key_of_the_wrong_form_is_refused_and_is_not_in_the_cache(cache, key):
    with pytest.raises(CacheKeyError) as caught:
        cache[key]
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, TypeError)
    message = one_line(caught)
    assert ("tuple has 2 or 3 parts" if isinstance(key, tuple) else "cache keys are hook names") in message
    assert "('resid_post', 3)" in message  # says which forms it takes
    assert key not in cache
    assert cache.get(key) is None and cache.get(key, "absent") == "absent"


def test_a_layer_type_that_names_another_part_of_the_block_is_refused(cache):
    with pytest.raises(ValueError) as caught:
        cache["resid_post", 1, "x"]
    assert "layer_type must be None, got 'x'" in one_line(caught)
    with pytest.raises(ValueError, match="layer_type must be None or 'attn', got 'mlp'"):
        cache["q", 1, "mlp"]
    # TransformerLens's own spellings still read the same entries.
    assert cache["q", 1, "attn"] is cache["q", 1] is cache["blocks.1.attn.hook_q"]
    assert cache["scale", 1, "ln1"] is cache["blocks.1.ln1.hook_scale"]
    assert cache["resid_post", 1, "block"] is cache["resid_post", 1] and cache[Stream(2)] is cache["resid_pre", 2]
    assert isinstance(cache, Mapping) and ("resid_post", 1) in cache and "hook_embed" in cache


# --------------------------------------------------------------------------------------- ids to text
BAD_IDS = [
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "shape (1, 2, 3)"),
    (torch.zeros(2, 1, 1, 4, dtype=torch.long), ValueError, "shape (2, 1, 1, 4)"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer"),
    ([[1, 2], [3]], TypeError, "token ids [pos] or [batch, pos]"),
    ([-1, 4], ValueError, "token id -1"),
    ([4, 10**5], ValueError, "token id 100000"),
    (torch.tensor([2**63 + 5], dtype=torch.uint64), ValueError, "9223372036854775813 (uint64)"),
]


@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("read", ["to_str_tokens", "to_string"])
@pytest.mark.parametrize("ids, error, words", BAD_IDS, ids=[w for _, _, w in BAD_IDS])
def test_ids_that_are_not_a_sequence_or_a_batch_are_refused(family, read, ids, error, words):
    model = family_model_of(family).model
    with pytest.raises(error) as caught:
        getattr(model, read)(ids)
    message = one_line(caught)
    assert words in message


@pytest.mark.parametrize("family", TWO)
def test_ids_in_every_allowed_form_read_as_the_tokenizer_reads_them(family):
    model = family_model_of(family).model
    tok = model.tokenizer
    ids = [5, 17, 200]
    want = [tok.decode([i]) for i in ids]
    for form in (ids, torch.tensor(ids), torch.tensor([ids]), np.array(ids), torch.tensor(ids, dtype=torch.uint8)):
        assert model.to_str_tokens(form) == want
        assert model.to_string(form) in (tok.decode(ids), [tok.decode(ids)])
    assert model.to_str_tokens(torch.tensor(17)) == [tok.decode([17])]  # a lone id
    assert model.to_str_tokens(torch.tensor([ids, ids[::-1]])) == [want, want[::-1]]
    assert model.to_string(torch.tensor([ids, ids[::-1]])) == [tok.decode(ids), tok.decode(ids[::-1])]
    assert model.to_str_tokens([]) == []


# --------------------------------------------------------------------------------------- per-head decompositions
POST_NORMED = ["olmo2", "gemma2", "gemma3_text"]  # a norm after attention: the heads' writes do not sum to attn_out


@pytest.fixture(scope="module", params=POST_NORMED)
def post_normed(request, tokens):
    model = family_model_of(request.param).model
    with torch.no_grad():
        return model, model.run_with_cache(tokens, names_filter=lambda name: True)[1]


PER_HEAD = {
    "stack_head_results": lambda model, cache: cache.stack_head_results(),
    "stack_head_results(layer=1, incl_remainder)": lambda model, cache: cache.stack_head_results(1, incl_remainder=True),
    "stack_head_results(apply_ln)": lambda model, cache: cache.stack_head_results(pos_slice=-1, apply_ln=True),
    "resid_parts(per_head)": lambda model, cache: resid_parts(cache, Stream(2), per_head=True),
    "decompose_resid(per_head)": lambda model, cache: decompose_resid(cache, 2, per_head=True),
    "direct_logit_attribution(per_head)": lambda model, cache: direct_logit_attribution(model, cache, 5, per_head=True),
}


@pytest.mark.parametrize("call", list(PER_HEAD))
def test_every_per_head_decomposition_refuses_a_post_normed_model(post_normed, call):
    model, cache = post_normed
    with pytest.raises(ValueError) as caught:
        PER_HEAD[call](model, cache)
    assert "ln1_post" in one_line(caught)


@pytest.mark.parametrize("family", TWO)
def test_per_head_stacks_of_a_pre_norm_model_sum_to_the_stream(family, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: True)
    stack, labels = cache.stack_head_results(2, incl_remainder=True, return_labels=True)
    assert stack.shape[0] == 2 * model.cfg.n_heads + 1 and labels[0] == "L0H0" and labels[-1] == "remainder"
    assert torch.allclose(stack.sum(0), cache.stream(2), atol=1e-5)
    heads = stack[:-1].sum(0)
    writes = sum(cache["attn_out", layer] - model.blocks[layer].attn.b_O for layer in (0, 1))
    assert torch.allclose(heads, writes, atol=1e-5)  # the heads are the attention writes less the output bias


# --------------------------------------------------------------------------------------- token tensors
@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("shape", [(0, 5), (0, 1)])
def test_an_empty_batch_is_refused_by_every_entry_point(family, shape):
    model = family_model_of(family).model
    empty = torch.zeros(shape, dtype=torch.long)
    for call in (lambda: model(empty), lambda: model.run_with_cache(empty), lambda: model.generate(empty, 2),
                 lambda: model(empty, return_type="loss"), lambda: model(empty, stop_at_layer=1)):
        with pytest.raises(ValueError) as caught:
            call()
        assert f"no sequence (shape {shape})" in one_line(caught)


@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("dtype", [torch.uint64, torch.uint32])
def test_wide_unsigned_ids_run_as_long_ids_and_too_wide_ones_are_refused_by_name(family, dtype, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        assert torch.equal(model(tokens.to(dtype)), model(tokens))
        assert torch.equal(model.generate(tokens.to(dtype), 2), model.generate(tokens, 2))
    if dtype == torch.uint64:
        rows = tokens.tolist()
        rows[1][3] = 2**63 + 7
        wide = torch.tensor(rows, dtype=dtype)
        with pytest.raises(ValueError) as caught:
            model(wide)
        assert "token id 9223372036854775815 (uint64) at [batch 1, pos 3] is outside the vocabulary" in one_line(caught)


# --------------------------------------------------------------------------------------- what hooks return
def to_meta(x, hook):
    return x.to("meta")


def too_short(x, hook):
    return x[:, :1]


def as_double(x, hook):
    return x.double()


@pytest.mark.parametrize("family", TWO)
@pytest.mark.parametrize("point", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z", "ln_final.hook_normalized"])
@pytest.mark.parametrize("hook, error, words", [
    (to_meta, ValueError, ("to_meta", "on meta", "is on cpu", ".to('cpu')")),
    (too_short, ValueError, ("too_short", "shape")),
    (as_double, TypeError, ("as_double", "torch.float64", "torch.float32")),
])
def test_a_hook_returning_the_wrong_tensor_is_refused_naming_the_hook(family, point, hook, error, words, tokens):
    model = family_model_of(family).model
    with torch.no_grad(), pytest.raises(error) as caught:
        model.run_with_hooks(tokens, fwd_hooks=[(point, hook)])
    message = one_line(caught)
    assert point in message and all(w in message for w in words), message
