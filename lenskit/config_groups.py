"""ModelConfig's grouped settings: one frozen dataclass per part of the model (`cfg.rope`, `cfg.attention`, `cfg.moe`,
`cfg.mla`, `cfg.linear`, `cfg.mamba`, `cfg.block`, `cfg.scales`), and each setting's flat keyword (`FLAT_NAMES`), the
name `ModelConfig(...)`, `replace(...)` and the error messages use. `lenskit.config` checks the values and re-exports
all of it."""

from __future__ import annotations

from dataclasses import dataclass


# Each group is a frozen dataclass of one part of the model, read as `cfg.<group>.<name>`; ModelConfig checks their
# values (naming the flat keyword, `ModelConfig.rope_factor`), so a group built alone is not validated until it is
# put into a config.
@dataclass(frozen=True)
class RopeConfig:
    """Rotary positions (`cfg.rope`), used where `positional == "rotary"`."""

    dim: int | None = None  # rotary_dim; None means d_head when positional == "rotary"; fewer dims is partial rotary
    base: float = 10000.0  # rotary_base
    type: str = "default"  # "llama3", "linear", "yarn" or "proportional": frequencies rescaled by the fields below
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_n_ctx: int | None = None
    beta_fast: float = 32.0  # yarn: dims turning more than this often over original_n_ctx keep their speed
    beta_slow: float = 1.0  # yarn: dims turning less than this often are divided by factor
    truncate: bool = True  # yarn: the ramp between them starts and ends on whole dims (gpt-oss: False)
    attention_factor: float | None = None  # yarn: cos and sin times this; None: 0.1 ln(factor) + 1
    local_base: float | None = None  # local_rotary_base: the base of the "sliding" blocks when it differs (Gemma 3)
    proportion: float = 1.0  # type="proportional": the share of each head's dim pairs that turn at all (Gemma 4)
    # latent attention (DeepSeek V3) under a rope_type other than "default": the scores' scale is times
    # (0.1 mscale_all_dim ln(factor) + 1) ** 2, as transformers' yarn_apply_mscale folds it in; None: not scaled
    mscale_all_dim: float | None = None
    adjacent_pairs: bool = False  # dims 2i and 2i + 1 turn together (Llama 4's complex pairs), not i and i + dim / 2


