# Sourced by the scripts: creates or reuses a venv with everything installed, exports $PY.
# RLHF_VENV overrides the venv location; RLHF_PYTHON the interpreter that creates it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLHF_VENV:-$ROOT/.venv}"
BASE_PY="${RLHF_PYTHON:-$(command -v python3 || command -v python)}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[rlhf] creating venv $VENV" >&2
  "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Reinstall when the dependency declarations change.
STAMP="$VENV/.rlhf-install-$(cat "$ROOT/pyproject.toml" "$ROOT/requirements/constraints.txt" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
if [ ! -f "$STAMP" ]; then
  echo "[rlhf] installing dependencies into $VENV (one time, about a minute)" >&2
  "$PY" -m pip install -q --upgrade pip >&2
  # torch first and pinned: an open range would pull a multi-GB CUDA build on CPU machines.
  "$PY" -m pip install -q "torch==2.13.0" >&2
  "$PY" -m pip install -q -c "$ROOT/requirements/constraints.txt" -e "$ROOT[dev]" >&2
  rm -f "$VENV"/.rlhf-install-*
  touch "$STAMP"
fi
export PY ROOT
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_DISABLE_TELEMETRY=1
