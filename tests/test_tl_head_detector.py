"""lenskit.transformer_lens.head_detector against scores written out entry by entry from their definitions."""

import pytest
import torch

import lenskit
import lenskit.transformer_lens as tl
from lenskit.transformer_lens import head_detector
from lenskit.transformer_lens.head_detector import detect_head

TEXT = "x = x + 1\nx = x + 1\n"


@pytest.fixture(scope="module")
def model():
    return tl.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)


def patterns_by_loops(ids):
    n = len(ids)
    prev, dup, ind = (torch.zeros(n, n) for _ in range(3))
    for q in range(n):
        for k in range(q + 1):
            prev[q, k] = float(k == q - 1)
            dup[q, k] = float(k < q and ids[k] == ids[q])
            ind[q, k] = float(k >= 1 and ids[k - 1] == ids[q])
    return {"previous_token_head": prev, "duplicate_token_head": dup, "induction_head": ind}


def test_named_patterns_are_their_definitions():
    ids = [5, 6, 7, 5, 5, 6]
    for name, expected in patterns_by_loops(ids).items():
        assert torch.equal(head_detector.PATTERNS[name](torch.tensor([ids])), expected), name


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
@pytest.mark.parametrize("exclude", [(False, False), (True, True)])
def test_scores_by_hand(model, error_measure, exclude):
    exclude_bos, exclude_current = exclude
    tokens = model.to_tokens(TEXT)
    ids = tokens[0].tolist()
    n = len(ids)
    _, cache = model.run_with_cache(tokens)
    scores = detect_head(model, TEXT, "induction_head", exclude_bos=exclude_bos,
                         exclude_current_token=exclude_current, error_measure=error_measure)
    detection = patterns_by_loops(ids)["induction_head"]
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            p = cache["pattern", layer][0, head].clone()
            kept = [(q, k) for q in range(n) for k in range(n)
                    if not (exclude_bos and k == 0) and not (exclude_current and q == k)]
            if error_measure == "mul":
                want = sum(p[q, k] * detection[q, k] for q, k in kept) / sum(p[q, k] for q, k in kept)
            else:
                want = 1 - round(float(sum(abs(p[q, k] - detection[q, k]) for q, k in kept)) / n, 3)
            assert float(scores[layer, head]) == pytest.approx(float(want), abs=2e-3 if error_measure == "abs" else 1e-5)


def test_heads_texts_and_refusals(model):
    all_heads = detect_head(model, TEXT, "previous_token_head")
    some = detect_head(model, TEXT, "previous_token_head", heads=[(0, 1), (1, 0)])
    assert some[0, 1] == all_heads[0, 1] and some[1, 0] == all_heads[1, 0]
    assert (some == -1).sum() == some.numel() - 2
    two = detect_head(model, [TEXT, "a b a b"], "duplicate_token_head")
    torch.testing.assert_close(two, (detect_head(model, TEXT, "duplicate_token_head")
                                     + detect_head(model, "a b a b", "duplicate_token_head")) / 2)
    with pytest.raises(ValueError, match="unknown head"):
        detect_head(model, TEXT, "name_mover_head")
    with pytest.raises(ValueError, match="lower-triangular"):
        detect_head(model, TEXT, torch.ones(3, 3))
    with pytest.raises(ValueError, match="error_measure"):
        detect_head(model, TEXT, "induction_head", error_measure="l2")
