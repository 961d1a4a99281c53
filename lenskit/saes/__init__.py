"""Sparse autoencoders and transcoders, read from the formats people publish and spliced into any lenskit model.

>>> from lenskit.saes import SAE
>>> sae = SAE.load("stdlib-gpt2-sae-L3")
>>> with model.saes([sae]):
...     logits, cache = model.run_with_cache(tokens)   # cache[f"{sae.hook_name}.hook_sae_acts_post"]
"""

from .formats import EMBEDDED_SAES, SAEFileError
from .sae import SAE, SAEConfig

__all__ = ["EMBEDDED_SAES", "SAE", "SAEConfig", "SAEFileError"]
