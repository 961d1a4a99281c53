"""Rotary settings in a `config.json`, in either spelling: transformers 4's top-level `rope_theta` and
`rope_scaling`, transformers 5's `rope_parameters` (per layer type for Gemma 3), and GPT-NeoX's `rotary_emb_base`
and `rotary_pct`. They resolve as transformers 5 resolves them; fields that would make transformers 4 and 5 compute
different frequencies, and bases or factors outside their domain (transformers turns them into NaN), are refused
by name and value.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..config import ROPE_TYPES
from .fields import HF_LAYER_TYPES, REFUSED, REQUIRED, ConfigReader

_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "yarn": {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate",
                       "attention_factor", "mscale", "mscale_all_dim"}}


def _rope_dict(r: ConfigReader, key: str) -> dict | None:
    """The rotary settings object under `key` (None when absent, null or empty); one setting for every layer."""
    params = r.d.get(key)
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"config field {key}={params!r} must be an object (model_type={r.family!r})")
    if isinstance(next(iter(params.values()), None), dict):
        raise ValueError(f"config field {key} holds per-layer-type rotary settings; lenskit implements one setting for every layer")
    return params or None


def _rotary(r: ConfigReader, params: Mapping[str, Any], where: str, head_dim: int, *, theta: tuple[str, float | None],
            default_theta: float, fraction: tuple[str, float | None] = ("partial_rotary_factor", None),
            default_fraction: float = 1.0, types: tuple[str, ...] = ROPE_TYPES) -> dict[str, Any]:
    """ModelConfig's rotary fields from one settings object (`where` names it in errors), as transformers 5 fills it:
    its own rope_theta and partial_rotary_factor first, else the top-level fields `theta` and `fraction` (name,
    value or None), else the family's defaults. A value given both inside and at the top level, differently, is
    refused: transformers 4 reads the top-level one, transformers 5 the inner one."""
    sub = ConfigReader(params, r.family, where=f"{where}.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in types:
        raise ValueError(f"config field {where}.rope_type={rope_type!r} is not supported for model_type={r.family!r}; "
                         f"lenskit implements {list(types)}")
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"} - _ROPE_KEYS[rope_type])
    if extra:
        raise ValueError(f"config field {where} has {extra}, which rope_type={rope_type!r} does not use; lenskit refuses to guess")

    def pick(inner: str, top: tuple[str, float | None], default: float, null: Any) -> float:
        value = sub.float(inner, None, positive=True, null=null)
        top_key, top_value = top
        if value is not None and top_value is not None and value != top_value:
            raise ValueError(f"config fields {where}.{inner}={value!r} and {top_key}={top_value!r} disagree (transformers 5 "
                             f"reads the first, transformers 4 the second); keep one of them (model_type={r.family!r})")
        return next(v for v in (value, top_value, default) if v is not None)

    base = pick("rope_theta", theta, default_theta, null=REFUSED)
    share = pick("partial_rotary_factor", fraction, default_fraction, null=None)
    if share > 1:
        key = fraction[0] if "partial_rotary_factor" not in params else f"{where}.partial_rotary_factor"
        raise ValueError(f"config field {key}={share!r} must be in (0, 1]: the share of each head that rotates "
                         f"(model_type={r.family!r})")
    fields: dict[str, Any] = {"positional": "rotary", "rotary_base": base, "rotary_dim": int(head_dim * share)}
    if rope_type in ("linear", "llama3"):
        fields.update(rope_type=rope_type, rope_factor=sub.float("factor", positive=True))
    if rope_type == "yarn":
        fields.update(_yarn(r, sub, where))
    if rope_type == "llama3":
        # transformers 5 fills a missing pre-training length from max_position_embeddings
        fields.update(rope_low_freq_factor=sub.float("low_freq_factor", positive=True),
                      rope_high_freq_factor=sub.float("high_freq_factor", positive=True),
                      rope_original_n_ctx=sub.int("original_max_position_embeddings", r.int("max_position_embeddings")))
    return fields


def _yarn(r: ConfigReader, sub: ConfigReader, where: str) -> dict[str, Any]:
    """YaRN's fields as transformers 5 reads them: a null factor is the context's growth, max_position_embeddings /
    original_max_position_embeddings; an absent or null beta is the paper's 32 (fast) or 1 (slow); the attention
    factor is given, or mscale / mscale_all_dim's ratio when both are given (DeepSeek's spelling), or None (derived
    from the factor, see `lenskit.pieces.rotary.attention_factor`)."""
    old_len = sub.int("original_max_position_embeddings", r.int("max_position_embeddings"))
    factor = sub.float("factor", REQUIRED, positive=True, null=None)
    factor = r.int("max_position_embeddings") / old_len if factor is None else factor
    fast = sub.float("beta_fast", 32.0, positive=True, null=32.0)
    slow = sub.float("beta_slow", 1.0, positive=True, null=1.0)
    if fast < slow:
        raise ValueError(f"config fields {where}.beta_fast={fast!r} and {where}.beta_slow={slow!r}: beta_fast must be at "
                         f"least beta_slow (the ramp runs from the fast dims to the slow ones); fix config.json "
                         f"(model_type={r.family!r})")
    scale = sub.float("attention_factor", None, positive=True, null=None)
    mscale, mscale_all = sub.float("mscale", None, null=None), sub.float("mscale_all_dim", None, null=None)
    if scale is None and mscale and mscale_all:  # transformers reads a 0 as absent, so does this

        def gain(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if not gain(mscale) > 0 or not gain(mscale_all) > 0:
            raise ValueError(f"config fields {where}.mscale={mscale!r} and {where}.mscale_all_dim={mscale_all!r} give a "
                             f"non-positive attention factor for factor={factor!r}; fix config.json (model_type={r.family!r})")
        scale = float(gain(mscale) / gain(mscale_all))
    return {"rope_type": "yarn", "rope_factor": factor, "rope_original_n_ctx": old_len, "rope_beta_fast": fast,
            "rope_beta_slow": slow, "rope_truncate": sub.bool("truncate", True), "rope_attention_factor": scale}


def rope(r: ConfigReader, head_dim: int, *, theta_key: str = "rope_theta", fraction_key: str = "partial_rotary_factor",
          default_fraction: float = 1.0, types: tuple[str, ...] = ROPE_TYPES, unread: tuple[str, ...] = (),
          default_theta: float = 10000.0, default_params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Rotary fields from either spelling, resolved as transformers 5 resolves them: 4.x's `rope_scaling` when it is
    given, else 5.x's `rope_parameters`, completed by the top-level `theta_key` and `fraction_key` (4.x's
    `rope_theta`; GPT-NeoX's `rotary_emb_base`, `rotary_pct`). Both objects given with different settings are
    refused by name, as is a top-level value that contradicts the object's. `unread` are top-level rope_theta /
    partial_rotary_factor fields this family's transformers 5 ignores (GPT-NeoX's); they are refused unless they
    agree with the result. `default_theta` is the family's base for an absent theta, `default_params` its settings
    when neither object is given (gpt-oss: YaRN)."""
    given = {key: _rope_dict(r, key) for key in ("rope_scaling", "rope_parameters")}
    if default_params is not None and not any(given.values()):
        given["rope_parameters"] = dict(default_params)
    top = dict(theta=(theta_key, r.float(theta_key, None, positive=True, null=REFUSED)),
               fraction=(fraction_key, r.float(fraction_key, None, positive=True, null=None)))

    def resolve(key: str) -> dict[str, Any]:
        return _rotary(r, given[key] or {}, key, head_dim, **top, default_theta=default_theta,
                       default_fraction=default_fraction, types=types)

    if given["rope_scaling"] and given["rope_parameters"]:
        old, new = resolve("rope_scaling"), resolve("rope_parameters")
        if old != new:
            differ = ", ".join(f"{k}: {old.get(k)!r} vs {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
            raise ValueError(f"config fields rope_scaling and rope_parameters disagree ({differ}): transformers 5 takes "
                             "rope_scaling when both are there, though its own files spell the settings rope_parameters; "
                             f"keep the one the checkpoint was trained with (model_type={r.family!r})")
    fields = resolve("rope_scaling" if given["rope_scaling"] else "rope_parameters")
    read_as = {"rope_theta": ("rotary_base", lambda v: v), "partial_rotary_factor": ("rotary_dim", lambda v: int(head_dim * v))}
    for key in unread:
        value = r.float(key, None, positive=True)
        ours, convert = read_as[key]
        if value is not None and convert(value) != fields[ours]:
            raise ValueError(f"config field {key}={value!r} is not read by transformers 5 for model_type={r.family!r}, "
                             f"and it contradicts what is ({ours}={fields[ours]!r} from {theta_key}, {fraction_key} and "
                             f"rope_parameters); remove {key} or make them agree")
    return fields


def gemma3_rope(r: ConfigReader, head_dim: int) -> dict[str, Any]:
    """Gemma 3's two rotary settings, as transformers 5 resolves them: global blocks (`full_attention`: base, maybe
    linear scaling) and local blocks (`sliding_attention`: their own base, unscaled), from the per-layer-type
    `rope_parameters`, completed by 4.x's `rope_scaling` (merged into the global one), `rope_theta` (global base)
    and `rope_local_base_freq` (local base). Fields that contradict each other are refused by name."""
    params = r.d.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or set(params) - set(HF_LAYER_TYPES)):
        raise ValueError(f"config field rope_parameters={params!r} must map {sorted(HF_LAYER_TYPES)} to rotary settings "
                         f"(model_type={r.family!r})")
    glob_params, local_params = ((params or {}).get(t) or {} for t in ("full_attention", "sliding_attention"))
    theta = ("rope_theta", r.float("rope_theta", None, positive=True, null=REFUSED))
    local_theta = ("rope_local_base_freq", r.float("rope_local_base_freq", None, positive=True, null=REFUSED))
    where = "rope_parameters.full_attention"
    glob = _rotary(r, glob_params, where, head_dim, theta=theta, default_theta=1_000_000.0)
    scaling = _rope_dict(r, "rope_scaling")
    if scaling:
        merged = _rotary(r, {**glob_params, **scaling}, "rope_scaling", head_dim, theta=theta, default_theta=1_000_000.0)
        if glob_params and merged != glob:
            raise ValueError(f"config fields rope_scaling={scaling!r} and {where}={glob_params!r} disagree (transformers 5 "
                             f"merges rope_scaling into it); keep the one the checkpoint was trained with (model_type={r.family!r})")
        glob = merged
    local = _rotary(r, local_params, "rope_parameters.sliding_attention", head_dim, theta=local_theta, default_theta=10000.0)
    if local.get("rope_type", "default") != "default" or local["rotary_dim"] != glob["rotary_dim"]:
        raise ValueError("config field rope_parameters.sliding_attention: lenskit implements only plain rotary with the "
                         "global blocks' rotary dims for Gemma 3's local blocks")
    return {**glob, "local_rotary_base": local["rotary_base"]}


