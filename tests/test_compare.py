"""The lens under intervention, checked against transformers' GPT-2 read through ln_f + lm_head by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from families import every_family

from lenses.compare import COLUMNS, compare_runs, output_summary
from lenskit.intervene.interventions import Block, Head, ablation_hooks


@torch.no_grad()
def hf_lens_logits(hf_model, tokens, registrations=()):
    """Logit-lens logits [layer, batch, pos, d_vocab] of every stream: each block's input (recorded by a
    pre-hook, after any edit upstream) read through ln_f + lm_head, then the model's own logits."""
    t = hf_model.transformer
    streams = {}
    record = lambda i: lambda module, args: streams.__setitem__(i, args[0].clone())  # noqa: E731
    handles = [m.register_forward_hook(fn) for m, fn in registrations]
    handles += [block.register_forward_pre_hook(record(i)) for i, block in enumerate(t.h)]
    try:
        logits = hf_model(tokens).logits
    finally:
        for h in handles:
            h.remove()
    return torch.stack([*(hf_model.lm_head(t.ln_f(streams[i])) for i in range(len(t.h))), logits])


@every_family
def test_columns_and_shape(model, tokens):
    frame = compare_runs(model, tokens[:1], ablation_hooks(model, Head(1, 0)))
    assert list(frame.columns) == COLUMNS
    assert len(frame) == (model.cfg.n_layers + 1) * tokens.shape[1]
    last = frame[frame.position == tokens.shape[1] - 1]
    assert last["target_token"].isna().all() and last["clean_target_prob"].isna().all()
    batched = compare_runs(model, tokens, [])
    assert "batch" in batched.columns and len(batched) == len(frame) * len(tokens)


@every_family
def test_no_edit_means_no_difference(model, tokens):
    frame = compare_runs(model, tokens, [])
    assert (frame["kl"] == 0).all()
    assert (frame["clean_top_token_id"] == frame["ablated_top_token_id"]).all()
    assert (frame["delta_target_prob"].dropna() == 0).all()


def test_matches_transformers_with_a_skipped_block(model, hf_model, tokens):
    skip = lambda module, args, output: args[0]  # noqa: E731
    clean = hf_lens_logits(hf_model, tokens)
    ablated = hf_lens_logits(hf_model, tokens, [(hf_model.transformer.h[1], skip)])
    frame = compare_runs(model, tokens, ablation_hooks(model, Block(1)))
    L, B, P = clean.shape[:3]
    frame = frame.sort_values(["layer", "batch", "position"])
    logp_c, logp_a = clean.log_softmax(-1), ablated.log_softmax(-1)
    kl = (logp_c.exp() * (logp_c - logp_a)).sum(-1)
    np.testing.assert_allclose(frame["kl"].to_numpy(), kl.reshape(-1).numpy(), atol=2e-5)
    np.testing.assert_array_equal(frame["clean_top_token_id"].to_numpy(), clean.argmax(-1).reshape(-1).numpy())
    np.testing.assert_array_equal(frame["ablated_top_token_id"].to_numpy(), ablated.argmax(-1).reshape(-1).numpy())
    np.testing.assert_allclose(frame["ablated_top_prob"].to_numpy(), logp_a.exp().amax(-1).reshape(-1).numpy(), atol=1e-5)
    # with the default target, the last layer's losses are the two runs' next-token cross-entropies
    last = frame[(frame.layer == L - 1) & frame.clean_target_loss.notna()]
    ce = lambda logits: F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")  # noqa: E731
    np.testing.assert_allclose(last["clean_target_loss"].to_numpy(), ce(clean[-1]).numpy(), atol=1e-5)
    np.testing.assert_allclose(last["ablated_target_loss"].to_numpy(), ce(ablated[-1]).numpy(), atol=1e-5)
    # identities: streams 0..1 are upstream of block 1 and identical; stream 2 is stream 1 passed through
    assert (frame[frame.layer <= 1]["kl"] == 0).all()
    assert (frame[frame.layer == 3]["kl"] > 0).all()
    at1 = frame[frame.layer == 1].set_index(["batch", "position"])
    at2 = frame[frame.layer == 2].set_index(["batch", "position"])
    assert (at2["ablated_top_token_id"] == at1["clean_top_token_id"]).all()
    np.testing.assert_allclose(at2["ablated_top_prob"], at1["clean_top_prob"], rtol=0, atol=1e-6)


@every_family
def test_fixed_target_and_output_summary(model, tokens):
    headed = next(l for l in range(model.cfg.n_layers) if model.cfg.has_heads(l))  # Qwen 3.5, Nemotron-H, Granite 4: block 1
    frame = compare_runs(model, tokens[0], ablation_hooks(model, Head(headed, [0, 1])), target=42)
    assert (frame["target_token_id"] == 42).all() and frame["clean_target_prob"].notna().all()
    np.testing.assert_allclose(frame["delta_target_prob"], frame["ablated_target_prob"] - frame["clean_target_prob"])
    np.testing.assert_allclose(np.exp(-frame["clean_target_loss"]), frame["clean_target_prob"], rtol=1e-6)
    nxt = output_summary(compare_runs(model, tokens[0], ablation_hooks(model, Head(headed, [0, 1]))))
    assert list(nxt["position"]) == list(range(tokens.shape[1] - 1))
    assert {"position", "input_token", "clean_top_token_id", "ablated_top_token_id", "clean_loss", "ablated_loss",
            "kl"} <= set(nxt.columns)


def test_text_prompts_with_padding(tmp_path):
    from tiny_tokenizer import make_model_with_tokenizer

    model = make_model_with_tokenizer()
    frame = compare_runs(model, ["def add(a, b):", "import os"], ablation_hooks(model, Block(0)))
    lengths = [len(model.tokenizer.encode(t)) for t in ["def add(a, b):", "import os"]]
    assert [frame[(frame.batch == b) & (frame.layer == 0)]["position"].max() + 1 for b in (0, 1)] == lengths
    second = frame[(frame.batch == 1) & (frame.layer == 0)]["input_token"]
    assert "".join(second) == "import os"


@every_family
def test_plots_draw_the_frame(model, tokens):
    from lenses import plots

    frame = compare_runs(model, tokens[0], ablation_hooks(model, Block(1)))
    fig = plots.difference_heatmap(frame, "delta_target_prob")
    z = np.array(fig.data[0].z, dtype=float)
    assert z.shape == (model.cfg.n_layers + 1, tokens.shape[1])
    expected = frame.pivot(index="layer", columns="position", values="delta_target_prob").to_numpy()
    np.testing.assert_array_equal(np.isnan(z), np.isnan(expected))
    np.testing.assert_allclose(z[~np.isnan(z)], expected[~np.isnan(expected)])
    assert fig.data[0].zmid == 0
    kl = plots.difference_heatmap(frame, "kl")
    assert np.nanmax(np.array(kl.data[0].z, dtype=float)) == pytest.approx(frame["kl"].max())
    with pytest.raises(ValueError, match="value="):
        plots.difference_heatmap(frame, "entropy")
