"""A supported model family's record (`Family`): one Hugging Face `model_type`, written once, in its own module.

Each module `lenskit.families.<model_type>` defines `FAMILY`, a `Family` built from its parts in that module: `read`
(config.json -> `ModelConfig` fields), `write` (the way back), `LAYOUT` (checkpoint names), `PRESETS` (published
shapes) and `TINY` (the tiny random config the tests build). `TINY_SHAPE` is the shape most tiny configs start from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import ModelConfig
from .layouts import Layout
from .readers import read_config

# The tiny configs' common shape: 2 blocks of d_model 32 (4 heads), a 101-token vocabulary, 64 positions. With a
# family's `tiny_3_blocks`, the 3-block model (the GPT-2 fixture's depth) every test above the model runs on.
TINY_SHAPE: Mapping[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                     vocab_size=101, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
# Mixtures of experts: 4 experts (the family's own count field), 2 per token, so every expert gets tokens.
TINY_MOE_SHAPE: Mapping[str, Any] = dict(TINY_SHAPE, num_key_value_heads=2, num_experts_per_tok=2)


@dataclass(frozen=True)
class Family:
    """One Hugging Face `model_type`, written once."""

    model_type: str  # config.json's `model_type`, e.g. "llama"
    hf_class: str  # transformers' causal-LM class, config.json's `architectures` entry, e.g. "LlamaForCausalLM"
    hf_config_class: str  # transformers' config class, e.g. "LlamaConfig"
    models: str  # the published models of the family, as README's families table lists them
    read: Callable[..., dict[str, Any]]  # config.json -> ModelConfig keyword arguments (the module's `read`)
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
            back = ModelConfig(**read_config(written, self.model_type, self.read), name=cfg.name)
        except ValueError as e:
            raise ValueError(f"this config cannot be saved as model_type={self.model_type!r}: {e}") from e
        ours, theirs = cfg.to_flat_dict(), back.to_flat_dict()  # by flat name: the field that would not come back
        lost = [f"{k}={v!r} (would read back as {theirs[k]!r})" for k, v in ours.items() if v != theirs[k]]
        if lost:
            raise ValueError(f"a model_type={self.model_type!r} config.json cannot express {'; '.join(lost)}; "
                             "saving in the Hugging Face layout needs the family's own architecture")
        return written
