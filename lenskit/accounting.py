"""Parameter and FLOP accounting for a model config of any supported family, from the shapes alone.

Everything here is arithmetic on a `ModelConfig` (a model, a config, or a preset name), so
`accounting.param_summary("gpt2-xl")` costs nothing and needs no weights. Each piece counts itself: a block's
rows are what its block form, token mixer and MLP (the classes `lenskit.pieces.layers` chooses from the config)
return from `params`, the attention core's FLOPs are the mixer's `core_flops`, the MLP's are its `active_weights`;
this module sums them over the blocks. The tests check each count against `sum(p.numel())` of a real
`HookedTransformer` and the GPT-2 numbers against hand arithmetic.

Conventions (the ones of Kaplan et al., 2020, "Scaling Laws for Neural Language Models"):

- *Non-embedding* parameters exclude the token embedding, the position embedding and an untied
  unembedding; they include every block and the final norm. A tied unembedding shares the
  embedding's matrix and is counted once, in the embedding row.
- A matmul with a weight of `n` entries costs `2 n` FLOPs per token (one multiply, one add). Norms,
  biases, GELU and softmax are elementwise and left out, as Kaplan et al. leave them out.
- The attention core is the two matmuls that mix positions: scores `Q K^T` and the weighted sum
  `pattern V`. Each costs `2 * n_keys * d_attn` per token per layer, so the core is
  `4 * n_layers * n_keys * d_attn` FLOPs per token forward, with `d_attn = n_heads * d_head` and
  `n_keys = n_ctx` (the full score matrix, as dense kernels compute it). `causal=True` counts only the
  keys a query can see: `(n_ctx + 1) / 2` on average. Kaplan et al.'s own `2 n_layer n_ctx d_attn`
  counts one of the two matmuls; multiply ours by 1/2 to compare.
- In a mixture of experts (`cfg.moe.n_experts`), a MoE block's MLP holds its router (`d_model * n_experts`, plus a
  bias per expert where `cfg.moe.router_bias`) and every expert (with its biases, gpt-oss's); *active* parameters are
  those one token uses: the router and its k routed experts, so
  `active = total - (n_experts - k) * per_expert` summed over the MoE blocks. Attention sinks (gpt-oss, a logit
  per head) count as attention biases. MLP FLOPs count the active weights
  only (the router and the k routed experts); the dense blocks of a sparse model (Qwen3-MoE's mlp_only_layers)
  count their dense MLP.
- A Mamba-2 block (`layer_types` "mamba", lenskit.pieces.mamba2) holds in_proj, its convolution and out_proj, with
  their biases and A_log, dt_bias and D per head counted as biases; its core (row `linear_core`, as linear attention's)
  is the scan's recurrence, `5 d_head d_state` FLOPs per token and head. Nemotron-H's blocks hold one sublayer each
  (`block.one_sublayer`): the absent half counts nothing.
- A linear-attention block (Qwen 3.5's Gated DeltaNet, `layer_types` "linear") holds its projections (q/k/v,
  the output gate z, beta and a: `in_qkv`, `in_z`, `in_b`, `in_a`), the depthwise causal convolution (2 FLOPs per
  weight per token, like a matmul's), `out_proj`, and per value head `A_log` and `dt_bias` (counted as biases);
  its gated output norm's gain counts with the norms. Its core (row `linear_core`) is the delta rule's recurrence:
  per token and value head, the state's read of k, its rank-one update and its read of q, `6 d_k d_v` FLOPs,
  whatever the context: linear attention's cost is linear in the context, where softmax attention's core
  (`attn_core`, the full-attention blocks only) grows with it. Gated attention's q projection also gives its
  output gate: `2 d_attn` rows.
- Gemma 4's full blocks have their own head width and kv heads (so their own `d_attn`), and their values are their
  keys' projection (no v weights); its value norm has no gain, and each block's `layer_scalar` is a buffer, not a
  parameter (as in transformers). E2B and E4B's per-layer inputs: their table (`per_layer_embed`, d_vocab_per_layer x
  n_layers x d_per_layer) is an embedding, the projection of the token embedding to them and its norm
  (`per_layer_proj`) is not; each block's gate and projection of its input are its `per_layer` row (2 FLOPs per
  weight per token each, as the model projection is: the `per_layer` FLOP row), its norm one of its norms. Their
  kv-sharing blocks have no k/v weights or key norm, and with `double_wide_mlp` an MLP of 2 d_mlp. 26B-A4B's blocks
  hold the dense MLP, and beside it the router (its projection, a gain over d_model and a scale per expert) and the
  experts, with three norms of their own; its active parameters and MLP FLOPs count the dense MLP, the router and
  the k routed experts.
- Training costs 3x the forward pass (the backward pass is about twice the forward): `6 N` per token,
  so `C = 6 N D` for `D` tokens with `N` the non-embedding parameters.

>>> param_summary("gpt2").loc["non_embedding", "value"]   # 85,056,000
85056000
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Union

import pandas as pd

from .config import ModelConfig
from .pieces.layers import attention_class, block_class, mixer_classes, mlp_class, summed_counts
from .pieces.moe import MoE
from .pieces.norms import norm_params
from .pieces.per_layer import PerLayerInputs

ConfigLike = Union[ModelConfig, str, Any]  # a ModelConfig, a preset name, or anything with a .cfg


def as_config(model_or_cfg: ConfigLike) -> ModelConfig:
    """A `ModelConfig` from a config, a preset name (`"gpt2"`), or a model carrying `.cfg`."""
    if isinstance(model_or_cfg, ModelConfig):
        return model_or_cfg
    if isinstance(model_or_cfg, str):
        return ModelConfig.from_name(model_or_cfg)
    cfg = getattr(model_or_cfg, "cfg", None)
    if isinstance(cfg, ModelConfig):
        return cfg
    raise TypeError(
        f"expected a ModelConfig, a preset name or a HookedTransformer, got {type(model_or_cfg).__name__}; "
        "build a config with lenskit.ModelConfig(...) or ModelConfig.from_name('gpt2')"
    )


# ---------------------------------------------------------------- parameters
def _experts(cfg: ModelConfig) -> tuple[int, int]:
    """One expert's (weights, biases), as the model's MoE piece counts it."""
    moe = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), None)  # at most len(dense_layers) + 1 steps
    return (MoE if moe is None else mlp_class(cfg, moe)).expert_params(cfg)


def _shared_note(cfg: ModelConfig) -> str:
    """", the shared expert(s) and their gate", as the accounting notes name them; "" without shared experts."""
    n = cfg.moe.n_shared_experts
    if not n:
        return ""
    return (", the shared expert" if n == 1 else f", the {n} shared experts") + (" and its gate" if cfg.moe.shared_gate else "")


def _per_expert(cfg: ModelConfig) -> int:
    """One expert's parameters."""
    return sum(_experts(cfg))


