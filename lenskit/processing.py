"""Weight processing as TransformerLens defines it: fold the norms, centre the writing weights and the unembedding,
fold the value biases, refactor the attention circuits. Opt-in; `process_weights` returns a processed copy and
leaves the caller's model as it was.

    fold_ln                 each pre-sublayer norm's gain (and LayerNorm's bias) goes into the weights that read its
                            output (q/k/v, the MLP's input and gate, the unembedding); the norm keeps only its
                            normalisation (weight at its identity, LayerNorm's bias zero). With LayerNorm the readers
                            are also centred over d_model, as TransformerLens does (their input has zero mean).
    center_writing_weights  W_E, W_pos, W_O, b_O, W_out, b_out lose their mean over d_model (LayerNorm only: the next
                            norm removes that mean anyway, so only the stream changes, by a per-position constant).
    center_unembed          W_U (and b_U) lose their mean over the vocabulary: every logit at a position shifts by the
                            same amount, so log-probabilities are unchanged.
    fold_value_biases       b_O += sum_h b_V[h] @ W_O[h], b_V = 0: exact because each query's pattern sums to 1.
    refactor_factored_attn_matrices
                            each head's W_Q, W_K (biases included) and W_V, W_O refactored by SVD so that the QK and
                            OV circuits are unchanged (see `_refactor`); learned-position families only (GPT-2).

TransformerLens's order is kept: fold_ln, center_writing_weights, center_unembed, fold_value_biases (b_O centred again
after it where the writing weights are centred), refactor_factored_attn_matrices. Arithmetic runs in float32, then
casts back to the model's dtype.

After `fold_ln`, a norm's `hook_normalized` is the pure normalisation, TransformerLens's meaning ("LNPre"):
(x - mean) / scale for LayerNorm, x / scale for RMSNorm; `hook_scale` is unchanged. Post-sublayer norms (Gemma's
sandwich `ln*_post`) and q/k norms read no stream and are left as they are, as in TransformerLens; OLMo 2 and 3,
whose blocks have only post-norms, get no fold_ln at all (TransformerLens skips it there, final norm included).

Each piece says what applies to it: `processing_refusal` (the positions, the token mixers, the block form, the norm
and the readout refuse an option by name where it would not be exact) and `norm_readers` (the projections fold_ln
folds a norm into); this module applies the options over the model's pieces.

A tied unembedding is untied first wherever W_E or W_U changes (`cfg.tie_word_embeddings` becomes False). A processed
model records what was done in `model.processing` (a tuple of option names, in order); its final norm and unembedding
change, so a tuned lens fitted on the raw model is refused by `model_fingerprint` (fit one on the processed model).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .pieces.deltanet import GatedDeltaNet
from .pieces.layers import block_class, mixer_classes
from .pieces.mamba2 import Mamba2Mixer
from .pieces.norms import NORM_CLASSES
from .pieces.readout import Readout
from .pieces.rotary import Rotary

if TYPE_CHECKING:
    from .model import HookedTransformer

OPTIONS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices")


def refusal(cfg, option: str) -> tuple[str, bool] | None:
    """Why `option` cannot be applied exactly to a model of `cfg`, and whether TransformerLens itself skips it there
    (True: its default silently leaves it out); None when it applies. Each piece says it for itself
    (`processing_refusal`); the first piece that refuses, in `_pieces`'s order, gives the reason."""
    for piece in _pieces(cfg):
        why = piece.processing_refusal(cfg, option)
        if why is not None:
            return why
    return None


def _pieces(cfg) -> list[Any]:
    """The kinds of piece a model of `cfg` is made of, in the order their refusals are checked: rotary positions,
    the token mixers (softmax attention before linear attention and Mamba-2), the block form, the norm, the readout."""
    mixers = sorted({mixer for layer in range(cfg.n_layers) for mixer in mixer_classes(cfg, layer)},
                    key=lambda piece: (issubclass(piece, (GatedDeltaNet, Mamba2Mixer)), piece.__name__))
    return [*([Rotary] if cfg.positional == "rotary" else []), *mixers, block_class(cfg), NORM_CLASSES[cfg.norm], Readout]