@dataclass(frozen=True)
class AttentionConfig:
    """The softmax-attention blocks' projections, norms and scores (`cfg.attention`)."""

    fused_qkv: bool = True  # one projection `attn.qkv` (GPT-2, NeoX) or three, `attn.qkv.q/k/v`
    qkv_bias: bool = True
    out_bias: bool = True
    qk_norm: bool = False  # an RMSNorm over d_head on each query and key head (Qwen 3)
    qk_norm_per_head: bool = True  # False: the q/k norm spans all heads' features at once (OLMo 2)
    query_pre_attn_scalar: float | None = None  # scores are scaled by this ** -0.5 (None: d_head ** -0.5)
    softcap: float | None = None  # attn_softcap: scores -> c * tanh(scores / c) before the mask (Gemma 2)
    sinks: bool = False  # attn_sinks: a learned logit per head joins each softmax's denominator (gpt-oss)
    output_gate: bool = False  # attn_output_gate: q's projection also gives each head a sigmoid gate (Qwen 3.5)
    v_norm: bool = False  # a weightless RMSNorm over each value head, like the q/k norms but with no gain (Gemma 4)
    # Gemma 4's "full" blocks with their own head shapes and keys that are also values.
    full_d_head: int | None = None  # d_head of the "full" blocks where it differs (global_head_dim); None: d_head
    full_n_kv_heads: int | None = None  # kv heads of the "full" blocks where they differ; None: n_kv_heads
    full_k_is_v: bool = False  # the "full" blocks' values are their keys' projection (attention_k_eq_v)
    # Llama 4's pieces (lenskit.pieces.attention)
    chunk_size: int | None = None  # attn_chunk_size: the chunk of a "chunked" block's layer type
    qk_unit_norm: bool = False  # the rotary blocks' queries and keys RMS-normalised per head, with no gain
    # attention temperature tuning in the blocks without rotary: each query times
    # 1 + temperature_scale * ln(1 + floor((position + 1) / temperature_floor)); None: off
    temperature_floor: int | None = None
    temperature_scale: float = 0.1


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts (`cfg.moe`, lenskit.pieces.moe); all None / () for a dense model."""

    n_experts: int | None = None  # experts in each MoE block
    n_experts_per_token: int | None = None  # k: the experts each token is routed to
    d_expert: int | None = None  # each expert's hidden width; None means d_mlp (a MoE model's dense blocks use d_mlp)
    routing: str = "softmax_topk"  # how router logits become k weights, see ROUTINGS
    dense_layers: tuple[int, ...] = ()  # blocks of a MoE model whose MLP is the ordinary dense one (Qwen3-MoE)
    router_bias: bool = False  # the router's logits have a learned bias per expert (gpt-oss)
    swiglu_alpha: float = 1.702  # mlp="swiglu_clamped": the gain inside the sigmoid, gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # mlp="swiglu_clamped": the gate is clamped above at this, the up projection to +-this
    # DeepSeek V3's (lenskit.pieces.shared_experts): experts in n_group groups, each token choosing among the experts of
    # its topk_group best groups; routed weights times routed_scaling_factor; n_shared_experts experts' width of a
    # dense SwiGLU MLP that every token runs, added to the routed experts' sum
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # Qwen3-Next's shared expert (with any routing): its own width where it is not n_shared_experts * d_expert
    # (shared_expert_intermediate_size), and a sigmoid gate per token on its output (shared_expert_gate)
    d_shared: int | None = None
    shared_gate: bool = False


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (`cfg.mla`, lenskit.pieces.latent_attention; DeepSeek V3); kv_lora_rank None for
    ordinary attention. Each head's query and key are qk_nope_head_dim features without positions and `cfg.rope.dim`
    rotated ones (transformers' qk_rope_head_dim), and its value is `cfg.d_head` wide (v_head_dim): each width has
    one home."""

    kv_lora_rank: int | None = None  # the compressed keys and values' width (the latent the KV cache holds)
    q_lora_rank: int | None = None  # the query's low-rank bottleneck; None: one projection d_model -> heads
    qk_nope_head_dim: int | None = None  # each head's query/key features that carry no position
    rope_interleave: bool = True  # the rotated features come in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's)


