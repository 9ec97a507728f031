#!/usr/bin/env bash
# The GPU checks in one command, one JSON of results (issue 17; docs/parity.md "How to run it"):
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default OUT_DIR: runs/gpu_check
#
# 1. `hypertrain sim device-check --device cuda`: real grid jobs, shortened, on CPU and on
#    the GPU; the GPU is refused if a held-out loss differs beyond the tolerance.
# 2. The simulator bench on the GPU (`bench/bench_sim.py --sweep-only --device cuda`):
#    batched against per-replica at M = 1..32; the target is >= 3x at M = 32.
# 3. A two-rank island on NCCL (`hypertrain up --island-ranks 2 --island-device cuda`, one
#    region of two islands, rank r on cuda:r); it needs two GPUs and says so with fewer.
#
# Writes OUT_DIR/gpu_check.json (every part's result and whether it passed) and exits 0
# when every part that ran passed, 1 when one failed, 2 with one line when no CUDA device
# is visible.  GPU_CHECK_DEVICE=cpu runs the same parts on the CPU, shortened (the test
# suite's dry run: tests/integration/test_gpu_check.py).  PYTHON: the interpreter (default
# .venv/bin/python, else python3), which must have torch with CUDA and hypertrain installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
case "$DEVICE" in
    cuda | cpu) ;;
    *) echo "gpu_check: GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
if ! "$PYTHON" -c "import hypertrain, torch" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch and hypertrain (set PYTHON, or run bash scripts/setup.sh)" >&2
    exit 2
fi
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -lt 1 ]; then
    echo "gpu_check: no CUDA device is visible here (torch.cuda.is_available() is False): nothing to check; run it on a machine with an NVIDIA GPU" >&2
    exit 2
fi
mkdir -p "$OUT"
echo "gpu_check: device $DEVICE, $GPUS GPU(s), results in $OUT"

# The CPU dry run shortens every part; on a GPU each runs as designed.
if [ "$DEVICE" = cpu ]; then
    CHECK_ARGS=(--steps 10 --max-jobs 1)
    BENCH_ARGS=(--ms 1,2 --steps 1)
    TWO_RANKS_OK=1
else
    CHECK_ARGS=()
    BENCH_ARGS=(--quick)
    TWO_RANKS_OK=$([ "$GPUS" -ge 2 ] && echo 1 || echo 0)
fi

echo "== 1. device check"
"$PYTHON" -m hypertrain sim device-check --device "$DEVICE" --out "$OUT/device-check" "${CHECK_ARGS[@]}" \
    > "$OUT/device_check.log" 2>&1
CHECK_RC=$?
tail -n 2 "$OUT/device_check.log"

echo "== 2. simulator bench on $DEVICE"
"$PYTHON" bench/bench_sim.py --sweep-only --device "$DEVICE" --json "$OUT/bench_sim.json" "${BENCH_ARGS[@]}" \
    > "$OUT/bench_sim.log" 2>&1
BENCH_RC=$?
tail -n 2 "$OUT/bench_sim.log"

echo "== 3. a two-rank island ($([ "$DEVICE" = cuda ] && echo NCCL || echo gloo))"
if [ "$TWO_RANKS_OK" = 1 ]; then
    rm -rf "$OUT/two-ranks"
    "$PYTHON" -m hypertrain up --steps 20 --batch 8 --h-r 5 --h-g 10 --regions eu --islands-per-region 2 \
        --holdout-windows 16 --island-ranks 2 --island-device "$DEVICE" --run-dir "$OUT/two-ranks" \
        > "$OUT/two_ranks.log" 2>&1
    RANKS_RC=$?
    tail -n 1 "$OUT/two_ranks.log"
else
    RANKS_RC=skipped
    echo "skipped: a two-rank NCCL island needs 2 GPUs, this machine has $GPUS"
fi

"$PYTHON" - "$OUT" "$DEVICE" "$GPUS" "$CHECK_RC" "$BENCH_RC" "$RANKS_RC" <<'EOF'
import json, re, sys
from pathlib import Path

import torch

out, device, gpus, check_rc, bench_rc, ranks_rc = sys.argv[1:]
out = Path(out)


def load(path):
    return json.loads(path.read_text()) if path.is_file() else None


def tail(name, n=3):
    f = out / name
    return f.read_text().splitlines()[-n:] if f.is_file() else []


two = {"rc": None if ranks_rc == "skipped" else int(ranks_rc), "skipped": ranks_rc == "skipped"}
if not two["skipped"]:
    text = (out / "two_ranks.log").read_text()
    m = re.search(r"final state digest ([0-9a-f]+)", text)
    two.update(final_digest=m.group(1) if m else None, log_tail=tail("two_ranks.log"))
    two["passed"] = two["rc"] == 0 and m is not None
bench = load(out / "bench_sim.json")
parts = {
    "device_check": {"rc": int(check_rc), "passed": int(check_rc) == 0,
                     "report": load(out / "device-check" / "device_check.json"),
                     "log_tail": tail("device_check.log")},
    "bench_sim": {"rc": int(bench_rc), "passed": int(bench_rc) == 0 and bench is not None,
                  "result": bench, "log_tail": tail("bench_sim.log")},
    "two_rank_island": two,
}
result = {
    "device": device,
    "gpus": int(gpus),
    "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "torch": torch.__version__,
    "parts": parts,
    "targets": (bench or {}).get("targets"),
    "passed": all(p.get("passed", True) for p in parts.values() if not p.get("skipped")),
}
(out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"gpu_check: {'PASSED' if result['passed'] else 'FAILED'}; targets {result['targets']}; "
      f"{out / 'gpu_check.json'}")
sys.exit(0 if result["passed"] else 1)
EOF
