"""Metrics against values worked out by hand on two- and three-token distributions."""

import math

import pandas as pd
import pytest
import torch

from lenses import metrics

# p = (1/2, 1/4, 1/4), q = (1/4, 1/4, 1/2), given as log-probabilities plus an arbitrary shift
# (logits are only defined up to a constant; the functions must not care).
P = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64).log() + 3.0
Q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64).log() - 1.0
L2 = math.log(2)


def test_entropy_by_hand():
    # H(p) = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert metrics.entropy(P).item() == pytest.approx(1.5 * L2, rel=1e-12)
    uniform = torch.zeros(7, dtype=torch.float64)
    assert metrics.entropy(uniform).item() == pytest.approx(math.log(7), rel=1e-12)


def test_kl_both_directions_by_hand():
    # KL(p||q) = 1/2 ln(2) + 1/4 ln(1) + 1/4 ln(1/2) = 0.25 ln 2; here also KL(q||p) = 0.25 ln 2 by symmetry of the swap
    assert metrics.kl_divergence(P, Q).item() == pytest.approx(0.25 * L2, rel=1e-12)
    # An asymmetric pair: p = (1/2, 1/2), q = (1/4, 3/4)
    p = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    q = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    kl_pq = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_qp = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert metrics.kl_divergence(p, q).item() == pytest.approx(kl_pq, rel=1e-12)
    assert metrics.kl_divergence(q, p).item() == pytest.approx(kl_qp, rel=1e-12)
    assert kl_pq != pytest.approx(kl_qp)
    # forward_kl is KL(final || lens); reverse_kl is KL(lens || final)
    assert metrics.forward_kl(p, q).item() == pytest.approx(kl_pq, rel=1e-12)
    assert metrics.reverse_kl(p, q).item() == pytest.approx(kl_qp, rel=1e-12)


def test_kl_matches_torch_and_is_zero_on_self():
    torch.manual_seed(0)
    a, b = torch.randn(4, 5, 50), torch.randn(4, 5, 50)
    ref = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(metrics.kl_divergence(a, b), ref)
    assert metrics.kl_divergence(a, a).abs().max() < 1e-6


def test_zero_mass_conventions():
    # p puts zero mass on token 2; q puts zero mass on token 1 (logits of -inf)
    p = torch.tensor([0.0, 0.0, -float("inf")], dtype=torch.float64)
    q = torch.tensor([0.0, -float("inf"), 0.0], dtype=torch.float64)
    assert metrics.entropy(p).item() == pytest.approx(L2)
    assert metrics.kl_divergence(p, q).item() == float("inf")  # p has mass where q has none
    # JSD stays finite: m = (1/2, 1/4, 1/4); KL(p||m) = 1/2 ln 1 + 1/2 ln 2, KL(q||m) = 1/2 ln 1 + 1/2 ln 2
    assert metrics.js_divergence(p, q).item() == pytest.approx(0.5 * L2, rel=1e-12)
    assert metrics.total_variation(p, q).item() == pytest.approx(0.5)


def test_js_divergence_by_hand_is_real_jsd():
    # m = (3/8, 1/4, 3/8). KL(p||m) = 1/2 ln(4/3) + 1/4 ln(2/3); KL(q||m) = 1/4 ln(2/3) + 1/2 ln(4/3)
    want = 0.5 * (0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3)) * 2
    got = metrics.js_divergence(P, Q).item()
    assert got == pytest.approx(want, rel=1e-12)
    # not the "symmetrised KL" some tools call JSD: 0.5 (KL(p||q) + KL(q||p)) = 0.25 ln 2
    assert got != pytest.approx(0.25 * L2, rel=1e-3)
    assert metrics.js_divergence(Q, P).item() == pytest.approx(got, rel=1e-12)
    # bounded by ln 2, reached for disjoint supports
    far = torch.tensor([0.0, -1e4], dtype=torch.float64), torch.tensor([-1e4, 0.0], dtype=torch.float64)
    assert metrics.js_divergence(*far).item() == pytest.approx(L2, rel=1e-9)


def test_total_variation_by_hand():
    # 0.5 * (|1/2 - 1/4| + 0 + |1/4 - 1/2|) = 0.25
    assert metrics.total_variation(P, Q).item() == pytest.approx(0.25, rel=1e-12)


def test_cross_entropies_by_hand():
    # -log q(token 2) = ln 2; soft: H(p, q) = H(p) + KL(p||q) = 1.5 ln 2 + 0.25 ln 2
    assert metrics.cross_entropy(Q, torch.tensor(2)).item() == pytest.approx(L2, rel=1e-12)
    assert metrics.soft_cross_entropy(P, Q).item() == pytest.approx(1.75 * L2, rel=1e-12)
    torch.manual_seed(1)
    logits, t = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), t.reshape(-1), reduction="none").view(3, 7)
    torch.testing.assert_close(metrics.cross_entropy(logits, t), ref)
    with pytest.raises(ValueError, match="leading shape"):
        metrics.cross_entropy(logits, t[:, :3])


