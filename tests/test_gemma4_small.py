"""Gemma 4 E2B and E4B's pieces against transformers' own `Gemma4ForCausalLM`: per-layer inputs (a small input per
block from the tokens, lenskit.pieces.per_layer), kv sharing (the last blocks reading an earlier block's keys and
values, lenskit.pieces.kv_sharing) and the double-wide MLP of the sharing blocks, each alone and together.

Golden parity at the logits and every residual write (tests/golden.py), on the fused and the eager attention paths,
tied and untied, through transformers' single and sharded files and through our own save_pretrained; a padded batch
against each prompt alone; sliding blocks whose window (5) is shorter than the prompt (17). The hooks: each block's
per-layer input and write as transformers computes them, the sharing block's keys as its source's, an edit of the
source's keys reaching the sharing block as it does in transformers, and one forward's state per thread.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import transformers
from conftest import make_hf_family
from fixtures import unchanged_copy
from golden import assert_golden, hf_blocks, max_diff, run_then_remove
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# 4 blocks (sliding, full, sliding, full); with 2 shared, block 2 reads block 0's keys and block 3 block 1's
CONFIGS = {
    "per_layer_inputs": dict(num_kv_shared_layers=0),
    "kv_sharing": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=2, use_double_wide_mlp=False),
    "kv_sharing_double_wide": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=2),
    "together": dict(num_kv_shared_layers=2),
    "together_one_shared": dict(num_kv_shared_layers=1),
}


def small(name: str = "together", seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """The registry's tiny Gemma 4 (per-layer inputs of 8, double-wide sharing blocks) over 4 blocks, as `name` says."""
    hf = make_hf_family("gemma4_text", seed=seed, num_hidden_layers=4, layer_types=LAYERS,
                        **{**CONFIGS[name], **changes})
    # transformers 5.24 slices its per-layer inputs before the sharing blocks unless asked for every hidden state,
    # and has none to slice without them: a TypeError. The outputs are the same either way.
    hf.config.output_hidden_states = True
    return hf


EAGER = [(lambda n: n.endswith("hook_pattern"), unchanged_copy)]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_golden_each_piece_alone_and_together(name, tied, tokens):
    hf = small(name, tie_word_embeddings=tied)
    model = HookedTransformer.from_hf(hf)
    cfg = model.cfg
    assert cfg.tie_word_embeddings == tied and cfg.sliding_window == 5 < tokens.shape[1]
    assert (cfg.block.d_per_layer is not None) == (name != "kv_sharing" and name != "kv_sharing_double_wide")
    assert cfg.block.n_kv_shared_layers == CONFIGS[name]["num_kv_shared_layers"]
    assert_golden(model, hf, tokens)
    assert_golden(model, hf, tokens, fwd_hooks=EAGER)


def test_golden_with_keys_as_values_in_the_sharing_blocks(tokens):
    """31B's full blocks (their own kv heads, keys as values) as the source of a sharing full block."""
    hf = small("together", attention_k_eq_v=True, num_global_key_value_heads=1)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.attention.full_k_is_v and model.blocks[3].attn.kv_source == 1 and model.blocks[3].attn.n_kv_heads == 1
    assert_golden(model, hf, tokens)
    assert_golden(model, hf, tokens, fwd_hooks=EAGER)


