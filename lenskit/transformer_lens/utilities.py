"""`transformer_lens.utilities`: where TransformerLens 3.2 and later keep what `transformer_lens.utils` held
(`import transformer_lens.utilities as utils`). The same functions as this namespace's `utils`, one home."""

from .utils import *  # noqa: F401,F403
from . import utils

__all__ = utils.__all__
