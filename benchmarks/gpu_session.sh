#!/usr/bin/env bash
# The one script a device session runs on the GPU machine (after benchmarks/gpu_prepare.sh
# here), about 7 minutes in all:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
# Writes everything under $OUT (at most 8 files come back): the GPU tests' log, the nvCOMP
# codec benchmark and the large-state save check, each as text and JSON.
set -u
OUT=${OUT:-/tmp/tierckpt-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} > "$OUT/machine.txt" 2>&1
# 1. every GPU test (nvCOMP codec on the GPU, CPU decode of GPU output, pinned arena, capture)
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
  tests/test_codecs.py tests/test_arena.py tests/test_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_gpu.txt"
# 2. nvCOMP: encode/decode GB/s and ratio on 4 GB of bf16 weights, CPU decode, D2H saved
timeout 200 python3 benchmarks/gpu_codecs.py --gb 4 --budget-s 150 \
  --weights .whl/minilm_bf16.safetensors --json "$OUT/gpu_codecs.json" > "$OUT/gpu_codecs.txt" 2>&1
echo "gpu_codecs exit $?" >> "$OUT/gpu_codecs.txt"
# 3. blocking time of saves of a 20 GB GPU state, pinned arena, against torch.save
timeout 200 python3 benchmarks/gpu_check.py --budget-s 170 --json "$OUT/gpu_check.json" \
  > "$OUT/gpu_check.txt" 2>&1
echo "gpu_check exit $?" >> "$OUT/gpu_check.txt"
tail -n 3 "$OUT"/*.txt
