"""What changes a run: ablations of blocks, sublayers, heads and neurons (`interventions`), activation
patching (`patching`) and the position masks they share (`masks`)."""
