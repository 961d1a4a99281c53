"""The README.md model card of a lens folder, so that the folder is a ready Hugging Face model repo.

The card is written from the lens's config.json alone: YAML front matter (library_name, base_model when
the model's hub id is known, tags), then the recipe, the data it was trained on, and the per-layer
evaluation table that `lenskit eval-lens --card` records under the config's "eval" key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .io import CONFIG_FILE, read_config, write_atomic

CARD_FILE = "README.md"
TAGS = ("tuned-lens", "interpretability", "lenskit")
JACOBIAN_FORMAT = "lenskit-jacobian-lens"  # lenses.jacobian.FORMAT (which imports this module)
JACOBIAN_TAGS = ("jacobian-lens", "interpretability", "lenskit")
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Short GPT-2 names -> the hub repositories they now redirect to.
SHORT_GPT2 = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
              "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl",
              "distilgpt2": "distilbert/distilgpt2"}
EVAL_COLUMNS = ("layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned")


def base_model(model_name: Any) -> str | None:
    """The model's hub repo id when its name is one (not a local path), else None."""
    if not isinstance(model_name, str) or Path(model_name).expanduser().exists():
        return None
    if model_name in SHORT_GPT2:
        return SHORT_GPT2[model_name]
    return model_name if HUB_REPO_ID.match(model_name) else None


def front_matter(base: str | None, tags: tuple[str, ...]) -> list[str]:
    front = ["---", "library_name: lenskit"] + ([f"base_model: {base}"] if base else [])
    return front + ["tags:", *(f"- {t}" for t in tags), "---", ""]


def model_card(config: dict[str, Any]) -> str:
    """The card's Markdown for a lens config (as `TunedLens.config()` writes it)."""
    if config.get("format") == JACOBIAN_FORMAT:
        return jacobian_card(config)
    base = base_model(config.get("model_name"))
    front = front_matter(base, TAGS)
    name = base or config.get("model_name") or "a model"
    kind = ("A bias-only tuned lens (one learned bias per residual stream, h + b_l, no matrix;"
            if config.get("bias_only") else "A tuned lens (one affine translator per residual stream, h + A_l h + b_l;")
    body = [f"# {'Bias-only tuned' if config.get('bias_only') else 'Tuned'} lens for {name}", "",
            f"{kind} {config.get('n_layers')} layers, "
            f"d_model {config.get('d_model')}{', with resid_mid translators' if config.get('resid_mid') else ''}) "
            "written by lenskit. The weights are in "
            f"`{config.get('weights')}`, the settings in `{CONFIG_FILE}`.", "",
            "```python", "import lenskit", "from lenses import TunedLens", "",
            f"model = lenskit.HookedTransformer.from_pretrained({json.dumps(base or config.get('model_name'))})",
            "lens = TunedLens.load(\"<this repo id or folder>\", model)", "```", "",
            f"The model's fingerprint (sha256 of its final norm and unembedding): `{config.get('model_fingerprint')}`.", ""]
    body += _training(config) + _data(config) + _evaluation(config)
    return "\n".join(front + body).rstrip() + "\n"


def _training(config: dict[str, Any]) -> list[str]:
    recipe = config.get("recipe")
    if not isinstance(recipe, dict):
        return ["## Training", "", "No training recipe is recorded (the lens was not trained by lenskit).", ""]
    rows = [f"| {k} | {json.dumps(v)} |" for k, v in recipe.items()]
    done = config.get("steps_done")
    tokens = config.get("tokens_seen")
    summary = f"{done} step{'' if done == 1 else 's'}, {tokens:,} tokens." if isinstance(done, int) and isinstance(tokens, int) else ""
    return ["## Training", "", f"Trained with `lenskit train-lens`: {summary}".rstrip(), "",
            "| recipe | value |", "|---|---|", *rows, ""]


def _data(config: dict[str, Any]) -> list[str]:
    data = config.get("data")
    if not isinstance(data, dict):
        return []
    keys = [k for k in ("inputs", "n_files", "n_documents", "n_tokens", "bytes", "sha256") if k in data]
    rows = [f"| {k} | {json.dumps(data[k])[:200]} |" for k in keys]
    return ["## Data", "", "| provenance | value |", "|---|---|", *rows, ""]


