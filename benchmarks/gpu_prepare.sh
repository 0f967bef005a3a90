#!/usr/bin/env bash
# Optional, run HERE (with network) before a device session whose GPU machine has no
# network: fetches into .whl/ (ignored by git; carry=[".whl"]) what benchmarks/gpu_session.sh
# installs, for the device image (Python 3.12, CUDA major $CU, default 13). No weights file
# is staged: the scripts make their weights on the device. Fails if .whl/ exceeds 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PY=${PY:-.venv/bin/python}
CU=${CU:-13}
# with dependencies: nvidia-nvcomp-cuNN needs nvidia-libnvcomp-cuNN (libnvcomp.so)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "nvidia-nvcomp-cu$CU" zstandard lz4 pytest pytest-timeout hypothesis xxhash \
  safetensors
# numpy and friends are in the device image already
rm -f .whl/numpy-*.whl
du -ch .whl/* | tail -1
bytes=$(du -cb .whl/* | tail -1 | cut -f1)
if [ "$bytes" -ge $((64 << 20)) ]; then
  echo "staged $bytes bytes: over the 64 MiB a device call may carry" >&2
  exit 1
fi
