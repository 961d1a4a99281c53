"""Patchscope against a patch written out by hand, the logit-lens identity, evaluation and trajectories, bad
input, and nnterp's `patchscope_lens` on the same weights.

The hand-written reference runs the whole target prompt through `model.run_with_hooks`, one row at a time,
with a hook that overwrites the placeholder's position of an explicitly named hook point, and reads the
last position of the model's full logits: it shares no code with the lens's batched, prefix-sharing path
beyond the model itself.

nnterp (the `bench` extra): its layer i is the output of block i, `layers_output[i]`, which is our stream
i + 1, and `patchscope_lens(..., layers=[i])` takes the source state from layer i's output and writes it
into the target prompt's layer i output, so it is our `Patchscope(model)` at stream i + 1 with the placeholder
at the last position (`TargetPrompt(prompt, -1)`); it returns probabilities, not logits. It has no stream 0
(the embeddings) nor a `resid_mid`, so those are compared against the hand-written patch only. nnterp 1.3.0
imports `nnsight.intervention.tracing`, which nnsight 0.8 moved away, so it needs nnsight 0.7.0 (and that in
turn cloudpickle >= 3, which it does not declare); pyproject's `bench` extra pins both.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from families import build_family_model, family_model_of
from tiny_tokenizer import VOCAB, make_tokenizer

import lenskit
from lenses import LogitLens, Patchscope
from lenses.evaluation import evaluate_windows
from lenses.patchscope import DEFAULT_TARGET_PROMPT
from lenses.trajectory import Trajectory
from lenskit import Stream

SOURCE = ["def add(a, b):\n    return a + b", "import os\nprint('hello world')"]


def hook_name(model, s: Stream) -> str:
    """The hook that carries stream s, spelt out here rather than taken from Stream.hook_name."""
    n = model.cfg.n_layers
    if s.point == "resid_pre" and s.layer == n:
        return f"blocks.{n - 1}.hook_resid_post"
    return f"blocks.{s.layer}.hook_{s.point}"


@torch.no_grad()
def hand_patch(model, prompt, name: str, position: int, rows: torch.Tensor) -> torch.Tensor:
    """Each row of rows [rows, d_model] written over `name` at `position` of the prompt, one full forward per
    row: the last position's logits [rows, d_vocab]."""
    tokens = model.to_tokens(prompt) if isinstance(prompt, str) else prompt[None]
    out = []
    for row in rows:
        def patch(x, hook, row=row):
            x = x.clone()
            x[:, position] = row
            return x

        out.append(model.run_with_hooks(tokens, fwd_hooks=[(name, patch)])[0, -1])
    return torch.stack(out)


