"""Weight processing (lenskit.processing): the processed model computes the raw model's log-probabilities, its stream
moves only where TransformerLens says it does, its weights are TransformerLens 4.3's processed weights on the same
checkpoint, and every option that cannot be exact for a family is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_family
from families import build_family_model
from references import transformer_lens_4_3
from tiny_tokenizer import VOCAB, make_tokenizer

import lenskit

OPTIONS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
LAYERNORM = ("gpt2", "gpt_neox")
# Every family: each option either applies or is refused by name below.
FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "olmo3", "phi3",
            "smollm3", "mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_5_text", "gemma4_text", "apertus",
            "deepseek_v3", "qwen3_next", "llama4_text", "falcon_h1", "glm4_moe", "nemotron_h",
            "granitemoehybrid")
# (family, option) -> words the refusal must contain.
REFUSED = {
    ("llama", "center_writing_weights"): "needs LayerNorm",
    ("gemma2", "center_writing_weights"): "needs LayerNorm",
    ("gemma2", "center_unembed"): "soft-cap",
    ("olmo2", "center_writing_weights"): "needs LayerNorm",
    ("olmo2", "fold_ln"): "post-norm blocks",
    ("gpt_oss", "fold_value_biases"): "attention sinks",
    ("qwen3_5_text", "fold_ln"): "linear-attention",
    ("qwen3_5_text", "fold_value_biases"): "output gate",
    ("gemma4_text", "center_writing_weights"): "needs LayerNorm",
    ("gemma4_text", "center_unembed"): "soft-cap",
    ("apertus", "center_writing_weights"): "needs LayerNorm",  # RMSNorm's; xIELU itself leaves every option exact
    ("deepseek_v3", "center_writing_weights"): "needs LayerNorm",
    ("deepseek_v3", "fold_value_biases"): "nothing to fold in latent attention",
    ("qwen3_next", "fold_ln"): "linear-attention",
    ("qwen3_next", "fold_value_biases"): "output gate",
    ("llama4_text", "center_writing_weights"): "needs LayerNorm",
    ("falcon_h1", "fold_ln"): "Mamba-2 blocks",  # the mixer beside each block's attention reads ln1 too
    ("falcon_h1", "center_writing_weights"): "needs LayerNorm",
    ("falcon_h1", "fold_value_biases"): "Falcon-H1's multipliers",
    ("glm4_moe", "center_writing_weights"): "needs LayerNorm",
    ("granitemoehybrid", "center_writing_weights"): "needs LayerNorm",
    ("granitemoehybrid", "fold_ln"): "Mamba-2 blocks",
    ("nemotron_h", "fold_ln"): "Mamba-2 blocks",
    ("nemotron_h", "center_writing_weights"): "needs LayerNorm",
    ("nemotron_h", "fold_value_biases"): "Mamba-2 blocks: they have no values",
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))


def _applies(family: str, option: str) -> bool:
    from lenskit.processing import refusal

    return refusal(build_family_model(family).model.cfg, option) is None


def _assert_same_logprobs(raw: lenskit.HookedTransformer, processed: lenskit.HookedTransformer) -> None:
    tokens = _tokens()
    with torch.no_grad():
        a, b = raw(tokens).log_softmax(-1), processed(tokens).log_softmax(-1)
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("option", OPTIONS + ("all",))
def test_log_probs_unchanged(family, option):
    raw = build_family_model(family).model
    wanted = [o for o in OPTIONS if _applies(family, o)] if option == "all" else [option]
    if not all(_applies(family, o) for o in wanted):  # refused by name, before anything is copied or changed
        with pytest.raises(ValueError, match=f"^{option} .*{family}.*; pass {option}=False$"):
            raw.process_weights(**{o: o == option for o in OPTIONS})
        return
    before = {k: v.clone() for k, v in raw.state_dict().items()}
    processed = raw.process_weights(**{o: o in wanted for o in OPTIONS})
    assert processed is not raw and processed.processing == tuple(wanted)
    assert raw.processing == () and all(torch.equal(before[k], v) for k, v in raw.state_dict().items())
    _assert_same_logprobs(raw, processed)
    if option == "center_unembed":  # the logits themselves move by one constant per position
        with torch.no_grad():
            shift = raw(_tokens()) - processed(_tokens())
        assert (shift - shift[..., :1]).abs().max().item() < 1e-4
        assert processed.W_U.mean(1).abs().max().item() < 1e-6


def test_refactor_keeps_the_circuits():
    """GPT-2's refactored heads: the same log-probabilities, the same QK circuit (biases included) and OV circuit,
    W_O's rows orthonormal, and W_Q, W_K columns of equal norms (TransformerLens's even split)."""
    raw = build_family_model("gpt2").model
    processed = raw.process_weights(fold_ln=False, center_writing_weights=False, center_unembed=False,
                                    fold_value_biases=False, refactor_factored_attn_matrices=True)
    assert processed.processing == ("refactor_factored_attn_matrices",)
    _assert_same_logprobs(raw, processed)
    qk = lambda m: torch.cat([m.W_Q, m.b_Q[:, :, None]], 2) @ torch.cat([m.W_K, m.b_K[:, :, None]], 2).transpose(2, 3)  # noqa: E731
    assert (qk(raw) - qk(processed)).abs().max().item() < 1e-5
    assert (raw.W_V @ raw.W_O - processed.W_V @ processed.W_O).abs().max().item() < 1e-5
    eye = torch.eye(raw.cfg.d_head).expand(*processed.W_O.shape[:2], -1, -1)
    assert (processed.W_O @ processed.W_O.transpose(2, 3) - eye).abs().max().item() < 1e-5
    assert not processed.b_V.any()
    q_in = torch.cat([processed.W_Q, processed.b_Q[:, :, None]], 2)
    k_in = torch.cat([processed.W_K, processed.b_K[:, :, None]], 2)
    assert (q_in.norm(dim=2) - k_in.norm(dim=2)).abs().max().item() < 1e-5


def test_half_precision_keeps_its_dtype():
    """Processing runs in float32 and writes back in the model's dtype, new biases included."""
    raw = build_family_model("gpt2").model.to(torch.bfloat16)
    processed = raw.process_weights()
    assert {p.dtype for p in processed.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        a, b = raw(_tokens()).float().log_softmax(-1), processed(_tokens()).float().log_softmax(-1)
    assert (a - b).abs().max().item() < 0.1  # bf16 rounding of both models, not a change of function


@pytest.mark.parametrize("family", LAYERNORM)
def test_centred_stream_is_the_raw_stream_less_its_mean(family):
    """With every writing weight centred, each residual stream is the raw one less its mean over d_model (a
    multiple of the all-ones direction, per position), since every LayerNorm reading it removes that mean."""
    raw = build_family_model(family).model
    processed = raw.process_weights(fold_ln=False, center_writing_weights=True, center_unembed=False,
                                    fold_value_biases=False)
    names = lambda n: "resid" in n  # noqa: E731
    _, ours = processed.run_with_cache(_tokens(), names)
    _, theirs = raw.run_with_cache(_tokens(), names)
    for name, h in theirs.items():
        assert (ours[name] - (h - h.mean(-1, keepdim=True))).abs().max().item() < 1e-5, name
        assert ours[name].mean(-1).abs().max().item() < 1e-5, name


def test_fold_ln_leaves_a_pure_normalisation():
    """After fold_ln, hook_normalized is TransformerLens's LNPre output: (x - mean) / scale, unscaled, unbiased;
    an RMSNorm's is x / scale (Gemma's (1 + w) gain is at its identity, w = 0)."""
    for family in ("gpt2", "llama", "gemma2"):
        processed = build_family_model(family).model.process_weights(fold_ln=True, center_unembed=False,
                                                                     fold_value_biases=False)
        _, cache = processed.run_with_cache(_tokens(), lambda n: n.startswith("blocks.1.") and "ln1" in n
                                            or n == "blocks.1.hook_resid_pre")
        x = cache["blocks.1.hook_resid_pre"]
        x = x - x.mean(-1, keepdim=True) if family == "gpt2" else x
        expected = x / cache["blocks.1.ln1.hook_scale"]
        assert (cache["blocks.1.ln1.hook_normalized"] - expected).abs().max().item() < 1e-5, family
        assert torch.equal(processed.blocks[1].ln1.gain, torch.ones(processed.cfg.d_model)), family


def test_fold_ln_folds_the_block_norms_and_keeps_the_latent_norms():
    """DeepSeek V3's latent attention: ln1 folds into q_a and kv_a (what reads the stream), the norms inside the
    attention (q_a_norm, kv_a_norm: between the latents and their up-projections) stay as they are."""
    raw = build_family_model("deepseek_v3").model
    folded = raw.process_weights(fold_ln=True, center_unembed=False, fold_value_biases=False)
    _assert_same_logprobs(raw, folded)
    for block, before in zip(folded.blocks, raw.blocks):
        assert (block.ln1.weight == 1).all() and (block.ln2.weight == 1).all()
        for norm in ("q_a_norm", "kv_a_norm"):
            assert torch.equal(getattr(block.attn, norm).weight, getattr(before.attn, norm).weight)
        torch.testing.assert_close(block.attn.kv_a.weight, before.attn.kv_a.weight * before.ln1.weight, rtol=0, atol=1e-6)


def test_refusals():
    for (family, option), words in REFUSED.items():
        model = build_family_model(family).model
        with pytest.raises(ValueError, match=words) as info:
            model.process_weights(**{o: o == option for o in OPTIONS})
        assert option in str(info.value) and len(str(info.value).splitlines()) == 1
    for family in ("gpt_neox", "llama"):  # rotary, as TransformerLens refuses it
        with pytest.raises(ValueError, match="refactor_factored_attn_matrices is not defined for .*rotary"):
            build_family_model(family).model.process_weights(refactor_factored_attn_matrices=True)
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices is not defined for deepseek_v3") as info:
        build_family_model("deepseek_v3").model.process_weights(refactor_factored_attn_matrices=True)
    assert len(str(info.value).splitlines()) == 1
    model = build_family_model("gpt2").model
    with pytest.raises(TypeError, match="True, False or None"):
        model.process_weights(fold_ln="yes")
    once = model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                  fold_value_biases=False)
    twice = once.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                  fold_value_biases=False)
    assert twice.processing == ("fold_ln",)  # idempotent: the norms are already at their identity
    assert all((once.state_dict()[k] - v).abs().max() < 1e-6 for k, v in twice.state_dict().items())