def _kinds(cfg: ModelConfig) -> dict[int, int]:
    """A representative block of each kind -> how many blocks are of that kind. Blocks of one kind are equal (their
    pieces, and what each piece counts, are the same), so sums over the blocks are a few products, whatever n_layers
    is: without per-layer types, the blocks are MoE or dense (a config claiming 10**9 layers is summed at once)."""
    if cfg.layer_types is not None:  # blocks may differ (their mixer, heads, MLP): as many as layer_types lists
        first: dict[tuple, int] = {}
        counts: dict[int, int] = {}
        for i in range(cfg.n_layers):  # a block's kind is what its pieces count
            mixer, mlp = attention_class(cfg, i), mlp_class(cfg, i)
            key = (mixer, mlp, tuple(block_class(cfg).params(cfg, i).items()),
                   tuple(mixer.core_flops(cfg, i, 1).items()), mlp.active_weights(cfg, i))
            rep = first.setdefault(key, i)
            counts[rep] = counts.get(rep, 0) + 1
        return counts
    if cfg.moe.n_experts is None or not cfg.moe.dense_layers:
        return {0: cfg.n_layers}
    kinds = {cfg.moe.dense_layers[0]: len(cfg.moe.dense_layers)}
    moe = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), None)  # at most len(dense_layers) + 1 steps
    if moe is not None:
        kinds[moe] = cfg.n_layers - len(cfg.moe.dense_layers)
    return kinds


def block_kinds(model_or_cfg: ConfigLike) -> dict[int, int]:
    """The first block of each kind (blocks of one kind have the same parameters) -> how many blocks are of it."""
    return _kinds(as_config(model_or_cfg))


