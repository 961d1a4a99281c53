"""lenskit.transformer_lens's TransformerLens 3.x/4.x module paths, the names SAELens imports, component isinstance
checks, `install()`, and the TransformerBridge stand-in (TransformerLens itself is not needed here)."""

import subprocess
import sys

import pytest
import torch

import lenskit
import lenskit.transformer_lens as tl
from lenskit.transformer_lens import components, utilities, utils
from lenskit.transformer_lens.components.mlps.can_be_used_as_mlp import CanBeUsedAsMLP
from lenskit.transformer_lens.model_bridge import TransformerBridge, legacy_name


@pytest.fixture(scope="module")
def model():
    return tl.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)


def test_module_paths_name_the_same_objects():
    from lenskit.observe.hooks import HookedRootModule
    from lenskit.transformer_lens.HookedRootModule import HookedRootModule as by_module
    from lenskit.transformer_lens.HookedTransformer import HookedRootModule as by_ht
    from lenskit.transformer_lens.HookedTransformer import Loss, Output

    assert tl.HookedRootModule is by_module is by_ht is HookedRootModule
    assert utilities.get_act_name is utils.get_act_name and utilities.test_prompt is utils.test_prompt
    assert set(utils.__all__) <= set(dir(utilities))
    assert Loss is torch.Tensor and Output is not None and utils.USE_DEFAULT_VALUE is None


def test_in_and_out_are_the_blocks_input_and_output():
    assert utils.get_act_name("in", 3) == "blocks.3.hook_resid_pre"
    assert utils.get_act_name("out", 0) == "blocks.0.hook_resid_post"
    assert utils.get_act_name("mlp_post", 2) == "blocks.2.mlp.hook_post"


def test_components_hold_on_lenskit_pieces(model):
    block = model.blocks[0]
    assert isinstance(block.mlp, components.MLP) and isinstance(block.mlp, CanBeUsedAsMLP)
    assert not isinstance(block.mlp, components.GatedMLP)
    assert isinstance(block.attn, components.Attention) and isinstance(block.attn, components.AbstractAttention)
    assert not isinstance(block.attn, components.GroupedQueryAttention)  # GPT-2: a key per head
    assert isinstance(block, components.TransformerBlock) and isinstance(model.unembed, components.Unembed)
    assert isinstance(block.ln1, components.LayerNorm) and not isinstance(block.ln1, components.RMSNorm)
    assert not isinstance(torch.nn.Linear(2, 2), CanBeUsedAsMLP)
    assert issubclass(type(block.mlp), CanBeUsedAsMLP)
    with pytest.raises(TypeError, match="isinstance"):
        components.MLP()


def test_grouped_query_attention_is_told_apart():
    cfg = tl.HookedTransformerConfig(n_layers=1, d_model=32, n_ctx=16, d_head=8, n_heads=4, n_key_value_heads=2,
                                     d_vocab=50, positional_embedding_type="rotary", gated_mlp=True,
                                     normalization_type="RMS", act_fn="silu")
    gqa = tl.HookedTransformer(cfg)
    assert isinstance(gqa.blocks[0].attn, components.GroupedQueryAttention)
    assert not isinstance(gqa.blocks[0].attn, components.Attention)
    assert isinstance(gqa.blocks[0].mlp, components.GatedMLP) and isinstance(gqa.blocks[0].ln1, components.RMSNorm)


class _Tok:
    bos_token_id, pad_token_id, padding_side = 7, 0, "left"


