"""Backward hooks: the gradient they see is autograd's, what they return replaces it, and they are gone on exit."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_hf_gpt2
from families import every_family
from fixtures import random_tokens

import lenskit
from lenskit.observe.hook_context import HOOK_CONTEXT

POINT = "blocks.1.hook_resid_post"


@pytest.fixture
def gpt2() -> lenskit.HookedTransformer:
    """A model of the test's own: these tests fill parameters' .grad."""
    return lenskit.HookedTransformer.from_hf(make_hf_gpt2())


@pytest.fixture
def tokens() -> torch.Tensor:
    return random_tokens(2, 7, seed=3)


def _param_grads(model, tokens, bwd_hooks=()) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with model.hooks(bwd_hooks=bwd_hooks):
        model(tokens, return_type="loss").backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@every_family
def test_the_gradient_a_hook_sees_is_autograds(model, tokens):
    kept, seen = {}, []
    with model.hooks(fwd_hooks=[(POINT, lambda x, hook: kept.setdefault("act", x))],
                     bwd_hooks=[(POINT, lambda g, hook: seen.append((g.clone(), hook.name)))]):
        loss = model(tokens, return_type="loss")
        expected, = torch.autograd.grad(loss, kept["act"])
    assert len(seen) == 1 and seen[0][1] == POINT
    assert seen[0][0].shape == kept["act"].shape
    torch.testing.assert_close(seen[0][0], expected, atol=0, rtol=0)
    assert expected.abs().max() > 0


def test_a_returned_gradient_replaces_it_upstream(gpt2, tokens):
    plain = _param_grads(gpt2, tokens)
    scaled = _param_grads(gpt2, tokens, [("blocks.0.hook_resid_pre", lambda g, hook: g * 3)])
    # Only the embeddings lie upstream of block 0's input: the position embedding's gradient triples, every other
    # one is unchanged, but for the token embedding, tied to the unembedding, which takes both paths' gradients.
    assert set(scaled) == set(plain) and gpt2.embed.weight is gpt2.unembed.weight
    torch.testing.assert_close(scaled["pos_embed.weight"], 3 * plain["pos_embed.weight"], atol=1e-6, rtol=1e-5)
    assert plain["pos_embed.weight"].abs().max() > 0
    unembedding_only = _param_grads(gpt2, tokens, [("blocks.0.hook_resid_pre", lambda g, hook: torch.zeros_like(g))])
    through_stream = plain["embed.weight"] - unembedding_only["embed.weight"]
    assert through_stream.abs().max() > 0
    torch.testing.assert_close(scaled["embed.weight"] - unembedding_only["embed.weight"], 3 * through_stream,
                               atol=1e-6, rtol=1e-5)
    for name in plain:
        if name not in ("embed.weight", "pos_embed.weight"):
            assert torch.equal(scaled[name], plain[name]), name


def test_a_hook_returning_none_changes_nothing(gpt2, tokens):
    calls = []
    plain = _param_grads(gpt2, tokens)
    watched = _param_grads(gpt2, tokens, [(lambda n: n.endswith("hook_resid_mid"), lambda g, hook: calls.append(hook.name))])
    assert calls == [f"blocks.{l}.hook_resid_mid" for l in reversed(range(gpt2.cfg.n_layers))]  # met going backward
    assert all(torch.equal(watched[n], plain[n]) for n in plain)


def test_backward_hooks_see_the_gradient_at_the_value_forward_hooks_wrote(gpt2, tokens):
    def grad_at(fwd_hooks):
        kept, seen = [], []
        keep = (POINT, lambda x, hook: kept.append(x))  # after the edit, the value the rest of the model reads
        with gpt2.hooks(fwd_hooks=[*fwd_hooks, keep], bwd_hooks=[(POINT, lambda g, hook: seen.append(g))]):
            loss = gpt2(tokens, return_type="loss")
            expected, = torch.autograd.grad(loss, kept[0], retain_graph=True)
            loss.backward()
        gpt2.zero_grad(set_to_none=True)
        return seen[0], expected

    edited, expected = grad_at([(POINT, lambda x, hook: x * 2.5)])
    torch.testing.assert_close(edited, expected, atol=0, rtol=0)
    plain, _ = grad_at([])
    assert not torch.allclose(edited, plain, atol=1e-4)  # the edit changed the gradient: the test can tell


def test_one_tensor_two_points_later_point_first(gpt2, tokens):
    """`resid_post` of block 0 is `resid_pre` of block 1; going backward, block 1's input is met first."""
    order = []

    def double(g, hook):
        order.append(hook.name)
        return g * 2

    def record(g, hook):
        order.append(hook.name)
        seen.append(g)

    seen: list[torch.Tensor] = []
    with gpt2.hooks(bwd_hooks=[("blocks.0.hook_resid_post", record)]):
        gpt2(tokens, return_type="loss").backward()
    with gpt2.hooks(bwd_hooks=[("blocks.0.hook_resid_post", record), ("blocks.1.hook_resid_pre", double)]):
        gpt2(tokens, return_type="loss").backward()
    gpt2.zero_grad(set_to_none=True)
    assert order == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre", "blocks.0.hook_resid_post"]
    torch.testing.assert_close(seen[1], 2 * seen[0], atol=0, rtol=0)


