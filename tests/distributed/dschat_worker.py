"""The DeepSpeed-Chat conversion under torchrun: every rank checks the source, rank 0 converts, all
get the same directory (tests/unit/models/test_dschat.py builds the source).

    torchrun --nproc-per-node=2 tests/distributed/dschat_worker.py SRC RUN_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh, shutdown  # noqa: E402
from rlhf.models import dschat  # noqa: E402


def main(src: str, run_dir: str, out: str) -> None:
    mesh = init_mesh(EngineConfig(device="cpu", timeout_s=120))
    path = dschat.reward_model_input(src, "ppo.reward_model_path", run_dir, mesh)
    files = sorted(p.name for p in Path(path).iterdir())  # complete on every rank once it returns
    Path(out, f"rank{mesh.rank}.json").write_text(json.dumps({"path": path, "files": files}))
    shutdown(mesh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