def block_params(model_or_cfg: ConfigLike, layer: int = 0) -> pd.DataFrame:
    """Block `layer`'s parameters: rows `attn`, `mlp`, `norms`; columns `weights`, `biases`, `params`.

    Norm gains count as weights and norm shifts as biases. For GPT-2 shapes
    (`d_attn = d_model`, `d_mlp = 4 d_model`) a block holds `12 d^2` weights in its matmuls
    (attention 4 d^2, MLP 8 d^2) and `13 d` biases and gains. A MoE block's `mlp` is its router and every
    expert (see `param_summary`'s `active` for what one token uses).
    """
    cfg = as_config(model_or_cfg)
    counts = block_class(cfg).params(cfg, layer)  # each piece of the block counts itself
    rows = {row: counts.get(row, (0, 0)) for row in ("attn", "mlp", "norms")}
    rows.update({row: count for row, count in counts.items() if row not in rows})  # per_layer (Gemma 4 E2B/E4B)
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=["weights", "biases"])
    frame["params"] = frame["weights"] + frame["biases"]
    frame.index.name = "component"
    return frame


def param_table(model_or_cfg: ConfigLike) -> pd.DataFrame:
    """Every parameter of the model, once: one row per (layer, component), in forward order.

    Columns: `layer` (block index, or <NA> outside the blocks), `component` (`embed`, `pos_embed`,
    `attn`, `mlp`, `norms`, `ln_final`, `unembed`), `weights`, `biases`, `params`, `embedding` (True for
    the rows that are not counted as non-embedding), `note`. `table.params.sum()` is the model's size.
    """
    cfg = as_config(model_or_cfg)
    return _table(cfg, range(cfg.n_layers))


def _table(cfg: ModelConfig, layers: Iterable[int]) -> pd.DataFrame:
    """`param_table`'s rows, with block rows for `layers` only."""
    d, v = cfg.d_model, cfg.d_vocab
    rows: list[dict[str, Any]] = [
        dict(layer=None, component="embed", weights=v * d, biases=0, embedding=True,
             note="token embedding" + (", shared with the unembedding" if cfg.tie_word_embeddings else "")),
        dict(layer=None, component="pos_embed", weights=cfg.n_ctx * d if cfg.positional == "learned" else 0, biases=0,
             embedding=True, note="learned position embedding" if cfg.positional == "learned"
             else "none: rotary positions have no parameters"),
    ]
    if cfg.block.d_per_layer is not None:  # Gemma 4 E2B/E4B's per-layer inputs: a table (an embedding) and a projection
        counts = PerLayerInputs.params(cfg)
        rows += [dict(layer=None, component="per_layer_embed", weights=counts["per_layer_embed"][0],
                      biases=counts["per_layer_embed"][1], embedding=True,
                      note="per-layer input embedding: d_vocab_per_layer x n_layers x d_per_layer"),
                 dict(layer=None, component="per_layer_proj", weights=counts["per_layer_proj"][0],
                      biases=counts["per_layer_proj"][1], embedding=False,
                      note="the token embedding's projection to the per-layer inputs, and its norm")]
    for layer in layers:
        for component, row in block_params(cfg, layer).iterrows():
            rows.append(dict(layer=layer, component=component, weights=int(row.weights), biases=int(row.biases),
                             embedding=False, note=""))
    final_w, final_b = norm_params(cfg)
    rows.append(dict(layer=None, component="ln_final", weights=final_w, biases=final_b, embedding=False, note="final norm"))
    if cfg.tie_word_embeddings:
        rows.append(dict(layer=None, component="unembed", weights=0, biases=0, embedding=True,
                         note=f"tied to embed: its {v * d:,} weights are counted once, in the embed row"))
    else:
        rows.append(dict(layer=None, component="unembed", weights=v * d, biases=0, embedding=True,
                         note="untied unembedding"))
    frame = pd.DataFrame(rows)
    frame["layer"] = frame["layer"].astype("Int64")
    frame["params"] = frame["weights"] + frame["biases"]
    return frame[["layer", "component", "weights", "biases", "params", "embedding", "note"]]