def process_weights(model: "HookedTransformer", fold_ln: bool | None = False, center_writing_weights: bool | None = False,
                    center_unembed: bool | None = False, fold_value_biases: bool | None = False,
                    refactor_factored_attn_matrices: bool | None = False, inplace: bool = False) -> "HookedTransformer":
    """The model with the chosen options applied (see the module's docstring): a copy, or `model` itself with
    `inplace=True`. Each option is True (apply, or refuse with a ValueError saying why), False (skip) or None (what
    TransformerLens's default does: skipped where it skips it, center_writing_weights for RMSNorm and fold_ln for
    OLMo 2/3; refused where it would apply it but the model would change, e.g. center_unembed under Gemma 2's soft-cap)."""
    asked = dict(zip(OPTIONS, (fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                               refactor_factored_attn_matrices)))
    chosen = []
    for option, value in asked.items():
        if value not in (True, False, None):
            raise TypeError(f"{option} must be True, False or None, got {value!r}")
        why = refusal(model.cfg, option) if value is not False else None
        if why is not None and (value is True or not why[1]):
            raise ValueError(why[0])
        if value is True or (value is None and why is None):
            chosen.append(option)
    done = tuple(getattr(model, "processing", ()))  # each option is idempotent: applying one again changes nothing
    if not inplace:  # the tokenizer is shared and the mapped weight files stay with the original
        model = copy.deepcopy(model, {id(model.tokenizer): model.tokenizer, id(model.weight_files): None})
        model.weight_files = None
    if not chosen:
        return model
    with torch.no_grad():
        if set(chosen) & {"fold_ln", "center_writing_weights", "center_unembed"}:
            _untie(model)
        if "fold_ln" in chosen:
            _fold_ln(model)
        if "center_writing_weights" in chosen:
            _center_writing(model)
        if "center_unembed" in chosen:
            _center_rows(model.unembed, dim=0)  # [d_vocab, d_model]: the mean over the vocabulary
        if "fold_value_biases" in chosen:
            _fold_value_biases(model, recenter="center_writing_weights" in chosen or "center_writing_weights" in done)
        if "refactor_factored_attn_matrices" in chosen:
            _refactor(model)
    model.processing = done + tuple(o for o in chosen if o not in done)
    return model


# ------------------------------------------------------------------------------------------ helpers
def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write a float32 result back into a parameter in its own dtype."""
    param.data = value.to(param.dtype)


def _bias(layer: nn.Linear) -> nn.Parameter:
    """The layer's bias, created as zeros [out_features] where it has none."""
    if layer.bias is None:
        layer.bias = nn.Parameter(layer.weight.new_zeros(layer.weight.shape[0]))
    return layer.bias


def _untie(model: "HookedTransformer") -> None:
    """Give the unembedding its own copy of a tied embedding, so editing one leaves the other."""
    if model.unembed.weight is model.embed.weight:
        model.unembed.weight = nn.Parameter(model.embed.weight.detach().clone())
    if model.cfg.tie_word_embeddings:
        model.cfg = model.cfg.replace(tie_word_embeddings=False)


def _center_rows(layer: nn.Module, dim: int) -> None:
    """Remove the weight's mean along `dim` (and its bias's mean where the weight is [d_model, in], dim 0)."""
    _set(layer.weight, layer.weight.float() - layer.weight.float().mean(dim, keepdim=True))
    if getattr(layer, "bias", None) is not None and dim == 0:
        _set(layer.bias, layer.bias.float() - layer.bias.float().mean())


def _fold_norm(norm: nn.Module, readers: list[nn.Linear], center: bool) -> None:
    """Fold the norm's gain (and bias) into each reader [out, d_model], then set the norm to its identity."""
    gain = norm.gain.float()  # [d_model]; Gemma's 1 + w
    bias = getattr(norm, "bias", None)
    for layer in readers:
        w = layer.weight.float()  # [out, d_model]
        if bias is not None:
            _set(_bias(layer), _bias(layer).float() + w @ bias.float())
        w = w * gain
        _set(layer.weight, w - w.mean(1, keepdim=True) if center else w)
    _set(norm.weight, torch.full_like(gain, norm.IDENTITY_WEIGHT))  # new tensors: a mapped file is never written
    if bias is not None:
        _set(bias, torch.zeros_like(gain))


def _fold_ln(model: "HookedTransformer") -> None:
    center = model.cfg.norm == "layernorm"  # TransformerLens centres the readers of a LayerNorm only
    for block in model.blocks:
        if type(block).PRE_NORMS:  # type: ignore[attr-defined]  # a ModuleList item is a Module to mypy. OLMo 2's post-norm blocks have nothing before their sublayers
            _fold_norm(block.ln1, block.attn.norm_readers(), center)
            _fold_norm(block.ln2, block.mlp.norm_readers(), center)
    _fold_norm(model.ln_final, [model.unembed], center)  # LayerNorm's bias becomes an unembedding bias, b_U
    if center:  # only a LayerNorm's bias can give a projection a bias it lacked
        _sync_biases(model)


def _center_writing(model: "HookedTransformer") -> None:
    for table in (model.embed, getattr(model, "pos_embed", None)):
        if table is not None:  # [rows, d_model]: each row's mean over d_model
            _set(table.weight, table.weight.float() - table.weight.float().mean(1, keepdim=True))
    for block in model.blocks:
        _center_rows(block.attn.out, dim=0)  # [d_model, n_heads * d_head]
        _center_rows(block.mlp.fc_out, dim=0)  # [d_model, d_mlp]


