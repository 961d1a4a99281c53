#!/usr/bin/env bash
# Every CPU benchmark, one after the other, in one sitting: the "one idle-machine run" that
# benchmarks/results.md reports. Each script's output goes to benchmarks/logs/<name>.txt; run_all.txt notes
# when each started and ended and the one-minute load average then (above the core count means other work
# shared the machine). About 20 minutes on a 2-core machine, most of it bench.py, the bf16 forward and
# the loading benchmark (which writes ~4 GiB of checkpoints under ~/.cache/lenskit/bench the first time).
#
#   bash benchmarks/run_all.sh            # needs `pip install -e ".[bench]"`
set -euo pipefail
cd "$(dirname "$0")/.."
logs=benchmarks/logs
mkdir -p "$logs"
{
    echo "# run_all.sh, $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
    echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
    echo "python: $(python --version 2>&1); $(python -c 'import torch, transformers; print("torch", torch.__version__, "threads", torch.get_num_threads(), "| transformers", transformers.__version__)')"
    echo "bf16 in hardware: $(grep -o -m1 -w -E 'avx512_bf16|amx_bf16' /proc/cpuinfo || echo none)"
} > "$logs/run_all.txt"

run() {
    local name=$1
    shift
    echo "start $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $*" | tee -a "$logs/run_all.txt"
    local status=0
    "$@" > "$logs/$name.txt" 2>&1 || status=$?
    echo "end   $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) exit $status" | tee -a "$logs/run_all.txt"
    failed=$((failed + (status != 0)))
}

failed=0
run bench python benchmarks/bench.py --repeats 9 --memory-repeats 3 --no-profile
run training python benchmarks/bench_training.py --rounds 7
run eval python benchmarks/bench_eval.py --tokens 8192 --steps 4 --repeats 11 --threads 2
run loading python benchmarks/bench_loading.py --rounds 3 --csv benchmarks/loading.csv
run bf16 python benchmarks/bench_bf16.py --rounds 7
run training_bf16 python benchmarks/bench_training.py --rounds 3 --dtype bfloat16 --skip lenskit_autograd
run training_gpt2 python benchmarks/bench_training.py --model gpt2 --tokens 512 --rounds 2 --skip lenskit_autograd
run patchscope python benchmarks/bench_patchscope.py --rounds 7
run jacobian python benchmarks/bench_jacobian.py --prompts 2 --repeats 5 --threads 1 --sweep 4
run startup python benchmarks/bench_startup.py --runs 5
run moe python benchmarks/bench_moe.py --repeats 7
run qwen35 python benchmarks/bench_qwen35.py
run mamba2 python benchmarks/bench_mamba2.py --threads 1
run long_context python benchmarks/bench_long_context.py
echo "done $(date -u +%H:%M:%S), $failed script(s) failed" | tee -a "$logs/run_all.txt"
exit $((failed > 0))
