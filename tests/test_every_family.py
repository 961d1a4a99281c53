"""Everything above the model, on a tiny model of every family (tests/families.py, fixture `family_model`):
the logit lens, trajectories, the tuned lens, ablations, patching, compare_runs, anatomy and a figure.

References are transformers' own modules (the logit lens), exact identities (a skipped block, a zeroed
head, parts that sum to the stream) and hand computations (a head's write, a neuron's share).
"""

from __future__ import annotations

import json

import pytest
import torch
from families import held_beside_the_stream
from fixtures import random_tokens
from golden import hf_reference
from lens_fixtures import write_text_folder

from lenses import LogitLens, TunedLens
from lenses.anatomy import decompose_resid, direct_logit_attribution
from lenses.compare import compare_runs
from lenses.evaluation import evaluate
from lenses.training import Recipe, train
from lenses.trajectory import Trajectory
from lenses.tuned import model_fingerprint
from lenskit import Stream
from lenskit.intervene.interventions import Attn, Block, Head, Mlp, Neurons, ablation_hooks
from lenskit.intervene.patching import patching_hooks
from lenskit.io.data import load_token_stream
from lenskit.observe.resid import late_writes

PROMPT = "def add(a, b):\n    return a + b\n"
EVERY_HOOK = lambda name: True  # noqa: E731 - includes the per-head attn.hook_result


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(2, 11, seed=7, high=300, low=3)


@pytest.fixture(scope="module")
def every(family_model, tokens):
    """The model's logits and a cache of every hook (per-head writes included)."""
    return family_model.model.run_with_cache(tokens, names_filter=EVERY_HOOK)


def hf_readout(hf, h: torch.Tensor) -> torch.Tensor:
    """transformers' own final norm and output embedding (and final soft-cap, or Granite's logits divisor, where the
    config has one) on h."""
    base = getattr(hf, "transformer", None) or getattr(hf, "gpt_neox", None) or hf.model
    norm = (getattr(base, "ln_f", None) or getattr(base, "final_layer_norm", None) or getattr(base, "norm_f", None)
            or getattr(base, "final_layernorm", None) or base.norm)  # norm_f: Nemotron-H
    # Falcon-H1's muP multiplier, Granite's divisor
    logits = hf.get_output_embeddings()(norm(h)) * getattr(base, "lm_head_multiplier", 1.0) / getattr(hf.config, "logits_scaling", 1.0)
    cap = getattr(hf.config, "final_logit_softcapping", None)
    return logits if cap is None else cap * torch.tanh(logits / cap)


# ------------------------------------------------------------------------------------------ logit lens
def test_logit_lens_is_transformers_readout_at_every_stream(family_model, tokens, every):
    model, hf = family_model.model, family_model.hf
    _, cache = every
    ref_logits, ref = hf_reference(hf, tokens)
    lens = LogitLens(model)
    n = model.cfg.n_layers
    with torch.no_grad():
        for l in range(n):
            h = ref[Stream(l).hook_name(n)]  # transformers' stream l, read by its own final norm and unembedding
            torch.testing.assert_close(lens(h, l), hf_readout(hf, h), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lens.decode(cache, l), hf_readout(hf, h), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lens.decode(cache, n), ref_logits, atol=1e-4, rtol=1e-4)


def test_logit_lens_at_the_last_stream_is_the_models_logits_exactly(family_model, tokens):
    model = family_model.model
    n = model.cfg.n_layers
    with torch.no_grad():
        logits = model(tokens)
        _, cache = model.run_with_cache(tokens, names_filter=Stream(n).hook_name(n))  # norm hooks off: same kernel
        assert torch.equal(LogitLens(model).decode(cache, n), logits)


