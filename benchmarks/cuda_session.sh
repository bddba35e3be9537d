#!/usr/bin/env bash
# Issue [host]'s GPU checks in one call, for a session lent a GPU for a few minutes (from the repository root):
#
#     OUT=/some/dir bash benchmarks/cuda_session.sh
#
# 1. benchmarks/cuda_step.py: every optimizer against torch's sparse ones and the step's memory floor, each
#    steady step once more under set_sync_debug_mode("error"); each step's kernels under torch.profiler
#    ($OUT/cuda_profile.txt). Adafactor three times: compiled (adafactor), uncompiled with its per-table sums
#    spread over lanes (adafactor_rows), and uncompiled by plain index_add (adafactor_index_add), the path before.
#    benchmarks/id_join.py: the host's join of the step's ids, the C pass (into pinned memory) against torch's ops.
# 2. tests/package/test_cuda.py: every optimizer trains on CUDA as on the CPU; steady steps with host ids pass
#    torch.cuda.set_sync_debug_mode("error") on the reference path and on the compiled (Triton) one; a GPU
#    checkpoint resumes on the CPU. And tests/package/test_torch_versions.py's draws on the GPU's torch.
# Logs go to $OUT (default: the current directory), written as they run (a run cut short keeps what ran); record
# the figures in docs/benchmarks.md with the GPU, torch version and commit (both print them).
set -u
out=${OUT:-.}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "host: $(lscpu 2>/dev/null | sed -n "s/^Model name: *//p" | head -1), $(nproc) cores" | tee -a "$out/gpu.txt"
"${PY:-python3}" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
timeout "${BENCH_S:-300}" "${PY:-python3}" benchmarks/cuda_step.py --profile "$out/cuda_profile.txt" > "$out/cuda_step.log" 2>&1
echo "cuda_step: rc=$?"
cat "$out/cuda_step.log"
timeout 90 "${PY:-python3}" benchmarks/id_join.py --iters 20 > "$out/id_join.log" 2>&1
echo "id_join: rc=$?"
cat "$out/id_join.log"
timeout "${TESTS_S:-200}" "${PY:-python3}" -m pytest -q -p no:cacheprovider -rs tests/package/test_cuda.py \
    tests/package/test_torch_versions.py -k "test_cuda or draw or duplicate_sum" > "$out/test_cuda.log" 2>&1
echo "tests: rc=$? $(tail -1 "$out/test_cuda.log")"