def param_summary(model_or_cfg: ConfigLike) -> pd.DataFrame:
    """The headline counts, indexed by quantity, with columns `value` and `note`.

    Quantities: `total`, `embed`, `pos_embed`, `unembed` (0 when tied), `non_embedding`, `blocks`,
    `per_block`, `per_block_attn`, `per_block_mlp`, `per_block_norms`, `weights`, `biases`,
    `mlp_share_of_block`, `attn_share_of_block`, `per_block_over_d2` (GPT-2: 12 + 13/d).
    """
    cfg = as_config(model_or_cfg)
    # Blocks of one kind are equal, so one block's rows of each kind, counted that many times, stand for all of
    # them: the sums are exact Python ints, and a config claiming 10**9 layers is summed at once, not row by row.
    kinds = _kinds(cfg)
    table, block = _table(cfg, list(kinds)), block_params(cfg)
    times = [1 if pd.isna(layer) else kinds[int(layer)] for layer in table.layer]

    def total(column: str, rows: Iterable[bool] | None = None) -> int:
        keep = [True] * len(table) if rows is None else list(rows)
        return sum(int(value) * n for value, n, k in zip(table[column], times, keep) if k)

    by = table.groupby("component", sort=False)["params"].sum()
    per_block = int(block.params.sum())
    blocks = sum(int(block_params(cfg, layer).params.sum()) * n for layer, n in kinds.items())
    non_embedding = total("params", ~table.embedding)
    values: dict[str, tuple[float, str]] = {
        "total": (total("params"), "every parameter once (a tied unembedding is not counted twice)"),
        "embed": (int(by["embed"]), "d_vocab * d_model"),
        "pos_embed": (int(by["pos_embed"]), "n_ctx * d_model" if cfg.positional == "learned" else
                      f"{cfg.positional}: none" if cfg.positional == "rotary" else "no positions: none"),
        "unembed": (int(by["unembed"]), "tied to embed, counted once" if cfg.tie_word_embeddings else "d_model * d_vocab"),
        **({"per_layer_embed": (int(by["per_layer_embed"]), "per-layer inputs' table (an embedding): d_vocab_per_layer "
                                "x n_layers x d_per_layer")} if cfg.block.d_per_layer is not None else {}),
        "non_embedding": (non_embedding, "blocks + final norm (Kaplan et al.'s N)"),
        "blocks": (blocks, "n_layers * per_block" if len(kinds) == 1 else "MoE blocks and dense blocks" if
                   cfg.moe.dense_layers else "linear- and full-attention blocks (per_block*: block 0's)" if
                   "linear" in cfg.layer_types else "blocks of several shapes (per_block*: block 0's)"),
        "per_block": (per_block, "12 d^2 + 13 d for GPT-2 shapes" if cfg.is_gpt2 and cfg.d_mlp == 4 * cfg.d_model else ""),
        "per_block_attn": (int(block.loc["attn", "params"]), _mixer_note(cfg)),
        "per_block_mlp": (int(block.loc["mlp", "params"]), "none: a mixer-only block" if cfg.block.one_sublayer and
                          cfg.layer_type(0) != "mlp" else ("dense MLP, and router and every expert beside it"
                           if cfg.block.experts_beside_mlp else "router and every expert" + _shared_note(cfg))
                          if cfg.is_moe_layer(0) else
                           "fc_in and fc_out" if cfg.mlp == "gelu" else "gate, fc_in, fc_out (gated MLP)"),
        "per_block_norms": (int(block.loc["norms", "params"]), ("ln1 (one sublayer)" if cfg.block.one_sublayer else
                            {"pre": "ln1 and ln2", "post": "ln1_post and ln2_post",
                             "sandwich": "ln1, ln2, ln1_post and ln2_post"}[cfg.norm_placement])
                            + (", q/k norms" if cfg.attention.qk_norm and cfg.has_heads(0) else "")
                            + (", the mixer's output norm" if cfg.layer_type(0) in ("mamba", "linear") else "")),
        "weights": (total("weights"), "matrices, embeddings and norm gains"),
        "biases": (total("biases"), "linear biases and norm shifts" + (", attention sinks" if cfg.attention.sinks else "")),
        "mlp_share_of_block": (float(block.loc["mlp", "params"] / per_block), "GPT-2: 2/3"),
        "attn_share_of_block": (float(block.loc["attn", "params"] / per_block), "GPT-2: 1/3"),
        "per_block_over_d2": (per_block / cfg.d_model**2, "GPT-2: 12 + 13/d"),
    }
    if cfg.moe.n_experts is not None:
        n_moe = sum(n for layer, n in kinds.items() if cfg.is_moe_layer(layer))
        unused = n_moe * (cfg.moe.n_experts - cfg.moe.n_experts_per_token) * _per_expert(cfg)
        values.update({
            "experts": (n_moe * cfg.moe.n_experts * _per_expert(cfg),
                        f"{cfg.moe.n_experts} experts x 3 d_model d_expert{' + biases' if _experts(cfg)[1] else ''} in "
                        f"each of {n_moe} MoE blocks"),
            "per_expert": (_per_expert(cfg), "gate, up and down projections" + (" and their biases" if
                                                                                  _experts(cfg)[1] else "")),
            "active": (values["total"][0] - unused, f"what one token uses: the router and {cfg.moe.n_experts_per_token} of "
                       f"{cfg.moe.n_experts} experts per MoE block, and everything else"
                       + (f" ({_shared_note(cfg).removeprefix(', ')} too)" if cfg.moe.n_shared_experts else "")),
            "active_non_embedding": (non_embedding - unused, "active, less the embeddings"),
        })
    else:  # a dense model: one token uses every parameter, shown so that every preset reads alike
        values.update({"active": (values["total"][0], "what one token uses: all of it (no experts)"),
                       "active_non_embedding": (non_embedding, "active, less the embeddings")})
    # object dtype keeps counts as exact ints beside the float shares
    frame = pd.DataFrame({"value": pd.Series({k: v for k, (v, _) in values.items()}, dtype=object),
                          "note": pd.Series({k: n for k, (_, n) in values.items()}, dtype=object)})
    frame.index.name = "quantity"
    return frame


