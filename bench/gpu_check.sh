#!/usr/bin/env bash
# One GPU, one command: the single-GPU test tier, then the GPU benchmark, within GPU_CHECK_BUDGET_S (default 560 s).
#
#     bash bench/gpu_check.sh            # on a machine with one (or more) NVIDIA GPU; under 10 minutes
#
# 1. where there is a GPU and bench/gpu_wheels.sh exists (the carried wheels, no network): installs them;
# 2. CPU-side checks: tests/test_gpu.py's single-GPU tier is collected, the benchmark's shapes and FLOP arithmetic
#    compute;
# 3. without CUDA: one line saying so, exit 1 (nothing measured, nothing written); with CUDA, first the premise of
#    tests/test_gpu.py's context count: the files a process that only counted the GPUs holds open (does driver
#    initialisation open /dev/nvidia<N>?), and the CUDA contexts NVML counts per GPU before and after, printed and
#    kept in bench/results/gpu_premise.txt;
# 4. python -m pytest tests/test_gpu.py (1-GPU tests, the most GPU-specific first, each within its own bound) -rs -v,
#    at most GPU_CHECK_TESTS_S (default 380 s), its junit XML, log and collected ids in
#    bench/results/gpu_tier.{xml,log,collected} (the benchmark lists the tests that did not run); then up to 30 s for
#    the GPU to have no compute process left;
# 5. python bench/gpu_bench.py with the time left (it skips, and lists, what does not fit), recording the tier's
#    outcome: bench/results/gpu_bench.{json,md} and runs/gpu_bench/. Everything written is also copied to $OUT
#    when it is set, flat, 7 files: the lent GPU machine returns at most 8, at most 2 folders down (runs/gpu_bench/
#    as gpu_bench_runs.tar.gz). Exit status: the tier's, else the benchmark's.
set -u
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-560}
py=${PYTHON:-python3}
tier=(tests/test_gpu.py -k "not 2gpu and not two_gpus")
left() { echo $((budget - ($(date +%s) - start))); }

if nvidia-smi -L 2>/dev/null | grep -q "^GPU" && [ -f bench/gpu_wheels.sh ]; then
    bash bench/gpu_wheels.sh install || { echo "error: bash bench/gpu_wheels.sh install failed" >&2; exit 1; }
fi

if ! collected=$("$py" -m pytest "${tier[@]}" --collect-only -q 2>&1); then
    echo "$collected" | tail -20 >&2
    echo "error: the single-GPU tier of tests/test_gpu.py is not collected" >&2
    exit 1
fi
"$py" - <<'PY' || { echo "error: the benchmark's FLOP arithmetic failed" >&2; exit 1; }
import sys
sys.path.insert(0, "bench")
from gpu_bench import model_flops_per_token
from qwen_shape import SHAPES
for name, shape in SHAPES.items():
    assert model_flops_per_token(shape, 2048)["total"] > 0, name
PY

if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA device (torch.cuda.is_available() is False): the single-GPU tier and the GPU benchmark did not run; no figure written" >&2
    exit 1
fi

mkdir -p bench/results
"$py" - <<'PY' 2>&1 | tee bench/results/gpu_premise.txt
import os, sys
sys.path.insert(0, "tests")
import torch
from conftest import gpu_contexts
before = gpu_contexts()
count = torch.cuda.device_count()
torch._C._get_accelerator()  # what DCP's uploader reaches through dist.barrier(): driver initialisation
files = sorted({os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")})
print(f"gpu_check premise: a process that only counted the GPUs ({count}) holds {files}")
print(f"gpu_check premise: /dev/nvidia<N> open without a context: {[f for f in files if f[len('/dev/nvidia'):].isdigit()]}")
print(f"gpu_check premise: CUDA contexts per GPU (NVML) before {before}, after {gpu_contexts()} (this process: none expected)")
PY
tests_s=$(( $(left) - 150 ))
[ "$tests_s" -gt "${GPU_CHECK_TESTS_S:-380}" ] && tests_s=${GPU_CHECK_TESTS_S:-380}
[ "$tests_s" -lt 30 ] && tests_s=30  # timeout 0 would mean no limit at all
rm -f bench/results/gpu_tier.xml
echo "$collected" > bench/results/gpu_tier.collected
# -v: each test's outcome is in the log as it ends (the junit XML is written only if pytest reaches its end)
timeout -k 10 "$tests_s" "$py" -m pytest "${tier[@]}" -rs -v --junitxml bench/results/gpu_tier.xml \
    2>&1 | tee bench/results/gpu_tier.log
tier_rc=${PIPESTATUS[0]}
for _ in $(seq 30); do  # a tier cut short may leave ranks finishing: the benchmark wants the GPU to itself
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
    sleep 1
done
"$py" bench/gpu_bench.py --budget-s $(( $(left) - 15 )) --tier-junit bench/results/gpu_tier.xml \
    --tier-log bench/results/gpu_tier.log --tier-rc "$tier_rc" --tier-collected bench/results/gpu_tier.collected
bench_rc=$?

if [ -n "${OUT:-}" ]; then  # one flat folder: the device machine returns 8 files at most, 2 folders down at most
    cp bench/results/gpu_bench.json bench/results/gpu_bench.md bench/results/gpu_tier.log bench/results/gpu_tier.xml \
        bench/results/gpu_tier.collected bench/results/gpu_premise.txt "$OUT/" 2>/dev/null
    [ -d bench/results/runs/gpu_bench ] && tar -czf "$OUT/gpu_bench_runs.tar.gz" -C bench/results/runs gpu_bench
fi
echo "gpu_check: tier exit $tier_rc, benchmark exit $bench_rc, $(( $(date +%s) - start )) s"
[ "$tier_rc" -ne 0 ] && exit "$tier_rc"
exit "$bench_rc"
