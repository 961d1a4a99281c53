"""The registry of supported model families: one `Family` record per Hugging Face `model_type`.

A record holds everything lenskit knows about a family: its config reader and writer, its checkpoint
layout, transformers' class names, its published shapes (presets) and the tiny random config the tests
build. Everything else derives from `FAMILIES`: the loader's dispatch, the list of supported types in
the refusal message, `lenskit.PRESETS`, `lenskit info`'s help, tests/families.py's parametrisation and
the README check. Adding a dense family is a record here (its published shapes built by `presets.py`), a
reader in `readers.py` and a writer in `writers.py` (plus a layout in `layouts.py` when its names are new).

>>> family_of("llama").hf_class
'LlamaForCausalLM'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from . import readers, readers_hybrid, readers_moe, writers
from ..config import ModelConfig, register_families
from .layouts import GEMMA, GPT2, GPT_NEOX, GPT_OSS, LLAMA, MIXTRAL, MOE, OLMO2, PHI3, QWEN3_5, Layout
from .layouts_gemma4 import GEMMA4
from .presets import GEMMA2_FIELDS, GEMMA3_FIELDS, LLAMA3_FIELDS, OLMO2_FIELDS, OLMOE_FIELDS, QWEN3_MOE_FIELDS, gemma_preset, gemma4_preset, gpt2_preset, gpt_oss_preset, llama_preset, named_presets, olmo3_preset, pythia_preset, qwen3_5_preset


@dataclass(frozen=True)
class Family:
    """One Hugging Face `model_type`, written once."""

    model_type: str  # config.json's `model_type`, e.g. "llama"
    hf_class: str  # transformers' causal-LM class, config.json's `architectures` entry, e.g. "LlamaForCausalLM"
    hf_config_class: str  # transformers' config class, e.g. "LlamaConfig"
    models: str  # the published models of the family, as README's families table lists them
    read: Callable[..., dict[str, Any]]  # config.json -> ModelConfig keyword arguments (lenskit.families.readers)
    write: Callable[[ModelConfig], dict[str, Any]] | None  # ModelConfig -> config.json fields; None: no saving
    layout: Layout  # checkpoint names and stored shapes
    presets: Mapping[str, ModelConfig]  # published shapes by lowercase short name
    tiny: Mapping[str, Any]  # `hf_config_class` kwargs of the tiny random model the golden tests build
    # What makes `tiny` the 3-block model (the GPT-2 fixture's depth) every test above the model runs on.
    tiny_3_blocks: Mapping[str, Any] = field(default_factory=lambda: {"num_hidden_layers": 3})

    def hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """The `config.json` of `cfg` that `transformers` (class `hf_class`) and lenskit both read as `cfg`.
        A config the family cannot express is refused, naming the fields that would not come back."""
        if self.write is None:
            raise ValueError(f"saving model_type={self.model_type!r} in the Hugging Face layout is not implemented; "
                             "keep the checkpoint folder you loaded from")
        if cfg.family != self.model_type:
            raise ValueError(f"a {cfg.family!r} config cannot be written as model_type={self.model_type!r}")
        written = {"architectures": [self.hf_class], "model_type": self.model_type, **self.write(cfg)}
        try:
            back = ModelConfig(**readers.read_config(written, self.model_type, self.read), name=cfg.name)
        except ValueError as e:
            raise ValueError(f"this config cannot be saved as model_type={self.model_type!r}: {e}") from e
        ours, theirs = cfg.to_flat_dict(), back.to_flat_dict()  # by flat name: the field that would not come back
        lost = [f"{k}={v!r} (would read back as {theirs[k]!r})" for k, v in ours.items() if v != theirs[k]]
        if lost:
            raise ValueError(f"a model_type={self.model_type!r} config.json cannot express {'; '.join(lost)}; "
                             "saving in the Hugging Face layout needs the family's own architecture")
        return written


# ------------------------------------------------------------------ tiny test configs
# Each exercises what makes the family itself: partial rotary and the parallel block (gpt_neox), GQA and
# llama3 rotary scaling (llama), a sliding window shorter than the test prompts (mistral), q/k/v biases
# (qwen2), q/k norms and a d_head that is not d_model / n_heads (qwen3).
_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=101,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
# Gemma: weights 10x larger than usual so that soft-caps this small bite (test_families checks they do), a
# query_pre_attn_scalar that is not d_head, one sliding block (window shorter than the prompt) and one global.
_GEMMA_TINY = dict(_SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                   initializer_range=0.2, final_logit_softcapping=2.0, pad_token_id=0)

# Mixtures of experts: 4 experts, 2 per token, so every expert gets tokens; Mixtral with a window shorter than
# the prompt, Qwen3-MoE with a dense block (mlp_only_layers) and a narrower expert width than its dense MLP,
# OLMoE with its top-k weights renormalised (norm_topk_prob) and its q/k norms over the whole projection.
# Mixtral's weights are 5x the usual scale, so its random blocks move the predictions enough for a tuned lens to learn.
_MOE_TINY = dict(_SHAPE, num_key_value_heads=2, num_experts_per_tok=2)
# gpt-oss: the first block sliding with a window shorter than the prompt, the second full; YaRN (x4 over 16 tokens);
# heads of 16 (q is wider than d_model); weights large enough, and a limit low enough, that the clamp bites; a sigmoid
# gain that is not the default. conftest moves the sinks far from zero and the expert biases away from it.
_GPT_OSS_TINY = dict(_MOE_TINY, num_local_experts=4, head_dim=16, sliding_window=5, initializer_range=0.2,
                     swiglu_limit=1.5, swiglu_alpha=1.5,
                     rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=16))

# Qwen 3.5: a gated full-attention block then a Gated DeltaNet one, and with 3 blocks linear, full, linear (the tests
# look at the heads of block 0 of the first, block 1 of the second); two q/k heads serving four value heads, d_k != d_v,
# half of each attention head rotating, mrope sections (which text positions make moot), weights large enough that
# the linear blocks' writes matter, room for prompts longer than the 64-position chunk.
_QWEN3_5_TINY = dict(_SHAPE, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
                     layer_types=["full_attention", "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                          mrope_section=[2, 1, 1], mrope_interleaved=True))

# Gemma 4: a sliding block (window shorter than the prompt, base 100) and a full one, whose heads are wider (24, not 16)
# with one kv head whose keys are also its values, proportional rotary over a quarter of its pairs; plain-gain norms
# (perturbed by conftest, which also moves each block's layer_scalar off 1), a final soft-cap that bites; E2B's
# per-layer inputs (of 8, vocabulary 300, the tiny tokenizer's), and with 3 blocks its kv sharing: the last block reads
# block 0's keys, its MLP twice as wide. 26B-A4B's experts: tests/test_gemma4_moe.py.
_GEMMA4_TINY = dict(_SHAPE, num_key_value_heads=2, head_dim=16, global_head_dim=24, num_global_key_value_heads=1,
                    attention_k_eq_v=True, sliding_window=5, initializer_range=0.2, final_logit_softcapping=2.0,
                    pad_token_id=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
                    use_double_wide_mlp=True, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                     "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                            rope_theta=10000.0)})

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family(
        "gpt2", "GPT2LMHeadModel", "GPT2Config", "GPT-2, the embedded `stdlib-gpt2`", readers.read_gpt2, writers.write_gpt2, GPT2,
        presets=named_presets(gpt2_preset("gpt2", 12, 768, 12), gpt2_preset("gpt2-medium", 24, 1024, 16), gpt2_preset("gpt2-large", 36, 1280, 20),
                       gpt2_preset("gpt2-xl", 48, 1600, 25)),
        tiny=dict(n_layer=3, n_embd=32, n_head=4, vocab_size=101, n_positions=64, bos_token_id=0, eos_token_id=0,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        tiny_3_blocks={},
    ),
    Family(
        "gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", "Pythia", readers.read_gpt_neox, writers.write_gpt_neox,
        GPT_NEOX,
        presets=named_presets(pythia_preset("pythia-70m", 6, 512, 8), pythia_preset("pythia-160m", 12, 768, 12),
                       pythia_preset("pythia-410m", 24, 1024, 16), pythia_preset("pythia-1b", 16, 2048, 8),
                       pythia_preset("pythia-1.4b", 24, 2048, 16), pythia_preset("pythia-2.8b", 32, 2560, 32),
                       pythia_preset("pythia-6.9b", 32, 4096, 32, d_vocab=50432), pythia_preset("pythia-12b", 36, 5120, 40, d_vocab=50688)),
        tiny=dict(_SHAPE, rotary_pct=0.5, rotary_emb_base=1000.0, use_parallel_residual=True, hidden_act="gelu",
                  hidden_dropout=0.0, attention_dropout=0.0, layer_norm_eps=1e-5),
    ),
    Family(
        "llama", "LlamaForCausalLM", "LlamaConfig", "Llama 2, 3, 3.1, 3.2, TinyLlama, SmolLM, the embedded `stdlib-llama`", readers.read_llama,
        writers.write_llama, LLAMA,
        presets=named_presets(
            llama_preset("llama-3.2-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 131072, True, 500000.0, rope_factor=32.0, **LLAMA3_FIELDS),
            llama_preset("llama-3.2-3b", "llama", 28, 3072, 24, 8, 8192, 128256, 131072, True, 500000.0, rope_factor=32.0, **LLAMA3_FIELDS),
            llama_preset("llama-3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 131072, False, 500000.0, rope_factor=8.0,
                   **LLAMA3_FIELDS)),
        tiny=dict(_SHAPE, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=16)),
    ),
    Family(
        "mistral", "MistralForCausalLM", "MistralConfig", "Mistral 7B", readers.read_mistral, writers.write_mistral, LLAMA,
        presets=named_presets(llama_preset("mistral-7b", "mistral", 32, 4096, 32, 8, 14336, 32000, 32768, False, 10000.0,
                              sliding_window=4096)),
        tiny=dict(_SHAPE, num_key_value_heads=2, sliding_window=5, head_dim=8),
    ),
    Family(
        "qwen2", "Qwen2ForCausalLM", "Qwen2Config", "Qwen 2, 2.5", readers.read_qwen2, writers.write_qwen2, LLAMA,
        presets=named_presets(llama_preset("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768, True, 1000000.0),
                       llama_preset("qwen2.5-1.5b", "qwen2", 28, 1536, 12, 2, 8960, 151936, 32768, True, 1000000.0),
                       llama_preset("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 131072, False, 1000000.0)),
        tiny=dict(_SHAPE, num_key_value_heads=2),
    ),
    Family(
        "qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen 3", readers.read_qwen3, writers.write_qwen3, LLAMA,
        presets=named_presets(llama_preset("qwen3-0.6b", "qwen3", 28, 1024, 16, 8, 3072, 151936, 40960, True, 1000000.0, d_head=128),
                       llama_preset("qwen3-1.7b", "qwen3", 28, 2048, 16, 8, 6144, 151936, 40960, True, 1000000.0, d_head=128),
                       llama_preset("qwen3-4b", "qwen3", 36, 2560, 32, 8, 9728, 151936, 40960, True, 1000000.0, d_head=128),
                       llama_preset("qwen3-8b", "qwen3", 36, 4096, 32, 8, 12288, 151936, 40960, False, 1000000.0, d_head=128)),
        tiny=dict(_SHAPE, num_key_value_heads=2, head_dim=16),
    ),
    Family(
        "gemma2", "Gemma2ForCausalLM", "Gemma2Config", "Gemma 2", readers.read_gemma2, writers.write_gemma2, GEMMA,
        presets=named_presets(gemma_preset("gemma-2-2b", "gemma2", 26, 2304, 8, 4, 9216, 256000, 8192, 4096, 2, **GEMMA2_FIELDS),
                       gemma_preset("gemma-2-9b", "gemma2", 42, 3584, 16, 8, 14336, 256000, 8192, 4096, 2, **GEMMA2_FIELDS)),
        tiny=dict(_GEMMA_TINY, attn_logit_softcapping=1.0),
    ),
    Family(
        "gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma 3 (text only: 1B, or the text part of 4B+)",
        readers.read_gemma3_text, writers.write_gemma3_text, GEMMA,
        presets=named_presets(gemma_preset("gemma-3-1b", "gemma3_text", 26, 1152, 4, 1, 6912, 262144, 32768, 512, 6, **GEMMA3_FIELDS),
                       gemma_preset("gemma-3-4b", "gemma3_text", 34, 2560, 8, 4, 10240, 262208, 131072, 1024, 6, **GEMMA3_FIELDS,
                              rope_type="linear", rope_factor=8.0)),  # the text part of Gemma3ForConditionalGeneration
        tiny=dict(_GEMMA_TINY, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                   "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0)}),
        tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    ),
    Family(
        "olmo2", "Olmo2ForCausalLM", "Olmo2Config", "OLMo 2", readers.read_olmo2, writers.write_olmo2, OLMO2,
        presets=named_presets(llama_preset("olmo-2-1b", "olmo2", 16, 2048, 16, 16, 8192, 100352, 4096, False, 500000.0, **OLMO2_FIELDS),
                       llama_preset("olmo-2-7b", "olmo2", 32, 4096, 32, 32, 11008, 100352, 4096, False, 500000.0, **OLMO2_FIELDS)),
        tiny=dict(_SHAPE, num_key_value_heads=2, pad_token_id=0),
    ),
    Family(
        "phi3", "Phi3ForCausalLM", "Phi3Config", "Phi-3 (4k context)", readers.read_phi3, writers.write_phi3, PHI3,
        presets=named_presets(llama_preset("phi-3-mini", "phi3", 32, 3072, 32, 32, 8192, 32064, 4096, False, 10000.0, fused_qkv=True,
                              mlp="swiglu_fused", sliding_window=2047, bos_token_id=1, eos_token_id=32000)),
        tiny=dict(_SHAPE, num_key_value_heads=2, sliding_window=6, pad_token_id=0,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    ),
    Family(
        "mixtral", "MixtralForCausalLM", "MixtralConfig", "Mixtral", readers_moe.read_mixtral, writers.write_mixtral, MIXTRAL,
        presets=named_presets(llama_preset("mixtral-8x7b", "mixtral", 32, 4096, 32, 8, 14336, 32000, 32768, False, 1_000_000.0,
                              norm_eps=1e-5, bos_token_id=1, eos_token_id=2, n_experts=8, n_experts_per_token=2,
                              routing="softmax_topk_renorm")),
        tiny=dict(_MOE_TINY, num_local_experts=4, sliding_window=5, head_dim=8, initializer_range=0.1),
    ),
    Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen 3 MoE", readers_moe.read_qwen3_moe,
        writers.write_qwen3_moe, MOE,
        presets=named_presets(llama_preset("qwen3-30b-a3b", "qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 40960, False, 1_000_000.0,
                              d_head=128, d_expert=768, **QWEN3_MOE_FIELDS),
                       llama_preset("qwen3-235b-a22b", "qwen3_moe", 94, 4096, 64, 4, 12288, 151936, 40960, False, 1_000_000.0,
                              d_head=128, d_expert=1536, **QWEN3_MOE_FIELDS)),
        tiny=dict(_MOE_TINY, num_experts=4, head_dim=16, moe_intermediate_size=24, mlp_only_layers=[1]),
    ),
    Family(
        "olmoe", "OlmoeForCausalLM", "OlmoeConfig", "OLMoE", readers_moe.read_olmoe, writers.write_olmoe, MOE,
        presets=named_presets(llama_preset("olmoe-1b-7b", "olmoe", 16, 2048, 16, 16, 1024, 50304, 4096, False, 10000.0, **OLMOE_FIELDS)),
        tiny=dict(_MOE_TINY, num_experts=4, norm_topk_prob=True, pad_token_id=0),
    ),
    Family(
        "gpt_oss", "GptOssForCausalLM", "GptOssConfig", "gpt-oss", readers_moe.read_gpt_oss, writers.write_gpt_oss, GPT_OSS,
        presets=named_presets(gpt_oss_preset("gpt-oss-20b", 24, 32), gpt_oss_preset("gpt-oss-120b", 36, 128)),
        tiny=_GPT_OSS_TINY,
    ),
    Family(
        "olmo3", "Olmo3ForCausalLM", "Olmo3Config", "OLMo 3", readers.read_olmo3, writers.write_olmo3, OLMO2,
        presets=named_presets(olmo3_preset("olmo-3-7b", 32, 4096, 32, 32, 11008), olmo3_preset("olmo-3-32b", 64, 5120, 40, 8, 27648)),
        # a sliding block (window shorter than the prompt, its own base) and a full one with YaRN (x4 over 16 tokens)
        tiny=dict(_SHAPE, num_key_value_heads=2, pad_token_id=0, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                   "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                          original_max_position_embeddings=16)}),
        tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    ),
    Family(
        "smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", "SmolLM3", readers.read_smollm3, writers.write_smollm3, LLAMA,
        # HuggingFaceTB/SmolLM3-3B's config.json (from memory, not downloaded): every fourth block without rotary
        presets=named_presets(llama_preset("smollm3-3b", "smollm3", 36, 2048, 16, 4, 11008, 128256, 65536, True, 5_000_000.0,
                              nope_layers=tuple(range(3, 36, 4)), bos_token_id=None, eos_token_id=128012)),
        tiny=dict(_SHAPE, num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0),  # block 1 (of 2 or 3): no rotary
    ),
    Family(
        "qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "Qwen 3.5 (text only)", readers_hybrid.read_qwen3_5_text,
        writers.write_qwen3_5_text, QWEN3_5,
        presets=named_presets(qwen3_5_preset("qwen3.5-0.8b", 24, 1024, 8, 2, 3584, 16, True),
                       qwen3_5_preset("qwen3.5-2b", 24, 2048, 8, 2, 6144, 16, True),
                       qwen3_5_preset("qwen3.5-4b", 32, 2560, 16, 4, 9216, 32, True),
                       qwen3_5_preset("qwen3.5-9b", 32, 4096, 16, 4, 12288, 32, False),
                       qwen3_5_preset("qwen3.5-27b", 64, 5120, 24, 4, 17408, 48, False)),
        tiny=_QWEN3_5_TINY,
        tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]),
    ),
    Family(
        "gemma4_text", "Gemma4ForCausalLM", "Gemma4TextConfig", "Gemma 4 (text only: E2B, E4B, 26B-A4B, 31B)",
        readers.read_gemma4_text, writers.write_gemma4_text, GEMMA4,
        # google/gemma-4-*'s text_config: E2B's 20 last blocks (E4B's 18) read earlier blocks' keys, and E2B's have
        # MLPs twice as wide; 26B-A4B has 128 experts of 704 (8 per token) beside each dense MLP; E2B's full blocks are
        # one in five, the others' one in six
        presets=named_presets(
            gemma4_preset("gemma-4-e2b", 35, 1536, 8, 1, None, 6144, 512, 131072, pattern=5, k_is_v=False, d_per_layer=256,
                    n_kv_shared_layers=20, double_wide_mlp=True),
            gemma4_preset("gemma-4-e4b", 42, 2560, 8, 2, None, 10240, 512, 131072, k_is_v=False, d_per_layer=256,
                    n_kv_shared_layers=18),
            gemma4_preset("gemma-4-26b-a4b", 30, 2816, 16, 8, 2, 2112, 1024, 262144, experts_beside_mlp=True, n_experts=128,
                    n_experts_per_token=8, d_expert=704, routing="softmax_topk_renorm"),
            gemma4_preset("gemma-4-31b", 60, 5376, 32, 16, 4, 21504, 1024, 262144)),
        tiny=_GEMMA4_TINY,
        # transformers makes the last block full, which here reads block 0's keys and values (the last earlier full
        # block); block 1, the one most tests look into, keeps the sliding blocks' heads
        tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                           num_kv_shared_layers=1),
    ),
)}

PRESETS: dict[str, ModelConfig] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}
"""Published shapes by short name (case-insensitive; an organisation prefix is ignored by `ModelConfig.from_name`)."""


def family_of(model_type: Any) -> Family:
    """The record of `model_type`; an unknown one is refused, listing the supported types."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; lenskit implements {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def config_fields(d: Mapping[str, Any], tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for a Hugging Face config dict, or a one-line error naming the field.
    With the checkpoint's `tensor_names`, a layer count above the blocks they hold is refused before anything is
    built per layer, so a config claiming a million layers is refused at once."""
    try:
        family = family_of(d.get("model_type"))
    except ValueError as e:
        raise ValueError(f"config field {e}") from None
    n_blocks = None if tensor_names is None else family.layout.block_count(tensor_names)
    return readers.read_config(d, family.model_type, family.read, n_blocks)


register_families(presets=PRESETS, config_fields=config_fields, family_of=family_of)  # ModelConfig looks them up there
