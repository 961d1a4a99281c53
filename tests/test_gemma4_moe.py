"""Gemma 4 26B-A4B's experts beside the dense MLP (lenskit.pieces.dense_and_experts) against transformers' own
`Gemma4ForCausalLM`: golden parity (alone, and with E2B's per-layer inputs and kv sharing), the router's choices as
transformers makes them, the stream identities (the lens at the last stream, decompose_resid), expert ablation
against transformers run with its router edited by hand, the CLI's `ablate --expert`, the fused checkpoint names,
fold_ln, and the parameter and FLOP counts of the real model.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import transformers
from conftest import make_hf_family
from fixtures import random_tokens, unchanged_copy
from golden import assert_golden, max_diff, run_then_remove
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from lenses import LogitLens
from lenses.cli import main
from lenskit import HookedTransformer, accounting
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.pieces.dense_and_experts import DenseAndExperts

MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8, hidden_size_per_layer_input=0)
LAYERS = ["sliding_attention", "full_attention", "full_attention"]
EAGER = [(lambda n: n.endswith("hook_pattern"), unchanged_copy)]
EVERY_HOOK = lambda name: True  # noqa: E731


def moe(seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """The registry's tiny Gemma 4 over 3 blocks with 4 experts of 8 (2 per token) beside each block's MLP, router
    gains and per-expert scales moved off 1 (a fresh model's), so that a dropped scale cannot hide."""
    hf = make_hf_family("gemma4_text", seed=seed, num_hidden_layers=3, layer_types=LAYERS, **{**MOE, **changes})
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.router.scale.mul_(0.5 + torch.rand_like(layer.router.scale))
            layer.router.per_expert_scale.mul_(0.5 + torch.rand_like(layer.router.per_expert_scale))
    hf.config.output_hidden_states = True  # transformers 5.24's slicing before sharing blocks needs per-layer inputs
    return hf


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(3, 17, seed=8)


@pytest.fixture(scope="module")
def pair():
    hf = moe()
    return hf, HookedTransformer.from_hf(hf)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("extra", [{}, dict(hidden_size_per_layer_input=8, num_kv_shared_layers=1)],
                         ids=["experts", "with-per-layer-inputs-and-kv-sharing"])
def test_golden(extra, tied, tokens):
    hf = moe(tie_word_embeddings=tied, **extra)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.block.experts_beside_mlp and model.cfg.is_moe_layer(0) and isinstance(model.blocks[0].mlp, DenseAndExperts)
    assert model.cfg.kv_source_layers == ((None, None, 1) if extra else (None,) * 3)
    assert_golden(model, hf, tokens)
    assert_golden(model, hf, tokens, fwd_hooks=EAGER)
    assert_golden(model, hf, tokens, fwd_hooks=[(EVERY_HOOK, lambda x, hook: None)])  # the experts' slot outputs too


def test_a_padded_batch_equals_each_prompt_alone_and_transformers(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 101, (n,), generator=gen) for n in (17, 9, 4)]
    batch = torch.zeros(3, 17, dtype=torch.long)  # right-padded with the pad id
    for row, p in enumerate(prompts):
        batch[row, : len(p)] = p
    with torch.no_grad():
        together = model(batch)
        for row, p in enumerate(prompts):  # routing is per token: padding cannot move another token's experts
            assert max_diff(together[row, : len(p)], hf(p[None]).logits[0]) <= 1e-4, row
            assert max_diff(together[row, : len(p)], model(p[None])[0]) <= 1e-4, row  # rounding, not a leak


@pytest.mark.parametrize("shards", [None, "3KB"], ids=["single-file", "sharded"])
def test_golden_through_transformers_files_and_ours(shards, tmp_path, tokens):
    hf = moe(seed=3)
    hf.save_pretrained(tmp_path / "theirs", **({"max_shard_size": shards} if shards else {}))
    ours = HookedTransformer.from_pretrained(tmp_path / "theirs")
    assert_golden(ours, hf, tokens)
    ours.save_pretrained(tmp_path / "ours")  # transformers' names, experts fused as it stores them
    names = set(load_file(tmp_path / "ours" / "model.safetensors"))
    assert names == set(hf.state_dict()) - {"lm_head.weight"} and "model.layers.0.experts.gate_up_proj" in names  # tied
    back = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert_golden(HookedTransformer.from_pretrained(tmp_path / "ours"), back, tokens)


def test_the_router_chooses_as_transformers_and_reads_the_stream_before_the_mlp(pair, tokens):
    hf, model = pair
    seen, handles = {}, []
    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.router.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, (args[0], *out))))
        handles.append(layer.router.proj.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__((i, "logits"), out)))
    run_then_remove(hf, tokens, handles)
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    for i in range(3):
        read, _, weights, chosen = seen[i]  # the router's input, its probabilities, weights and experts [token, ...]
        torch.testing.assert_close(read, cache["resid_mid", i].reshape(-1, 32), atol=1e-4, rtol=0)  # the stream
        assert max_diff(cache["router_logits", i], seen[i, "logits"].view(3, 17, 4)) <= 1e-5
        assert torch.equal(cache["expert_indices", i], chosen.view(3, 17, 2))
        assert max_diff(cache["expert_weights", i], weights.view(3, 17, 2)) <= 1e-6
        dense, experts = cache[f"blocks.{i}.mlp.hook_dense_out"], cache[f"blocks.{i}.mlp.hook_moe_out"]
        torch.testing.assert_close(model.blocks[i].ln2_post(dense + experts), cache["mlp_out", i], atol=1e-5, rtol=0)