@pytest.mark.parametrize("shards", [None, "3KB"], ids=["single-file", "sharded"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_golden_through_transformers_files(shards, tied, tmp_path, tokens):
    small("together", seed=3, tie_word_embeddings=tied).save_pretrained(
        tmp_path, **({"max_shard_size": shards} if shards else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shards)
    theirs = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    theirs.config.output_hidden_states = True
    assert_golden(HookedTransformer.from_pretrained(tmp_path), theirs, tokens)


def test_our_files_are_transformers_own_and_read_back(tmp_path, tokens):
    """save_pretrained writes transformers' names (no k/v projection or norm in the sharing blocks), which both
    libraries read back to the same model."""
    model = HookedTransformer.from_hf(small("together", seed=5, tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    hf = small("together", seed=5, tie_word_embeddings=False)
    assert names == set(hf.state_dict())
    assert "model.embed_tokens_per_layer.weight" in names and "model.layers.0.per_layer_input_gate.weight" in names
    assert not any(n.startswith(("model.layers.2.self_attn.k_", "model.layers.3.self_attn.v_")) for n in names)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size_per_layer_input"], config["num_kv_shared_layers"], config["use_double_wide_mlp"]) == (8, 2, True)
    back = HookedTransformer.from_pretrained(tmp_path)
    assert back.cfg == model.cfg.replace(name=tmp_path.name)  # an absolute folder is named by its own name
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    theirs = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    theirs.config.output_hidden_states = True
    assert_golden(back, theirs, tokens)


def test_a_checkpoint_holding_the_sharing_blocks_k_and_v_weights_loads_without_them(tmp_path, tokens):
    """Google's files keep k_proj, v_proj and k_norm in the sharing blocks, which no forward reads (transformers drops
    them on load, `_keys_to_ignore_on_load_unexpected`); so does lenskit. Elsewhere an unknown tensor is refused."""
    hf = small("together", seed=6)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in (2, 3):
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(32, 32)
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"] = torch.randn(32, 32)
        tensors[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(16)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_golden(HookedTransformer.from_pretrained(tmp_path), hf, tokens)
    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.randn(48)  # block 1 computes its keys: not a dropped name
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.bias"):
        HookedTransformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_padded_batch_equals_each_prompt_alone_and_transformers(name):
    hf = small(name, seed=7)
    model = HookedTransformer.from_hf(hf)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 101, (n,), generator=gen) for n in (17, 9, 4)]
    batch = torch.full((3, 17), 0, dtype=torch.long)  # right-padded with the pad id
    for row, p in enumerate(prompts):
        batch[row, : len(p)] = p
    with torch.no_grad():
        together = model(batch)
        for row, p in enumerate(prompts):
            alone = hf(p[None]).logits[0]
            assert max_diff(together[row, : len(p)], alone) <= 1e-4, row
            assert max_diff(together[row, : len(p)], model(p[None])[0]) <= 1e-4, row  # rounding, not a leak


# ------------------------------------------------------------------ the hooks
def hf_per_layer(hf, tokens) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Each transformers block's per-layer input (its argument) and per-layer write (post_per_layer_input_norm)."""
    inputs, writes, handles = {}, {}, []
    for i, block in enumerate(hf_blocks(hf)):
        handles.append(block.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, args[1] if len(args) > 1 else kwargs["per_layer_input"]),
            with_kwargs=True))
        handles.append(block.post_per_layer_input_norm.register_forward_hook(
            lambda m, args, out, i=i: writes.__setitem__(i, out)))
    run_then_remove(hf, tokens, handles)
    return inputs, writes


def test_per_layer_inputs_and_writes_are_transformers(tokens):
    hf = small("together")
    model = HookedTransformer.from_hf(hf)
    inputs, writes = hf_per_layer(hf, tokens)
    _, cache = model.run_with_cache(tokens)
    d = model.cfg.block.d_per_layer
    assert cache["per_layer_inputs.hook_token"].shape == cache["per_layer_inputs.hook_proj"].shape == (3, 17, 4, d)
    for i in range(4):
        assert cache["per_layer_in", i].shape == (3, 17, d) and cache["per_layer_out", i].shape == (3, 17, 32)
        assert max_diff(cache["per_layer_in", i], inputs[i]) <= 1e-5
        assert max_diff(cache["per_layer_out", i], writes[i]) <= 1e-4
    mixed = (cache["per_layer_inputs.hook_token"] + cache["per_layer_inputs.hook_proj"]) * 2 ** -0.5
    torch.testing.assert_close(cache["per_layer_in", 2], mixed[:, :, 2], atol=1e-6, rtol=0)
    # the write is a term of the decomposition and of direct logit attribution, and an ablation target of its own
    stack, labels = cache.decompose_resid(return_labels=True)
    assert [l for l in labels if l.endswith("per_layer_out")] == [f"{i}_per_layer_out" for i in range(4)]
    torch.testing.assert_close(stack.sum(0), cache["resid_post", 3], atol=1e-5, rtol=0)


def test_editing_one_blocks_per_layer_input_changes_that_block_only(tokens):
    model = HookedTransformer.from_hf(small("together"))
    _, clean = model.run_with_cache(tokens)
    hooks = [("blocks.2.hook_per_layer_in", lambda x, hook: torch.zeros_like(x))]
    _, cache = model.run_with_cache(tokens, fwd_hooks=hooks)
    assert torch.equal(cache["resid_pre", 2], clean["resid_pre", 2])
    assert torch.equal(cache["per_layer_in", 3], clean["per_layer_in", 3])
    assert max_diff(cache["per_layer_out", 2], clean["per_layer_out", 2]) > 1e-3


def test_sharing_blocks_name_their_source_and_read_its_keys(tokens):
    model = HookedTransformer.from_hf(small("together"))
    cfg = model.cfg
    assert cfg.kv_source_layers == (None, None, 0, 1)
    assert [b.attn.kv_source for b in model.blocks[2:]] == [0, 1] and not hasattr(model.blocks[1].attn, "kv_source")
    for gone in ("attn.hook_rot_k", "attn.k_norm.hook_scale", "attn.v_norm.hook_normalized"):
        assert f"blocks.1.{gone}" in model.hook_dict and f"blocks.3.{gone}" not in model.hook_dict
    assert "k" not in dict(model.blocks[3].attn.qkv.named_parameters()) and model.blocks[3].mlp.W_in.shape == (32, 96)
    _, cache = model.run_with_cache(tokens)
    for reader, source in ((2, 0), (3, 1)):
        assert torch.equal(cache[f"blocks.{reader}.attn.hook_k"], cache[f"blocks.{source}.attn.hook_rot_k"])
        assert torch.equal(cache[f"blocks.{reader}.attn.hook_v"], cache[f"blocks.{source}.attn.v_norm.hook_normalized"])
    with pytest.raises(ValueError, match=r"block 3 has no key or value weights: it reads block 1's keys"):
        model.blocks[3].attn.W_V


def test_an_edit_of_the_sources_keys_reaches_the_sharing_block_as_in_transformers(tokens):
    """Shifting block 0's key projection (hook_k) changes block 2's attention too: the same keys, in both libraries.
    (A shift, not a scale, which the key norm would undo.)"""
    hf = small("together")
    model = HookedTransformer.from_hf(hf)
    handle = hf.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, args, out: out + 1.0)
    try:
        with torch.no_grad():
            theirs = hf(tokens).logits
    finally:
        handle.remove()
    hooks = [("blocks.0.attn.hook_k", lambda k, hook: k + 1.0)]
    _, clean = model.run_with_cache(tokens)
    logits, cache = model.run_with_cache(tokens, fwd_hooks=hooks)
    assert max_diff(logits, theirs) <= 1e-4
    assert torch.equal(cache["blocks.2.attn.hook_k"], cache["blocks.0.attn.hook_rot_k"])  # the sharing block saw the edit
    assert max_diff(cache["blocks.2.attn.hook_k"], clean["blocks.2.attn.hook_k"]) > 1e-3
    # an edit where the sharing block reads them changes that block only
    hooks = [("blocks.3.attn.hook_k", lambda k, hook: k * 3.0)]  # after the key norm: a scale bites
    _, cache = model.run_with_cache(tokens, fwd_hooks=hooks)
    assert torch.equal(cache["blocks.1.attn.hook_rot_k"], clean["blocks.1.attn.hook_rot_k"])
    assert torch.equal(cache["resid_pre", 3], clean["resid_pre", 3]) and max_diff(cache["attn_out", 3], clean["attn_out", 3]) > 1e-3


def test_each_thread_runs_its_own_forward_state(tokens):
    """Two threads running one model at once each get their own per-layer inputs and shared keys."""
    model = HookedTransformer.from_hf(small("together"))
    inputs = [tokens, tokens.flip(1)]
    with torch.no_grad():
        want = [model(t) for t in inputs]
    got: dict[tuple[int, int], torch.Tensor] = {}
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        with torch.no_grad():
            for step in range(20):
                got[i, step] = model(inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 40 and all(torch.equal(out, want[i]) for (i, _), out in got.items())


def test_the_per_layer_inputs_compute_with_the_embedding():
    """A device map places them with `embed` (they read the tokens and the embedding); apart from it, refused."""
    from lenskit.placement import placement_from_map

    cfg = HookedTransformer.from_hf(small("together")).cfg
    placement = placement_from_map({"": "cpu"}, cfg.n_layers)
    assert placement.device_of("per_layer_inputs.embed.weight") == placement.embed
    with pytest.raises(ValueError, match=r"'per_layer_inputs' on meta but 'embed' on cpu"):
        placement_from_map({"": "cpu", "per_layer_inputs": "meta"}, cfg.n_layers)


def test_blocks_run_alone_are_refused_in_one_line(tokens):
    """The per-layer inputs and shared keys are the forward's: a block run by hand, or run_blocks resuming from a
    stream, is refused naming what it lacks."""
    model = HookedTransformer.from_hf(small("together"))
    x = model(tokens, stop_at_layer=2)
    for run, what in ((lambda: model.run_blocks(x, 2), "block 2's keys and values (block 0's)"),
                      (lambda: model.blocks[0](x), "block 0's keys")):
        with pytest.raises(RuntimeError) as err:
            run()
        message = str(err.value)
        assert what in message and "run model(tokens)" in message and "\n" not in message, message
    alone = HookedTransformer.from_hf(small("per_layer_inputs"))
    with pytest.raises(RuntimeError, match=r"block 1's per-layer input is computed by the model's forward"):
        alone.run_blocks(alone(tokens, stop_at_layer=1), 1)
