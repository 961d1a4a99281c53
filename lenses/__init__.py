"""lenses: analysis that reads lenskit's residual stream (logit lens, tuned lens, trajectories, plots)."""

from .base import Lens

__all__ = ["Lens"]
