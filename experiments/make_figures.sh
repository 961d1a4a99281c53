#!/usr/bin/env bash
# Regenerate every figure and table the README and the gallery (docs/gallery.md) show, into docs/figures/, from the embedded model.
#
#   bash experiments/make_figures.sh            # all of them (a few minutes on a laptop CPU)
#   bash experiments/make_figures.sh accounting residual_growth   # only these scripts
#
# Each script writes its CSV and figures under docs/figures/ and prints its numbers; the output of
# each (its printed numbers) is kept in docs/figures/<script>.log. No network is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

SCRIPTS=(logit_lens_heatmap tuned_vs_logit lens_zoo causal_fidelity block_deletion residual_growth accounting attribution architectures sae_gallery)
if [ "$#" -gt 0 ]; then SCRIPTS=("$@"); fi

mkdir -p docs/figures
for name in "${SCRIPTS[@]}"; do
    script="experiments/${name%.py}.py"
    if [ ! -f "$script" ]; then
        echo "make_figures: $script does not exist; known scripts: $(ls experiments/*.py | xargs -n1 basename | tr '\n' ' ')" >&2
        exit 2
    fi
    echo "== $script"
    start=$(date +%s)
    python3 "$script" | tee "docs/figures/${name%.py}.log"  # stdout (the numbers) kept; progress bars on stderr
    echo "== $script done in $(( $(date +%s) - start )) s"
done
echo "figures in docs/figures/:"
ls docs/figures