def test_defaults_follow_transformer_lens():
    """model.process_weights() applies what TransformerLens's defaults apply: all four options for GPT-2, for
    Llama all but center_writing_weights (which TransformerLens skips for RMSNorm), for OLMo 2 no fold_ln."""
    gpt2, llama = build_family_model("gpt2").model, build_family_model("llama").model
    assert gpt2.process_weights().processing == OPTIONS
    assert llama.process_weights().processing == ("fold_ln", "center_unembed", "fold_value_biases")
    olmo2 = build_family_model("olmo2").model  # post-norm: TransformerLens folds nothing there
    assert olmo2.process_weights().processing == ("center_unembed", "fold_value_biases")
    with pytest.raises(ValueError, match="soft-cap"):  # TransformerLens would centre it and change the model
        build_family_model("gemma2").model.process_weights()
    assert not gpt2.cfg.tie_word_embeddings or gpt2.unembed.weight is gpt2.embed.weight  # the raw model stays tied
    processed = gpt2.process_weights()
    assert not processed.cfg.tie_word_embeddings and processed.unembed.weight is not processed.embed.weight


def test_from_pretrained_processes_and_inplace(tmp_path):
    folder = tmp_path / "gpt2"
    make_hf_family("gpt2", vocab_size=VOCAB).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    raw = lenskit.HookedTransformer.from_pretrained(folder)
    processed = lenskit.HookedTransformer.from_pretrained(folder, fold_ln=True, center_writing_weights=True,
                                                          center_unembed=True, fold_value_biases=True)
    assert raw.processing == () and processed.processing == OPTIONS
    _assert_same_logprobs(raw, processed)
    again = lenskit.HookedTransformer.from_pretrained(folder)  # memory-mapped: processing never wrote the file
    assert all(torch.equal(raw.state_dict()[k], v) for k, v in again.state_dict().items())
    assert again.process_weights(inplace=True) is again
    assert all(torch.equal(again.state_dict()[k], v) for k, v in processed.state_dict().items())
    with pytest.raises(TypeError):
        lenskit.HookedTransformer.from_pretrained(folder, fold_layernorm=True)


