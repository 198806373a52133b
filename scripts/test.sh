#!/usr/bin/env bash
# Installs what is needed (venv) and runs the test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m slow   or   scripts/test.sh tests/unit -x
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
exec "$PY" -m pytest -p no:cacheprovider "$@"
