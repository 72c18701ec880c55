#!/usr/bin/env bash
# The CPU demo: train a tiny Llama 4 style model on synthetic packed documents with context
# parallelism 2 (two processes, gloo), then the same steps with CP=1, and compare the losses.
#
#   bash scripts/run_demo.sh [--section.key value ...]      (overrides go to both runs)
#   CONFIG=configs/qwen3_debug_cp2.toml bash scripts/run_demo.sh   (torchtitan's own models:
#       llama3, qwen3, gpt_oss, deepseek_v3 _debug_cp2.toml)
#
# On a fresh machine it creates the project's virtualenv (.venv, or $VENV; see
# scripts/setup_env.sh) with torch 2.14.1 and torchtitan 0.3.0, so the system Python is
# untouched. Set PYTHON=/path/to/python to use an environment that already has
# them. Prints the plan varlen-cp logs at the first step, each step's loss and tokens/s
# while training, and ends by writing $OUT/loss_curve.png (CP=2 vs CP=1); full logs go to
# $OUT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/configs/llama4_debug_cp2.toml}"
OUT="${OUT:-$ROOT/outputs/demo}"
cd "$ROOT"

if [[ -z "${PYTHON:-}" ]]; then  # the project's .venv (created on the first run)
  PYTHON="$(bash scripts/setup_env.sh | tail -n 1)"
fi
LAUNCHER=varlen_cp.integrations.torchtitan.train
"$PYTHON" -c "import torchtitan, $LAUNCHER" 2>/dev/null \
  || { echo "error: $PYTHON cannot import torchtitan and varlen_cp" >&2; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per process: 2 processes, 2 cores

# torchtitan's step lines -> "[CP=2] step  3  loss 6.55606  grad_norm 0.5604  tokens/s 362";
# varlen-cp's plan block (first step, and when a choice changes) -> "[CP=2] varlen_cp ..."
show_steps() {
  awk -v tag="$1" '/ step: / {
      sub(/.* step: */, ""); n = split($0, f, / +/);
      for (i = 1; i < n; i++) v[f[i]] = f[i + 1];
      printf "[%s] step %3s  loss %s  grad_norm %s  tokens/s %s\n", tag, f[1], v["loss:"],
             v["grad_norm:"], v["tps:"];
      fflush(); next }
    / - varlen_cp - / && !/ - varlen_cp - INFO - step / {
      sub(/.* - varlen_cp - [A-Z]+ - /, ""); printf "[%s] varlen_cp %s\n", tag, $0; fflush() }'
}

run() {  # tag, loss file, log file, launcher...
  local tag="$1" losses="$2" log="$3"; shift 3
  echo "== $tag: $*"
  "$@" --config "$CONFIG" --job.dump_folder "$OUT/$tag" --metrics.loss_file "$losses" \
       --metrics.disable_color_printing true "${OVERRIDES[@]}" 2>&1 \
    | tee "$log" | show_steps "$tag"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then
    echo "error: the $tag run failed (exit $rc); last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit "$rc"
  fi
}

OVERRIDES=("$@")
START=$(date +%s)
run "CP=2" "$OUT/cp2.jsonl" "$OUT/cp2.log" \
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 --local-ranks-filter 0 \
  -m "$LAUNCHER" --parallelism.context_parallel_degree 2
run "CP=1" "$OUT/cp1.jsonl" "$OUT/cp1.log" \
  "$PYTHON" -m "$LAUNCHER" --parallelism.context_parallel_degree 1

RC=0
"$PYTHON" - "$OUT/cp2.jsonl" "$OUT/cp1.jsonl" "$(( $(date +%s) - START ))" <<'EOF' || RC=$?
import json
import sys

cp2, cp1 = ([json.loads(line) for line in open(p)] for p in sys.argv[1:3])
if len(cp2) != len(cp1) or not cp1:
    sys.exit(f"error: {len(cp2)} CP=2 steps vs {len(cp1)} CP=1 steps")
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(cp2, cp1))
rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(cp2, cp1))
ok = rel <= 1e-4  # fp32 rounding differences, amplified a little by Adam over the steps
print(f"loss {cp1[0]['loss']:.4f} -> {cp1[-1]['loss']:.4f} in {len(cp1)} steps; "
      f"CP=2 vs CP=1: max |dloss| = {diff:.2e} (relative {rel:.1e}) -> "
      f"{'MATCH' if ok else 'MISMATCH'} (fp32 tolerance 1e-4); {sys.argv[3]} s in all")
sys.exit(0 if ok else 1)
EOF
# The loss curves beside the logs (a note instead when matplotlib is missing).
"$PYTHON" -m varlen_cp.cli.loss_curve "$OUT/cp2.jsonl" "$OUT/cp1.jsonl" \
  --out "$OUT/loss_curve.png" || true
exit "$RC"
