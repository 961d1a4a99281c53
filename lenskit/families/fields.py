"""Typed access to one `config.json` dict, for the family readers: every error names the field and its value.

An absent field takes the reader's default (transformers 5's for the family); an explicit null means what transformers
makes of None, or is refused where transformers refuses it. A layer count above the checkpoint's blocks, when they
are known, is refused before anything is built per layer.
"""

from __future__ import annotations

import builtins
import math
from typing import Any, Mapping

# transformers' per-layer attention kinds (`layer_types`, Gemma 3's `rope_parameters` keys) -> ModelConfig.layer_types
HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}

# The deepest published decoders have a few hundred blocks (Llama 3.1 405B: 126). A config.json claiming more than
# this is refused by name before anything per layer is built, with or without a checkpoint to check it against.
MAX_LAYERS = 10_000

REQUIRED = ...  # `default`: config.json must give the field
REFUSED = object()  # `null`: an explicit null is refused, as transformers' typed config classes refuse it
_UNSET = object()  # `null` not given: null is accepted where the default is None (and means None), refused elsewhere


class ConfigReader:
    """Typed access to one config dict; every error names the field.

    An absent field takes `default`, which is transformers 5's own default for the family (tests/test_config_defaults.py
    builds each family's config class with no arguments and compares); REQUIRED makes the field required. An explicit
    null is what transformers makes of None: the reader passes `null=` where the field is optional (a derived value,
    or "none"); elsewhere null is refused, as transformers' typed config classes refuse it. `n_blocks`, when the
    checkpoint is known, is the number of blocks its tensor names hold: a layer count above it is refused before
    anything that scales with the count is built."""

    def __init__(self, d: Mapping[str, Any], family: str, n_blocks: int | None = None, where: str = "") -> None:
        self.d, self.family, self.n_blocks = d, family, n_blocks
        self.where = where  # the path of `d` inside config.json in messages, e.g. "rope_parameters."

    def _bad(self, key: str, want: str) -> ValueError:
        return ValueError(f"config field {self.where}{key}={self.d[key]!r} must be {want} (model_type={self.family!r})")

    def _lookup(self, key: str, default: Any, null: Any, want: str) -> tuple[bool, Any]:
        """(True, value) for a value to check, or (False, result) for an absent field or an accepted null."""
        if key not in self.d:
            if default is REQUIRED:
                raise ValueError(f"config.json lacks required field {self.where + key!r} for model_type={self.family!r}")
            return False, default
        if self.d[key] is None:
            if null is _UNSET:
                null = None if default is None else REFUSED
            if null is REFUSED:
                raise ValueError(f"config field {self.where}{key}=None must be {want}, not null (model_type={self.family!r}); "
                                 "remove the field for transformers' default or give a value")
            return False, null
        return True, self.d[key]

    def int(self, key: str, default: Any = REQUIRED, positive: bool = True, null: Any = _UNSET) -> int | None:
        want = "a positive integer" if positive else "an integer >= 0"  # a count or a width, never below zero
        given, value = self._lookup(key, default, null, want)
        if given and (isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0)):
            raise self._bad(key, want)
        return value

    def float(self, key: str, default: Any = REQUIRED, positive: bool = False, null: Any = _UNSET) -> float | None:
        want = "a positive finite number" if positive else "a finite number"
        given, value = self._lookup(key, default, null, want)
        if not given:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (positive and value <= 0):
            raise self._bad(key, want)
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        want = "true or false (a JSON boolean, not a string or number)"
        given, value = self._lookup(key, default, REFUSED, want)
        if given and not isinstance(value, bool):
            raise self._bad(key, want)
        return value

    def token_id(self, key: str, default: builtins.int | None) -> builtins.int | None:  # `int` here is the method
        """A special token id; absent: the family's default, null: none."""
        value = self.d.get(key, default)
        if isinstance(value, list):  # several EOS ids: the first is the one text generation stops on
            value = value[0] if value else None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._bad(key, "a non-negative integer token id")
        return value

    def require(self, key: str, supported: tuple, default: Any = None) -> Any:
        """The field's value, refused unless it is one of `supported` (absent counts as `default`)."""
        value = self.d.get(key, default)
        if value not in supported:
            raise ValueError(
                f"config field {key}={value!r} is not supported for model_type={self.family!r}; "
                f"lenskit implements {list(supported)}"
            )
        return value

    def n_layers(self, key: str) -> builtins.int:
        """The layer count, at most MAX_LAYERS. When the checkpoint's blocks are known, a count above them is refused
        here, before anything is built per layer. (A count below them is cheap to check later, naming the extra tensors.)"""
        n = self.int(key)
        if self.n_blocks is not None and n > self.n_blocks:
            raise ValueError(f"config field {key}={n} does not match the checkpoint, whose tensor names hold "
                             f"{self.n_blocks} block(s): {n - self.n_blocks} are missing; fix {key} in config.json or "
                             "use the checkpoint it belongs to")
        if n > MAX_LAYERS:
            raise ValueError(f"config field {key}={n} is beyond lenskit's bound of {MAX_LAYERS:,} blocks (model_type="
                             f"{self.family!r}); no published decoder comes near it, so config.json is likely corrupt")
        return n
