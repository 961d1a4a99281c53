"""A sparse autoencoder or transcoder, whatever format it came from: one set of weights in one orientation and
one definition of each activation, so that every reader (lenskit.saes.formats) only has to say which.

Orientation: `W_enc [d_in, d_sae]`, `W_dec [d_sae, d_out]`, `W_skip [d_out, d_in]` (a skip transcoder adds
`x @ W_skip.T`). `d_out == d_in` for an SAE; a transcoder reads `hook_name` and writes `hook_name_out`.

    pre  = (x - b_dec if apply_b_dec_to_input else x) @ W_enc + b_enc
    relu:      f = relu(pre)
    topk:      f = relu(pre) on the k largest pre-activations, 0 elsewhere
    jumprelu:  f = relu(pre) * (pre > threshold)                  (Gemma Scope, SAELens, circuit-tracer)
    gated:     pre = x' @ W_enc;  f = (pre + b_gate > 0) * relu(pre * exp(r_mag) + b_mag)   (SAELens gated)
    decode(f) = f @ W_dec + b_dec (+ x @ W_skip.T)

Arithmetic runs in the weights' dtype, as each format's reference runs it (they cast the input to the weights'
dtype); results come back in the input's dtype, so a spliced SAE leaves a model's dtype as it was.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..observe.hooks import HookPoint
from .formats import ARCHITECTURES, SAEConfig, read_sae, write_saelens  # noqa: F401 - SAEConfig, ARCHITECTURES re-exported

# The hook points a spliced SAE adds, under "<hook_name>.<point>" (SAELens's names).
SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error")


def _shapes(cfg: SAEConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"W_enc": (cfg.d_in, cfg.d_sae), "W_dec": (cfg.d_sae, cfg.out_width), "b_dec": (cfg.out_width,)}
    if cfg.architecture == "gated":
        return {**shapes, "b_gate": (cfg.d_sae,), "r_mag": (cfg.d_sae,), "b_mag": (cfg.d_sae,)}
    shapes["b_enc"] = (cfg.d_sae,)
    return {**shapes, "threshold": (cfg.d_sae,)} if cfg.architecture == "jumprelu" else shapes


class SAE(nn.Module):
    """A sparse autoencoder (or transcoder) read from any supported format: `SAE.load(path_or_repo, hook=None)`.

    >>> sae = SAE.load("stdlib-gpt2-sae-L3")
    >>> f = sae.encode(cache[sae.hook_name]); x_hat = sae.decode(f)
    >>> f.shape, int((f[0, -1] > 0).sum())       # [batch, pos, d_sae]; TopK: 32 active latents per token
    (torch.Size([1, 13, 1536]), 32)
    >>> with model.saes([sae]): spliced, spliced_cache = model.run_with_cache(tokens)
    >>> torch.allclose(spliced, logits, atol=1e-3)   # with the error term the logits are unchanged
    True
    """

    def __init__(self, cfg: SAEConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        expected = _shapes(cfg)
        optional = {"W_skip": (cfg.out_width, cfg.d_in)}
        for name in weights:
            if name not in expected and name not in optional:
                raise ValueError(f"{cfg.source}: unexpected tensor {name!r} for a {cfg.architecture} SAE "
                                 f"(expected {sorted(expected)})")
        for name, shape in {**expected, **optional}.items():
            if name not in weights:
                if name in expected:
                    raise ValueError(f"{cfg.source}: tensor {name!r} is missing; a {cfg.architecture} SAE needs {sorted(expected)}")
                self.register_buffer(name, None)
                continue
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{cfg.source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape} "
                                 f"(d_in={cfg.d_in}, d_sae={cfg.d_sae}, d_out={cfg.out_width})")
            if not t.dtype.is_floating_point:
                raise ValueError(f"{cfg.source}: tensor {name!r} has dtype {t.dtype}; SAE weights must be floating point")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{cfg.source}: tensor {name!r} holds NaN or inf; the file is corrupt")
            self.register_parameter(name, nn.Parameter(t.detach().clone(), requires_grad=False))
        for point in SAE_POINTS:
            setattr(self, point, HookPoint())
        self._copies: dict[torch.device, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ facts
    @property
    def hook_name(self) -> str | None:
        return self.cfg.hook_name

    @property
    def hook_name_out(self) -> str | None:
        return self.cfg.hook_name_out or self.cfg.hook_name

    @property
    def d_in(self) -> int:
        return self.cfg.d_in

    @property
    def d_sae(self) -> int:
        return self.cfg.d_sae

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def _weights(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The weights on `device`: the SAE's own where they live, else one copy per device, kept (a model split
        over devices runs its SAEs where their hooks are)."""
        own = {n: p for n, p in self.named_parameters()}
        if device == self.device:
            return own
        if device not in self._copies:
            self._copies[device] = {n: p.to(device) for n, p in own.items()}
        return self._copies[device]

    def _apply(self, fn, recurse=True):
        self._copies = {}
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------- maths
    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        """x with its features on the last axis: per-head hooks (`attn.hook_z`, [.., head, d_head]) are flattened,
        as SAELens and Gemma Scope train on them."""
        if x.shape[-1] != self.d_in and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == self.d_in:
            return x.flatten(-2)
        if x.shape[-1] != self.d_in:
            raise ValueError(f"this SAE reads vectors of width d_in={self.d_in} ({self.cfg.source}), but got an activation "
                             f"of shape {tuple(x.shape)}; it was trained for another model or another hook")
        return x

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activations of x [..., d_in] (already flat), in the weights' dtype; a gated SAE's magnitude path."""
        w = self._weights(x.device)
        x = x.to(w["W_enc"].dtype)
        if self.cfg.apply_b_dec_to_input:
            x = x - w["b_dec"]
        if self.cfg.architecture == "gated":
            return (x @ w["W_enc"]) * w["r_mag"].exp() + w["b_mag"]
        return x @ w["W_enc"] + w["b_enc"]

    def _activate(self, pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Feature activations from pre-activations (x: the flat input, which a gated SAE's gate reads)."""
        arch, w = self.cfg.architecture, self._weights(pre.device)
        if arch == "relu":
            return torch.relu(pre)
        if arch == "jumprelu":
            return torch.relu(pre) * (pre > w["threshold"])
        if arch == "gated":
            x = x.to(w["W_enc"].dtype)
            x = x - w["b_dec"] if self.cfg.apply_b_dec_to_input else x
            return (x @ w["W_enc"] + w["b_gate"] > 0) * torch.relu(pre)
        top = pre.topk(self.cfg.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre = self._pre(x)
        return pre, self._activate(pre, x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [..., d_sae] of x [..., d_in], in x's dtype."""
        return self._encode(self._flat(x))[1].to(x.dtype)

    def decode(self, f: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction [..., d_out] of feature activations f, in f's dtype. A skip transcoder also needs
        its input x (its skip term is `x @ W_skip.T`)."""
        w = self._weights(f.device)
        out = f.to(w["W_dec"].dtype) @ w["W_dec"] + w["b_dec"]
        if w.get("W_skip") is not None:
            if x is None:
                raise ValueError("this transcoder has a skip connection (W_skip): decode(f, x) needs its input x too")
            out = out + self._flat(x).to(out.dtype) @ w["W_skip"].T
        return out.to(f.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): the reconstruction (a transcoder's prediction of its output hook), in x's dtype."""
        flat = self._flat(x)
        return self.decode(self._encode(flat)[1], flat).to(x.dtype)

    # ---------------------------------------------------------------- files
    @classmethod
    def load(cls, path_or_repo: str | os.PathLike, hook: str | tuple[str, str] | None = None) -> SAE:
        """Read an SAE or transcoder: a folder or file of SAELens, Gemma Scope (params.npz or its safetensors),
        EleutherAI sparsify, circuit-tracer (one layer's .safetensors) or dictionary_learning (ae.pt, read without
        unpickling) format; a hub repo path (`org/repo/sub/folder`) through the local Hugging Face cache; or a short
        name of an SAE that ships with lenskit (`stdlib-gpt2-sae-L3`). `hook` names the hook where the file does not
        (a transcoder: `(input_hook, output_hook)`), or overrides it.

        >>> sae = SAE.load("stdlib-gpt2-sae-L3")     # a short name; or a hub repo path, the hook from its folder name:
        >>> sae.hook_name                            # SAE.load("google/gemma-scope-2b-pt-res/layer_12/width_16k/average_l0_82")
        'blocks.3.hook_resid_pre'
        """
        return cls(*read_sae(path_or_repo, hook))

    def save(self, folder: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Write SAELens 6's layout: `cfg.json` (metadata holds the hook) and `sae_weights.safetensors`."""
        write_saelens(self, folder, extra or {})

    def extra_repr(self) -> str:
        c = self.cfg
        k = f", k={c.k}" if c.k else ""
        where = f"{c.hook_name} -> {c.hook_name_out}" if c.is_transcoder else f"{c.hook_name}"
        return f"{c.architecture}{k}, d_in={c.d_in}, d_sae={c.d_sae}, hook={where}, format={c.format}"