def test_tokens_with_bos_removed():
    right = type("T", (), {"bos_token_id": 7, "pad_token_id": 0, "padding_side": "right"})()
    rows = torch.tensor([[7, 1, 2, 0], [7, 3, 4, 5]])
    assert utils.get_tokens_with_bos_removed(right, rows).tolist() == [[1, 2, 0], [3, 4, 5]]
    left = torch.tensor([[0, 0, 7, 1], [7, 3, 4, 5]])
    assert utils.get_tokens_with_bos_removed(_Tok(), left).tolist() == [[0, 0, 1], [3, 4, 5]]
    same = type("T", (), {"bos_token_id": 7, "pad_token_id": 7, "padding_side": "left"})()
    assert utils.get_tokens_with_bos_removed(same, torch.tensor([[7, 7, 7, 1], [7, 3, 4, 5]])).tolist() == \
        [[7, 7, 1], [3, 4, 5]]
    with pytest.raises(ValueError, match="no BOS"):
        utils.get_tokens_with_bos_removed(_Tok(), torch.tensor([[0, 0, 5, 1]]))


def test_install_registers_every_submodule_and_refuses_a_real_one():
    code = ("import sys, lenskit.transformer_lens as t; t.install(); t.install(); import transformer_lens as tl;"
            "from transformer_lens.components.mlps.can_be_used_as_mlp import CanBeUsedAsMLP;"
            "from transformer_lens.HookedTransformer import HookedRootModule, Loss, Output;"
            "import transformer_lens.utilities as u; from transformer_lens.model_bridge import TransformerBridge;"
            "assert tl is t and sys.modules['transformer_lens.patching'] is t.patching; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
    code = ("import sys, types; sys.modules['transformer_lens'] = types.ModuleType('transformer_lens');"
            "import lenskit.transformer_lens as t; t.install()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: a real transformer_lens") and "call install() first" in last


def test_bridge_boots_raw_and_compatibility_mode_processes(model):
    bridge = TransformerBridge.boot_transformers(lenskit.DEFAULT_MODEL, device="cpu")
    raw = tl.HookedTransformer.from_pretrained_no_processing(lenskit.DEFAULT_MODEL)
    tokens = bridge.to_tokens("def f(x): return x")
    assert tokens[0, 0] == bridge.tokenizer.bos_token_id
    with torch.no_grad():
        torch.testing.assert_close(bridge(tokens), raw(tokens))
        bridge.enable_compatibility_mode(disable_warnings=True)
        torch.testing.assert_close(bridge(tokens), model(tokens))
        assert torch.equal(bridge.W_E, model.W_E) and not torch.equal(bridge.W_E, raw.W_E)  # centred, as processed
    with pytest.raises(RuntimeError, match="already"):
        bridge.enable_compatibility_mode()


def test_bridge_takes_transformer_lens_4_names(model):
    bridge = TransformerBridge.boot_transformers(lenskit.DEFAULT_MODEL, device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True)
    tokens = bridge.to_tokens("x = 1")
    _, cache = bridge.run_with_cache(tokens, names_filter=["blocks.0.attn.hook_out", "blocks.1.hook_in", "embed.hook_out"])
    _, ref = model.run_with_cache(tokens)
    assert sorted(cache.keys()) == ["blocks.0.hook_attn_out", "blocks.1.hook_resid_pre", "hook_embed"]
    for name in cache.keys():
        torch.testing.assert_close(cache[name], ref[name])
    zeroed = bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.hook_out", lambda x, hook: x * 0)])
    by_legacy = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mlp_out", lambda x, hook: x * 0)])
    torch.testing.assert_close(zeroed, by_legacy)
    assert legacy_name("blocks.2.mlp.out.hook_in") == "blocks.2.mlp.hook_post"
    assert legacy_name("blocks.2.hook_resid_mid") == "blocks.2.hook_resid_mid"
    out = bridge.generate("def", max_new_tokens=3, do_sample=False, verbose=False)
    assert out == model.generate("def", max_new_tokens=3, do_sample=False, verbose=False) and out.startswith("def")


@pytest.mark.parametrize("remove_batch_dim", [False, True])
def test_pos_slice_keeps_the_selected_positions(model, remove_batch_dim):
    tokens = model.to_tokens("def f(x): return x + 1")
    n = tokens.shape[1]
    _, full = model.run_with_cache(tokens, remove_batch_dim=remove_batch_dim)
    for pos_slice, index in ((2, [2]), (-1, [n - 1]), (utils.Slice([0, 3]), [0, 3])):
        _, part = model.run_with_cache(tokens, remove_batch_dim=remove_batch_dim, pos_slice=pos_slice)
        assert sorted(part.keys()) == sorted(full.keys())
        at = torch.tensor(index)
        lead = 0 if remove_batch_dim else 1
        for name in ("hook_embed", "blocks.1.hook_resid_mid", "blocks.0.attn.hook_q", "blocks.1.mlp.hook_post"):
            assert torch.equal(part[name], full[name].index_select(lead, at))
        for name in ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"):
            assert torch.equal(part[name], full[name].index_select(full[name].ndim - 2, at))


def test_unembed_hooks_are_the_readouts_input_and_logits(model):
    logits, cache = model.run_with_cache("The cat sat on the mat")
    assert list(cache.keys())[-2:] == ["unembed.hook_in", "unembed.hook_out"]
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    centred = resid - resid.mean(-1, keepdim=True)  # fold_ln leaves ln_final without weight or bias
    normed = centred / (centred.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    torch.testing.assert_close(cache["unembed.hook_in"], normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["unembed.hook_out"], normed @ model.W_U + model.b_U, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache["unembed.hook_out"], logits)
    # A hook on hook_in changes the logits the forward returns: nothing reaches them past it.
    zeroed = model.run_with_hooks("The cat sat on the mat", fwd_hooks=[("unembed.hook_in", lambda x, hook: x * 0)])
    torch.testing.assert_close(zeroed, model.b_U.expand_as(zeroed))
    plain = lenskit.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)
    assert "unembed.hook_in" not in plain.hook_dict  # lenskit's own hook set is unchanged


def test_layer_zero_remainder_is_transformer_lens_s_final_stream(model):
    tokens = model.to_tokens(["The cat sat on the mat", "A dog ran in the park"])
    _, cache = model.run_with_cache(tokens)
    assert isinstance(cache, tl.ActivationCache) and isinstance(cache, lenskit.ActivationCache)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    for stack_fn in (cache.stack_head_results, cache.stack_neuron_results):
        stack, labels = stack_fn(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
        assert labels == ["remainder"] and torch.equal(stack, final[None])
        empty, labels = stack_fn(layer=0, pos_slice=-1, return_labels=True)
        assert labels == [] and empty.shape[0] == 0
    # Layer 1 and lenskit's own cache keep lenskit's definition: the stream entering the layer.
    stack = cache.stack_head_results(layer=1, pos_slice=-1, incl_remainder=True)
    torch.testing.assert_close(stack.sum(0), cache["blocks.1.hook_resid_pre"][:, -1])
    plain = lenskit.ActivationCache(dict(cache.cache_dict), model.cfg.n_layers, model)
    torch.testing.assert_close(plain.stack_head_results(layer=0, pos_slice=-1, incl_remainder=True)[-1],
                               cache["blocks.0.hook_resid_pre"][:, -1])


def test_errors_are_also_the_assertion_transformer_lens_raises(model):
    from lenskit.transformer_lens.errors import KeyAssertionError, ValueAssertionError

    _, cache = model.run_with_cache(model.to_tokens(["one two", "three four"]))
    with pytest.raises(ValueError, match="batch size 2") as caught:
        cache.remove_batch_dim()
    assert isinstance(caught.value, AssertionError) and isinstance(caught.value, ValueAssertionError)
    with pytest.raises(AssertionError, match="use_attn_result"):
        model.add_hook("blocks.0.attn.hook_result", lambda x, hook: x)
    with pytest.raises(KeyError, match="set_use_split_qkv_input") as caught:
        model.add_hook("blocks.0.hook_q_input", lambda x, hook: x)
    assert isinstance(caught.value, KeyAssertionError)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())  # nothing attached by a refusal
    model.set_use_attn_result(True)
    try:
        seen = []
        model.add_hook("blocks.0.attn.hook_result", lambda x, hook: seen.append(x.shape))
        model("one two")
        assert seen == [(1, 3, model.cfg.n_heads, model.cfg.d_model)]
    finally:
        model.reset_hooks()
        model.set_use_attn_result(False)
    with pytest.raises(AssertionError):
        model.get_token_position(" zebra", "one two")


def test_loading_from_pretrained_looks_names_up_offline():
    import json

    from lenskit.io.hub import embedded_model_folder
    from lenskit.transformer_lens import loading_from_pretrained as loading

    assert loading.get_official_model_name("GPT2-Small") == "gpt2"
    assert loading.get_official_model_name("pythia-70m-deduped") == "pythia-70m"
    assert set(loading.make_model_alias_map().values()) == set(loading.OFFICIAL_MODEL_NAMES)
    with pytest.raises(ValueError, match="closest: gpt2") as caught:
        loading.get_official_model_name("gpt3")
    assert isinstance(caught.value, AssertionError)
    # The embedded GPT-2's fields against its own config.json, read here as transformers names them.
    hf = json.loads((embedded_model_folder("stdlib-gpt2") / "config.json").read_text())
    got = loading.convert_hf_model_config("stdlib-gpt2")
    assert (got["d_model"], got["n_heads"], got["n_layers"], got["n_ctx"], got["d_vocab"]) == \
        (hf["n_embd"], hf["n_head"], hf["n_layer"], hf["n_positions"], hf["vocab_size"])
    assert got["d_head"] * got["n_heads"] == got["d_model"] and got["normalization_type"] == "LN"
    llama = loading.convert_hf_model_config("stdlib-llama")
    assert llama["normalization_type"] == "RMS" and llama["gated_mlp"] and llama["act_fn"] == "silu"
    assert loading.convert_hf_model_config("gpt2")["d_mlp"] == 3072  # a preset, no folder needed
    # A model built from the config has the loaded model's parameter shapes.
    built = tl.HookedTransformer(loading.get_pretrained_model_config("stdlib-gpt2"))
    loaded = tl.HookedTransformer.from_pretrained_no_processing("stdlib-gpt2")
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in loaded.state_dict().items()}
    with pytest.raises(ValueError, match="hub"):
        loading.get_checkpoint_labels("attn-only-2l")


