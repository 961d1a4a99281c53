"""`import lenskit.transformer_lens as transformer_lens`: TransformerLens 3's module paths and defaults over lenskit's
computation (the lead is writing this namespace; its submodules are thin)."""
