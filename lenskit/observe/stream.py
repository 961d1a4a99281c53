"""Stream: one name for a place in the residual stream (a layer and a point), and its hook name.

This module is the one place that spells residual-stream hook names (`blocks.{layer}.hook_resid_pre` ...),
checks a layer against a model and turns what users type ("3", "resid_mid.3") into a location.

>>> Stream(3)                          # the stream after 3 blocks: blocks.3.hook_resid_pre
Stream(layer=3, point='resid_pre')
>>> Stream(3, "resid_mid").hook_name(n_layers=6)
'blocks.3.hook_resid_mid'
>>> Stream.parse("resid_mid.3") == Stream(3, "resid_mid")
True

Layers. A point inside a block (`attn_out`, `resid_mid`, `mlp_out`, `resid_post`) exists for blocks
0..n_layers-1. `resid_pre` also takes layer n_layers, the stream after the last block (that block's
`resid_post`), so that `Stream(l)` is "the stream after l blocks" for l in 0..n_layers, the lens
convention. The one negative rule, everywhere: a negative layer l means n_layers + l, the way Python
indexes the blocks (`Stream(-1)` is the input of the last block).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

# The points of a block, in the order a forward pass reaches them, and their hook names inside the block.
# A family that adds a point (e.g. a post-sublayer norm's output) adds one entry here, in forward order.
POINTS: dict[str, str] = {
    "resid_pre": "hook_resid_pre",
    "attn_out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "mlp_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
FINAL_POINT = "resid_pre"  # the point that also has layer n_layers: the stream after every block


class PointError(KeyError, ValueError):
    """An unknown point name (a KeyError for lookups, a ValueError for arguments)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def block_hook_name(layer: int, suffix: str) -> str:
    """The hook name of `suffix` (e.g. `attn.hook_z`) inside block `layer`: `blocks.{layer}.{suffix}`."""
    return f"blocks.{layer}.{suffix}"


def check_layer(layer: int, n_layers: int, *, final: bool = False, what: str = "layer") -> int:
    """`layer` as a non-negative index: blocks 0..n_layers-1 (or 0..n_layers with `final`); negative = n_layers + layer."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"{what} must be an int, got {type(layer).__name__} {layer!r}")
    top = n_layers if final else n_layers - 1
    if not -n_layers <= layer <= top:
        raise IndexError(f"{what} {layer} is out of range: expected 0..{top} (or -{n_layers}..-1, counting back) "
                         f"for a model with {n_layers} blocks")
    return layer + n_layers if layer < 0 else layer


_SPEC = re.compile(r"^(?:(?P<point>[a-z_]+)[.:])?(?P<layer>-?\d+)$")
_HOOK = re.compile(r"^blocks\.(?P<layer>\d+)\.(?P<suffix>hook_\w+)$")


@functools.total_ordering
@dataclass(frozen=True)
class Stream:
    """A residual-stream location: `point` of block `layer` (for `resid_pre`, also layer n_layers).

    Ordered by depth: block by block, and inside a block in forward order (see `POINTS`).
    Compare resolved streams (`resolve(n_layers)`) when some layers are negative.
    """

    layer: int
    point: str = "resid_pre"

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int):
            raise TypeError(f"a stream's layer must be an int, got {type(self.layer).__name__} {self.layer!r}")
        if self.point not in POINTS:
            raise PointError(f"unknown residual point {self.point!r}; the point must be one of {', '.join(POINTS)}")

    # ------------------------------------------------------------ making one
    @classmethod
    def parse(cls, spec: "int | str | Stream", point: str | None = None) -> "Stream":
        """A Stream from an int (`Stream(l)`), a Stream, or text: "3", "-1", "resid_mid.3", "resid_mid:3",
        or a hook name such as "blocks.3.hook_resid_mid". `point` applies to a bare layer only."""
        if isinstance(spec, Stream):
            if point is not None and point != spec.point:
                raise ValueError(f"{spec} already names its point; drop point={point!r}")
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls(spec, point or FINAL_POINT)
        if not isinstance(spec, str):
            raise TypeError(f"a stream is an int, a Stream or text such as 'resid_mid.3', got {type(spec).__name__}")
        text = spec.strip()
        hook = _HOOK.match(text)
        if hook:
            by_suffix = {suffix: name for name, suffix in POINTS.items()}
            if hook["suffix"] not in by_suffix:
                raise PointError(f"{spec!r} is not a residual-stream hook; expected one of {', '.join(POINTS.values())}")
            return cls(int(hook["layer"]), by_suffix[hook["suffix"]])
        match = _SPEC.match(text)
        if not match:
            raise ValueError(f"cannot read a stream from {spec!r}; write a layer ('3') or point.layer ('resid_mid.3')")
        if match["point"] and point is not None and match["point"] != point:
            raise ValueError(f"{spec!r} already names its point; drop point={point!r}")
        return cls(int(match["layer"]), match["point"] or point or FINAL_POINT)

    def resolve(self, n_layers: int) -> "Stream":
        """The same place with a non-negative layer, checked against a model of `n_layers` blocks."""
        layer = check_layer(self.layer, n_layers, final=self.point == FINAL_POINT, what=f"{self.point} layer")
        return self if layer == self.layer else Stream(layer, self.point)

    # ------------------------------------------------------------ reading one
    def hook_name(self, n_layers: int) -> str:
        """The hook that carries this stream; `Stream(n_layers)` is the last block's `resid_post`."""
        s = self.resolve(n_layers)
        if s.point == FINAL_POINT and s.layer == n_layers:
            return block_hook_name(n_layers - 1, POINTS["resid_post"])
        return block_hook_name(s.layer, POINTS[s.point])

    def canonical(self) -> "Stream":
        """`resid_post` of block l is `resid_pre` of l + 1, the stream after l + 1 blocks; other points stay."""
        return Stream(self.layer + 1) if self.point == "resid_post" and self.layer >= 0 else self

    def _key(self) -> tuple[int, int]:
        return self.layer, list(POINTS).index(self.point)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return self._key() < other._key()

    def __str__(self) -> str:
        return f"{self.point}.{self.layer}"


def as_stream(stream: "int | str | Stream", point: str | None = None) -> Stream:
    """What every API that takes a place in the stream calls: a bare int l is `Stream(l)`."""
    return Stream.parse(stream, point)


def streams(n_layers: int, points: str | tuple[str, ...] = FINAL_POINT) -> list[Stream]:
    """Every stream of the given points, in depth order. `streams(n)` is the n + 1 streams after 0..n blocks."""
    points = (points,) if isinstance(points, str) else tuple(points)
    for p in points:
        Stream(0, p)  # validates the name
    out = [Stream(layer, p) for layer in range(n_layers) for p in points]
    if FINAL_POINT in points:
        out.append(Stream(n_layers))
    return sorted(out)


def stream_hook_names(n_layers: int, points: str | tuple[str, ...] = FINAL_POINT) -> list[str]:
    """Hook names of `streams(n_layers, points)`, in the same order."""
    return [s.hook_name(n_layers) for s in streams(n_layers, points)]

