#!/usr/bin/env bash
# The one script a GPU machine runs (issue 14), under 8 minutes in all, from the project's
# files alone: it installs what it needs (from .whl/ when benchmarks/gpu_prepare.sh staged
# it, else from the package registry), makes its weights on the device, runs the CUDA tests
# and the target measurements, prints one summary table and exits non-zero if any check
# failed.
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
# Everything it writes lands under $OUT (logs as .txt, results as .json).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tierckpt-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
SECTION=""
step() { SECTION=$1; echo "== $1 ($(date -u +%T))"; }

step install
# nvCOMP's Python wheel for the CUDA major version this torch was built with, plus its
# library wheel (nvidia-libnvcomp-cuNN, a dependency: so never --no-deps), the CPU codecs
# and what pytest needs under the project's configuration
CU=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
PKGS="nvidia-nvcomp-cu$CU zstandard lz4 pytest pytest-timeout hypothesis xxhash safetensors"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --find-links .whl --target /tmp/site $PKGS \
    > "$OUT/install.txt" 2>&1
else
  "$PY" -m pip install -q --target /tmp/site $PKGS > "$OUT/install.txt" 2>&1
fi
echo "exit $?" >> "$OUT/install.txt"
export PYTHONPATH="/tmp/site:$PWD"
{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, sys; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -c "import nvidia.nvcomp as nv; print('nvcomp', getattr(nv, '__version__', '?'))"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# 1. the CUDA tests: nvCOMP on the GPU and its CPU decode, pinned arena, capture, restore
step "cuda tests"
timeout 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" \
  tests/test_codecs.py tests/test_arena.py tests/test_gpu.py tests/test_gpu_restore.py \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "exit $?" >> "$OUT/pytest_gpu.txt"

# 2. nvCOMP: compress-on-device vs raw copy, ratio, GB/s, CPU decode exact (synthetic bf16
#    weights made on the device: no weights file is carried)
step "nvcomp codecs"
timeout 130 "$PY" benchmarks/gpu_codecs.py --gb 2 --budget-s 100 \
  --json "$OUT/gpu_codecs.json" > "$OUT/gpu_codecs.txt" 2>&1
echo "exit $?" >> "$OUT/gpu_codecs.txt"

# 3. capture: pinned D2H bandwidth, capture's D2H rate and blocked ms per GiB on a 20 GB
#    bf16/fp32 state with >= 1,000 small tensors, against torch.save
step "capture"
timeout 180 "$PY" benchmarks/gpu_check.py --size-gb 20 --small-tensors 1200 --budget-s 160 \
  --json "$OUT/gpu_check.json" > "$OUT/gpu_check.txt" 2>&1
echo "exit $?" >> "$OUT/gpu_check.txt"

# 4. restore onto the GPU (local tier vs disk read; RAM vs pinned H2D); contexts per device
step "restore + contexts"
timeout 110 "$PY" benchmarks/gpu_targets.py --gb 4 --json "$OUT/gpu_targets.json" \
  > "$OUT/gpu_targets.txt" 2>&1
echo "exit $?" >> "$OUT/gpu_targets.txt"

step summary
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows, failed = [], False
def code(name):
    p = out / name
    if not p.exists():
        return None
    last = [l for l in p.read_text().splitlines() if l.startswith("exit ")]
    return int(last[-1].split()[1]) if last else None
for label, log in [("install", "install.txt"), ("CUDA tests (-m gpu)", "pytest_gpu.txt"),
                   ("nvCOMP codecs", "gpu_codecs.txt"), ("capture (20 GB)", "gpu_check.txt"),
                   ("restore + contexts", "gpu_targets.txt")]:
    rc = code(log)
    ok = rc == 0
    failed |= not ok
    tail = (out / log).read_text().strip().splitlines()[-2:-1] if (out / log).exists() else []
    rows.append((label, "ok" if ok else f"FAILED (exit {rc})", tail[0][:70] if tail else ""))
t = out / "gpu_targets.json"
if t.exists():
    for name, c in json.loads(t.read_text())["checks"].items():
        rows.append((f"  {name}", {True: "ok", False: "FAILED", None: "not measured"}[c["ok"]],
                     str(c["value"])))
print(f"| {'check':<24} | {'result':<18} | detail")
print(f"|{'-'*26}|{'-'*20}|{'-'*40}")
for r in rows:
    print(f"| {r[0]:<24} | {r[1]:<18} | {r[2]}")
(out / "summary.txt").write_text("\n".join(" | ".join(r) for r in rows) + "\n")
sys.exit(1 if failed else 0)
PYEOF
