#!/usr/bin/env bash
# One pass over a CUDA machine with no network: the pipeline on the embedded default, then the
# generation and PPO benches, then ONE table. Installs nothing and creates no venv (unlike
# scripts/_env.sh): it runs ${PY:-python3} with the project prepended to PYTHONPATH, so the
# dependencies must already be importable (docs/gpu.md: wheels unpacked to /tmp/site, on PYTHONPATH).
#
#   [PY=python3] [OUT=/tmp] [GEN_REPEATS=3] scripts/gpu_check.sh
#
# Writes under ${OUT:-/tmp}/gpu_check: run/ (run.dir of the stages), <step>.log (stderr/stdout of
# each step), generation.jsonl, ppo_bench.jsonl, decode_check.jsonl (JSON lines), seconds.txt, table.md.
# Exit codes: 0 all steps passed, 2 no CUDA GPU, else the exit code of the step that failed (named).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is false or torch is missing)" >&2
  exit 2
fi

DIR="${OUT:-/tmp}/gpu_check"
RUN="$DIR/run"
rm -rf "$DIR"
mkdir -p "$DIR"
STEP="setup"
trap 'code=$?; if [ "$code" -ne 0 ]; then
        echo "gpu_check: FAILED at step \"$STEP\" (exit $code); last lines of $DIR/$STEP.log:" >&2
        tail -n 25 "$DIR/$STEP.log" >&2 2>/dev/null || true
      fi' EXIT

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# step NAME STDOUT_FILE CMD...: runs CMD (stderr to NAME.log), appends "NAME seconds" to seconds.txt
step() {
  local name="$1" out="$2"; shift 2
  STEP="$name"
  echo "gpu_check: $name: $*" >&2
  local t0; t0=$(now_ms)
  "$@" > "$out" 2> "$DIR/$name.log"
  local ms=$(( $(now_ms) - t0 ))
  printf '%s %d.%03d\n' "$name" $(( ms / 1000 )) $(( ms % 1000 )) >> "$DIR/seconds.txt"
}

# the stages run as `python -m rlhf` would, under bench/stage_peak.py (writes peak_0.json: peak RSS, peak GPU)
STAGE_ARGS=("run.dir=$RUN" "logger.progress=false" "engine.device=cuda")
for s in sft reward ppo; do
  step "stage_$s" "$DIR/stage_$s.out" "$PY" bench/stage_peak.py "$DIR/peak_$s" "stage=$s" "${STAGE_ARGS[@]}"
done
step generation_bench "$DIR/generation.jsonl" \
  "$PY" bench/generation.py --device cuda --nproc 1 --workload small gpu05b gpu1b --repeats "${GEN_REPEATS:-3}"
step ppo_bench "$DIR/ppo_bench.jsonl" \
  "$PY" bench/ppo.py --device cuda --world-sizes 1 --workload gpu05b --steps 3 --variants hybrid
# the CUDA-graph decode loop against the row-removing loop and HF generate (fp32; exit 1 on a mismatch)
step decode_check "$DIR/decode_check.jsonl" "$PY" scripts/gpu_decode_check.py

STEP="table"
"$PY" - "$DIR" "$RUN" <<'EOF' | tee "$DIR/table.md"
import json, sys
from pathlib import Path

d, run = Path(sys.argv[1]), Path(sys.argv[2])

def last(path, key):
    """Last value of key in a metrics.jsonl (None when never logged)."""
    val = None
    for line in Path(path).read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if key in row:
            val = row[key]
    return val

def lines(name):
    return [json.loads(x) for x in (d / name).read_text().splitlines() if x.startswith("{")]

fmt = lambda v, f="{:.4f}": "n/a" if v is None else f.format(v)  # noqa: E731
rows = []
for name, secs in (x.split() for x in (d / "seconds.txt").read_text().splitlines()):
    rows.append((f"{name} seconds", f"{float(secs):.1f}"))
for key in ("gold/score", "gold/score_greedy"):
    rows.append((f"{key} before PPO (SFT)", fmt(last(run / "sft" / "metrics.jsonl", key))))
    rows.append((f"{key} after PPO", fmt(last(run / "ppo" / "metrics.jsonl", key))))
rows.append(("reward eval/accuracy", fmt(last(run / "reward" / "metrics.jsonl", "eval/accuracy"))))
for s in ("sft", "reward", "ppo"):
    peak = json.loads((d / f"peak_{s}" / "peak_0.json").read_text())
    rows.append((f"stage_{s} peak GPU (allocated / reserved) / host RSS",
                 f"{fmt(peak.get('peak_gpu_gb'), '{:.2f}')} / {fmt(peak.get('peak_gpu_reserved_gb'), '{:.2f}')} / "
                 f"{peak['peak_rss_gb']:.2f} GiB"))
gen = lines("generation.jsonl")
device = next((r.get("device") for r in gen if r.get("device")), "?")
for r in gen:
    if r["metric"] in ("tokens_per_s", "bandwidth_bound_tokens_per_s", "bandwidth_bound_kv_tokens_per_s"):
        extra = f" ({100 * r['fraction_reached']:.1f}% of bound, {r['bandwidth_gb_s']} GB/s)" \
            if "fraction_reached" in r else ""
        rows.append((f"generation {r['workload']} {r['variant']} {r['metric']}", f"{r['value']:,.0f}{extra}"))
    elif r["metric"] == "speedup":
        rows.append((f"generation {r['workload']} {r['variant']}", f"{r['value']}x"))
for r in lines("ppo_bench.jsonl"):
    if r["metric"] in ("s_per_step", "generate_s", "score_s", "train_s", "peak_gpu_gb", "peak_rss_gb", "static_gb"):
        unit = " GiB" if r["metric"].endswith("_gb") else ""
        rows.append((f"ppo bench {r['workload']} {r['variant']} ws{r['world_size']} {r['metric']}",
                     f"{r['value']:.3f}{unit}"))
for r in lines("decode_check.jsonl"):
    rows.append((f"decode check {r['check']}", ("ok " if r["ok"] else "FAILED ") +
                 json.dumps({k: v for k, v in r.items() if k not in ("check", "ok")})))
print(f"\n## gpu_check on {device}\n\n| what | value |\n| --- | --- |")
for k, v in rows:
    print(f"| {k} | {v} |")
EOF