# ------------------------------------------------------------------ TransformerLens 4.3's bridge
@pytest.fixture(scope="module")
def bridge_class():
    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge


VIEWS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out", "b_in", "b_out", "W_gate",
         "W_U", "b_U", "W_E")


@pytest.mark.slow  # boots TransformerLens once per family
@pytest.mark.filterwarnings("ignore:Phi3ArchitectureAdapter does not support fold_ln")  # it folds by its own path
@pytest.mark.parametrize("family", ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2",
                                    "olmo3", "phi3", "smollm3"))
def test_weights_match_transformer_lens(family, tmp_path, bridge_class, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / family
    make_hf_family(family, vocab_size=VOCAB).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    raw = lenskit.HookedTransformer.from_pretrained(folder)
    options = {o: _applies(family, o) for o in OPTIONS}
    ours = raw.process_weights(**options)
    bridge = bridge_class.boot_transformers(str(folder), device="cpu").eval()
    bridge.enable_compatibility_mode(disable_warnings=True, **options)
    names = VIEWS + (("W_pos",) if raw.cfg.positional == "learned" else ())
    assert not torch.equal(raw.W_U, ours.W_U)  # something was processed, so the comparison can fail
    for name in names:
        mine = getattr(ours, name)
        try:
            theirs = getattr(bridge, name)
        except AttributeError:  # the bridge has no stacked view of a bias the checkpoint lacks; ours reads zeros
            assert name.startswith("b_") and mine is not None and not mine.any(), name
            continue
        if mine is None or theirs is None:
            assert mine is None and theirs is None, name
            continue
        if name in ("W_K", "W_V", "b_K", "b_V"):  # the bridge shows kv heads once; ours repeats them per query head
            mine = mine[:, :: raw.cfg.n_heads // raw.cfg.n_kv_heads]
        assert mine.shape == theirs.shape, (name, mine.shape, theirs.shape)
        assert (mine - theirs).abs().max().item() < 1e-5, name


@pytest.mark.slow
def test_refactor_matches_transformer_lens(tmp_path, bridge_class, monkeypatch):
    """GPT-2, all options and the refactor: TransformerLens's weights, each singular direction up to its sign
    (an SVD's signs are its own choice; a head's q and k columns flip together, as do its v and o)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "gpt2"
    make_hf_family("gpt2", vocab_size=VOCAB).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    options = dict.fromkeys(OPTIONS + ("refactor_factored_attn_matrices",), True)
    ours = lenskit.HookedTransformer.from_pretrained(folder, **options)
    bridge = bridge_class.boot_transformers(str(folder), device="cpu").eval()
    bridge.enable_compatibility_mode(disable_warnings=True, **options)
    for pair in (("W_Q", "W_K", "b_Q", "b_K"), ("W_V", "W_O", "b_V")):
        first = getattr(ours, pair[0])  # [layer, head, d_model, d_head]: one sign per singular direction
        sign = (first * getattr(bridge, pair[0])).sum(2, keepdim=True).sign()  # [layer, head, 1, d_head]
        for name in pair:
            mine, theirs = getattr(ours, name), getattr(bridge, name)
            flip = sign.transpose(2, 3) if name == "W_O" else sign[:, :, 0] if name.startswith("b_") else sign
            assert (mine * flip - theirs).abs().max().item() < 1e-5, name
    for name in ("b_O", "W_E", "W_pos", "W_U", "b_U", "W_in", "b_in", "W_out", "b_out"):
        assert (getattr(ours, name) - getattr(bridge, name)).abs().max().item() < 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ("mixtral", "qwen3_moe", "olmoe"))
def test_experts_match_transformer_lens(family, tmp_path, bridge_class, monkeypatch):
    """fold_ln into a mixture of experts: ln2's gain goes into the router and every expert's gate and input, as
    TransformerLens folds them (its experts are transformers' fused [expert, gate rows | up rows, d_model])."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / family
    make_hf_family(family, vocab_size=VOCAB).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    raw = lenskit.HookedTransformer.from_pretrained(folder)
    ours = raw.process_weights(fold_ln=True, center_unembed=True, fold_value_biases=True)
    bridge = bridge_class.boot_transformers(str(folder), device="cpu").eval()
    bridge.enable_compatibility_mode(disable_warnings=True, center_writing_weights=False)
    state, params = bridge.state_dict(), dict(bridge.named_parameters())
    sparse = [l for l, block in enumerate(ours.blocks) if hasattr(block.mlp, "experts")]  # Qwen3-MoE has dense ones
    assert sparse
    for layer in sparse:
        block = ours.blocks[layer]
        assert (block.mlp.router.weight - state[f"blocks.{layer}.mlp.gate.weight"]).abs().max().item() < 1e-5
        fused = [p for n, p in params.items() if f"layers.{layer}." in n and n.endswith("experts.gate_up_proj")]
        mine = torch.stack([torch.cat([e.gate.weight, e.fc_in.weight]) for e in block.mlp.experts])
        assert len(fused) == 1 and (mine - fused[0]).abs().max().item() < 1e-5, layer
        assert not torch.equal(mine, torch.stack([torch.cat([e.gate.weight, e.fc_in.weight])
                                                  for e in raw.blocks[layer].mlp.experts]))
    assert (ours.W_U - bridge.W_U).abs().max().item() < 1e-5


def test_fold_ln_changes_the_lens_fingerprint():
    """A lens fitted on the raw model is refused on a folded one: fold_ln rewrites the final norm and the
    unembedding, which `model_fingerprint` hashes (the streams themselves are unchanged by fold_ln)."""
    from lenses.tuned import model_fingerprint

    raw = build_family_model("llama").model
    folded = raw.process_weights(fold_ln=True, center_unembed=False, fold_value_biases=False)
    assert model_fingerprint(folded) != model_fingerprint(raw)
    assert model_fingerprint(raw.process_weights(fold_ln=False, center_unembed=False)) == model_fingerprint(raw)


def test_centred_writing_weights_change_the_lens_fingerprint_though_the_readout_is_untouched(tmp_path):
    """center_writing_weights moves every stream by a constant along the all-ones direction and leaves ln_final and
    the unembedding as they were: a tuned lens fitted on the raw model would read shifted streams, so it is refused."""
    from lenses import TunedLens
    from lenses.tuned import model_fingerprint

    raw = build_family_model("gpt2").model
    centred = raw.process_weights(fold_ln=False, center_writing_weights=True, center_unembed=False, fold_value_biases=False)
    assert torch.equal(centred.unembed.weight, raw.unembed.weight) and torch.equal(centred.ln_final.weight, raw.ln_final.weight)
    assert model_fingerprint(centred) != model_fingerprint(raw)
    TunedLens(raw).save(tmp_path / "lens")
    with pytest.raises(ValueError, match="fingerprint|another model"):
        TunedLens.load(tmp_path / "lens", centred)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_processed_model_is_not_saved_as_if_raw(family, tmp_path):
    model = build_family_model(family).model.process_weights(fold_ln=True, center_unembed=False, fold_value_biases=False)
    with pytest.raises(ValueError, match=r"weights are processed \(fold_ln.*save the raw model"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