_OLMO3_THETA = 500000.0  # transformers 5's Olmo3Config.default_theta, for either layer type


def olmo3_rope(r: ConfigReader, head_dim: int) -> dict[str, Any]:
    """OLMo 3's two rotary settings, as transformers 5 resolves them: `rope_parameters` keyed by layer type, full
    blocks (`full_attention`: maybe YaRN, as the published checkpoints are) and sliding blocks (`sliding_attention`:
    plain, their own base), completed by 4.x's `rope_scaling` (merged into the full one) and the top-level
    `rope_theta`, which transformers 5 gives to the full blocks only. A top-level base the sliding blocks would not
    get (transformers 4 gave it to every block) and fields that contradict each other are refused by name."""
    params = r.d.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or set(params) - set(HF_LAYER_TYPES)):
        raise ValueError(f"config field rope_parameters={params!r} must map {sorted(HF_LAYER_TYPES)} to rotary settings "
                         f"(model_type={r.family!r})")
    glob_params, local_params = ((params or {}).get(t) or {} for t in ("full_attention", "sliding_attention"))
    for where, given in (("full_attention", glob_params), ("sliding_attention", local_params)):
        if given.get("partial_rotary_factor", 1.0) != 1.0:  # OLMo 3's rotary always spans the whole head
            raise ValueError(f"config field rope_parameters.{where}.partial_rotary_factor={given['partial_rotary_factor']!r} "
                             f"is not read by transformers for model_type={r.family!r}; remove it")
    theta = ("rope_theta", r.float("rope_theta", None, positive=True, null=REFUSED))
    types = ROPE_TYPES + ("yarn",)
    where = "rope_parameters.full_attention"
    glob = _rotary(r, glob_params, where, head_dim, theta=theta, default_theta=_OLMO3_THETA, types=types)
    scaling = _rope_dict(r, "rope_scaling")
    if scaling:
        merged = _rotary(r, {**glob_params, **scaling}, "rope_scaling", head_dim, theta=theta, default_theta=_OLMO3_THETA,
                         types=types)
        if glob_params and merged != glob:
            raise ValueError(f"config fields rope_scaling={scaling!r} and {where}={glob_params!r} disagree (transformers 5 "
                             f"merges rope_scaling into it); keep the one the checkpoint was trained with (model_type={r.family!r})")
        glob = merged
    local = _rotary(r, local_params, "rope_parameters.sliding_attention", head_dim, theta=("rope_theta", None),
                    default_theta=_OLMO3_THETA)
    if theta[1] is not None and "rope_theta" not in local_params and theta[1] != local["rotary_base"]:
        raise ValueError(f"config field rope_theta={theta[1]!r}: transformers 5 gives it to the full-attention blocks only "
                         f"(the sliding ones keep {_OLMO3_THETA!r}), transformers 4 to every block; give "
                         f"rope_parameters.sliding_attention.rope_theta as well (model_type={r.family!r})")
    if local.get("rope_type", "default") != "default":
        raise ValueError("config field rope_parameters.sliding_attention: lenskit implements only plain rotary for "
                         f"OLMo 3's sliding blocks, found rope_type={local['rope_type']!r}")
    return {**glob, "local_rotary_base": local["rotary_base"]}