def test_what_circuit_tracer_relies_on():
    model = tl.HookedTransformer.from_pretrained_no_processing(lenskit.DEFAULT_MODEL)
    tokens = model.to_tokens("The cat sat")
    assert model.cfg.to_dict()["n_layers"] == model.cfg.n_layers and model.cfg.output_logits_soft_cap == 0.0
    with pytest.raises(Exception, match="cannot assign"):
        model.cfg.n_layers = 3  # every other field stays frozen
    # A soft-cap written to the config changes this model's forward: c tanh(logits / c), by hand.
    plain = model(tokens)
    model.cfg.output_logits_soft_cap = 2.0
    torch.testing.assert_close(model(tokens), 2.0 * torch.tanh(plain / 2.0))
    model.cfg.output_logits_soft_cap = 0.0
    # A module put in place of model.unembed is what the forward calls.
    seen = []

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(x.shape)
            return self.inner(x) * 0 + 1

    original = model.unembed
    model.unembed = Wrapper(original)
    try:
        assert torch.equal(model(tokens), torch.ones_like(plain)) and seen == [(*tokens.shape, model.cfg.d_model)]
    finally:
        model.unembed = original
    torch.testing.assert_close(model(tokens), plain)
    # A backward hook from a hooks() block stays on the graph of the forward run inside it, as in TransformerLens.
    grads = []
    embed = model.embed.weight
    embed.requires_grad_(True)
    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", lambda g, hook: grads.append(g.shape))]):
        loss = model(tokens, return_type="loss")
    loss.backward()
    assert grads == [(*tokens.shape, model.cfg.d_model)]
    model(tokens, return_type="loss").backward()  # a forward after the block: the hook is not on its graph
    assert len(grads) == 1
    assert [b.attn.attn_type for b in model.blocks] == ["global"] * model.cfg.n_layers
