"""Splicing SAEs into a run: each SAE's hook point hands its activation to the SAE and takes back the
reconstruction (plus the SAE's error, by default, so that the model computes what it computed before).

While spliced, every SAE's own hook points are in `model.hook_dict` as `"<hook>.hook_sae_input"`,
`.hook_sae_acts_pre`, `.hook_sae_acts_post`, `.hook_sae_recons` and `.hook_sae_error` (SAELens's names), so
`run_with_cache`, `run_with_hooks` and the patching and ablation APIs see and edit them like any other point.
Editing `hook_sae_acts_post` changes the model's run even with the error term: the error is the clean
reconstruction's, computed beside the hooked one and held constant for autograd, as SAELens does, so a gradient
reaches the stream below an SAE through its features only.

A transcoder reads its input hook and replaces its output hook (`hook_name_out`) by its prediction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..observe.stream import POINTS
from .sae import SAE, SAE_POINTS

if TYPE_CHECKING:
    from ..model import HookedTransformer


def check_fits(model: HookedTransformer, sae: SAE) -> None:
    """Refuse, by name, an SAE whose hook the model lacks or whose width cannot be the hook's."""
    for name in (sae.hook_name, sae.hook_name_out):
        if name is None:
            raise ValueError(f"this SAE ({sae.cfg.source}) names no hook; load it with SAE.load(path, hook='blocks.L.hook_...')")
        if name not in model.hook_dict:
            raise KeyError(f"SAE {sae.cfg.source} reads/writes {name!r}, a hook this model ({model.cfg.model_name or 'model'}) "
                           f"lacks; it was made for another model (model_name={sae.cfg.model_name!r}), or pass hook= to place it")
    widths = set(POINTS.values())  # the stream's points: d_model wide
    for name, width in ((sae.hook_name, sae.d_in), (sae.hook_name_out, sae.cfg.out_width)):
        if name.rsplit(".", 1)[-1] in widths and width != model.cfg.d_model:
            raise ValueError(f"SAE {sae.cfg.source} has width {width} at {name}, but this model's d_model is "
                             f"{model.cfg.d_model}; it was made for another model (model_name={sae.cfg.model_name!r})")


def splice_value(sae: SAE, x: torch.Tensor, y: torch.Tensor, use_error_term: bool) -> torch.Tensor:
    """The value that replaces y at the SAE's output hook, given x at its input hook (x is y for an SAE), run
    through the SAE's hook points so that hooks on them see and may edit each stage."""
    flat = sae._flat(x)
    sae_in = sae.hook_sae_input(flat)
    pre = sae.hook_sae_acts_pre(sae._pre(sae_in))
    acts = sae.hook_sae_acts_post(sae._activate(pre, sae_in))
    recons = sae.hook_sae_recons(sae.decode(acts, sae_in).to(y.dtype))
    if use_error_term:
        # The error of the clean reconstruction (no hooks): edits at the SAE's points move the output. It is a
        # constant to autograd, as in SAELens, so gradients reach the stream through the features alone.
        with torch.no_grad():
            error = y.reshape(recons.shape) - sae.decode(sae._encode(flat)[1], flat).to(y.dtype)
        recons = recons + sae.hook_sae_error(error)
    return recons.reshape(y.shape)


@contextmanager
def spliced(model: HookedTransformer, saes: Sequence[SAE], use_error_term: bool = True) -> Iterator[HookedTransformer]:
    saes = list(saes)
    for sae in saes:
        if not isinstance(sae, SAE):
            raise TypeError(f"model.saes takes lenskit.saes.SAE objects, got {type(sae).__name__}")
        check_fits(model, sae)
    taken = [sae.hook_name_out for sae in saes]
    twice = {n for n in taken if taken.count(n) > 1}
    if twice:
        raise ValueError(f"two SAEs write {sorted(twice)}; splice one SAE per hook")
    points = {f"{sae.hook_name}.{p}": getattr(sae, p) for sae in saes for p in SAE_POINTS}
    clash = [n for n in points if n in model.hook_dict]
    if clash:
        raise ValueError(f"{clash[0]} is already a hook point: an SAE is already spliced there (nested model.saes?)")
    hooks = []
    for sae in saes:
        if sae.cfg.is_transcoder:
            hooks += _transcoder_hooks(sae, use_error_term)
        else:
            hooks.append((sae.hook_name, lambda x, hook, sae=sae: splice_value(sae, x, x, use_error_term)))
    for name, point in points.items():
        point.name = name
    model.hook_dict.update(points)
    try:
        with model.hooks(hooks):
            yield model
    finally:
        for name in points:
            model.hook_dict.pop(name, None)


def _transcoder_hooks(sae: SAE, use_error_term: bool) -> list:
    """Two hooks: the input hook keeps what it saw; the output hook replaces its value by the transcoder's."""
    seen: dict[str, torch.Tensor] = {}

    def read(x: torch.Tensor, hook) -> None:
        seen["x"] = x

    def write(y: torch.Tensor, hook) -> torch.Tensor:
        return splice_value(sae, seen.pop("x"), y, use_error_term)

    return [(sae.hook_name, read), (sae.hook_name_out, write)]