_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def gemma4_rope(r: ConfigReader, head_dim: int) -> dict[str, Any]:
    """Gemma 4's two rotary settings from `rope_parameters` keyed by layer type (transformers 5's defaults, a plain
    base 1e4 on the sliding blocks and proportional rotary over a quarter of the pairs at base 1e6 on the full ones,
    when it is absent): the sliding blocks plain and whole-head; the full blocks plain or proportional (pairs across
    the whole head, the last ones standing still). Anything else is refused by name."""
    params = r.d.get("rope_parameters")
    params = _GEMMA4_ROPE if params is None else params
    if not isinstance(params, dict) or set(params) - set(HF_LAYER_TYPES):
        raise ValueError(f"config field rope_parameters={params!r} must map {sorted(HF_LAYER_TYPES)} to rotary settings "
                         f"(model_type={r.family!r})")
    types = set(HF_LAYER_TYPES[t] for t in (r.d.get("layer_types") or HF_LAYER_TYPES))
    for key in ("sliding_attention", "full_attention"):
        if not isinstance(params.get(key), dict) and HF_LAYER_TYPES[key] in types:
            raise ValueError(f"config field rope_parameters.{key} is missing (model_type={r.family!r}); give its "
                             f"rope_type and rope_theta")
    local = params.get("sliding_attention") or {"rope_type": "default"}
    glob = dict(params.get("full_attention") or {"rope_type": "default"})
    local_fields = _rotary(r, local, "rope_parameters.sliding_attention", head_dim, theta=("rope_theta", None),
                           default_theta=10000.0, types=("default",))
    if local_fields["rotary_dim"] != head_dim:
        raise ValueError("config field rope_parameters.sliding_attention.partial_rotary_factor: lenskit implements "
                         f"whole-head rotary on Gemma 4's sliding blocks (model_type={r.family!r})")
    where = "rope_parameters.full_attention"
    rope_type = glob.get("rope_type", "default")
    if rope_type == "proportional":
        sub = ConfigReader(glob, r.family, where=f"{where}.")
        extra = sorted(set(glob) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
        if extra:
            raise ValueError(f"config field {where} has {extra}, which rope_type='proportional' does not use; lenskit "
                             "refuses to guess")
        share = sub.float("partial_rotary_factor", 1.0, positive=True, null=1.0)
        if share > 1:
            raise ValueError(f"config field {where}.partial_rotary_factor={share!r} must be in (0, 1] (model_type={r.family!r})")
        return {"positional": "rotary", "rotary_dim": head_dim, "rotary_base": sub.float("rope_theta", positive=True),
                "rope_type": "proportional", "rope_factor": sub.float("factor", 1.0, positive=True, null=1.0),
                "rope_proportion": share, "local_rotary_base": local_fields["rotary_base"]}
    glob_fields = _rotary(r, glob, where, head_dim, theta=("rope_theta", None), default_theta=1_000_000.0,
                          types=("default",))
    if glob_fields["rotary_dim"] != head_dim:
        raise ValueError(f"config field {where}.partial_rotary_factor: with rope_type='default' lenskit implements "
                         f"whole-head rotary on Gemma 4's full blocks; use rope_type='proportional' (model_type={r.family!r})")
    return {**glob_fields, "local_rotary_base": local_fields["rotary_base"]}