def _fold_value_biases(model: "HookedTransformer", recenter: bool) -> None:
    for block in model.blocks:
        attn = block.attn
        v_bias = attn.qkv.parts()[2][1]
        if v_bias is None:
            continue
        b_V = attn.b_V.float()  # [head, d_head], kv heads repeated
        b_O = _bias(attn.out)
        if not model.cfg.attention.out_bias:
            model.cfg = model.cfg.replace(out_bias=True)
        # into the stored bias: W_O is the write as it reaches the stream, times the residual scale where there is one
        folded = b_O.float() + torch.einsum("hd,hdm->m", b_V, attn.W_O.float()) / getattr(attn.out, "scale", 1.0)
        _set(b_O, folded - folded.mean() if recenter else folded)
        qkv = attn.qkv
        if isinstance(qkv, nn.Linear):  # fused [q | k | v]: v's rows are the last
            _set(qkv.bias, torch.cat([qkv.bias.float()[:-v_bias.shape[0]], v_bias.float().new_zeros(v_bias.shape)]))
        else:
            _set(qkv.v.bias, torch.zeros_like(v_bias, dtype=torch.float32))


def _sync_biases(model: "HookedTransformer") -> None:
    """Say in the config that the q/k/v and MLP projections have biases where folding gave them some."""
    changes = {}
    attns: list[Any] = [b.attn for b in model.blocks]  # each a token-mixer piece, which names its norm's readers
    if not model.cfg.attention.qkv_bias and any(l.bias is not None for a in attns for l in a.norm_readers()):
        changes["qkv_bias"] = True
    dense: list[Any] = [b.mlp for b in model.blocks if not hasattr(b.mlp, "experts")]  # an expert's bias is the family's own
    if not model.cfg.mlp_bias and any(l.bias is not None for mlp in dense for l in mlp.norm_readers()):
        changes["mlp_bias"] = True
    if changes:
        model.cfg = model.cfg.replace(**changes)


def _refactor(model: "HookedTransformer") -> None:
    """TransformerLens's refactor of each head's low-rank circuits, by SVD (A Mathematical Framework for
    Transformer Circuits): with the biases as one more input feature, W_QK = [W_Q; b_Q] [W_K; b_K]^T = U S V^T
    becomes W_Q = U sqrt(S), W_K = V sqrt(S); b_V goes into b_O, and W_OV = W_V W_O = U S V^T becomes W_V = U S,
    W_O = V^T. Each singular vector's sign is the SVD's, so columns may differ from TransformerLens's by a sign."""
    _fold_value_biases(model, recenter=False)
    for block in model.blocks:
        attn = block.attn
        n, d_head = attn.n_heads, attn.d_head
        q_in = torch.cat([attn.W_Q.float(), attn.b_Q.float()[:, None]], dim=1)  # [head, d_model + 1, d_head]
        k_in = torch.cat([attn.W_K.float(), attn.b_K.float()[:, None]], dim=1)
        u, s, v = _low_rank_svd(q_in, k_in)  # [head, d_model + 1, d_head], [head, d_head], same as u
        q_in, k_in = u * s.sqrt()[:, None], v * s.sqrt()[:, None]
        u, s, v = _low_rank_svd(attn.W_V.float(), attn.W_O.float().transpose(1, 2))  # W_OV = W_V W_O
        w_v, w_o = u * s[:, None], v.transpose(1, 2)  # [head, d_model, d_head], [head, d_head, d_model]
        rows = lambda w: w.transpose(1, 2).reshape(n * d_head, -1)  # noqa: E731 [head, d_model, d_head] -> [out, d_model]
        weights = [rows(q_in[:, :-1]), rows(k_in[:, :-1]), rows(w_v)]
        biases = [q_in[:, -1].reshape(-1), k_in[:, -1].reshape(-1), attn.b_V.float().reshape(-1)]
        if isinstance(attn.qkv, nn.Linear):  # fused [q | k | v]
            _set(attn.qkv.weight, torch.cat(weights))
            _set(_bias(attn.qkv), torch.cat(biases))
        else:
            for layer, w, b in zip((attn.qkv.q, attn.qkv.k, attn.qkv.v), weights, biases):
                _set(layer.weight, w)
                _set(_bias(layer), b)
        # [d_model, head * d_head], stored without the residual scale the projection applies (W_O includes it)
        _set(attn.out.weight, w_o.reshape(n * d_head, -1).T / getattr(attn.out, "scale", 1.0))
    _sync_biases(model)


def _low_rank_svd(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of a @ b^T (a [head, m, r], b [head, n, r]) without forming it: a = Qa Ra, b = Qb Rb, then the
    SVD of the small core Ra Rb^T. Returns U [head, m, r], S [head, r], V [head, n, r] with a @ b^T = U diag(S) V^T."""
    qa, ra = torch.linalg.qr(a)
    qb, rb = torch.linalg.qr(b)
    uc, s, vch = torch.linalg.svd(ra @ rb.transpose(1, 2))  # [head, r, r] each, s [head, r]
    return qa @ uc, s, qb @ vch.transpose(1, 2)