@dataclass(frozen=True)
class LinearConfig:
    """The linear-attention blocks (`cfg.linear`; layer_types "linear", lenskit.pieces.deltanet); all None without them."""

    n_k_heads: int | None = None  # q/k heads of the Gated DeltaNet
    n_v_heads: int | None = None  # value heads (a multiple of the q/k heads, each k head serving a group)
    d_k: int | None = None  # q/k head width
    d_v: int | None = None  # value head width
    conv_width: int | None = None  # the causal convolution's kernel width
    # q, k, v and the output gate z in one projection, b and a in another, each laid out per q/k head group as
    # Qwen3-Next stores them (in_proj_qkvz, in_proj_ba); False: four projections, as Qwen 3.5 stores them
    fused: bool = False


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 mixers (`cfg.mamba`; layer_types "mamba", lenskit.pieces.mamba2); n_heads None without them. The
    mixer's inner width is n_heads * d_head; B and C are n_groups * d_state wide, each group serving n_heads / n_groups
    consecutive heads, and the gated norm normalises each of n_groups equal slices of the inner width."""

    n_heads: int | None = None  # mamba_num_heads / mamba_n_heads
    d_head: int | None = None  # each head's width (mamba_head_dim / mamba_d_head)
    d_state: int | None = None  # the state's width per head (ssm_state_size / mamba_d_state)
    n_groups: int = 1
    conv_width: int = 4  # the causal convolution's kernel (conv_kernel / mamba_d_conv)
    conv_bias: bool = True
    in_bias: bool = False  # in_proj's bias (use_bias / mamba_proj_bias)
    out_bias: bool = False  # out_proj's bias (use_bias / Falcon-H1's projectors_bias)
    chunk_size: int = 256  # positions per chunk of the prompt's scan; the function does not depend on it
    dt_min: float = 0.0  # time_step_limit: each step size is clamped to [dt_min, dt_max]
    dt_max: float = float("inf")
    norm: str = "gate_then_norm"  # see MAMBA_NORMS (lenskit.config_checks)
    # Falcon-H1's muP multipliers: the normed stream times in_multiplier before in_proj, in_proj's z, x, B, C and dt
    # parts times multipliers[0..4], the mixer's write times out_multiplier
    in_multiplier: float = 1.0
    multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    out_multiplier: float = 1.0


@dataclass(frozen=True)
class BlockConfig:
    """What a block adds beside its attention and MLP (`cfg.block`): Gemma 4's per-layer inputs, kv sharing, rescaled
    stream and experts beside the MLP (lenskit.pieces.per_layer, kv_sharing, dense_and_experts); off by default."""

    layer_scalar: bool = False  # each block ends by multiplying the stream by a stored scalar (`hook_rescale_out`)
    d_per_layer: int | None = None  # per-layer inputs: a d_per_layer-wide input per block from the tokens (E2B, E4B)
    d_vocab_per_layer: int | None = None  # their vocabulary; None means d_vocab where there are per-layer inputs
    n_kv_shared_layers: int = 0  # the last blocks reuse the keys and values of the last earlier block of their type
    double_wide_mlp: bool = False  # those kv-sharing blocks' MLPs are 2 * d_mlp wide
    experts_beside_mlp: bool = False  # each block's MLP has experts beside it, with norms of their own (26B-A4B)
    mamba_beside_attention: bool = False  # each block's attention has a Mamba-2 mixer beside it on ln1's output (Falcon-H1)
    # each block is one of transformers' layers, a token mixer or an MLP and never both, behind one norm (Nemotron-H):
    # layer type "mlp" is an MLP-only block, any other a mixer-only one (lenskit.pieces.layers.OneSublayerBlock)
    one_sublayer: bool = False


@dataclass(frozen=True)
class ScalesConfig:
    """Constant multipliers on the model's activations (`cfg.scales`): muP-trained models (Granite, Falcon-H1) keep their
    weights at one scale and multiply the activations instead; all 1.0 for other models. They are applied where the
    reference applies them, never folded into the stored weights, and each is where a researcher reads it:
    `hook_embed` is the embedding after `embedding`; a sublayer's write (`hook_attn_out`, `hook_mlp_out`, and every
    head's, expert's and neuron's share of it) is after `residual` and the sublayer's own write multiplier, which its
    output projection applies (lenskit.pieces.linear.ScaledLinear), so W_O, W_out and the per-head results are the
    writes as they reach the stream; the logits (and `W_U`, `model.unembed(x)`) are after `logits`. The Mamba-2
    mixer's own (its input, its in_proj parts, its write) are `cfg.mamba`'s."""

    embedding: float = 1.0  # the stream after the embedding is times this (embedding_multiplier)
    residual: float = 1.0  # each sublayer's output is times this before it joins the stream (Granite's residual_multiplier)
    logits: float = 1.0  # the logits are times this (Granite's 1 / logits_scaling, Falcon-H1's lm_head_multiplier)
    # Falcon-H1's attention: its input (ln1's output) times attention_in before q, k and v; each key times key (before
    # rotary, so hook_k shows the scaled key); its write times attention_out (the output projection's scale)
    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    # Falcon-H1's MLP: the gate's pre-activation times mlp_gate (hook_pre shows the product); the write times mlp_down
    # (the output projection's scale)
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


GROUPS: dict[str, type] = {"rope": RopeConfig, "attention": AttentionConfig, "moe": MoEConfig, "linear": LinearConfig,
                           "block": BlockConfig, "mla": MLAConfig, "mamba": MambaConfig, "scales": ScalesConfig}
# Each grouped setting's flat keyword (the name ModelConfig(...), replace(...) and the error messages use) -> its group
# and its name there. tools that rename reads (config_rename.py) parse this literal, so keep it one plain dict.
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "rotary_dim": ("rope", "dim"), "rotary_base": ("rope", "base"), "rope_type": ("rope", "type"),
    "rope_factor": ("rope", "factor"), "rope_low_freq_factor": ("rope", "low_freq_factor"),
    "rope_high_freq_factor": ("rope", "high_freq_factor"), "rope_original_n_ctx": ("rope", "original_n_ctx"),
    "rope_beta_fast": ("rope", "beta_fast"), "rope_beta_slow": ("rope", "beta_slow"), "rope_truncate": ("rope", "truncate"),
    "rope_attention_factor": ("rope", "attention_factor"), "local_rotary_base": ("rope", "local_base"),
    "rope_proportion": ("rope", "proportion"), "rope_mscale_all_dim": ("rope", "mscale_all_dim"),
    "rope_adjacent_pairs": ("rope", "adjacent_pairs"), "attn_chunk_size": ("attention", "chunk_size"),
    "qk_unit_norm": ("attention", "qk_unit_norm"), "attn_temperature_floor": ("attention", "temperature_floor"),
    "attn_temperature_scale": ("attention", "temperature_scale"),
    "fused_qkv": ("attention", "fused_qkv"), "qkv_bias": ("attention", "qkv_bias"), "out_bias": ("attention", "out_bias"),
    "qk_norm": ("attention", "qk_norm"), "qk_norm_per_head": ("attention", "qk_norm_per_head"),
    "query_pre_attn_scalar": ("attention", "query_pre_attn_scalar"), "attn_softcap": ("attention", "softcap"),
    "attn_sinks": ("attention", "sinks"), "attn_output_gate": ("attention", "output_gate"),
    "v_norm": ("attention", "v_norm"), "full_d_head": ("attention", "full_d_head"),
    "full_n_kv_heads": ("attention", "full_n_kv_heads"), "full_k_is_v": ("attention", "full_k_is_v"),
    "n_experts": ("moe", "n_experts"), "n_experts_per_token": ("moe", "n_experts_per_token"),
    "d_expert": ("moe", "d_expert"), "routing": ("moe", "routing"), "dense_layers": ("moe", "dense_layers"),
    "router_bias": ("moe", "router_bias"), "swiglu_alpha": ("moe", "swiglu_alpha"), "swiglu_limit": ("moe", "swiglu_limit"),
    "n_group": ("moe", "n_group"), "topk_group": ("moe", "topk_group"),
    "routed_scaling_factor": ("moe", "routed_scaling_factor"), "n_shared_experts": ("moe", "n_shared_experts"),
    "d_shared_expert": ("moe", "d_shared"), "shared_expert_gate": ("moe", "shared_gate"),
    "linear_n_k_heads": ("linear", "n_k_heads"), "linear_n_v_heads": ("linear", "n_v_heads"),
    "linear_d_k": ("linear", "d_k"), "linear_d_v": ("linear", "d_v"), "linear_conv_width": ("linear", "conv_width"),
    "linear_fused": ("linear", "fused"),
    "layer_scalar": ("block", "layer_scalar"), "d_per_layer": ("block", "d_per_layer"),
    "d_vocab_per_layer": ("block", "d_vocab_per_layer"), "n_kv_shared_layers": ("block", "n_kv_shared_layers"),
    "double_wide_mlp": ("block", "double_wide_mlp"), "experts_beside_mlp": ("block", "experts_beside_mlp"),
    "one_sublayer": ("block", "one_sublayer"),
    "kv_lora_rank": ("mla", "kv_lora_rank"), "q_lora_rank": ("mla", "q_lora_rank"),
    "qk_nope_head_dim": ("mla", "qk_nope_head_dim"), "rope_interleave": ("mla", "rope_interleave"),
    "mamba_beside_attention": ("block", "mamba_beside_attention"),
    "embedding_multiplier": ("scales", "embedding"), "residual_multiplier": ("scales", "residual"),
    "logits_multiplier": ("scales", "logits"), "attention_in_multiplier": ("scales", "attention_in"),
    "key_multiplier": ("scales", "key"), "attention_out_multiplier": ("scales", "attention_out"),
    "mlp_gate_multiplier": ("scales", "mlp_gate"), "mlp_down_multiplier": ("scales", "mlp_down"),
    "mamba_n_heads": ("mamba", "n_heads"), "mamba_d_head": ("mamba", "d_head"), "mamba_d_state": ("mamba", "d_state"),
    "mamba_n_groups": ("mamba", "n_groups"), "mamba_conv_width": ("mamba", "conv_width"),
    "mamba_conv_bias": ("mamba", "conv_bias"), "mamba_in_bias": ("mamba", "in_bias"),
    "mamba_out_bias": ("mamba", "out_bias"), "mamba_chunk_size": ("mamba", "chunk_size"),
    "mamba_dt_min": ("mamba", "dt_min"), "mamba_dt_max": ("mamba", "dt_max"), "mamba_norm": ("mamba", "norm"),
    "mamba_in_multiplier": ("mamba", "in_multiplier"), "mamba_multipliers": ("mamba", "multipliers"),
    "mamba_out_multiplier": ("mamba", "out_multiplier"),
}
