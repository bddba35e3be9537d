#!/usr/bin/env bash
# Issue [host]'s GPU checks in one call, for a session lent a GPU for a few minutes (from the repository root):
#
#     OUT=/some/dir bash benchmarks/cuda_session.sh
#
# 1. tests/package/test_cuda.py: every optimizer trains on CUDA as on the CPU; steady steps with host ids pass
#    torch.cuda.set_sync_debug_mode("error") on the reference path and on the compiled (Triton) one; a GPU
#    checkpoint resumes on the CPU. And tests/package/test_torch_versions.py on the GPU's torch.
# 2. benchmarks/cuda_step.py: every optimizer against torch's sparse ones and the step's memory floor, each
#    steady step once more under set_sync_debug_mode("error").
# Logs go to $OUT (default: the current directory); record the figures in docs/benchmarks.md with the GPU,
# torch version and commit (both print them).
set -u
out=${OUT:-.}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
timeout 300 python -m pytest -q -p no:cacheprovider -rs tests/package/test_cuda.py tests/package/test_torch_versions.py \
    > "$out/test_cuda.log" 2>&1
echo "tests: rc=$? $(tail -1 "$out/test_cuda.log")"
timeout 280 python benchmarks/cuda_step.py > "$out/cuda_step.log" 2>&1
echo "cuda_step: rc=$?"
cat "$out/cuda_step.log"
