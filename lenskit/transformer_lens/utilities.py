"""`transformer_lens.utilities`: where TransformerLens 3.2 and later keep what `transformer_lens.utils` held
(`import transformer_lens.utilities as utils`). The same functions as this namespace's `utils`, one home."""

from . import utils
from .utils import *  # noqa: F401,F403

__all__ = utils.__all__
