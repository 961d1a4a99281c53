"""`lenskit.transformer_lens`: TransformerLens 3's defaults over lenskit's model, held beside TransformerLens 4.3's
bridge in compatibility mode on the same checkpoint (a tiny GPT-2 with GPT-2's real tokenizer): BOS first on text,
processed weights from `from_pretrained`, raw ones from `from_pretrained_no_processing`, TransformerLens's config
names, and `lenskit.HookedTransformer`'s own defaults left as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tl_fixtures import EOS, boot_bridge, tiny_gpt2_folder

import lenskit
import lenskit.transformer_lens as transformer_lens

RAW = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
TEXTS = ["Hello world, this is", "The cat sat on the mat and"]


@pytest.fixture(scope="module")
def folder():
    return tiny_gpt2_folder()


@pytest.fixture(scope="module")
def bridge(folder):
    return boot_bridge(folder)


@pytest.fixture(scope="module")
def raw_bridge(folder):
    return boot_bridge(folder, **RAW)


@pytest.fixture(scope="module")
def ours(folder):
    return transformer_lens.HookedTransformer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def ours_raw(folder):
    return transformer_lens.HookedTransformer.from_pretrained_no_processing(str(folder))


def test_bos_is_prepended_as_in_transformer_lens(ours, bridge):
    for text in (TEXTS[0], TEXTS):
        assert torch.equal(ours.to_tokens(text), bridge.to_tokens(text))
    assert ours.to_tokens(TEXTS[0])[0, 0].item() == EOS
    assert ours.to_str_tokens(TEXTS[0]) == bridge.to_str_tokens(TEXTS[0])
    assert ours.to_str_tokens(TEXTS[0], prepend_bos=False) == bridge.to_str_tokens(TEXTS[0], prepend_bos=False)
    assert torch.equal(ours.to_tokens(TEXTS[0], prepend_bos=False), bridge.to_tokens(TEXTS[0], prepend_bos=False))
    assert ours.cfg.default_prepend_bos is True and bridge.cfg.default_prepend_bos is True


def test_lenskit_keeps_its_own_default(folder):
    plain = lenskit.HookedTransformer.from_pretrained(folder)
    assert plain.cfg.default_prepend_bos is None  # GPT-2's tokenizer adds no BOS, so neither does lenskit
    assert plain.to_tokens("Hello world").tolist() == [[15496, 995]]
    assert plain.to_str_tokens("Hello world", prepend_bos=True) == ["<|endoftext|>", "Hello", " world"]
    assert plain.processing == ()


def test_text_forward_takes_prepend_bos(ours, bridge):
    for prepend in (None, True, False):
        mine = ours(TEXTS[0], prepend_bos=prepend)
        theirs = bridge(TEXTS[0], prepend_bos=prepend)
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() < 1e-4
    with_bos = ours(TEXTS[0])
    without = ours(TEXTS[0], prepend_bos=False)
    assert with_bos.shape[1] == without.shape[1] + 1  # the default put BOS first
    logits, cache = ours.run_with_cache(TEXTS[0], prepend_bos=False)
    assert cache["resid_post", 0].shape[1] == without.shape[1]
    loss = ours(TEXTS[0], return_type="loss")
    assert abs(loss.item() - bridge(TEXTS[0], return_type="loss").item()) < 1e-4


def test_from_pretrained_processes_as_transformer_lens(ours, ours_raw, bridge, raw_bridge):
    assert set(ours.processing) >= {"fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"}
    assert ours_raw.processing == ()
    tokens = bridge.to_tokens(TEXTS)
    assert (ours(tokens) - bridge(tokens)).abs().max().item() < 1e-4
    assert (ours_raw(tokens) - raw_bridge(tokens)).abs().max().item() < 1e-4
    for name in ("W_U", "W_E", "W_pos", "W_Q", "W_O", "b_O", "W_in", "b_out"):
        assert (getattr(ours, name) - getattr(bridge, name)).abs().max().item() < 1e-5, name
        assert (getattr(ours_raw, name) - getattr(raw_bridge, name)).abs().max().item() < 1e-5, name
    assert not torch.allclose(ours.W_U, ours_raw.W_U)  # processing happened, so the pairs could differ


def test_config_names_match_transformer_lens(ours, bridge):
    for name in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "act_fn",
                 "normalization_type", "positional_embedding_type", "default_prepend_bos", "d_vocab_out"):
        assert getattr(ours.cfg, name) == getattr(bridge.cfg, name), name
    assert ours.cfg.device == str(bridge.cfg.device) == "cpu"
    assert ours.cfg.dtype == torch.float32
    assert abs(ours.cfg.eps - bridge.cfg.eps) < 1e-12


def test_cfg_device_and_dtype_follow_the_model(folder):
    model = lenskit.HookedTransformer.from_pretrained(folder)
    twin = lenskit.HookedTransformer.from_pretrained(folder)
    model.to(torch.bfloat16)
    assert model.cfg.dtype == torch.bfloat16 and twin.cfg.dtype == torch.float32  # each model owns its config
    assert model.cfg == twin.cfg  # where a model is does not change what it is
    meta = lenskit.HookedTransformer(model.cfg.replace(n_layers=1)).to("meta")
    assert meta.cfg.device == "meta"


def test_hooked_transformer_config_builds_a_random_model():
    cfg = transformer_lens.HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=16, d_head=8, d_vocab=50,
                                                   act_fn="gelu_new", seed=3)
    model = transformer_lens.HookedTransformer(cfg)
    again = transformer_lens.HookedTransformer(cfg)
    assert model.cfg.n_heads == 4 and model.cfg.d_mlp == 128 and not model.cfg.tie_word_embeddings
    assert torch.equal(model.W_E, again.W_E)  # the seed seeds the init
    tokens = torch.tensor([[1, 2, 3, 4]])
    logits, cache = model.run_with_cache(tokens)
    assert logits.shape == (1, 4, 50) and cache["resid_post", 1].shape == (1, 4, 32)
    llama = transformer_lens.HookedTransformer(dict(n_layers=1, d_model=32, n_ctx=16, d_head=8, d_vocab=50,
                                                    act_fn="silu", gated_mlp=True, normalization_type="RMS",
                                                    positional_embedding_type="rotary", n_key_value_heads=2))
    assert llama.cfg.mlp == "swiglu" and llama.cfg.n_kv_heads == 2 and llama.W_gate is not None


def test_hooked_transformer_config_builds_a_relu_mlp():
    cfg = transformer_lens.HookedTransformerConfig(n_layers=2, d_model=10, n_heads=2, d_head=5, d_mlp=8, n_ctx=20,
                                                   d_vocab=50, act_fn="relu", seed=4)
    model = transformer_lens.HookedTransformer(cfg)
    assert model.cfg.act_fn == "relu" and model.cfg.mlp == "gelu"  # the plain MLP, with ReLU
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    for layer in range(2):  # by hand: ln2's output -> W_in, b_in -> relu -> W_out, b_out
        x = cache["normalized", layer, "ln2"]
        pre = x @ model.W_in[layer] + model.b_in[layer]
        assert torch.allclose(cache["pre", layer], pre, atol=1e-6) and (pre < 0).any()
        assert torch.equal(cache["post", layer], torch.relu(cache["pre", layer]))
        out = cache["post", layer] @ model.W_out[layer] + model.b_out[layer]
        assert torch.allclose(cache["mlp_out", layer], out, atol=1e-6)
    assert torch.allclose(logits, cache["ln_final.hook_normalized"] @ model.W_U + model.b_U, atol=1e-5)


def test_start_at_layer_runs_the_later_blocks_on_a_given_stream():
    model = transformer_lens.HookedTransformer(dict(n_layers=3, d_model=10, n_heads=2, d_head=5, d_mlp=8, n_ctx=20,
                                                    d_vocab=50, act_fn="relu", seed=5))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        embed, same_tokens, shortformer, mask = model.input_to_embed(tokens)
        assert torch.equal(same_tokens, tokens) and shortformer is None and mask is None
        assert torch.equal(model(embed, start_at_layer=0), model(tokens))
        assert torch.equal(model(embed, start_at_layer=0, tokens=tokens, return_type="loss"),
                           model(tokens, return_type="loss"))
        logits, cache = model.run_with_cache(tokens)
        for start in (1, -1):  # a negative start counts from the end, as a slice does
            later, seen = model.run_with_cache(cache["resid_pre", start % 3], start_at_layer=start)
            assert torch.equal(later, logits)  # the same hooks, so the same kernels: bit for bit
            assert "hook_embed" not in seen and f"blocks.{start % 3 - 1}.hook_resid_post" not in seen
        middle = model(model(tokens, stop_at_layer=1), start_at_layer=1, stop_at_layer=2)
        assert torch.equal(middle, model(tokens, stop_at_layer=2))
    for bad, words in ((dict(start_at_layer=3), "start_at_layer must be an int in \\[-3, 2\\]"),
                       (dict(start_at_layer=1, return_type="loss"), "needs the token ids"),
                       (dict(start_at_layer=0, shortformer_pos_embed=embed), "no shortformer positions"),
                       (dict(start_at_layer=0, attention_mask=torch.zeros(2, 9)), "masked positions")):
        with pytest.raises(ValueError, match=words):
            model(embed, **bad)
    with pytest.raises(ValueError, match=r"the residual stream \[batch, pos, 10\], got a torch.int64 tensor"):
        model(tokens, start_at_layer=1)


@pytest.mark.parametrize("norm", ["LN", "RMS"])
def test_caching_the_norms_moves_no_number(norm):
    """The namespace's norms are written out, as TransformerLens's are: a run caching their hooks gives the logits
    and streams of a run that does not, bit for bit (lenskit's own fused norm differs from its hooked one by rounding)."""
    model = transformer_lens.HookedTransformer(dict(n_layers=2, d_model=16, n_heads=2, d_head=8, n_ctx=20, d_vocab=50,
                                                    normalization_type=norm, seed=6))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        assert torch.equal(logits, model(tokens)) and torch.equal(cache["resid_post", 0], model(tokens, stop_at_layer=1))
        ln = model.blocks[1].ln2
        x = cache["resid_mid", 1] - cache["resid_mid", 1].mean(-1, keepdim=True) if norm == "LN" else cache["resid_mid", 1]
        scale = (x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
        assert torch.allclose(cache["scale", 1, "ln2"], scale, atol=1e-6)
        assert torch.allclose(ln(cache["resid_mid", 1]), F.layer_norm(cache["resid_mid", 1], (16,), ln.weight, ln.bias)
                              if norm == "LN" else F.rms_norm(cache["resid_mid", 1], (16,), ln.weight, ln.eps), atol=1e-6)


@pytest.mark.parametrize("bad, words", [
    (dict(attn_only=True), "always have an MLP"),
    (dict(normalization_type="LNPre"), "fold_ln"),
    (dict(act_fn="solu_ln"), "act_fn='solu_ln'"),
    (dict(act_fn="relu", gated_mlp=True), "act_fn='relu' with gated_mlp=True"),
    (dict(positional_embedding_type="shortformer"), "'standard' and 'rotary'"),
    (dict(not_a_setting=1), "not_a_setting"),
])
def test_config_refuses_what_lenskit_does_not_build(bad, words):
    with pytest.raises(ValueError, match=words):
        transformer_lens.HookedTransformer(dict(n_layers=1, d_model=32, n_ctx=16, d_head=8, d_vocab=50, **bad))


def test_loading_refusals(folder):
    with pytest.raises(ValueError, match="checkpoint_index"):
        transformer_lens.HookedTransformer.from_pretrained(str(folder), checkpoint_index=3)
    with pytest.raises(ValueError, match="pads on the right only"):
        transformer_lens.HookedTransformer.from_pretrained(str(folder), default_padding_side="left")
    with pytest.raises(ValueError, match="pads on the right only"):
        lenskit.HookedTransformer.from_pretrained(folder).to_tokens(TEXTS, padding_side="left")


def test_to_tokens_truncates_as_transformer_lens(ours, bridge):
    long = " word" * 300  # past n_ctx = 128
    assert torch.equal(ours.to_tokens(long), bridge.to_tokens(long))
    assert ours.to_tokens(long).shape[1] == ours.cfg.n_ctx
    plain = lenskit.HookedTransformer.from_pretrained(tiny_gpt2_folder())
    with pytest.raises(ValueError, match="n_ctx"):
        plain(long)  # lenskit's own default refuses rather than cut


def test_hf_model_argument(folder):
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    model = transformer_lens.HookedTransformer.from_pretrained("gpt2", hf_model=hf,
                                                               tokenizer=lenskit.io.tokenizer.load_tokenizer(folder))
    reference = transformer_lens.HookedTransformer.from_pretrained(str(folder))
    tokens = reference.to_tokens(TEXTS[0])
    assert isinstance(model, transformer_lens.HookedTransformer)
    assert (model(tokens) - reference(tokens)).abs().max().item() < 1e-5


def test_per_module_embedding_weights(ours, bridge):
    assert ours.embed.W_E is ours.W_E and torch.equal(ours.pos_embed.W_pos, ours.W_pos)
    assert torch.equal(ours.unembed.W_U, ours.W_U) and torch.equal(ours.unembed.b_U, ours.b_U)
    assert (ours.unembed.W_U - bridge.W_U).abs().max().item() < 1e-5
    assert (ours.unembed.b_U - bridge.b_U).abs().max().item() < 1e-5
    assert ours.unembed.b_U.any()  # fold_ln moved the final LayerNorm's bias into it, as TransformerLens does


def test_the_namespace_has_transformer_lens_module_paths():
    import importlib

    for path in ("utils", "patching", "hook_points", "evals", "past_key_value_caching", "FactoredMatrix",
                 "HookedTransformer", "HookedTransformerConfig"):
        importlib.import_module(f"lenskit.transformer_lens.{path}")
    from lenskit.transformer_lens import FactoredMatrix, HookedRootModule, HookPoint

    assert HookPoint is lenskit.HookPoint and FactoredMatrix(torch.eye(3), torch.eye(3)).AB.shape == (3, 3)
    assert issubclass(transformer_lens.HookedTransformer, HookedRootModule)


def test_switches_show_on_the_config_and_run_with_cache_takes_transformer_lens_flags(folder):
    model = transformer_lens.HookedTransformer.from_pretrained(str(folder))
    assert not model.cfg.use_attn_result and not model.cfg.use_hook_mlp_in
    model.set_use_attn_result(True)
    model.set_use_hook_mlp_in(True)
    assert model.cfg.use_attn_result and model.cfg.use_hook_mlp_in and not model.cfg.use_split_qkv_input
    _, cache = model.run_with_cache("Hello world", clear_contexts=True)
    assert "blocks.0.attn.hook_result" in cache and "blocks.1.hook_mlp_in" in cache
    model.set_use_attn_result(False)
    assert not model.cfg.use_attn_result
    with pytest.raises(ValueError, match="reset_hooks_end=True"):
        model.run_with_cache("Hello world", reset_hooks_end=False)
    built = transformer_lens.HookedTransformer(dict(n_layers=1, d_model=32, n_ctx=16, d_head=8, d_vocab=50,
                                                    use_attn_result=True))
    assert built.cfg.use_attn_result


def test_generate_has_transformer_lens_defaults(ours, bridge):
    prompt = "Hello world, this is"
    mine = ours.generate(prompt, max_new_tokens=6, do_sample=False, verbose=False)
    theirs = bridge.generate(prompt, max_new_tokens=6, do_sample=False, verbose=False)
    assert isinstance(mine, str) and mine == theirs  # text in, text out, BOS left out of the text
    for cache in (True, False):
        assert ours.generate(prompt, 6, do_sample=False, use_past_kv_cache=cache, verbose=False) == theirs
    tokens = ours.to_tokens(prompt)
    out = ours.generate(tokens, max_new_tokens=4, do_sample=False, verbose=False)
    assert torch.equal(out, bridge.generate(tokens, max_new_tokens=4, do_sample=False, verbose=False))
    torch.manual_seed(0)
    first = ours.generate(prompt, max_new_tokens=5, verbose=False)  # sampled by default, from torch's generator
    torch.manual_seed(0)
    assert ours.generate(prompt, max_new_tokens=5, verbose=False) == first
    import inspect

    assert list(inspect.signature(ours.generate).parameters)[:14] == [
        "input", "max_new_tokens", "stop_at_eos", "eos_token_id", "do_sample", "top_k", "top_p", "temperature",
        "freq_penalty", "use_past_kv_cache", "prepend_bos", "padding_side", "return_type", "verbose"]