@torch.no_grad()
def source_rows(model, points=("resid_pre",)):
    """Streams of the source texts at every position, flattened to rows: {Stream: [rows, d_model]}."""
    _, cache = model.run_with_cache(SOURCE)
    n = model.cfg.n_layers
    streams = [Stream(l, p) for p in points for l in range(n + (p == "resid_pre"))]
    return {s: cache.stream(s).reshape(-1, model.cfg.d_model) for s in streams}


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "gemma2"])
def test_batched_rows_equal_a_hand_written_patch_one_row_at_a_time(family):
    model = family_model_of(family).model
    n = model.cfg.n_layers
    ps = Patchscope(model)
    T = len(ps.target_tokens)
    assert model.to_str_tokens(DEFAULT_TARGET_PROMPT)[ps.position] == "?" and ps.position == T - 1
    ps.chunk_rows = 7  # several forwards, the last one short
    rows = source_rows(model, ("resid_pre", "resid_mid"))
    for s in [Stream(0), Stream(1), Stream(n - 1), Stream(n), Stream(1, "resid_mid")]:
        h = rows[s][::2][:12]  # 12 rows from different positions and texts
        assert len(h) == 12
        want = hand_patch(model, DEFAULT_TARGET_PROMPT, hook_name(model, s), ps.position, h)
        with torch.no_grad():
            got = ps(h, s)
            into = ps.logits_into(h, s, torch.full((len(h), model.cfg.d_vocab), float("nan")))
        assert got.dtype == torch.float32 and got.shape == (12, model.cfg.d_vocab)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{family} {s}")
        torch.testing.assert_close(into, got, atol=0, rtol=0)
        # the rows differ, and so do their readings: a lens that patched one row into all would fail above
        assert (got[0] - got[1]).abs().max() > 1e-3
    # resid_post l is the stream after l + 1 blocks; batch axes are kept
    h = rows[Stream(1)][:6]
    with torch.no_grad():
        torch.testing.assert_close(ps(h, Stream(0, "resid_post")), ps(h, 1), atol=0, rtol=0)
        assert ps(h.view(2, 3, -1), 1).shape == (2, 3, model.cfg.d_vocab)
        torch.testing.assert_close(ps(h.view(2, 3, -1), 1).view(6, -1), ps(h, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_last_stream_with_the_placeholder_last_is_the_logit_lens(family):
    model = family_model_of(family).model
    n = model.cfg.n_layers
    ps, logit = Patchscope(model), LogitLens(model)
    h = source_rows(model)[Stream(n)]
    with torch.no_grad():
        torch.testing.assert_close(ps(h, n), logit(h, n), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ps(h, Stream(n - 1, "resid_post")), logit(h, n), atol=1e-6, rtol=1e-6)
        # ...and this is the patch doing it: random rows too, and not at another stream
        r = torch.randn(5, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(ps(r, n), logit(r, n), atol=1e-6, rtol=1e-6)
        assert (ps(r, n - 1) - logit(r, n - 1)).abs().max() > 1e-3
    assert ps.reads_as_model(Stream(n)) and not ps.reads_as_model(Stream(n - 1))
    assert not Patchscope(model, position=3).reads_as_model(Stream(n))
    assert not Patchscope(model, target_layer=1).reads_as_model(Stream(n))


def test_fixed_target_layer_explicit_position_and_placeholder_not_last():
    model = family_model_of("llama").model
    n = model.cfg.n_layers
    rows = source_rows(model)
    h = rows[Stream(3)][:5]
    fixed = Patchscope(model, target_layer=1)
    want = hand_patch(model, DEFAULT_TARGET_PROMPT, "blocks.1.hook_resid_pre", fixed.position, h)
    with torch.no_grad():
        torch.testing.assert_close(fixed(h, 3), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fixed(h, 0), fixed(h, 3), atol=0, rtol=0)  # the source stream only checks h
        assert (fixed(h, 3) - Patchscope(model)(h, 3)).abs().max() > 1e-3
    mid = Patchscope(model, target_layer=Stream(2, "resid_mid"))
    with torch.no_grad():
        torch.testing.assert_close(mid(h, n), hand_patch(model, DEFAULT_TARGET_PROMPT, "blocks.2.hook_resid_mid",
                                                         mid.position, h), atol=1e-5, rtol=1e-5)

    T = len(fixed.target_tokens)
    at = Patchscope(model, position=4)
    assert at.position == 4 and Patchscope(model, position=-3).position == T - 3
    with torch.no_grad():
        torch.testing.assert_close(at(h, 2), hand_patch(model, DEFAULT_TARGET_PROMPT, "blocks.2.hook_resid_pre", 4, h),
                                   atol=1e-5, rtol=1e-5)

    # The placeholder's last occurrence, read at the prompt's last position (not at the placeholder).
    prompt = "cat -> ?\n? -> dog"
    pieces = model.to_str_tokens(prompt)
    marks = [i for i, p in enumerate(pieces) if p == "?"]
    ps = Patchscope(model, prompt)
    assert len(marks) == 2 and ps.position == marks[1] < len(pieces) - 1
    with torch.no_grad():
        torch.testing.assert_close(ps(h, 2), hand_patch(model, prompt, "blocks.2.hook_resid_pre", marks[1], h),
                                   atol=1e-5, rtol=1e-5)
    # A placeholder of several tokens: the last token of its last occurrence.
    several = Patchscope(model, "x 1135 y 1135 z", placeholder="1135")
    assert len(model.tokenizer.encode("1135")) > 1
    assert several.position == model.to_tokens("x 1135 y 1135").shape[1] - 1
    # Token ids work as the prompt, and `position` then needs no tokenizer.
    ids = model.to_tokens(prompt)[0]
    torch.testing.assert_close(Patchscope(model, ids, position=marks[1])(h, 2), ps(h, 2), atol=0, rtol=0)


def test_evaluation_and_trajectories_take_it_unchanged(default_model):
    """On the embedded (trained) model: a random tiny model predicts nearly uniformly at every layer, through
    any lens, which would let a wrong reading pass."""
    model = default_model
    n = model.cfg.n_layers
    ps = Patchscope(model)
    windows = model.to_tokens("import os\nimport sys\n\ndef main(argv):\n    return os.path.join(argv[0], 'x')\n")[0, :24].view(3, 8)
    tidy = evaluate_windows(model, {"patchscope": ps, "logit": LogitLens(model)}, windows, batch=2, progress=False)
    assert len(tidy) == 2 * (n + 1) * 3
    metrics = ["kl", "ce", "entropy", "top1_agree", "settled"]
    assert tidy[metrics].notna().all().all() and all(math.isfinite(v) for v in tidy[metrics].values.ravel())
    by = {name: g.set_index(["layer", "window"]).sort_index() for name, g in tidy.groupby("lens")}
    last = by["patchscope"].loc[n]
    torch.testing.assert_close(torch.tensor(last[metrics].values), torch.tensor(by["logit"].loc[n][metrics].values))
    # layer 1, window 0, by hand: KL(final || patchscope) and the next-token cross-entropy
    with torch.no_grad():
        logits, cache = model.run_with_cache(windows[:1])
        logp = ps(cache.stream(1)[0], 1).log_softmax(-1)
        final = logits[0].log_softmax(-1)
    kl = F.kl_div(logp, final, log_target=True, reduction="none").sum(-1).mean()
    ce = F.nll_loss(logp[:-1], windows[0, 1:])
    assert by["patchscope"].loc[(1, 0), "kl"] == pytest.approx(kl.item(), rel=1e-4, abs=1e-5)
    assert by["patchscope"].loc[(1, 0), "ce"] == pytest.approx(ce.item(), rel=1e-4, abs=1e-5)
    assert by["patchscope"].loc[(1, 0), "kl"] > 1e-3  # not the logit lens's numbers by accident
    assert by["patchscope"].loc[(1, 0), "kl"] != pytest.approx(by["logit"].loc[(1, 0), "kl"], rel=1e-3)

    traj = Trajectory.from_prompt(ps, SOURCE[1], top_k=3)
    assert traj.lens_name == "patchscope" and traj.top_ids.shape[:2] == (n + 1, 1)
    torch.testing.assert_close(traj.kl_to_final[n], torch.zeros_like(traj.kl_to_final[n]), atol=1e-5, rtol=0)
    with torch.no_grad():
        _, cache = model.run_with_cache(SOURCE[1])
        want = ps(cache.stream(2)[0], 2).softmax(-1).topk(3)
    torch.testing.assert_close(traj.top_probs[2, 0], want.values, atol=1e-5, rtol=1e-4)
    assert (traj.top_ids[2, 0, :, 0] == want.indices[:, 0]).all()
    frame = traj.to_frame()
    assert frame.attrs["lens"] == "patchscope" and len(frame) == (n + 1) * traj.lengths[0]


def test_bad_input_is_refused_in_one_line():
    model = family_model_of("gpt2").model
    n = model.cfg.n_layers
    ps = Patchscope(model)
    T = len(ps.target_tokens)

    def refused(exc, match, call):
        with pytest.raises(exc, match=match) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)

    refused(ValueError, r"do not contain the placeholder '\?'.*position=", lambda: Patchscope(model, "cat -> cat"))
    refused(ValueError, "do not contain the placeholder 'Z'", lambda: Patchscope(model, placeholder="Z"))
    refused(ValueError, "non-empty placeholder", lambda: Patchscope(model, placeholder=""))
    refused(ValueError, rf"position={T} is outside the target prompt's {T} tokens", lambda: Patchscope(model, position=T))
    refused(ValueError, "outside", lambda: Patchscope(model, position=-T - 1))
    refused(TypeError, "position must be an int", lambda: Patchscope(model, position=1.0))
    refused(TypeError, "target_prompt must be text", lambda: Patchscope(model, ["a ?", "b ?"]))
    refused(ValueError, "one prompt", lambda: Patchscope(model, torch.zeros(2, 3, dtype=torch.long), position=0))
    refused(ValueError, "d_model=32", lambda: ps(torch.zeros(2, 5), 1))
    refused(ValueError, "d_model=32", lambda: ps.logits_into(torch.zeros(2, 5), Stream(1), torch.empty(2, VOCAB)))
    for s in (Stream(1, "attn_out"), Stream(0, "mlp_out")):
        assert not ps.covers(s)
        refused(ValueError, "sublayer's write; read that with LogitLens", lambda: ps(torch.zeros(2, 32), s))
    assert ps.covers(Stream(1)) and ps.covers(Stream(1, "resid_mid")) and ps.covers(Stream(2, "resid_post"))
    refused(ValueError, "not target_layer mlp_out.1", lambda: Patchscope(model, target_layer=Stream(1, "mlp_out")))
    refused(IndexError, "out of range", lambda: ps(torch.zeros(2, 32), n + 1))
    no_tokenizer = lenskit.HookedTransformer.from_hf(family_model_of("gpt2").hf)
    refused(ValueError, "tokenizer", lambda: Patchscope(no_tokenizer, torch.tensor([1, 2, 3])))


def test_dtype_nan_rows_and_hooks_removed_after_an_exception():
    pair = build_family_model("gpt2")  # a model of its own: a global hook is attached to it below
    model = pair.model
    ps = Patchscope(model)
    h = source_rows(model)[Stream(2)][:4]
    with torch.no_grad():
        want = ps(h, 2)
        torch.testing.assert_close(ps(h.double(), 2), want, atol=0, rtol=0)  # cast to the model's dtype
        # rows never mix: a NaN row gives NaN logits and leaves the other rows as they were
        bad = h.clone()
        bad[1] = float("nan")
        got = ps(bad, 2)
    assert got[1].isnan().all()
    # (float rounding only: a NaN in the batch moves CPU attention off the fused kernel for the whole batch)
    torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]], atol=1e-5, rtol=1e-5)

    clean = model(SOURCE[0])
    remove = model.hook_dict["blocks.2.hook_mlp_out"].add_hook(lambda x, hook: 1 / 0)  # fails after the patch
    try:
        with pytest.raises(ZeroDivisionError):
            ps(h, 1)
        with pytest.raises(ZeroDivisionError):
            ps.logits_into(h, Stream(1, "resid_mid"), torch.empty(4, VOCAB))
        assert [name for name, hp in model.hook_dict.items() if hp.has_hooks()] == ["blocks.2.hook_mlp_out"]
    finally:
        remove()
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    with torch.no_grad():
        torch.testing.assert_close(ps(h, 2), want, atol=0, rtol=0)
        torch.testing.assert_close(model(SOURCE[0]), clean, atol=0, rtol=0)