def test_a_backward_after_the_block_exits_calls_nothing(gpt2, tokens):
    calls = []
    with gpt2.hooks(bwd_hooks=[(POINT, lambda g, hook: calls.append(1))]):
        loss = gpt2(tokens, return_type="loss")
    assert HOOK_CONTEXT.get().bwd is None and not gpt2.hook_dict[POINT].has_hooks()
    loss.backward()
    assert calls == []
    with gpt2.hooks(bwd_hooks=[(POINT, lambda g, hook: calls.append(1))]):
        gpt2(tokens, return_type="loss").backward()
    assert calls == [1]
    gpt2.zero_grad(set_to_none=True)


def test_a_raising_forward_leaves_no_backward_hook(gpt2, tokens):
    calls, graph = [], []

    def boom(x, hook):
        graph.append(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with gpt2.hooks(fwd_hooks=[("blocks.2.hook_resid_pre", boom)], bwd_hooks=[(POINT, lambda g, hook: calls.append(1))]):
            gpt2(tokens)
    assert HOOK_CONTEXT.get().bwd is None
    assert not any(hp.has_hooks() for hp in gpt2.hook_dict.values())
    graph[0].sum().backward()  # through the graph the failed forward built, past POINT
    gpt2(tokens, return_type="loss").backward()
    assert calls == []
    gpt2.zero_grad(set_to_none=True)


def test_unknown_names_are_refused_by_name_and_nothing_is_attached(gpt2):
    with pytest.raises(KeyError, match="blocks.1.hook_resid_pots"):
        with gpt2.hooks(fwd_hooks=[(POINT, lambda x, hook: None)], bwd_hooks=[("blocks.1.hook_resid_pots", lambda g, hook: None)]):
            pass
    with pytest.raises(KeyError, match="hook_nope"):
        gpt2.add_hook("hook_nope", lambda g, hook: None, dir="bwd")
    with pytest.raises(ValueError, match="dir"):
        gpt2.add_hook(POINT, lambda g, hook: None, dir="backward")
    assert not any(hp.has_hooks() for hp in gpt2.hook_dict.values())


def test_a_wrong_shape_is_refused(gpt2, tokens):
    with gpt2.hooks(bwd_hooks=[(POINT, lambda g, hook: g[:, :1])]):
        loss = gpt2(tokens, return_type="loss")
        with pytest.raises(ValueError, match=f"{POINT} returned"):
            loss.backward()
    gpt2.zero_grad(set_to_none=True)


def test_global_backward_hooks_stay_until_reset(gpt2, tokens):
    calls = []
    gpt2.add_hook(POINT, lambda g, hook: calls.append(hook.name), dir="bwd")
    try:
        gpt2(tokens, return_type="loss").backward()
        gpt2(tokens, return_type="loss").backward()
        assert calls == [POINT, POINT]
        loss = gpt2(tokens, return_type="loss")
        gpt2.reset_hooks()  # also for a graph built before the reset
        loss.backward()
        assert calls == [POINT, POINT]
    finally:
        gpt2.reset_hooks()
        gpt2.zero_grad(set_to_none=True)


def test_run_with_hooks_keeps_backward_hooks_only_when_asked(gpt2, tokens):
    calls = []
    hook = [(POINT, lambda g, hook: calls.append(1))]
    with pytest.warns(UserWarning, match="reset_hooks_end=False"):
        gpt2.run_with_hooks(tokens, bwd_hooks=hook, return_type="loss").backward()
    assert calls == []
    try:
        gpt2.run_with_hooks(tokens, bwd_hooks=hook, reset_hooks_end=False, return_type="loss").backward()
        assert calls == [1]
    finally:
        gpt2.reset_hooks()
        gpt2.zero_grad(set_to_none=True)
    gpt2(tokens, return_type="loss").backward()
    assert calls == [1]
    gpt2.zero_grad(set_to_none=True)


def test_backward_hooks_belong_to_the_calling_thread(gpt2, tokens):
    calls, errors = [], []

    def other_thread():
        try:
            gpt2(tokens, return_type="loss").backward()
        except Exception as e:  # surfaced below
            errors.append(e)

    with gpt2.hooks(bwd_hooks=[(POINT, lambda g, hook: calls.append(threading.current_thread().name))]):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert calls == [] and errors == []
        gpt2(tokens, return_type="loss").backward()
    assert len(calls) == 1
    gpt2.zero_grad(set_to_none=True)


def test_run_with_cache_incl_bwd(gpt2, tokens):
    """As TransformerLens: `.backward()` on the (scalar) output, gradients cached under `<name>_grad`."""
    names = [POINT, "blocks.0.attn.hook_z"]
    loss, cache = gpt2.run_with_cache(tokens, names, incl_bwd=True, return_type="loss")
    assert sorted(cache) == sorted([*names, *(f"{n}_grad" for n in names)])
    expected = {}
    with gpt2.hooks(fwd_hooks=[(n, lambda x, hook: expected.setdefault(hook.name, x)) for n in names]):
        again = gpt2(tokens, return_type="loss")
        grads = torch.autograd.grad(again, [expected[n] for n in names])
    for n, g in zip(names, grads):
        torch.testing.assert_close(cache[f"{n}_grad"], g, atol=0, rtol=0)
    assert any(p.grad is not None for p in gpt2.parameters())  # a plain backward: parameters' grads fill, as in TransformerLens
    gpt2.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="scalar"):
        gpt2.run_with_cache(tokens, names, incl_bwd=True)  # logits
    with torch.no_grad(), pytest.raises(ValueError, match="no_grad"):
        gpt2.run_with_cache(tokens, names, incl_bwd=True, return_type="loss")
    assert not any(hp.has_hooks() for hp in gpt2.hook_dict.values())


