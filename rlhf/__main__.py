"""Entry point: ``python -m rlhf stage=<stage> [hydra overrides...]`` (the stages:
rlhf.config.STAGE_TABLE).

Composes the Hydra config with the compose API (no output directory, no chdir, no timestamped
folders: every rank of a torchrun job computes the same config and only rank 0 writes to
``run.dir``), validates it, then runs ``stages.<stage>.run(cfg)``. With
``launcher.nproc_per_node>0`` and not already under a launcher, it starts torch.distributed.run
itself (docs/contract.md).

Exit codes: 0 success, 2 bad configuration or input, 3 a peer rank died or stopped answering
(rlhf/launcher/watchdog.py; the job can be rerun and resumes from its last checkpoint), 4 a
checkpoint or export could not be written (disk full, I/O error: rlhf.errors.SaveError; the earlier
checkpoints are intact and a rerun resumes), anything else a bug.
"""

from __future__ import annotations

import os
import sys

# Imports inside functions on purpose: `--help` answers in 0.03 s and a configuration error (exit 2)
# in 0.3 s (measured on the CPU dev machine), against 2-5 s once torch and transformers load; those
# load only when a stage runs (stages.<stage> and what it imports).

# {stages}: the names in rlhf.config.STAGE_TABLE, "sft|reward|ppo|dpo"; {table}: a line each
USAGE = """usage: python -m rlhf stage={stages} [key=value ...]

{table}

Hydra overrides, e.g. run.dir=runs/x train.max_steps=100 engine.zero_stage=3 data.path=f.jsonl
  --cfg       print the composed configuration and exit
  --help      this text
Config groups and keys: see docs/keys.md and rlhf/config.py."""


def _fail(msg: str, code: int = 2, kind: str = "error: ") -> None:
    """One line on stderr (``rlhf: error: ...``; a stop by a signal: ``rlhf: stopped by ...``), exit
    ``code``."""
    from rlhf.errors import one_line
    from rlhf.launcher.watchdog import hold_termination, write_error_file

    # every rank sees the same error: print it once
    printed = int(os.environ.get("RANK", "0")) == 0
    hold_termination()
    if printed:
        print(f"rlhf: {kind}{one_line(msg)}", file=sys.stderr, flush=True)
    # under a launcher: the root cause it reports
    write_error_file(one_line(msg), printed)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    argv = list(argv)
    if "--help" in argv or "-h" in argv:
        from rlhf.config import STAGE_TABLE, stage_names

        table = "\n".join(f"  {s.name:<8}{s.what}" for s in STAGE_TABLE)
        print(USAGE.format(stages="|".join(stage_names()), table=table))
        return
    show_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]

    from rlhf.compose import compose_config
    from rlhf.errors import SaveError, UserError

    try:
        cfg, yaml_text = compose_config(argv)
    except UserError as e:
        _fail(str(e))
    if show_cfg:
        print(yaml_text)
        return

    if cfg.launcher.nproc_per_node > 0 and "LOCAL_RANK" not in os.environ:
        from rlhf.launcher.launch import self_launch

        sys.exit(self_launch(cfg, argv))

    import importlib

    from rlhf.launcher.interrupt import Interrupted
    from rlhf.outputs.log import keep_writing

    # a console reader that goes away (| tee, then Ctrl-C) does not end the run
    keep_writing()
    stage = importlib.import_module(f"stages.{cfg.stage}")
    try:
        stage.run(cfg)
    except Interrupted as e:
        # the stop a signal asked for, its checkpoint saved: 130 / 143
        _fail(str(e), code=e.exit_code, kind="")
    except SaveError as e:
        # disk full or I/O error while saving: 4, the line says where a rerun resumes
        _fail(str(e), code=e.exit_code)
    except UserError as e:
        _fail(str(e), code=getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        # before the stop handler listens, or a second Ctrl-C: no checkpoint here
        _fail(
            "interrupted; the last checkpoint saved stands (rerun the same command to "
            "resume from it)",
            code=130,
            kind="",
        )
    except Exception as e:
        # A peer that died or stopped answering: one clear line and exit code 3, not a traceback
        # from deep inside FSDP (rlhf/launcher/watchdog.py). Anything else is a bug and keeps its
        # traceback.
        from rlhf.launcher import watchdog

        failure = watchdog.collective_failure(e, cfg.engine.timeout_s)
        if failure is None:
            raise
        watchdog.exit_with(failure)


if __name__ == "__main__":
    main()
    if "LOCAL_RANK" in os.environ:
        # a torchrun worker ends without finalization (mesh.end_process says why)
        from rlhf.engine.mesh import end_process

        end_process()