def _mixer_note(cfg: ModelConfig) -> str:
    """What block 0's token mixer counts (`per_block_attn`'s note), by its kind."""
    kind = cfg.layer_type(0)
    if kind == "mamba":
        return "the Mamba-2 mixer: in_proj, conv and out_proj; A_log, D and dt_bias (its gated norm: norms)"
    if kind == "linear":
        return "the Gated DeltaNet: its q, k, v, gate and decay projections, conv and out projection (its norm: norms)"
    if kind == "mlp":
        return "none: an MLP-only block"
    return ("q, k, v and out projections" + (f" (k, v: {cfg.n_kv_heads} of {cfg.n_heads} heads)"
                                             if cfg.n_kv_heads != cfg.n_heads else "")
            + (", and the Mamba-2 mixer beside them" if cfg.block.mamba_beside_attention else ""))


# -------------------------------------------------------------------- FLOPs
def flops_per_token(model_or_cfg: ConfigLike, n_ctx: int | None = None, causal: bool = False) -> pd.DataFrame:
    """Matmul FLOPs per token at context length `n_ctx` (default: the model's), by component.

    Rows: `attn_proj` (qkv and out), `attn_core` (`Q K^T` and `pattern V`), `linear_core` (only for a model
    with linear-attention blocks: their delta rule, constant per token), `mlp` (in a mixture of experts the
    router and the k routed experts), `unembed`, `total`.
    Columns: `forward`, `training` (3 x forward), `share` (of the forward total). See the module
    docstring for the conventions; the attention core is the only term that grows with `n_ctx`.
    """
    cfg = as_config(model_or_cfg)
    n_ctx = cfg.n_ctx if n_ctx is None else n_ctx
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
        raise ValueError(f"n_ctx must be a positive int (tokens of context), got {n_ctx!r}")
    n_keys = (n_ctx + 1) / 2 if causal else n_ctx  # mean number of keys a query attends to
    kinds = _kinds(cfg)
    # each token mixer's own core: softmax attention's grows with the keys, linear attention's does not
    per_kind = [{row: (n * core, 0) for row, core in mixer.core_flops(cfg, layer, n_keys).items()}
                for layer, n in kinds.items() for mixer in mixer_classes(cfg, layer)]
    cores: dict[str, int] = {"attn_core": 0, **{row: total for row, (total, _) in summed_counts(*per_kind).items()}}
    forward = {
        "attn_proj": 2 * sum(int(block_params(cfg, layer).loc["attn", "weights"]) * n for layer, n in kinds.items()),
        **cores,
        "mlp": 2 * sum(mlp_class(cfg, layer).active_weights(cfg, layer) * n for layer, n in kinds.items()),  # routed experts only
        # Gemma 4 E2B/E4B: the projection to every block's per-layer input (less its norm), and each block's gate and
        # projection of its input
        **({"per_layer": 2 * (cfg.d_model * cfg.n_layers * cfg.block.d_per_layer + sum(
            n * int(block_params(cfg, layer).loc["per_layer", "weights"]) for layer, n in kinds.items()))}
           if cfg.block.d_per_layer is not None else {}),
        "unembed": 2 * cfg.d_model * cfg.d_vocab,
    }
    forward["total"] = sum(forward.values())
    frame = pd.DataFrame({"forward": pd.Series(forward, dtype="float64")})
    frame["training"] = 3 * frame["forward"]
    frame["share"] = frame["forward"] / forward["total"]
    frame.index.name = "component"
    return frame


