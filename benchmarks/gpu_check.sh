#!/usr/bin/env bash
# Everything lenskit checks on a GPU, in one go (under 5 minutes on one H200): the CUDA tests, bench.py on the
# GPU, the eval-lens benchmark on the GPU and the long-context benchmark on the GPU. What it prints is what
# benchmarks/results.md's "GPU" section records. Without CUDA it says so and stops.
#
#   bash benchmarks/gpu_check.sh            # after scripts/install.sh (a CUDA torch build on the GPU machine)
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch $(python -c 'import torch; print(torch.__version__)'); nothing to check"
    exit 2
fi
echo "# gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python -c 'import torch, transformers; print("torch", torch.__version__, "CUDA", torch.version.cuda, "| transformers", transformers.__version__, "| GPUs", torch.cuda.device_count())'
failed=0
step() {
    local name=$1
    shift
    echo
    echo "== $name: $*"
    local start=$SECONDS
    "$@" || { echo "== $name FAILED (exit $?)"; failed=$((failed + 1)); }
    echo "== $name took $((SECONDS - start)) s"
}
step cuda-tests timeout 150 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_placement.py
step bench-cuda timeout 120 python benchmarks/bench.py --device cuda --repeats 5 --memory-repeats 1 --no-profile
step eval-cuda timeout 60 python benchmarks/bench_eval.py --device cuda --tokens 8192 --steps 4 --repeats 3
step long-context-cuda timeout 150 python benchmarks/bench_long_context.py --device cuda --tokens 1024 4096 8192 16384 \
    --tl-max 16384 --pattern-max 16384 --repeats 3 --csv benchmarks/long_context-cuda.csv
for f in benchmarks/results-cuda.md benchmarks/eval_speed-cuda.csv; do
    [ -f "$f" ] && { echo; echo "== $f"; cat "$f"; }
done
echo
echo "gpu_check: $failed step(s) failed"
exit $((failed > 0))