def test_final_norm_is_recomputed_per_stream(family_model, every):
    """LayerNorm and RMSNorm are both scale-invariant: a lens that recomputes the scale on each stream
    reads a rescaled stream the same; one that reused the final stream's scale would not."""
    model = family_model.model
    _, cache = every
    lens = LogitLens(model)
    h = cache.stream(Stream(1))
    with torch.no_grad():
        torch.testing.assert_close(lens(h * 10, 1), lens(h * 100, 1), atol=1e-4, rtol=1e-4)
        final = cache.stream(Stream(model.cfg.n_layers))
        ln = model.ln_final
        centred = getattr(ln, "bias", None) is not None
        x, f = (h - h.mean(-1, keepdim=True), final - final.mean(-1, keepdim=True)) if centred else (h, final)
        stale = model.unembed(x / (f.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt() * ln.gain
                              + (ln.bias if centred else 0))
        assert (stale - lens(h, 1)).abs().max() > 1e-2


def test_trajectory_and_its_frame(family_model):
    model = family_model.model
    traj = Trajectory.from_prompt(LogitLens(model), PROMPT, top_k=3)
    frame = traj.to_frame()
    n = model.cfg.n_layers
    assert sorted(frame.layer.unique()) == list(range(n + 1))
    tokens = model.to_tokens(PROMPT)
    last = frame[frame.layer == n].sort_values("position")
    with torch.no_grad():
        assert last.top_token_id.tolist() == model(tokens)[0].argmax(-1).tolist()
    assert len(frame) == (n + 1) * tokens.shape[1]


# ------------------------------------------------------------------------------------------ tuned lens
@pytest.fixture(scope="module")
def text_stream(family_model, tmp_path_factory):
    folder = write_text_folder(tmp_path_factory.mktemp("text") / "data", n=60)
    return load_token_stream([folder], family_model.model.tokenizer)


def test_untrained_tuned_lens_is_the_logit_lens(family_model, every):
    model = family_model.model
    _, cache = every
    tuned, logit = TunedLens(model), LogitLens(model)
    with torch.no_grad():
        for l in range(model.cfg.n_layers + 1):
            assert torch.equal(tuned.decode(cache, l), logit.decode(cache, l))


def test_tuned_lens_trains_evaluates_and_round_trips(family_model, text_stream, tmp_path):
    model = family_model.model
    recipe = Recipe(steps=8, ctx=16, tokens_per_step=64, lr=0.5)
    lens = train(TunedLens(model), text_stream, recipe, progress=False)
    history = lens.info["loss_history"]  # per step, per layer, each on that step's own batch
    # Summed over layers: a layer whose logit lens is already close (OLMo 2's last, KL ~0.006) moves less than
    # the batch-to-batch noise in 8 steps; the per-layer comparison is the evaluation below, on the same tokens.
    assert sum(history[-1]) < sum(history[0])
    table = evaluate(model, [LogitLens(model), lens], text_stream, ctx=16, progress=False)
    assert (table["kl_tuned"][:-1] < table["kl_logit"][:-1]).all()
    lens.save(tmp_path / "lens")
    again = TunedLens.load(tmp_path / "lens", model)
    h = torch.randn(2, 5, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for l in range(model.cfg.n_layers + 1):
            assert torch.equal(again(h, l), lens(h, l))


def test_fingerprint_tells_a_llama_from_a_qwen3_of_the_same_shape(tmp_path):
    from families import build_family_model

    llama, qwen3 = build_family_model("llama").model, build_family_model("qwen3").model
    with torch.no_grad():  # the same readout numbers: only the family differs
        qwen3.ln_final.weight.copy_(llama.ln_final.weight)
        qwen3.unembed.weight.copy_(llama.unembed.weight)
    assert (llama.cfg.n_layers, llama.cfg.d_model) == (qwen3.cfg.n_layers, qwen3.cfg.d_model)
    TunedLens(llama).save(tmp_path / "lens")
    with pytest.raises(ValueError) as err:
        TunedLens.load(tmp_path / "lens", qwen3)
    message = str(err.value)
    assert model_fingerprint(llama) in message and model_fingerprint(qwen3) in message
    assert "llama:" in message and "qwen3:" in message


def write_tuned_lens_package(folder, n_layers: int, d_model: int, bias: bool) -> torch.nn.ModuleList:
    """What tuned-lens 0.2's `TunedLens.save` writes: `json.dump(TunedLensConfig.to_dict())` to config.json and
    `torch.save(layer_translators.state_dict())` to params.pt, its translators being nn.Linear(d_model, d_model)."""
    g = torch.Generator().manual_seed(5)
    translators = torch.nn.ModuleList(torch.nn.Linear(d_model, d_model, bias=bias) for _ in range(n_layers))
    with torch.no_grad():
        for p in translators.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    folder.mkdir(parents=True)
    config = {"base_model_name_or_path": "EleutherAI/pythia-70m", "d_model": d_model, "num_hidden_layers": n_layers,
              "bias": bias, "base_model_revision": None, "unembed_hash": None, "lens_type": "linear_tuned_lens"}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(translators.state_dict(), folder / "params.pt")
    return translators


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_import_a_tuned_lens_package_folder(family, bias, tmp_path):
    from families import family_model_of

    model = family_model_of(family).model
    translators = write_tuned_lens_package(tmp_path / "tl", model.cfg.n_layers, model.cfg.d_model, bias)
    lens = TunedLens.load(tmp_path / "tl", model)
    assert lens.fingerprint == model_fingerprint(model) and lens.fingerprint.startswith(f"{family}:")
    h = torch.randn(2, 4, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for l, t in enumerate(translators):
            torch.testing.assert_close(lens(h, l), LogitLens(model)(h + t(h), l), atol=1e-5, rtol=1e-5)
        assert torch.equal(lens(h, model.cfg.n_layers), LogitLens(model)(h, model.cfg.n_layers))


# ----------------------------------------------------------------------------------------- ablations
def test_block_and_sublayer_ablations(family_model, tokens, every):
    model = family_model.model
    _, clean = every
    _, cache = model.run_with_cache(tokens, fwd_hooks=ablation_hooks(model, [Block(0)]))
    assert torch.equal(cache["resid_post", 0], cache["resid_pre", 0])
    _, cache = model.run_with_cache(tokens, fwd_hooks=ablation_hooks(model, [Attn(1)]))
    assert torch.equal(cache["resid_mid", 1], cache["resid_pre", 1])
    # fused vs eager attention kernels: rounding relative to the stream's size (Gemma scales its embedding by sqrt(d))
    torch.testing.assert_close(cache["resid_pre", 1], clean["resid_pre", 1], atol=1e-5, rtol=1e-5)
    _, cache = model.run_with_cache(tokens, fwd_hooks=ablation_hooks(model, [Mlp(1)]))
    post = cache["resid_mid", 1]
    for w in late_writes(model.hook_dict, 1):  # Gemma 4's per_layer_out and rescale_out stay, added in the block's order
        post = post + cache[f"blocks.1.hook_{w}"]
    assert torch.equal(cache["resid_post", 1], post)
    torch.testing.assert_close(cache["resid_mid", 1], clean["resid_mid", 1], atol=1e-5, rtol=1e-5)


def test_head_ablation_removes_exactly_that_query_heads_write(family_model, tokens, every):
    """Under GQA, heads 2 and 3 share key/value head 1: zeroing head 3 leaves head 2 alone.

    Where the block normalises attention's output (ln1_post: Gemma 2/3, OLMo 2) the write is that norm of
    the heads' sum, so the ablated write is the block's own ln1_post of the other heads' sum (plus bias)."""
    model = family_model.model
    _, clean = every
    head = model.cfg.n_heads - 1
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK, fwd_hooks=ablation_hooks(model, [Head(1, head)]))
    result, clean_result = cache["blocks.1.attn.hook_result"], clean["blocks.1.attn.hook_result"]
    assert torch.equal(result[:, :, head], torch.zeros_like(result[:, :, head]))
    torch.testing.assert_close(result[:, :, :head], clean_result[:, :, :head], atol=1e-6, rtol=0)
    block = model.blocks[1]
    if block.POST_NORMS:
        bias = getattr(block.attn.out, "bias", None)
        kept = clean_result.sum(-2) - clean_result[:, :, head] + (0 if bias is None else bias)
        with torch.no_grad():
            want = block.ln1_post(kept)
        assert (want - clean["attn_out", 1]).abs().max() > 1e-3  # the ablation changed the write
    else:
        want = clean["attn_out", 1] - clean_result[:, :, head]
    torch.testing.assert_close(cache["attn_out", 1], want, atol=1e-5, rtol=1e-5)
    # The head's write by hand: its z through its d_head-column block of the output projection (times the residual
    # multiplier, Granite's).
    d = model.cfg.d_head
    z = clean["blocks.1.attn.hook_z"][:, :, head]  # [batch, pos, d_head]
    scale = model.cfg.scales.residual * model.cfg.scales.attention_out  # Granite's and Falcon-H1's write multipliers
    by_hand = z @ model.blocks[1].attn.out.weight[:, head * d:(head + 1) * d].T * scale
    torch.testing.assert_close(model.blocks[1].attn.W_O[head], model.blocks[1].attn.out.weight[:, head * d:(head + 1) * d].T * scale,
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(clean_result[:, :, head], by_hand, atol=1e-5, rtol=0)
    assert cache["blocks.1.attn.hook_k"].shape[2] == model.cfg.n_kv_heads  # kv heads are not ablated


def test_neuron_ablation(family_model, tokens, every):
    model = family_model.model
    _, clean = every
    d_mlp = model.cfg.d_mlp
    neurons = [0, d_mlp - 1]
    moe = [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]
    dense = [i for i in range(model.cfg.n_layers) if i not in moe and model.cfg.has_mlp(i)]
    mixer_only = [i for i in range(model.cfg.n_layers) if not model.cfg.has_mlp(i)]  # Nemotron-H's one-sublayer blocks
    if mixer_only:
        with pytest.raises(ValueError, match=f"block {mixer_only[0]} is a .* block with no MLP"):
            ablation_hooks(model, [Neurons(mixer_only[0], [0])])
    if moe:  # a mixture of experts has no neurons to name (its experts are ablated instead); its dense blocks do
        with pytest.raises(ValueError, match="is a mixture of experts, whose MLP has no single d_mlp neurons"):
            ablation_hooks(model, [Neurons(moe[0], [0])])
    if not dense:
        return
    layer = dense[0]
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK, fwd_hooks=ablation_hooks(model, [Neurons(layer, neurons)]))
    post, clean_post = cache[f"blocks.{layer}.mlp.hook_post"], clean[f"blocks.{layer}.mlp.hook_post"]
    assert post.shape[-1] == d_mlp and torch.equal(post[..., neurons], torch.zeros_like(post[..., neurons]))
    # Each neuron writes its activation times its column of fc_out; the ablated write lacks exactly those.
    # Where the block normalises the MLP's output (ln2_post), the write is that norm of the MLP's output.
    block = model.blocks[layer]
    w_out = block.mlp.W_out[neurons].T  # [d_model, 2]: fc_out's columns, times any multiplier (Falcon-H1's)
    if block.POST_NORMS:
        kept = clean_post.clone()
        kept[..., neurons] = 0
        with torch.no_grad():
            want = block.ln2_post(block.mlp.fc_out(kept))
        unnormed = block.mlp.fc_out(clean_post) - clean_post[..., neurons] @ w_out.T  # the clean output less theirs
        torch.testing.assert_close(block.mlp.fc_out(kept), unnormed, atol=1e-5, rtol=1e-5)
    else:
        want = clean["mlp_out", layer] - clean_post[..., neurons] @ w_out.T
    torch.testing.assert_close(cache["mlp_out", layer], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError, match=f"{d_mlp} neurons"):
        ablation_hooks(model, [Neurons(layer, d_mlp)])


# ------------------------------------------------------------------------------------------ patching
@pytest.mark.parametrize("site", ["resid_pre", "attn_out", "head"])
def test_patched_run_equals_the_source_at_the_site(family_model, tokens, every, site):
    model = family_model.model
    logits_source, source = every
    corrupted = tokens.flip(1)
    hooks = patching_hooks(model, source, site, 1, heads=[0] if site == "head" else None)
    name = hooks[0][0]
    logits, cache = model.run_with_cache(corrupted, names_filter=EVERY_HOOK, fwd_hooks=hooks)
    if site == "head":
        torch.testing.assert_close(cache[name][:, :, 0], source[name][:, :, 0], atol=0, rtol=0)
        assert not torch.equal(cache[name][:, :, 1:], source[name][:, :, 1:])
    else:
        assert torch.equal(cache[name], source[name])
    if site == "resid_pre":  # the whole stream from block 1 on is the source's: so are the logits, once what Gemma 4
        # E2B/E4B's blocks read beside the stream is too (their per-layer inputs, from the tokens; shared keys)
        logits = model.run_with_hooks(corrupted, fwd_hooks=hooks + held_beside_the_stream(model, tokens))
        torch.testing.assert_close(logits, logits_source, atol=1e-5, rtol=0)


def test_compare_runs(family_model):
    model = family_model.model
    n = model.cfg.n_layers
    frame = compare_runs(model, PROMPT, ablation_hooks(model, [Block(n - 1)]))
    before = frame[frame.layer < n]
    assert (before.clean_top_token_id == before.ablated_top_token_id).all() and before.kl.abs().max() < 1e-6
    assert frame[frame.layer == n].kl.max() > 0
    assert sorted(frame.layer.unique()) == list(range(n + 1))


# ----------------------------------------------------------------------------------------- anatomy
@pytest.mark.parametrize("per_head", [False, True], ids=["sublayers", "heads"])
def test_parts_sum_to_the_stream_at_every_point(family_model, every, per_head):
    model = family_model.model
    _, cache = every
    n = model.cfg.n_layers
    if per_head and model.blocks[0].POST_NORMS:  # heads are summed before ln1_post: they do not add up to its write
        with pytest.raises(ValueError, match="per_head=False"):
            decompose_resid(cache, n, per_head=True)
        return
    for l in range(n + 1):
        for point in ("resid_pre", "resid_mid", "resid_post") if l < n else ("resid_pre",):
            parts = decompose_resid(cache, l, point, per_head=per_head)
            torch.testing.assert_close(parts.total(), cache.stream(Stream(l, point)), atol=1e-5, rtol=0)
    kinds = set(decompose_resid(cache, n, per_head=per_head).kinds)
    assert ("pos_embed" in kinds) == (model.cfg.positional == "learned")


def test_a_cache_without_the_position_term_is_refused_unless_there_is_none(family_model, tokens):
    """Without hook_pos_embed the first stream must be the token embedding alone (rotary families);
    a learned-position model's cache that lacks it is refused, never decomposed without it."""
    model = family_model.model
    writes = [f"blocks.{i}.hook_{p}" for i in range(model.cfg.n_layers)
              for p in ("attn_out", "mlp_out", *late_writes(model.hook_dict, i))]
    _, cache = model.run_with_cache(tokens, names_filter=["hook_embed", *writes])
    with pytest.raises(KeyError, match="hook_pos_embed"):
        decompose_resid(cache, 1)
    _, cache = model.run_with_cache(tokens, names_filter=["hook_embed", "blocks.0.hook_resid_pre", *writes])
    if model.cfg.positional == "learned":
        with pytest.raises(KeyError, match="hook_pos_embed"):
            decompose_resid(cache, 1)
    else:
        torch.testing.assert_close(decompose_resid(cache, 1).total(), model(tokens, stop_at_layer=1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["sublayers", "heads"])
def test_direct_logit_attribution_sums_to_the_logit_difference(family_model, tokens, every, per_head):
    """Attribution is to the logits before any final soft-cap (Gemma 2/3): `model.readout_uncapped`."""
    model = family_model.model
    _, cache = every
    plus, minus = torch.tensor([5, 17]), 9
    if per_head and model.blocks[0].POST_NORMS:  # heads are summed before ln1_post: no per-head share of the write
        with pytest.raises(ValueError, match="per_head=False"):
            direct_logit_attribution(model, cache, plus, minus, pos=[-1, 4], per_head=True)
        return
    with torch.no_grad():
        logits = model.readout_uncapped(cache.stream(Stream(model.cfg.n_layers)))
    dla = direct_logit_attribution(model, cache, plus, minus, pos=[-1, 4], per_head=per_head)
    sums = dla.groupby("batch").attribution.sum().to_numpy()
    want = torch.stack([logits[0, -1, 5] - logits[0, -1, 9], logits[1, 4, 17] - logits[1, 4, 9]])
    torch.testing.assert_close(torch.tensor(sums), want.float(), atol=1e-4, rtol=1e-4)
    assert dla.attrs["logit"] == pytest.approx(want.tolist(), abs=1e-5)
    assert ("ln_bias" in set(dla.kind)) == (model.cfg.norm == "layernorm")


def test_direct_logit_attribution_of_one_part_by_hand(family_model, every):
    """The embedding's row from the final norm's own forward: with its scale held at the final stream's,
    the norm is linear, so the row is (norm(e) - bias) * scale(e) / scale(x) . u, whatever the gain's form."""
    model = family_model.model
    _, cache = every
    dla = direct_logit_attribution(model, cache, 5, pos=-1)
    x, e = cache.stream(Stream(model.cfg.n_layers))[0, -1], cache["hook_embed"][0, -1]
    ln = model.ln_final
    bias = getattr(ln, "bias", None)

    def scale(v):
        v = v - v.mean() if bias is not None else v  # LayerNorm's scale is of the centred vector
        return (v.pow(2).mean() + ln.eps).sqrt()

    with torch.no_grad():
        u = model.unembed.weight[5] * model.cfg.scales.logits  # the logits' scale, where there is one (Granite)
        by_hand = ((ln(e) - (0 if bias is None else bias)) * scale(e) / scale(x)) @ u
    got = dla[(dla.batch == 0) & (dla.kind == "embed")].attribution.item()
    assert got == pytest.approx(by_hand.item(), abs=1e-5)


# ------------------------------------------------------------------------------------------- figures
def test_a_figure_builds(family_model, every):
    from lenses.plots import attribution_bars, logit_lens_heatmap

    model = family_model.model
    _, cache = every
    fig = logit_lens_heatmap(Trajectory.from_prompt(LogitLens(model), PROMPT, top_k=1))
    assert len(fig.data) >= 1 and fig.data[0].z.shape[0] == model.cfg.n_layers + 1
    per_head = not model.blocks[0].POST_NORMS  # per-head attribution is refused under post-norms (tested above)
    bars = attribution_bars(direct_logit_attribution(model, cache, 5, pos=-1, per_head=per_head))
    assert len(bars.data) >= 1


def test_the_family_list_covers_every_supported_family():
    from conftest import FAMILIES
    from families import FAMILY_BUILDERS

    missing = sorted(set(FAMILIES) - set(FAMILY_BUILDERS))
    assert not missing, f"add a builder for {missing} to FAMILY_BUILDERS in tests/families.py"