def six_nd(model_or_cfg: ConfigLike, n_tokens: float, non_embedding: bool = True) -> float:
    """Training compute `C = 6 N D` in FLOPs for `n_tokens` tokens (Kaplan et al.: N without embeddings).

    >>> six_nd("gpt2", 1e9)   # 6 x 85,056,000 non-embedding parameters x 1e9 tokens
    5.10336e+17
    """
    if not n_tokens >= 0:
        raise ValueError(f"n_tokens must be a non-negative number of tokens, got {n_tokens!r}")
    summary = param_summary(model_or_cfg)
    n = summary.loc["non_embedding" if non_embedding else "total", "value"]
    return 6.0 * float(n) * float(n_tokens)


# --------------------------------------------------------------- comparison
def accounting_row(model_or_cfg: ConfigLike, n_ctx: int | None = None, name: str | None = None) -> dict[str, Any]:
    """The headline numbers of one model as a flat dict (one row of `compare`)."""
    cfg = as_config(model_or_cfg)
    n_ctx = cfg.n_ctx if n_ctx is None else n_ctx
    s = param_summary(cfg)["value"]
    f = flops_per_token(cfg, n_ctx)["forward"]
    non_emb = float(s["non_embedding"])
    return {
        "model": name or cfg.name,
        "n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "d_mlp": cfg.d_mlp,
        "d_vocab": cfg.d_vocab, "n_ctx": n_ctx,
        "params": int(s["total"]), "embedding": int(s["total"]) - int(non_emb), "non_embedding": int(non_emb),
        "per_block": int(s["per_block"]), "per_block_over_d2": float(s["per_block_over_d2"]),
        "mlp_share_of_block": float(s["mlp_share_of_block"]),
        "forward_flops_per_token": float(f["total"]),
        "forward_flops_over_params": float(f["total"]) / float(s["total"]),
        # without the context-dependent term: the "2 FLOPs per parameter per token" rule
        "dense_flops_over_params": float(f["total"] - f["attn_core"]) / float(s["total"]),
        "attn_core_flops_per_token": float(f["attn_core"]),
        # Kaplan et al. compare the context-dependent term with 2N, N non-embedding.
        "attn_core_over_2n_nonembed": float(f["attn_core"]) / (2 * non_emb),
        "attn_core_over_2n_total": float(f["attn_core"]) / (2 * float(s["total"])),
        "training_flops_per_token": 3 * float(f["total"]),
    }


def compare(models: Mapping[str, ConfigLike] | Iterable[ConfigLike], n_ctx: int | None = None) -> pd.DataFrame:
    """One row per model (see `accounting_row`); `models` is a mapping name -> config, or configs/preset names.

    >>> compare(["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"], n_ctx=1024)[["model", "params", "non_embedding"]]
             model      params  non_embedding
    0         gpt2   124439808       85056000
    1  gpt2-medium   354823168      302311424
    2   gpt2-large   774030080      708390400
    3      gpt2-xl  1557611200     1475561600
    """
    items = models.items() if isinstance(models, Mapping) else ((None, m) for m in models)
    return pd.DataFrame([accounting_row(m, n_ctx, name) for name, m in items])
