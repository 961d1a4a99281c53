"""The pieces a model is built from, each written once: attention, rotary positions, norms, the dense MLPs (`mlp`),
block forms (`layers`), the projection (`linear`), the readout, and TransformerLens's weight views (`weights`)."""
