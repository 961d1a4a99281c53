"""lenses: analysis that reads lenskit's residual stream (logit lens, tuned lens, trajectories, plots).

>>> from lenses import LogitLens, Trajectory
>>> traj = Trajectory.from_prompt(LogitLens(model), "import os\\nos.path.")
>>> from lenses import plots; plots.save_figure(plots.logit_lens_heatmap(traj), "lens.png")
"""

from importlib import import_module
from typing import Any

from . import metrics
from .base import Lens
from .logit import POINTS, LogitLens
from .trajectory import Trajectory
from .tuned import TunedLens  # about 3 ms on top of the 2-3 s that torch takes: not worth a lazy import


def __getattr__(name: str) -> Any:
    # `plots` is imported on first use: it pulls in plotly, which analysis without figures never needs.
    if name != "plots":
        raise AttributeError(f"module 'lenses' has no attribute {name!r}")
    return import_module("lenses.plots")


__all__ = ["Lens", "LogitLens", "POINTS", "Trajectory", "TunedLens", "metrics", "plots"]
