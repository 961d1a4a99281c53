"""Trajectory rows against an independent full-vocabulary computation with transformers."""

import numpy as np
import pytest
import torch
from families import every_family
from fixtures import random_tokens
from tiny_tokenizer import make_model_with_tokenizer

from lenses import LogitLens, Trajectory
from lenses.base import BasisLens


@torch.no_grad()
def reference_log_probs(hf_model, tokens):
    """[layer, batch, pos, d_vocab] log-probs of the logit lens at every stream, all at once, from transformers."""
    out = hf_model(tokens, output_hidden_states=True)
    # transformers' last hidden state already went through ln_f; its logits are the final stream's lens
    lens = [hf_model.lm_head(hf_model.transformer.ln_f(h)) for h in out.hidden_states[:-1]] + [out.logits]
    return torch.stack(lens).double().log_softmax(-1)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, 9, seed=5)


def test_rows_agree_with_full_vocab_reference(model, hf_model, tokens):
    traj = Trajectory.from_prompt(LogitLens(model), tokens, top_k=3, chunk_size=4)
    df = traj.to_frame()
    logp = reference_log_probs(hf_model, tokens)  # [layer, batch, pos, vocab]
    p = logp.exp()
    final = logp[-1]
    L, B, P = logp.shape[:3]
    assert len(df) == L * B * P
    for row in df.itertuples():
        lp = logp[row.layer, row.batch, row.position]
        order = torch.argsort(lp, descending=True)
        assert [row.top1_token_id, row.top2_token_id, row.top3_token_id] == order[:3].tolist()
        assert row.top_token_id == row.top1_token_id and row.top_token == f"<{row.top_token_id}>"
        assert row.top_prob == pytest.approx(p[row.layer, row.batch, row.position, order[0]].item(), abs=1e-5)
        assert row.top3_prob == pytest.approx(p[row.layer, row.batch, row.position, order[2]].item(), abs=1e-5)
        want_h = -(lp.exp() * lp).sum().item()
        assert row.entropy == pytest.approx(want_h, abs=1e-4)
        fp = final[row.batch, row.position]
        want_kl = (fp.exp() * (fp - lp)).sum().item()  # KL(final || lens)
        assert row.kl_to_final == pytest.approx(want_kl, abs=1e-4)
        assert row.input_token_id == tokens[row.batch, row.position].item()
        if row.position < P - 1:
            t = tokens[row.batch, row.position + 1].item()
            assert row.target_token_id == t
            assert row.target_rank == (order == t).nonzero().item()
            assert row.target_prob == pytest.approx(lp[t].exp().item(), abs=1e-5)
            assert row.target_logprob == pytest.approx(lp[t].item(), abs=1e-4)
        else:
            assert row.target_token_id == -1 and row.target_rank == -1 and np.isnan(row.target_prob)
    assert (df.loc[df.layer == L - 1, "kl_to_final"].abs() < 1e-5).all()


@every_family
def test_chunking_does_not_change_results(model, tokens):
    lens = LogitLens(model)
    a = Trajectory.from_prompt(lens, tokens, top_k=4, chunk_size=1)
    b = Trajectory.from_prompt(lens, tokens, top_k=4, chunk_size=1000)
    assert torch.equal(a.top_ids, b.top_ids)
    for name in ("top_probs", "entropy", "kl_to_final", "target_logprob"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), equal_nan=True)
    assert a.entropy.shape == (model.cfg.n_layers + 1, 2, 9) and a.top_ids.shape == (model.cfg.n_layers + 1, 2, 9, 4)


@every_family
def test_fixed_target_and_single_prompt_frame(model, tokens):
    traj = Trajectory.from_prompt(LogitLens(model), tokens[0], top_k=2, target=7)
    df = traj.to_frame()
    assert "batch" not in df.columns  # one sequence: one row per (layer, position)
    assert list(df.columns[:10]) == ["layer", "position", "input_token", "input_token_id", "top_token", "top_token_id",
                                     "top_prob", "entropy", "kl_to_final", "target_token"]
    assert (df.target_token_id == 7).all() and (df.target_rank >= 0).all()
    # rank 0 exactly where token 7 is the top-1
    assert ((df.target_rank == 0) == (df.top_token_id == 7)).all()
    with pytest.raises(ValueError, match="shape"):
        Trajectory.from_prompt(LogitLens(model), tokens, target=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="top_k"):
        Trajectory.from_prompt(LogitLens(model), tokens, top_k=0)


