"""What observes the model without changing it: hook points (`hooks`), places in the residual stream
(`stream`), the activation cache, residual decompositions (`resid`) and TransformerLens's short names (`names`)."""