def test_repr_names_the_prompt_and_the_position():
    model = family_model_of("gpt2").model
    ps = Patchscope(model)
    text = repr(ps)
    assert "\n" not in text and text.startswith("Patchscope(")
    assert repr(DEFAULT_TARGET_PROMPT) in text and f"position={ps.position} of {len(ps.target_tokens)} tokens" in text
    assert "placeholder '?'" in text and "target=the source stream" in text
    assert "target=resid_mid.1" in repr(Patchscope(model, target_layer=Stream(1, "resid_mid"), position=0))
    assert "placeholder" not in repr(Patchscope(model, position=0))
    assert list(ps.parameters()) == [] and ps.state_dict() == {}


# ----------------------------------------------------------------- nnterp
def save_tiny_checkpoint(family: str, folder):
    """A random transformers checkpoint of `family` (3 blocks, d_model 32) and the tiny tokenizer, saved with
    transformers' own classes. Weights drawn with std 0.3, not the usual 0.02, so that next-token distributions
    are far from uniform and differ from layer to layer."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.3,
                                      bos_token_id=0, eos_token_id=0)
        hf = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.3,
                                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from the identity, so that a skipped or misplaced norm shows
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_equals_nnterp_patchscope_lens_on_the_same_weights(family, tmp_path, monkeypatch):
    pytest.importorskip("nnterp", reason="nnterp is in the bench extra: pip install -e '.[bench]'")
    from nnterp import StandardizedTransformer
    from nnterp.interventions import TargetPrompt, patchscope_lens
    from nnterp.nnsight_utils import get_token_activations

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = save_tiny_checkpoint(family, tmp_path / family)
    model = lenskit.HookedTransformer.from_pretrained(folder)
    theirs = StandardizedTransformer(str(folder), device_map="cpu")
    n = model.cfg.n_layers
    assert theirs.num_layers == n

    ps = Patchscope(model)
    assert theirs.tokenizer(DEFAULT_TARGET_PROMPT)["input_ids"] == ps.target_tokens.tolist()  # identical token ids
    assert ps.position == len(ps.target_tokens) - 1  # nnterp's TargetPrompt(prompt, -1)
    sources = ["def add(a, b):", "import os\nprint("]  # the same number of tokens: no padding on either side
    tokens = model.to_tokens(sources)
    assert [theirs.tokenizer(s)["input_ids"] for s in sources] == tokens.tolist()

    layers = list(range(n))
    with torch.no_grad():
        latents = get_token_activations(theirs, sources, layers=layers)  # [layer, source, d_model]: layer i's output
        probs = patchscope_lens(theirs, source_prompts=sources, target_patch_prompts=TargetPrompt(DEFAULT_TARGET_PROMPT, -1),
                                layers=layers)  # [source, layer, d_vocab]
        _, cache = model.run_with_cache(tokens)
        for i in layers:
            h = cache.stream(i + 1)[:, -1]  # nnterp's layer i is our stream i + 1
            # |h| reaches ~30 with these weights: float32 rounding of the two forwards, relative 2e-6
            torch.testing.assert_close(h, latents[i].float(), atol=1e-4, rtol=1e-5, msg=f"{family} layer {i} source")
            ours = ps(h, i + 1).log_softmax(-1)
            torch.testing.assert_close(ours, probs[:, i].float().log(), atol=1e-4, rtol=1e-4, msg=f"{family} layer {i}")
            assert ours.exp().max() > 0.05  # far from uniform (1/300): the comparison has something to compare
        # The patch matters: the readings differ from layer to layer.
        assert (probs[:, 0] - probs[:, n - 1]).abs().max() > 1e-2