class ShiftLens(BasisLens):
    """A made-up lens (adds a fixed vector per layer) to show Trajectory works with any Lens."""

    name = "shift"

    def __init__(self, model):
        super().__init__(model)
        self.shift = torch.nn.Parameter(torch.randn(model.cfg.n_layers + 1, model.cfg.d_model, generator=torch.Generator().manual_seed(0)))

    def transform_hidden(self, h, s):
        return h + self.shift[s.layer]


@every_family
def test_works_with_any_lens(model, tokens):
    lens = ShiftLens(model)
    traj = Trajectory.from_prompt(lens, tokens, top_k=1)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        want = lens(cache["resid_pre", 1], 1).log_softmax(-1)
    assert torch.equal(traj.top_ids[1, ..., 0], want.argmax(-1))
    torch.testing.assert_close(traj.entropy[1], -(want.exp() * want).sum(-1))
    assert traj.to_frame().attrs["lens"] == "shift"
    # The lens knows its model: the trajectory runs that model (its tokenizer, its output at the last layer).
    other = make_model_with_tokenizer()
    on_other = Trajectory.from_prompt(LogitLens(other), "import os", top_k=1)
    assert on_other.tokenizer is other.tokenizer
    with torch.no_grad():
        assert torch.equal(on_other.top_ids[-1, ..., 0], other("import os").argmax(-1))


def test_text_batches_drop_padding_and_decode_tokens():
    model = make_model_with_tokenizer()
    texts = ["def add(a, b):\n    return a + b", "import os"]
    traj = Trajectory.from_prompt(LogitLens(model), texts, top_k=2)
    df = traj.to_frame()
    n = [len(model.tokenizer.encode(t)) for t in texts]
    L = model.cfg.n_layers + 1
    assert len(df) == L * sum(n) and sorted(df.batch.unique()) == [0, 1]
    short = df[(df.batch == 1) & (df.layer == 0)]
    assert short.position.tolist() == list(range(n[1]))
    assert "".join(short.input_token) == "import os"
    assert short.target_token_id.tolist()[-1] == -1  # no next token at the end of the real text
    assert short.target_token.tolist()[:-1] == short.input_token.tolist()[1:]
    one = Trajectory.from_prompt(LogitLens(model), texts[1], top_k=2, target="os").to_frame()
    assert (one.target_token == "os").all()
    with pytest.raises(ValueError, match="exactly one token"):
        Trajectory.from_prompt(LogitLens(model), texts[1], target="return a + b")


def test_partial_utf8_tokens_show_their_bytes():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from lenskit.io.text import BYTE_DECODER, decode_token

    assert BYTE_DECODER == {ch: b for b, ch in bytes_to_unicode().items()}  # GPT-2's byte alphabet, reversed
    tok = make_model_with_tokenizer().tokenizer
    byte_e2 = tok.convert_tokens_to_ids(bytes_to_unicode()[0xE2])  # first byte of '→', alone not valid UTF-8
    assert tok.decode([byte_e2]) == "\ufffd" and decode_token(tok, byte_e2) == "\\xe2"
    assert decode_token(tok, tok.encode(" add")[0]) == tok.decode(tok.encode(" add")[:1])


def test_repr_is_one_line(model, tokens):
    traj = Trajectory.from_prompt(LogitLens(model), tokens, top_k=3)
    n_pos = tokens.shape[1]
    assert repr(traj) == f"Trajectory(logit lens, {tokens.shape[0]} prompts of {n_pos}-{n_pos} tokens, layers 0..3, top-3)"
    one = Trajectory.from_prompt(LogitLens(model), tokens[:1, :5], top_k=2)
    assert repr(one) == "Trajectory(logit lens, 5 tokens, layers 0..3, top-2)"
