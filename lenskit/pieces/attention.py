"""Causal self-attention and its pieces: the q/k/v projection (lenskit.pieces.qkv), the masks (causal,
sliding window), grouped-query attention, attention sinks, the output gate (Qwen 3.5: each head's output times a
sigmoid gate that q's projection also gives, `hook_gate`), and Gemma 4's pieces: blocks whose heads have their own width
and kv heads (`cfg.d_head_of`, `cfg.n_kv_heads_of`), keys that are also the values (`qkv.KeyValueQK`) and a gainless norm
on each value head (`attn.v_norm`); and Llama 4's: chunked local attention (`ChunkedMask`), a gainless q/k norm in
the rotary blocks (`attn.q_norm`, `attn.k_norm`), and the queries of the blocks without rotary scaled by a temperature
that grows with the position (`temperature`; `hook_q` is before it, the scores after). Each option is chosen once, in
`Attention.__init__`.

Hook shapes: hook_q, hook_rot_q, hook_z are per query head [batch, pos, head, d_head]; hook_k,
hook_rot_k, hook_v are per key/value head [batch, pos, kv_head, d_head]; hook_attn_scores and
hook_pattern are [batch, head, query_pos, key_pos]; hook_sink [batch, head, query_pos]; hook_result
[batch, pos, head, d_model].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .forward_state import ForwardState, needed
from .linear import write_projection, written
from .norms import UnitRMSNorm, make_norm
from .qkv import make_qkv
from .rotary import Rotary
from .weights import HeadCircuits


class CausalMask:
    """Each query sees itself and every earlier key."""

    def allowed(self, n_pos: int, device: torch.device, start: int = 0) -> torch.Tensor:
        """[query_pos, start + query_pos]: queries at positions start.. (after `start` cached keys), keys from 0."""
        return torch.ones(n_pos, start + n_pos, dtype=torch.bool, device=device).tril(start)

    def sdpa_kwargs(self, n_pos: int, device: torch.device, start: int = 0) -> dict:
        # the kernel's is_causal aligns the first query with the first key, right only without cached keys
        return {"is_causal": True} if start == 0 else {"attn_mask": self.allowed(n_pos, device, start)}


class SlidingWindowMask(CausalMask):
    """Each query sees itself and the `window - 1` keys before it (Mistral): key > query - window."""

    def __init__(self, window: int) -> None:
        self.window = window

    def allowed(self, n_pos: int, device: torch.device, start: int = 0) -> torch.Tensor:
        return super().allowed(n_pos, device, start).triu(start - (self.window - 1))

    def sdpa_kwargs(self, n_pos: int, device: torch.device, start: int = 0) -> dict:
        return {"attn_mask": self.allowed(n_pos, device, start)}


class ChunkedMask(CausalMask):
    """Each query sees the earlier keys of its own chunk of `chunk` positions (Llama 4's rotary blocks): key // chunk
    == query // chunk, chunks counted from position 0 (lenskit's batches are right-padded, so every row starts there)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def allowed(self, n_pos: int, device: torch.device, start: int = 0) -> torch.Tensor:
        queries = torch.arange(start, start + n_pos, device=device) // self.chunk  # [query_pos]
        keys = torch.arange(start + n_pos, device=device) // self.chunk  # [key_pos]
        return super().allowed(n_pos, device, start) & (queries[:, None] == keys[None, :])

    def sdpa_kwargs(self, n_pos: int, device: torch.device, start: int = 0) -> dict:
        return {"attn_mask": self.allowed(n_pos, device, start)}


def make_mask(cfg: ModelConfig, layer: int = 0) -> CausalMask:
    kind = cfg.layer_type(layer)
    if kind == "chunked":
        return ChunkedMask(cfg.attention.chunk_size)
    return SlidingWindowMask(cfg.sliding_window) if kind == "sliding" else CausalMask()


def temperature(positions: torch.Tensor, floor: int, scale: float) -> torch.Tensor:
    """Llama 4's attention temperature [pos] (float32) at `positions` [pos]: 1 + scale * ln(1 + floor((p + 1) / floor)),
    1 for the first `floor - 1` positions, then growing with the log of the context, so that long-context queries in
    the blocks without rotary stay sharp (transformers' `attn_temperature_tuning`, arXiv 2501.19399)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0


class Attention(HeadCircuits, nn.Module):
    """Multi-head causal self-attention: project, (q/k norm), (rotate), attend, write back.

    PyTorch's fused scaled-dot-product kernel runs unless the scores are soft-capped (which the kernel cannot do)
    or, on the CPU, q or k is not finite (see `_fused_agrees`); both paths compute the same function, non-finite
    values included. A hook on the scores or the pattern gets them from the eager path; the output stays the fused
    kernel's unless a hook edits them (returns a tensor or writes in place) or a backward hook is on them, so that
    reading a pattern never moves the logits (an edit takes the eager path, which in bf16 differs from the fused
    one by a few 1e-3 in the logits; in fp32 by rounding). Under grouped-query
    attention each group of n_heads / n_kv_heads query heads shares one key/value head. `layer` picks
    the block's mask and rotary base where the config alternates local and global blocks.

    With `attn_sinks` (gpt-oss), each head has a learned logit `sinks[h]` that joins every softmax as one more key
    with no value: hook_pattern is the probability over the real keys, and hook_sink the sink's share, so each
    query's pattern sums to 1 - sink. The sink's share only observes (the sink has no value, so an edit changes
    nothing); edit hook_pattern instead.
    """

    OWN_KV = True  # whether the block projects its own keys and values (not: kv_sharing.SharedKVAttention)

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Block `layer`'s attention parameters by accounting row (lenskit.accounting), as (weights, biases): q, k, v
        and out under `attn` (gated attention's q also gives the gate; where the keys' projection gives the values,
        Gemma 4's full blocks, no v), attention sinks as biases; its q/k norm gains under `norms`."""
        d, d_head = cfg.d_model, cfg.d_head_of(layer)
        a, kv = cfg.n_heads * d_head, cfg.n_kv_heads_of(layer) * d_head  # under GQA, kv is smaller than a
        q = 2 * a if cfg.attention.output_gate else a
        n_kv = 0 if not cls.OWN_KV else 1 if cfg.k_is_v(layer) else 2
        weights = d * (q + n_kv * kv) + a * d
        biases = (q + n_kv * kv if cfg.attention.qkv_bias else 0) + (d if cfg.attention.out_bias else 0) + (cfg.n_heads if cfg.attention.sinks else 0)
        qk = (2 * d_head if cfg.attention.qk_norm_per_head else a + kv) if cfg.attention.qk_norm else 0  # per head, or over all heads
        qk = qk if cls.OWN_KV else qk // 2  # no key norm where the keys are another block's
        return {"attn": (weights, biases), "norms": (qk, 0)}

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Why weight processing's `option` cannot be applied exactly to these heads (lenskit.processing), and whether
        TransformerLens itself skips it there; None when it applies."""
        if option == "refactor_factored_attn_matrices":
            for bad, why in ((cfg.n_kv_heads != cfg.n_heads, "grouped-query heads share k and v"),
                             (cfg.attention.qk_norm, "q/k norms sit between W_Q, W_K and the scores"),
                             (cfg.attention.output_gate, "its heads are gated or linear"),
                             (_scaled(cfg), "its weight views carry Falcon-H1's multipliers")):
                if bad:
                    return (f"refactor_factored_attn_matrices is not defined for {cfg.family}: {why}; pass "
                            "refactor_factored_attn_matrices=False", False)
        if option == "fold_value_biases":
            for bad, why in ((cfg.attention.sinks, "attention sinks make each pattern sum to less than 1"),
                             (cfg.attention.output_gate, "each head's output gate scales its value bias per position"),
                             (cfg.attention.v_norm and cfg.attention.qkv_bias,  # without a value bias there is nothing to fold
                              "the value norm (Gemma 4's) normalises each value, its bias included"),
                             (_scaled(cfg), "its weight views carry Falcon-H1's multipliers")):
                if bad:
                    return f"fold_value_biases is not exact for {cfg.family}: {why}; pass fold_value_biases=False", False
        return None

    def norm_readers(self) -> list[nn.Linear]:
        """The projections that read the normalised stream, into which fold_ln folds the norm before attention
        (lenskit.processing): the fused q/k/v projection, or each of q, k and v it has (Gemma 4's full blocks have no
        v: their keys are the values; a kv-sharing block has q only)."""
        if isinstance(self.qkv, nn.Linear):
            return [self.qkv]
        return [getattr(self.qkv, name) for name in ("q", "k", "v") if isinstance(getattr(self.qkv, name, None), nn.Linear)]

    @classmethod
    def core_flops(cls, cfg: ModelConfig, layer: int, n_keys: float) -> dict[str, float]:
        """FLOPs per token of the two matmuls that mix positions, scores `Q K^T` and `pattern V`, against `n_keys`
        keys: 2 * n_keys * d_attn each."""
        return {"attn_core": 2 * 2 * n_keys * cfg.n_heads * cfg.d_head_of(layer)}

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d_head, n_kv = cfg.d_head_of(layer), cfg.n_kv_heads_of(layer)  # Gemma 4's full blocks have their own
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, n_kv, d_head
        self.group = cfg.n_heads // n_kv
        self.qkv = make_qkv(cfg, layer)
        # the write's constant multipliers (Granite's residual, Falcon-H1's attention_out) live in the output projection,
        # so W_O, b_O and each head's result are the write as it reaches the stream
        self.out = write_projection(cfg.n_heads * d_head, cfg.d_model, cfg.attention.out_bias,
                                    cfg.scales.residual * cfg.scales.attention_out)
        self.mask = make_mask(cfg, layer)
        self.scale = (d_head if cfg.attention.query_pre_attn_scalar is None else cfg.attention.query_pre_attn_scalar) ** -0.5
        self.softcap = cfg.attention.softcap
        self.hook_q = HookPoint()  # [batch, pos, head, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], computed only when hooked
        if cfg.attention.output_gate:  # hook_z is then each head's mix times its gate: what the output projection reads
            self.hook_gate = HookPoint()  # [batch, pos, head, d_head], sigmoid of the gate, in (0, 1)
        internals = [self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores, self.hook_pattern]
        if cfg.attention.qk_norm and cfg.attention.qk_norm_per_head:
            self.q_norm = make_norm(cfg, d_head)  # over d_head, per head, before rotary
            self.k_norm = make_norm(cfg, d_head)
        elif cfg.attention.qk_norm:  # one norm over every head's features at once (OLMo 2); hooks see [batch, pos, head * d_head]
            self.q_norm = make_norm(cfg, cfg.n_heads * d_head)
            self.k_norm = make_norm(cfg, n_kv * d_head)
        if cfg.attention.qk_unit_norm and cfg.rotates(layer):  # Llama 4: per head, no gain, only where q and k turn
            # transformers normalises after rotating; a rotation keeps each head's length, so before is the same function
            self.q_norm = UnitRMSNorm(cfg.norm_eps)
            self.k_norm = UnitRMSNorm(cfg.norm_eps)
        if hasattr(self, "q_norm"):
            internals += [self.q_norm.hook_scale, self.q_norm.hook_normalized, self.k_norm.hook_scale, self.k_norm.hook_normalized]
        if cfg.attention.v_norm:  # no gain, over d_head per value head (Gemma 4)
            self.v_norm = UnitRMSNorm(cfg.norm_eps)
            internals += [self.v_norm.hook_scale, self.v_norm.hook_normalized]
        if cfg.attention.sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))  # [head], a logit per head
            self.hook_sink = HookPoint()  # [batch, head, query_pos]
            internals.append(self.hook_sink)
        if cfg.rotates(layer):  # not in a NoPE block (SmolLM3's every fourth), which has no positions at all
            self.rotary = Rotary(cfg, local=cfg.layer_type(layer) == "sliding", d_head=d_head)
            self.hook_rot_q = HookPoint()  # [batch, pos, head, d_head]
            self.hook_rot_k = HookPoint()  # [batch, pos, kv_head, d_head]
            internals += [self.hook_rot_q, self.hook_rot_k]
        # Each optional step is chosen here, once; forward calls whichever was chosen.
        self._norm_qk = (_unchanged if not hasattr(self, "q_norm") else self._apply_flat_qk_norm
                         if cfg.attention.qk_norm and not cfg.attention.qk_norm_per_head else self._apply_qk_norm)
        tuned = cfg.attention.temperature_floor is not None and not cfg.rotates(layer)  # Llama 4's blocks without rotary
        # (floor, scale) of `temperature` where this block tunes it, else None
        self.temperature_tuning = (cfg.attention.temperature_floor, cfg.attention.temperature_scale) if tuned else None
        self._temper_q = self._apply_temperature if tuned else _untempered
        self._norm_v = self.v_norm if cfg.attention.v_norm else _ungated
        self._cap = _unchanged_scores if self.softcap is None else self._softcap_scores
        self._rotate_qk = self._apply_rotary if cfg.rotates(layer) else _unrotated
        self._softmax = self._softmax_with_sink if cfg.attention.sinks else _softmax
        self._fused = self._fused_with_sink if cfg.attention.sinks else self._fused_plain
        self._gate_z = self._output_gate if cfg.attention.output_gate else _ungated
        self.layer = layer
        keeps = cfg.block.n_kv_shared_layers and layer in cfg.kv_source_layers  # a block whose keys later blocks read
        self._keep_kv = self._keep_for_sharing if keeps else _keep_nothing
        self._internals = tuple(internals)

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from its normed stream x [batch, pos, d_model], with the forward's
        `state` (lenskit.pieces.forward_state: its KV cache entry; None for a block alone, which has no cache)."""
        return self.from_projections(*self.qkv(x), state=state)

    def from_projections(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gate: torch.Tensor,
                         state: ForwardState | None = None) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from the projections q [batch, pos, head, d_head], k, v [batch, pos,
        kv_head, d_head] (and the gate's logits, as q): where per-head inputs (lenskit.observe.switches) enter too."""
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        past = None if state is None else state.entry(self)  # lenskit.kv_cache: None unless given past_kv_cache
        start = 0 if past is None else past.n_pos
        q, k = self._rotate_qk(*self._norm_qk(q, k), start)
        q = self._temper_q(q, start)
        v = self._norm_v(v)
        if past is not None:
            k, v = past.extend(k, v)  # [batch, n_pos + pos, kv_head, d_head]: the cached keys, then these
        self._keep_kv(k, v, state)  # where later blocks reuse this block's keys and values (Gemma 4: kv_sharing.py)
        return self.attend(q, k, v, *gate)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gate: torch.Tensor) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from q [batch, pos, head, d_head] and k, v [batch, key_pos, kv_head,
        d_head], as the scores read them (after norms and rotation; cached keys first): scores, pattern, mix, gate, out."""
        batch, pos = q.shape[:2]
        if self.softcap is not None or not _fused_agrees(q, k):
            z = self._eager(q, k, v)
        elif any(h.has_hooks() for h in self._internals):
            z = self._observed(q, k, v)
        else:
            z = self._fused(q, k, v)
        z = self.hook_z(self._gate_z(z, *gate))
        flat = z.reshape(batch, pos, self.n_heads * self.d_head)
        return self.out(flat) if not self.hook_result.has_hooks() else self._with_result(z, flat)

    def _with_result(self, z: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The write [batch, pos, d_model] with hook_result [batch, pos, head, d_model], each head's share of it. If
        the hooks there only read (nothing returned or changed in place, no backward hook), the write is the output
        projection's, as unhooked; else it is the sum of the hooked shares plus the bias, the same function rounded
        differently (in bf16 by a few 1e-3 in the logits)."""
        result = torch.einsum("bphd,hdm->bphm", z, self.W_O)
        before = result.clone()  # to see an edit in place (inference tensors count no writes, so values are compared)
        hooked = self.hook_result(result)
        if hooked is result and torch.equal(result, before) and not self.hook_result.has_hooks("bwd"):
            return self.out(flat)
        return hooked.sum(2) if self.out.bias is None else hooked.sum(2) + self.b_O

    # TransformerLens's views of the weights (`x @ W + b`, stacked over layers by lenskit.pieces.weights). Under GQA
    # W_K, W_V, b_K, b_V have one entry per query head, query head h reading kv head h // group, as
    # TransformerLens shows them. An absent bias reads as zeros.
    @property
    def W_Q(self) -> torch.Tensor:
        """[head, d_model, d_head]"""
        return self._per_head(0)

    @property
    def W_K(self) -> torch.Tensor:
        """[head, d_model, d_head], kv heads repeated"""
        return self._per_head(1)

    @property
    def W_V(self) -> torch.Tensor:
        """[head, d_model, d_head], kv heads repeated"""
        return self._per_head(2)

    @property
    def b_Q(self) -> torch.Tensor:
        """[head, d_head]"""
        return self._per_head(0, bias=True)

    @property
    def b_K(self) -> torch.Tensor:
        """[head, d_head], kv heads repeated"""
        return self._per_head(1, bias=True)

    @property
    def b_V(self) -> torch.Tensor:
        """[head, d_head], kv heads repeated"""
        return self._per_head(2, bias=True)

    @property
    def W_O(self) -> torch.Tensor:
        """[head, d_head, d_model]: head h's slice of the output projection (a view of it; times the write's scale
        where it has one, `cfg.scales.residual` and `attention_out`, a copy then)"""
        return written(self.out, self.out.weight.T).reshape(self.n_heads, self.d_head, -1)

    @property
    def b_O(self) -> torch.Tensor:
        """[d_model]"""
        return self.out.weight.new_zeros(self.out.out_features) if self.out.bias is None else written(self.out, self.out.bias)

    def _per_head(self, i: int, bias: bool = False) -> torch.Tensor:
        """q (0), k (1) or v (2): weight [head, d_model, d_head] or bias [head, d_head], kv heads repeated."""
        weight, b = self.qkv.parts()[i]
        if bias:
            t = (weight.new_zeros(weight.shape[0]) if b is None else b).view(-1, self.d_head)  # [head | kv_head, d_head]
        else:
            t = weight.view(-1, self.d_head, weight.shape[1]).transpose(1, 2)  # [head | kv_head, d_model, d_head]
        return t.repeat_interleave(self.n_heads // t.shape[0], dim=0)  # query head h reads kv head h // group

    def _apply_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def _apply_flat_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)

    def _apply_temperature(self, q: torch.Tensor, start: int) -> torch.Tensor:
        """q [batch, pos, head, d_head] times each position's `temperature`, in float32 and cast back as transformers
        does; positions count from the first cached one, as the rotary ones do."""
        positions = torch.arange(start, start + q.shape[1], device=q.device)
        return (q * temperature(positions, *self.temperature_tuning)[:, None, None]).to(q.dtype)

    def _output_gate(self, z: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return z * self.hook_gate(torch.sigmoid(gate))

    def _keep_for_sharing(self, k: torch.Tensor, v: torch.Tensor, state: ForwardState | None) -> None:
        needed(state, f"block {self.layer}'s keys for the blocks that share them").keep_kv(self.layer, k, v)

    def _softcap_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.tanh(scores / self.softcap) * self.softcap

    def _apply_rotary(self, q: torch.Tensor, k: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hook_rot_q(self.rotary(q, start)), self.hook_rot_k(self.rotary(k, start))

    def _fused_plain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=self.group > 1, scale=self.scale,
            **self.mask.sdpa_kwargs(q.shape[1], q.device, k.shape[1] - q.shape[1]),
        ).transpose(1, 2)  # [batch, pos, head, d_head]

    def _fused_with_sink(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The fused kernel with the sink as one more key that every query sees, with a zero value. One extra
        feature carries its logit: the queries' is sinks[h] / scale, the sink key's 1, the real keys' 0, so the sink's
        score is sinks[h] (exactly where the scale is a power of two, as gpt-oss's d_head 64 makes it; else to one
        rounding in q's dtype) and the real scores are unchanged."""
        batch, pos = q.shape[:2]
        sink_logit = (self.sinks / self.scale).to(q.dtype).expand(batch, pos, -1)  # [batch, pos, head]
        q = torch.cat([q, sink_logit[..., None]], dim=-1)  # [batch, pos, head, d_head + 1]
        sink_key = F.pad(k.new_ones(batch, 1, self.n_kv_heads, 1), (self.d_head, 0))  # [batch, 1, kv_head, d_head + 1]
        k = torch.cat([F.pad(k, (0, 1)), sink_key], dim=1)  # [batch, pos + 1, kv_head, d_head + 1]
        v = F.pad(v, (0, 0, 0, 0, 0, 1))  # [batch, pos + 1, kv_head, d_head], the sink's value is zero
        allowed = F.pad(self.mask.allowed(pos, q.device, k.shape[1] - 1 - pos), (0, 1), value=True)  # [query_pos, key_pos + 1]
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed, enable_gqa=self.group > 1,
            scale=self.scale,
        ).transpose(1, 2)  # [batch, pos, head, d_head]

    def _softmax_with_sink(self, scores: torch.Tensor) -> torch.Tensor:
        sink = self.sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)  # [batch, head, query_pos, 1]
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)  # [batch, head, query_pos, key_pos + 1]
        self.hook_sink(probs[..., -1])
        return probs[..., :-1]

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._mix(self._pattern(q, k)[0], v)

    def _observed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The eager path's scores and pattern for the hooks on them; if the hooks only read (no backward hook, nothing
        returned or edited in place), the output is the fused kernel's, so that observing a run leaves its numbers as
        an unobserved run gives them (in bf16 the two paths differ by a few 1e-3 in the logits)."""
        pattern, edited = self._pattern(q, k)
        if edited or any(h.has_hooks("bwd") for h in self._internals):
            return self._mix(pattern, v)
        return self._fused(q, k, v)

    def _pattern(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The pattern [batch, head, query_pos, key_pos] through the hooks on the scores and on it, and whether a hook
        replaced either of them or changed a value in place (a NaN counts as changed: the eager path keeps it)."""
        pos = q.shape[1]
        k = k.repeat_interleave(self.group, dim=2)  # [batch, pos, head, d_head]: query head h reads kv head h // group
        scores = self._cap(torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale)  # [batch, head, query_pos, key_pos]
        allowed = self.mask.allowed(pos, q.device, k.shape[1] - pos)  # keys past the queries' count are cached ones
        # Masked scores become -inf, and a NaN stays NaN, as transformers' additive mask leaves it
        scores = torch.where(allowed, scores, scores - float("inf"))
        before = scores.clone()  # to see an edit in place (inference tensors count no writes, so values are compared)
        hooked = self.hook_attn_scores(scores)
        probs = self._softmax(hooked)
        probs_before = probs.clone()
        pattern = self.hook_pattern(probs)
        edited = (hooked is not scores or pattern is not probs
                  or not torch.equal(scores, before) or not torch.equal(probs, probs_before))
        return pattern, edited

    def _mix(self, pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        v = v.repeat_interleave(self.group, dim=2)  # [batch, pos, head, d_head]
        return torch.einsum("bhqk,bkhd->bqhd", pattern, v)  # [batch, pos, head, d_head]


def _fused_agrees(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the fused kernel gives what the eager path gives for these q and k.

    On the CPU the kernel with `is_causal` returns zeros for a query whose every score is NaN (a NaN in q, or in
    every key it sees), where transformers' eager attention, like the eager path here, returns NaN. So a
    non-finite q or k takes the eager path there; the check costs one sum of each. On other devices nothing is
    checked (reading the sum would make the host wait for the device at every block), and the kernel's own
    handling of NaN applies.
    """
    # detached: only a number is read, and the sum must not join a graph (a Jacobian-lens fit runs with grad)
    return not q.is_cpu or math.isfinite((q.detach().sum(dtype=torch.float32) + k.detach().sum(dtype=torch.float32)).item())


def _scaled(cfg: ModelConfig) -> bool:
    """Whether the config has multipliers on attention's input, keys or write (Falcon-H1's), which the views carry."""
    scales = cfg.scales
    return scales.attention_in != 1.0 or scales.key != 1.0 or scales.attention_out != 1.0


def _unchanged(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k


def _unrotated(q: torch.Tensor, k: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k


def _untempered(q: torch.Tensor, start: int) -> torch.Tensor:
    return q


def _ungated(z: torch.Tensor) -> torch.Tensor:
    return z


def _keep_nothing(k: torch.Tensor, v: torch.Tensor, state: ForwardState | None) -> None:
    return None


def _unchanged_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.softmax(-1)
