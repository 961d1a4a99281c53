""""Did you mean": the names closest to a misspelt one, closest first, for every error that refuses a name."""

from __future__ import annotations

import difflib
import re
from typing import Iterable

_LAYER = re.compile(r"(?:^|\.)(?:blocks\.)?(\d+)(?=\.|$)|(?<=[a-z_])(\d+)$")


def did_you_mean(word: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6) -> str:
    """`"; did you mean 'a', 'b'?"` naming the `choices` closest to `word` (difflib), or `""` when none is close.

    >>> did_you_mean("stdlib-gtp2", ["stdlib-gpt2", "stdlib-llama"])
    "; did you mean 'stdlib-gpt2', 'stdlib-llama'?"
    """
    close = difflib.get_close_matches(str(word), list(choices), n=n, cutoff=cutoff)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def _layer_and_kind(name: str) -> tuple[str | None, str]:
    """('3', 'resid_post') from 'blocks.3.hook_resid_post', 'resid_post.3' or 'resid_post3'; (None, ...) outside blocks."""
    m = _LAYER.search(name)
    layer = (m.group(1) or m.group(2)) if m else None
    kind = _LAYER.sub("", name, count=1) if m else name
    return layer, kind.replace("hook_", "").strip(".")


def closest_hook_names(name: str, hook_names: Iterable[str], n: int = 3) -> list[str]:
    """The hook names (of this model) closest to `name`, closest first: the hook's kind ('resid_post', 'attn.q')
    spelt like `name`'s, and in the same block when `name` names one (`resid_pst.3`, `blocks.3.hook_resid_pots`).

    >>> closest_hook_names("resid_pst.3", ["blocks.2.hook_resid_post", "blocks.3.hook_resid_post", "blocks.3.hook_resid_pre"])
    ['blocks.3.hook_resid_post', 'blocks.3.hook_resid_pre', 'blocks.2.hook_resid_post']
    """
    layer, kind = _layer_and_kind(str(name))
    scored = []
    for i, hook in enumerate(hook_names):
        hook_layer, hook_kind = _layer_and_kind(hook)
        likeness = difflib.SequenceMatcher(None, kind, hook_kind).ratio()
        if likeness >= 0.6:
            scored.append((-(likeness + 0.5 * (hook_layer == layer)), i, hook))
    return [hook for *_, hook in sorted(scored)[:n]]


def hook_hint(name: str, hook_names: Iterable[str]) -> str:
    """`"; did you mean ...?"` with this model's closest hook names, or where to find them all."""
    close = closest_hook_names(name, hook_names)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else "; see model.hook_dict for all names"
