"""`transformer_lens.model_bridge.TransformerBridge`: TransformerLens 4's way of loading a model, over lenskit.

>>> from lenskit.transformer_lens.model_bridge import TransformerBridge
>>> model = TransformerBridge.boot_transformers("stdlib-gpt2", device="cpu")   # raw weights, as the bridge boots
>>> model.enable_compatibility_mode(disable_warnings=True)                     # TransformerLens's processing

The model is this namespace's `HookedTransformer` (lenskit's computation, BOS first): the legacy hook names
(`blocks.0.hook_resid_pre` ...) are its own, and TransformerLens 4's component names (`blocks.0.hook_in`,
`blocks.0.attn.hook_out`, `blocks.0.mlp.out.hook_in` ...) name the same hook points when hooks are attached or a
cache is filtered. A cache's keys are the legacy names. docs/transformer_lens.md lists what differs from the
real bridge.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from lenskit.config_names import note_prepend_bos
from lenskit.observe.stream import POINTS

from .HookedTransformer import HookedTransformer

# TransformerLens 4's name inside block i -> lenskit's (the legacy name its compatibility mode aliases).
BLOCK_NAMES = {
    "hook_in": POINTS["resid_pre"], "ln2.hook_in": POINTS["resid_mid"], "hook_out": POINTS["resid_post"],
    "attn.hook_in": "ln1.hook_normalized", "attn.hook_out": POINTS["attn_out"],
    "attn.q.hook_out": "attn.hook_q", "attn.k.hook_out": "attn.hook_k", "attn.v.hook_out": "attn.hook_v",
    "attn.o.hook_in": "attn.hook_z", "ln1.hook_out": "ln1.hook_normalized", "ln2.hook_out": "ln2.hook_normalized",
    "mlp.hook_in": "ln2.hook_normalized", "mlp.hook_out": POINTS["mlp_out"],
    "mlp.in.hook_out": "mlp.hook_pre", "mlp.out.hook_in": "mlp.hook_post",
}
TOP_NAMES = {"embed.hook_out": "hook_embed", "pos_embed.hook_out": "hook_pos_embed",
             "ln_final.hook_out": "ln_final.hook_normalized"}
_IN_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def legacy_name(name: str) -> str:
    """lenskit's (legacy) hook name for a TransformerLens 4 component name; any other name as it is.

    >>> legacy_name("blocks.3.attn.hook_out"), legacy_name("blocks.3.hook_resid_pre")
    ('blocks.3.hook_attn_out', 'blocks.3.hook_resid_pre')
    """
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    inside = _IN_BLOCK.match(name)
    if inside and inside[2] in BLOCK_NAMES:
        return f"blocks.{inside[1]}.{BLOCK_NAMES[inside[2]]}"
    return name


class TransformerBridge(HookedTransformer):
    """A lenskit model booted as TransformerLens 4 boots one (see the module's docstring)."""

    compatibility_mode: bool = False

    @classmethod
    def boot_transformers(cls, model_name: str | os.PathLike, hf_config_overrides: dict | None = None,
                          device: str | torch.device | None = None, dtype: torch.dtype | str = torch.float32,
                          tokenizer: Any = None, load_weights: bool = True, **kwargs: Any) -> "TransformerBridge":
        """A local folder, an embedded model's short name or a hub name in the local cache, with its raw weights
        (the bridge processes them only in `enable_compatibility_mode`)."""
        if hf_config_overrides:
            raise ValueError(f"hf_config_overrides={hf_config_overrides!r}: lenskit builds the model its config.json "
                             "describes; edit a copy of the folder's config.json instead")
        if not load_weights:
            raise ValueError("load_weights=False: lenskit loads a checkpoint whole; build a random model with "
                             "HookedTransformer(HookedTransformerConfig(...)) instead")
        model = cls.from_pretrained_no_processing(model_name, device=device, dtype=dtype, tokenizer=tokenizer, **kwargs)
        return model.eval()

    def enable_compatibility_mode(self, disable_warnings: bool = False, no_processing: bool = False,
                                  fold_ln: bool = True, center_writing_weights: bool = True,
                                  center_unembed: bool = True, fold_value_biases: bool = True,
                                  refactor_factored_attn_matrices: bool = False) -> None:
        """TransformerLens's weight processing in place (each option where it applies to the family, as there;
        `no_processing` skips it all). Legacy hook names work either way, as they are lenskit's own."""
        if self.compatibility_mode:
            raise RuntimeError("enable_compatibility_mode was already called on this model; processing twice would "
                               "change it again: boot a fresh one")
        if not no_processing:
            prepend_bos = self.cfg.default_prepend_bos  # processing may give the model a new config
            options = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                           center_unembed=center_unembed, fold_value_biases=fold_value_biases)
            self.process_weights(**{k: (None if v else False) for k, v in options.items()},
                                 refactor_factored_attn_matrices=refactor_factored_attn_matrices, inplace=True)
            note_prepend_bos(self.cfg, prepend_bos)
        self.compatibility_mode = True

    # TransformerLens 4's names resolve to the same hook points wherever a name is looked up.
    def _resolve(self, name_or_predicate):
        if isinstance(name_or_predicate, str):
            name_or_predicate = legacy_name(name_or_predicate)
        return super()._resolve(name_or_predicate)

    def hook_names(self, names_filter=None):
        if isinstance(names_filter, str):
            names_filter = legacy_name(names_filter)
        elif isinstance(names_filter, (list, tuple)):
            names_filter = [legacy_name(n) if isinstance(n, str) else n for n in names_filter]
        return super().hook_names(names_filter)