def jacobian_card(config: dict[str, Any]) -> str:
    """The card of a Jacobian lens folder (as `JacobianLens.config()` writes it): what J_s is, how it was estimated."""
    base = base_model(config.get("model_name"))
    name = base or config.get("model_name") or "a model"
    streams = config.get("streams") or []
    body = [f"# Jacobian lens for {name}", "",
            f"A Jacobian lens (Gurnee et al. 2026): one d_model x d_model matrix J_s per residual stream s, the mean "
            f"Jacobian of the last block's output with respect to stream s, read as readout(J_s h); streams {streams} "
            f"of {config.get('n_layers')}, d_model {config.get('d_model')}, written by lenskit. The matrices are in "
            f"`{config.get('weights')}` (`J.<stream>`), the settings in `{CONFIG_FILE}`.", "",
            "```python", "import lenskit", "from lenses import JacobianLens", "",
            f"model = lenskit.HookedTransformer.from_pretrained({json.dumps(base or config.get('model_name'))})",
            "lens = JacobianLens.load(\"<this repo id or folder>\", model)", "```", "",
            f"The model's fingerprint (sha256 of its final norm and unembedding): `{config.get('model_fingerprint')}`.", ""]
    estimator = config.get("estimator")
    if isinstance(estimator, dict):
        body += ["## Estimator", "", "| setting | value |", "|---|---|",
                 *(f"| {k} | {json.dumps(v)} |" for k, v in estimator.items()), ""]
    data = _data(config) if config.get("data") else []
    return "\n".join(front_matter(base, JACOBIAN_TAGS) + body + data).rstrip() + "\n"


def eval_problem(ev: object) -> str | None:
    """What is wrong with a config's "eval" section (as `record_eval` writes it), or None if it is well formed:
    an object with `n_tokens` (an int >= 0), `data_sha256` (a string or null) and `table`, a list of objects
    with an int `layer` and finite numbers."""
    if not isinstance(ev, dict):
        return f"must be an object, got {json.dumps(ev)[:60]}"
    n = ev.get("n_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return f"'n_tokens' must be an integer >= 0, got {json.dumps(n)[:60]}"
    if not (ev.get("data_sha256") is None or isinstance(ev.get("data_sha256"), str)):
        return f"'data_sha256' must be a string or null, got {json.dumps(ev.get('data_sha256'))[:60]}"
    table = ev.get("table")
    if not isinstance(table, list):
        return f"'table' must be a list of rows, got {json.dumps(table)[:60]}"
    for i, row in enumerate(table):
        if not isinstance(row, dict):
            return f"table row {i} must be an object, got {json.dumps(row)[:60]}"
        for key, value in row.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key == "layer" and not (number and isinstance(value, int)):
                return f"table row {i}: 'layer' must be an integer, got {json.dumps(value)[:60]}"
            if not number or value != value or value in (float("inf"), float("-inf")):
                return f"table row {i}: {key!r} must be a finite number, got {json.dumps(value)[:60]}"
        if "layer" not in row:
            return f"table row {i} has no 'layer'"
    return None


def check_eval(config: dict[str, Any], where: Path) -> None:
    """ValueError (one line naming the file and 'eval') if the config has a malformed "eval" section."""
    if "eval" in config and (problem := eval_problem(config["eval"])) is not None:
        raise ValueError(f"{where}: 'eval' {problem}; expected the table `lenskit eval-lens --card` writes: "
                         "delete the 'eval' key, or run eval-lens --card again")


def _evaluation(config: dict[str, Any]) -> list[str]:
    ev = config.get("eval")
    if eval_problem(ev) is not None:  # absent or unreadable: the card says so rather than failing
        return ["## Evaluation", "", "Not evaluated yet: `lenskit eval-lens --lens FOLDER --data HELD_OUT --card` "
                "adds the per-layer table here.", ""]
    lines = ["## Evaluation", "",
             f"KL(final ‖ lens) and cross-entropy in nats per token on {ev.get('n_tokens', '?'):,} held-out tokens "
             f"(data sha256 {str(ev.get('data_sha256'))[:12]}), logit lens against this tuned lens:" if isinstance(
                 ev.get("n_tokens"), int) else "KL and cross-entropy in nats per token, logit lens against this tuned lens:", "",
             "| " + " | ".join(EVAL_COLUMNS) + " |", "|" + "---|" * len(EVAL_COLUMNS)]
    for row in ev["table"]:
        cells = [row.get(c) for c in EVAL_COLUMNS]
        lines.append("| " + " | ".join(f"{c:.4f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return lines + [""]


def record_eval(folder: str | Path, table: list[dict[str, Any]], n_tokens: int, data_sha256: str | None) -> Path:
    """Store an eval-lens table in a lens folder's config.json (key "eval") and rewrite its README.md card."""
    folder = Path(folder)
    config = read_config(folder)
    config["eval"] = {"n_tokens": n_tokens, "data_sha256": data_sha256,
                      "table": [{c: int(row[c]) if c == "layer" else float(row[c]) for c in EVAL_COLUMNS} for row in table]}
    text = json.dumps(config, indent=2) + "\n"
    write_atomic(folder / CONFIG_FILE, lambda tmp: tmp.write_text(text))
    card = model_card(config)
    write_atomic(folder / CARD_FILE, lambda tmp: tmp.write_text(card, encoding="utf-8"))
    return folder / CARD_FILE