def test_the_lens_at_the_last_stream_is_the_model_and_the_stream_is_its_parts(pair, tokens):
    _, model = pair
    n = model.cfg.n_layers
    logits, cache = model.run_with_cache(tokens, names_filter=lambda name: "ln_final" not in name)
    assert torch.equal(LogitLens(model)(cache["resid_post", n - 1], n), logits)  # the readout's own path, unhooked
    for layer in range(n + 1):
        stack, labels = cache.decompose_resid(layer, return_labels=True)
        torch.testing.assert_close(stack.sum(0), cache["resid_pre", layer] if layer < n else cache["resid_post", n - 1],
                                   atol=1e-5, rtol=0)
    assert labels == ["embed"] + [f"{i}_{w}" for i in range(n) for w in ("attn_out", "mlp_out", "rescale_out")]


def hf_with_router_edit(hf, tokens, layer: int, expert: int, mode: str) -> torch.Tensor:
    """transformers' logits with `expert` of block `layer` ablated by hand: its routed weight zeroed (zero) or its
    router logit at -inf before the softmax (reroute)."""
    router = hf.model.layers[layer].router
    if mode == "zero":
        def edit(m, args, out):
            probs, weights, chosen = out
            return probs, weights.masked_fill(chosen == expert, 0.0), chosen
        handle = router.register_forward_hook(edit)
    else:
        handle = router.proj.register_forward_hook(lambda m, args, out: out.index_fill(-1, torch.tensor([expert]),
                                                                                       float("-inf")))
    try:
        with torch.no_grad():
            return hf(tokens).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("mode", ["zero", "reroute"])
def test_expert_ablation_is_transformers_with_its_router_edited(pair, tokens, mode):
    hf, model = pair
    _, clean = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    assert (clean["expert_indices", 1] == 3).any()
    hooks = expert_ablation_hooks(model, Expert(1, 3), mode)
    logits, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK, fwd_hooks=hooks)
    assert max_diff(logits, hf_with_router_edit(hf, tokens, 1, 3, mode)) <= 1e-4
    assert max_diff(logits, model(tokens)) > 1e-3
    if mode == "reroute":
        assert not (cache["expert_indices", 1] == 3).any()
    else:  # the weights of the expert's slots are zero, the dense MLP is untouched
        assert (cache["expert_weights", 1][clean["expert_indices", 1] == 3] == 0).all()
        assert torch.equal(cache["blocks.1.mlp.hook_dense_out"], clean["blocks.1.mlp.hook_dense_out"])


@pytest.mark.parametrize("mode", ["zero", "reroute"])
def test_the_cli_ablates_an_expert(tmp_path, capsys, mode):
    from tiny_tokenizer import VOCAB, make_tokenizer

    from lenses.compare import compare_runs, output_summary

    moe(vocab_size=VOCAB).save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(str(tmp_path / "model"))
    prompt = "def add(a, b):\n    return a + b\n"
    csv = tmp_path / "ablate.csv"
    assert main(["ablate", prompt, "--model", str(tmp_path / "model"), "--expert", "1.2", "--expert-mode", mode,
                 "--csv", str(csv)]) == 0
    model = HookedTransformer.from_pretrained(tmp_path / "model")
    want = output_summary(compare_runs(model, model.to_tokens(prompt), expert_ablation_hooks(model, [Expert(1, 2)], mode)))
    assert pd.read_csv(csv)["ablated_loss"].tolist() == pytest.approx(want["ablated_loss"].tolist(), abs=1e-6)
    assert f"ablated expert 1.2 (experts {mode})" in capsys.readouterr().out


def test_fold_ln_folds_ln2_into_the_dense_mlp_only(pair, tokens):
    """ln2 feeds the dense MLP alone (the router and experts read the stream through their own norms), so folding it
    there, and nowhere else, keeps the model's function."""
    _, model = pair
    folded = model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False)
    assert max_diff(folded(tokens), model(tokens)) <= 1e-4
    assert torch.equal(folded.blocks[0].mlp.router.proj.weight, model.blocks[0].mlp.router.proj.weight)
    assert torch.equal(folded.blocks[0].mlp.experts.gate_up, model.blocks[0].mlp.experts.gate_up)
    assert not torch.equal(folded.blocks[0].mlp.gate.weight, model.blocks[0].mlp.gate.weight)


def test_counts_and_flops_are_the_real_models(pair):
    """Every parameter counted as transformers holds it (the router's gain and per-expert scales, three more norms),
    active parameters leave out exactly the experts a token skips, and the FLOPs are torch's on a real forward."""
    hf, model = pair
    cfg = model.cfg
    s = accounting.param_summary(cfg)["value"]
    total = sum(p.numel() for p in hf.parameters())
    assert s["total"] == total == sum(p.numel() for p in model.parameters()) == accounting.param_table(cfg).params.sum()
    for i, block in enumerate(model.blocks):
        assert accounting.block_params(cfg, i).params.sum() == sum(p.numel() for p in block.parameters())
    skipped = sum((cfg.moe.n_experts - cfg.moe.n_experts_per_token) * (layer.experts.gate_up_proj[0].numel()
                                                               + layer.experts.down_proj[0].numel())
                  for layer in hf.model.layers)
    assert s["active"] == total - skipped and s["experts"] == sum(
        p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    fresh = HookedTransformer(cfg).eval()
    assert (fresh.blocks[0].mlp.router.per_expert_scale == 1).all() and (fresh.blocks[0].mlp.router.scale == 1).all()
    x = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, model.hooks(EAGER), torch.no_grad():
        model(x)
    assert counter.get_total_flops() / x.numel() == accounting.flops_per_token(cfg, n_ctx=16)["forward"]["total"]