def test_stable_on_peaked_half_precision_logits():
    logits = torch.tensor([[60.0, 0.0, -60.0]], dtype=torch.float16)
    h = metrics.entropy(logits)
    assert h.dtype == torch.float32 and torch.isfinite(h).all() and h.item() < 1e-20
    assert torch.isfinite(metrics.kl_divergence(logits, logits.flip(-1))).all()


def test_target_rank():
    logits = torch.tensor([[0.1, 3.0, 2.0, 3.0]])
    assert metrics.target_rank(logits, torch.tensor([1])).tolist() == [0]  # tie with token 3 counts as top
    assert metrics.target_rank(logits, torch.tensor([2])).tolist() == [2]
    assert metrics.target_rank(logits, torch.tensor([0])).tolist() == [3]


def test_units():
    assert metrics.nats_to_bits(L2) == pytest.approx(1.0)
    # 2 nats/token over 10 tokens = 20 nats = 20 / ln 2 bits, over 40 bytes
    assert metrics.bits_per_byte(2.0, n_tokens=10, n_bytes=40) == pytest.approx(20 / L2 / 40)
    with pytest.raises(ValueError, match="positive"):
        metrics.bits_per_byte(1.0, 0, 10)
    df = metrics.with_bits_per_byte(pd.DataFrame({"layer": [0], "kl_logit": [L2], "ce_logit": [2 * L2]}), 1, 1)
    assert list(df.columns) == ["layer", "kl_logit", "kl_logit_bpb", "ce_logit", "ce_logit_bpb"]
    assert df["ce_logit_bpb"].item() == pytest.approx(2.0)


def test_mean_ci_averages_within_units_first():
    # prompt a: values 1, 3 (mean 2); prompt b: 4 (mean 4); prompt c: 6. Across units: mean 4, sd 2, n 3
    df = pd.DataFrame({"layer": [0] * 4, "prompt": ["a", "a", "b", "c"], "kl": [1.0, 3.0, 4.0, 6.0]})
    out = metrics.mean_ci(df, "kl", by="layer", unit="prompt")
    half = 4.303 * 2 / math.sqrt(3)
    assert out["n"].item() == 3 and out["mean"].item() == pytest.approx(4.0)
    assert out["lo"].item() == pytest.approx(4 - half) and out["hi"].item() == pytest.approx(4 + half)
    pooled = metrics.mean_ci(df, "kl", by="layer")
    assert pooled["n"].item() == 4 and pooled["mean"].item() == pytest.approx(3.5)
    with pytest.raises(KeyError, match="nope"):
        metrics.mean_ci(df, "nope")


def test_nan_logits_stay_nan():
    # A broken distribution must surface as NaN, never as a finite entropy or KL.
    bad = torch.tensor([[float("nan"), 0.0, 1.0]])
    good = torch.tensor([[0.0, 0.5, 1.0]])
    assert torch.isnan(metrics.entropy(bad)).all()
    assert torch.isnan(metrics.forward_kl(bad, good)).all()
    assert torch.isnan(metrics.forward_kl(good, bad)).all()


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_more_units():
    from lenses.metrics import bootstrap_ci

    gen = torch.Generator().manual_seed(0)
    rows = [{"layer": l, "window": w, "pos": p, "v": float(torch.randn((), generator=gen)) + l}
            for l in range(2) for w in range(40) for p in range(3)]
    frame = pd.DataFrame(rows)
    ci = bootstrap_ci(frame, "v", by="layer", unit="window", n_boot=500)
    per_window = frame.groupby(["layer", "window"])["v"].mean()
    for l in range(2):
        row = ci[ci.layer == l].iloc[0]
        assert row["mean"] == pytest.approx(per_window[l].mean())  # the mean of window means
        assert row["lo"] < row["mean"] < row["hi"] and row["n"] == 40
        # about the normal interval of the window means: 1.96 standard errors
        se = per_window[l].std() / 40 ** 0.5
        assert (row["hi"] - row["lo"]) == pytest.approx(2 * 1.96 * se, rel=0.25)
    few = bootstrap_ci(frame[frame.window < 10], "v", by="layer", unit="window", n_boot=500)
    assert ((few["hi"] - few["lo"]).values > (ci["hi"] - ci["lo"]).values).all()
    assert bootstrap_ci(frame, "v", by="layer", unit="window", n_boot=500).equals(ci)  # the seed fixes the draw
