"""`transformer_lens.head_detector`: how much each head's attention looks like a pattern, TransformerLens's scores.

>>> from lenskit.transformer_lens.head_detector import detect_head
>>> detect_head(model, "one two three one two three", "induction_head").shape   # [layer, head]
torch.Size([6, 6])

A detection pattern is a lower-triangular [query_pos, key_pos] matrix. `"mul"` scores the share of a head's
attention that lands on the pattern's ones, sum(pattern * detection) / sum(pattern); `"abs"` scores
1 - sum|pattern - detection| / pos (rounded to 3 places, as TransformerLens does): 1 is a perfect match.
`exclude_bos` drops attention to position 0 and `exclude_current_token` the diagonal before scoring.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .errors import asserts

HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")
ErrorMeasure = Literal["abs", "mul"]


def get_previous_token_head_detection_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """[pos, pos]: each query attends to the token before it."""
    n = tokens.shape[-1]
    return torch.diag(torch.ones(n - 1), -1)


def get_duplicate_token_head_detection_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """[pos, pos]: each query attends to the earlier copies of its own token."""
    ids = tokens.reshape(-1)
    return torch.tril((ids[:, None] == ids[None, :]).float(), diagonal=-1)


def get_induction_head_detection_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """[pos, pos]: each query attends to the token after an earlier copy of its own token."""
    ids = tokens.reshape(-1)
    after_copy = torch.zeros(len(ids), len(ids))
    after_copy[:, 1:] = (ids[:, None] == ids[None, :-1]).float()  # key k follows a copy of the query's token
    return torch.tril(after_copy)  # keys up to the query itself


PATTERNS = {"previous_token_head": get_previous_token_head_detection_pattern,
            "duplicate_token_head": get_duplicate_token_head_detection_pattern,
            "induction_head": get_induction_head_detection_pattern}


def get_supported_heads() -> None:
    """Print the names a detection pattern can be given by."""
    print(f"Supported heads: {list(HEAD_NAMES)}")


def compute_head_attention_similarity_score(attention_pattern: torch.Tensor, detection_pattern: torch.Tensor, *,
                                            exclude_bos: bool, exclude_current_token: bool,
                                            error_measure: ErrorMeasure) -> torch.Tensor:
    """The score of patterns [..., pos, pos] against `detection_pattern` [pos, pos]: one per leading index."""
    n = detection_pattern.shape[-1]
    keep = torch.ones(n, n, device=attention_pattern.device)
    if exclude_bos:
        keep[:, 0] = 0
    if exclude_current_token:
        keep.fill_diagonal_(0)
    detection = detection_pattern.to(attention_pattern)
    if error_measure == "mul":
        pattern = attention_pattern * keep
        return (pattern * detection).sum((-2, -1)) / pattern.sum((-2, -1))
    diff = (attention_pattern - detection).abs() * keep
    return 1 - torch.round(diff.sum((-2, -1)) / n, decimals=3)


@asserts
def detect_head(model: Any, seq: str | list[str], detection_pattern: str | torch.Tensor,
                heads: list[tuple[int, int]] | dict[int, list[int]] | None = None, cache: Any = None, *,
                exclude_bos: bool = False, exclude_current_token: bool = False,
                error_measure: ErrorMeasure = "mul") -> torch.Tensor:
    """Each head's score [layer, head] on `seq` (see the module's docstring); heads not in `heads` score -1.

    `detection_pattern` is a name in HEAD_NAMES (built from the tokens; for a list of texts, the mean of each
    text's scores) or a [pos, pos] lower-triangular tensor for one text. `cache` is a cache of this text's run
    without its batch axis, to skip the run."""
    if error_measure not in ("abs", "mul"):
        raise ValueError(f"error_measure must be 'abs' or 'mul', got {error_measure!r}")
    if isinstance(detection_pattern, str) and detection_pattern not in PATTERNS:
        raise ValueError(f"unknown head {detection_pattern!r}; the named patterns are {', '.join(HEAD_NAMES)}, "
                         "or pass a [pos, pos] tensor")
    options = dict(exclude_bos=exclude_bos, exclude_current_token=exclude_current_token, error_measure=error_measure)
    if isinstance(seq, list):
        if not isinstance(detection_pattern, str):
            raise ValueError("a detection pattern tensor fits one text; pass one string, or a named pattern")
        return torch.stack([detect_head(model, s, detection_pattern, heads, **options) for s in seq]).mean(0)
    tokens = model.to_tokens(seq)
    n = tokens.shape[-1]
    if not 1 < n < model.cfg.n_ctx:
        raise ValueError(f"the text must tokenize to 2 .. n_ctx - 1 = {model.cfg.n_ctx - 1} tokens, got {n}")
    if isinstance(detection_pattern, str):
        detection_pattern = PATTERNS[detection_pattern](tokens.cpu())
    if detection_pattern.shape != (n, n) or not torch.equal(detection_pattern, detection_pattern.tril()):
        raise ValueError(f"the detection pattern must be lower-triangular [{n}, {n}] for this text's {n} tokens, "
                         f"got shape {tuple(detection_pattern.shape)}")
    if cache is None:
        _, cache = model.run_with_cache(tokens, remove_batch_dim=True,
                                        names_filter=lambda name: name.endswith("attn.hook_pattern"))
    wanted = {layer: list(range(model.cfg.n_heads)) for layer in range(model.cfg.n_layers)} if heads is None \
        else dict(heads) if isinstance(heads, dict) else _by_layer(heads)
    scores = -torch.ones(model.cfg.n_layers, model.cfg.n_heads)
    for layer, layer_heads in wanted.items():
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][list(layer_heads)]  # [head, pos, pos]
        scores[layer, list(layer_heads)] = compute_head_attention_similarity_score(
            pattern.float(), detection_pattern, **options).cpu()
    return scores


def _by_layer(heads: list[tuple[int, int]]) -> dict[int, list[int]]:
    wanted: dict[int, list[int]] = {}
    for layer, head in heads:
        wanted.setdefault(layer, []).append(head)
    return wanted
