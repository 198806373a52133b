#!/usr/bin/env bash
# The whole pipeline in one command, on the embedded default when given no overrides:
#   scripts/run_all.sh [hydra overrides...]        e.g. run.dir=runs/x train.max_steps=200
#   NPROC=2 scripts/run_all.sh                     every stage on 2 processes (torchrun)
#   scripts/run_all.sh stages=sft,dpo [overrides]  other stages, in that order (a leading stages= is
#                                                  the script's own argument, not passed to Hydra)
# Stages run in order (default: the pipeline rows of STAGE_TABLE in rlhf/config.py, SFT → reward → PPO);
# overrides pass to every stage.
# Writes <run.dir>/summary.json and prints a short table. A failing stage stops the script.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
# the stages of rlhf/config.py's STAGE_TABLE: every name, the pipeline's in order, and "sft, ..., ppo or dpo"
TABLE="$("$PY" -c 'from rlhf.config import pipeline_stages as p, stage_choices as c, stage_names as n
print(*n()); print(*p()); print(c())')"
{ read -r -a KNOWN; read -r -a PIPELINE; read -r CHOICES; } <<< "$TABLE"
known() { local k; for k in "${KNOWN[@]}"; do [ "$k" = "$1" ] && return 0; done; return 1; }
STAGES=()
if [ $# -gt 0 ] && [[ "$1" == stages=* ]]; then
  IFS=',' read -r -a STAGES <<< "${1#stages=}"
  shift
  [ ${#STAGES[@]} -gt 0 ] || { echo "[run_all] stages= names no stage (e.g. stages=sft,dpo)" >&2; exit 2; }
  for s in "${STAGES[@]}"; do
    if ! { known "$s" && [ -f "$ROOT/stages/$s.py" ]; }; then
      echo "[run_all] stages=: unknown stage '$s' (expected $CHOICES)" >&2
      exit 2
    fi
  done
else
  for s in "${PIPELINE[@]}"; do [ -f "$ROOT/stages/$s.py" ] && STAGES+=("$s"); done
fi
NPROC="${NPROC:-1}"
if [ "$NPROC" -gt 1 ]; then
  LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" -m rlhf)
else
  LAUNCH=("$PY" -m rlhf)
fi
RUN="$("$PY" -m rlhf --cfg "$@" | "$PY" -c 'import sys,yaml; r = yaml.safe_load(sys.stdin)["run"]; print(r["seed"], r["dir"])')"
read -r SEED RUN_DIR <<< "$RUN"
declare -A SECONDS_OF
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); }
T0=$(now_ms)
for s in "${STAGES[@]}"; do
  echo "[run_all] stage $s (run.dir=$RUN_DIR, nproc=$NPROC)" >&2
  t=$(now_ms)
  "${LAUNCH[@]}" "stage=$s" "$@" || { code=$?; echo "[run_all] stage $s failed (exit $code)" >&2; exit "$code"; }
  SECONDS_OF[$s]=$(secs $(( $(now_ms) - t )))
done
TOTAL=$(secs $(( $(now_ms) - T0 )))
ARGS=()
for s in "${STAGES[@]}"; do ARGS+=("--seconds" "$s=${SECONDS_OF[$s]}"); done
"$PY" -m rlhf.summary "$RUN_DIR" "${ARGS[@]}" --seconds "total=$TOTAL" --seed "$SEED"