def test_points_computed_on_request_are_computed_for_a_backward_hook_alone(gpt2, tokens):
    """hook_pattern (skipped by the fused attention) and hook_result (computed only when hooked) need no forward hook."""
    seen = {}
    names = ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_result"]
    with gpt2.hooks(bwd_hooks=[(n, lambda g, hook: seen.update({hook.name: g.shape})) for n in names]):
        gpt2(tokens, return_type="loss").backward()
    gpt2.zero_grad(set_to_none=True)
    b, p, h = *tokens.shape, gpt2.cfg.n_heads
    assert seen == {names[0]: (b, h, p, p), names[1]: (b, p, h, gpt2.cfg.d_model)}


@pytest.mark.slow  # imports and boots TransformerLens
def test_incl_bwd_matches_transformer_lens(tmp_path):
    """The same gradients as TransformerLens 4.3's bridge (compatibility mode, raw weights) on one checkpoint, under
    the same `<name>_grad` keys. (Not at hook_resid_mid: the bridge's is the input of ln2, whose gradient lacks the
    residual path's, where TransformerLens 3's and ours have the whole derivative.)"""
    from conftest import make_hf_family
    from references import transformer_lens_4_3
    from tiny_tokenizer import CORPUS, VOCAB, make_tokenizer

    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge

    make_hf_family("gpt2", vocab_size=VOCAB).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), device="cpu").eval()
    bridge.enable_compatibility_mode(no_processing=True)
    model = lenskit.HookedTransformer.from_pretrained(tmp_path)
    ids = bridge.to_tokens(CORPUS[0])
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.1.attn.hook_z", "blocks.1.hook_mlp_out",
             "blocks.2.hook_resid_post"]
    theirs_loss, theirs = bridge.run_with_cache(ids, names_filter=names, incl_bwd=True, return_type="loss")
    ours_loss, ours = model.run_with_cache(ids, names_filter=names, incl_bwd=True, return_type="loss")
    torch.testing.assert_close(ours_loss, theirs_loss, atol=1e-5, rtol=0)
    for name in names:
        assert theirs[name + "_grad"].abs().max() > 0
        torch.testing.assert_close(ours[name + "_grad"], theirs[name + "_grad"], atol=1e-7, rtol=1e-4)


def test_a_backward_hook_may_return_a_one_tuple_as_torch_module_hooks_do(gpt2, tokens):
    seen, point = [], "blocks.0.hook_resid_pre"

    def double(grad, hook):
        seen.append(grad.clone())
        return (grad * 2,)

    with gpt2.hooks(bwd_hooks=[(point, double)]):
        assert len(gpt2.hook_dict[point].bwd_hooks) == 1  # the context's hook, seen where it runs
        gpt2(tokens, return_type="loss").backward()
    doubled = gpt2.pos_embed.weight.grad.clone()
    gpt2.zero_grad(set_to_none=True)
    gpt2(tokens, return_type="loss").backward()
    assert len(gpt2.hook_dict[point].bwd_hooks) == 0 and len(seen) == 1
    torch.testing.assert_close(doubled, 2 * gpt2.pos_embed.weight.grad)  # the tuple's gradient went on
