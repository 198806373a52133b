"""``python -m rlhf.migrate``: DeepSpeed-Chat launch scripts and ``ds_config.json`` files → rlhf
    commands.

    python -m rlhf.migrate step1.sh step2.sh step3.sh [--ds-config ds_config.json] [--gpus N]
    [--nodes M] python -m rlhf.migrate --ds-config ds_config.json [--stage sft] python -m
    rlhf.migrate reward-model DSCHAT_DIR OUT_DIR

Prints, per ``main.py`` invocation, the ``python -m rlhf stage=...`` command line that runs it here,
then what is mapped with a difference and every flag or key that has no target, with its kind and
why (lines starting with ``#``: the output is a shell script). Scripts are read, never run. A
script's positional arguments ($1, $2, ...) go after its path in one argument: ``"run_1.3b.sh
out/step1 3"``. Scripts migrated together are linked: a step-3 ``--actor_model_name_or_path`` that
is step 1's ``--output_dir`` becomes step 1's export (``<run.dir>/sft/model``). docs/deepspeed.md
has the tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

from rlhf.errors import UserError
from rlhf.migrate.ds_config import apply_config, read_config
from rlhf.migrate.flags import Context, apply_flags
from rlhf.migrate.plan import Plan
from rlhf.migrate.script import Invocation, infer_step, read_script

EXPORTS = {"sft": "sft/model", "reward": "reward/model", "dpo": "dpo/model", "ppo": "ppo/actor"}
STAGES = tuple(EXPORTS)


def world_of(inv: Invocation, gpus: Optional[int], nodes: Optional[int]) -> tuple:
    """(GPUs per node, nodes, note): the command line's --gpus/--nodes, else the launcher's own
    (deepspeed --num_gpus/--num_nodes/--include, torchrun --nproc_per_node/--nnodes), else 8 × 1."""
    la = inv.launcher

    def first(*names):
        for n in names:
            if la.get(n):
                return la[n][0]
        return None

    per = gpus or first("num_gpus", "nproc_per_node", "num_processes")
    if per is None and la.get("include"):  # host:0,1,2
        per = len(la["include"][0].split(":")[-1].split(","))
    n = nodes or first("num_nodes", "nnodes", "num_machines") or 1
    note = ""
    if per is None:
        per, note = 8, "the script does not say how many GPUs: 8 per node assumed (--gpus N to say)"
    try:
        return int(per), int(n), note
    except ValueError:
        raise UserError(
            f"{inv.where}: the launcher's GPU count {per!r} / node count {n!r} is not a number"
        ) from None


def plan_invocation(
    inv: Invocation,
    exports: Dict[str, str],
    gpus: Optional[int],
    nodes: Optional[int],
    ds_config: Optional[dict],
    recipe: Optional[str],
    base_dir: Path,
) -> Plan:
    stage = infer_step(inv)
    plan = Plan(stage, f"{inv.where} (DeepSpeed-Chat {stage} step)")
    per, n, note = world_of(inv, gpus, nodes)
    if recipe:
        plan.set("recipe", recipe, "--recipe")
    if note:
        plan.note(note)
    if per * n > 1:
        plan.set("launcher.nproc_per_node", per, "the launcher's GPUs per node")
    if n > 1:
        plan.set("launcher.nnodes", n, "the launcher's nodes")
        plan.note(
            f"{n} nodes: run the command on every node with launcher.node_rank=<i> "
            f"launcher.rdzv_endpoint=<node 0>:29500"
        )
    for cfg_flag in ("deepspeed_config", "deepscale_config"):
        if inv.flags.get(cfg_flag):
            path = Path(inv.flags[cfg_flag][0])
            if not path.exists() and (base_dir / path).exists():
                path = base_dir / path
            apply_config(plan, read_config(str(path)))
    if ds_config is not None:
        apply_config(plan, ds_config)
    ctx = Context(stage, plan, {}, set(), per * n, exports)
    apply_flags(ctx, inv.flags)
    for name in inv.unresolved:
        plan.note(
            f"{name} is the script's caller's (no default in the script): give it in the "
            "command line above"
        )
    return plan


def migrate(
    scripts: List[str],
    ds_config_path: Optional[str] = None,
    stage: str = "sft",
    gpus: Optional[int] = None,
    nodes: Optional[int] = None,
    recipe: Optional[str] = "dschat",
) -> List[Plan]:
    ds_config = read_config(ds_config_path) if ds_config_path else None
    plans: List[Plan] = []
    exports: Dict[str, str] = {}
    for spec in scripts:
        path, *args = spec.split()
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"{path}: cannot read the script ({e.strerror or e})") from None
        found = read_script(text, path, args)
        if not found:
            raise UserError(
                f"{path}: no DeepSpeed-Chat main.py invocation in it "
                "(deepspeed/torchrun/python ... main.py --flags)"
            )
        for inv in found:
            plan = plan_invocation(inv, exports, gpus, nodes, ds_config, recipe, p.parent)
            plans.append(plan)
            run_dir = plan.overrides.get("run.dir")
            out = inv.flags.get("output_dir")
            if run_dir and out:
                exports[str(Path(out[0]))] = f"{run_dir.strip(chr(39))}/{EXPORTS[plan.stage]}"
    if not scripts:
        if ds_config is None:
            raise UserError("nothing to migrate: give launch scripts and/or --ds-config FILE")
        plan = Plan(stage, f"{ds_config_path} (DeepSpeed config)")
        if gpus and gpus * (nodes or 1) > 1:
            plan.set("launcher.nproc_per_node", gpus, "--gpus")
        apply_config(plan, ds_config)
        plans.append(plan)
    return plans


def _reward_model(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.migrate reward-model")
    ap.add_argument(
        "src", help="a DeepSpeed-Chat step-2 output directory (rwtransformer.* and v_head.weight)"
    )
    ap.add_argument("dst", help="where to write the sequence-classification model")
    a = ap.parse_args(argv)
    from rlhf.models.dschat import convert_dschat_reward_model

    out = convert_dschat_reward_model(a.src, a.dst)
    print(
        f"wrote {out}: a sequence classifier (num_labels=1) for ppo.reward_model_path or rlhf.score"
    )


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["reward-model"]:
            _reward_model(argv[1:])
            return
        ap = argparse.ArgumentParser(
            prog="python -m rlhf.migrate", description=__doc__.split("\n\n")[0]
        )
        ap.add_argument(
            "scripts", nargs="*", help='launch scripts; "script.sh ARG1 ARG2" gives its $1 $2'
        )
        ap.add_argument(
            "--ds-config",
            help="a DeepSpeed ds_config.json (applied to every command; the scripts' flags win)",
        )
        ap.add_argument(
            "--stage", default="sft", choices=STAGES, help="the stage of a --ds-config given alone"
        )
        ap.add_argument(
            "--gpus", type=int, help="GPUs per node (else the launcher's --num_gpus, else 8)"
        )
        ap.add_argument("--nodes", type=int, help="nodes (else the launcher's --num_nodes, else 1)")
        ap.add_argument(
            "--tables",
            action="store_true",
            help="print the flag and key tables (markdown) and exit",
        )
        ap.add_argument(
            "--recipe",
            default="dschat",
            help="the recipe the commands name (dschat: DeepSpeed-Chat's PPO behaviour; 'none': "
            "rlhf picks)",
        )
        a = ap.parse_args(argv)
        if a.tables:
            from rlhf.migrate.ds_config import config_table_markdown
            from rlhf.migrate.flags import flag_table_markdown

            print(flag_table_markdown() + "\n\n" + config_table_markdown())
            return
        recipe = None if a.recipe in ("none", "") else a.recipe
        plans = migrate(a.scripts, a.ds_config, a.stage, a.gpus, a.nodes, recipe)
    except UserError as e:
        print(f"rlhf.migrate: error: {e}", file=sys.stderr)
        sys.exit(2)
    left = sum(len(p.unmapped) for p in plans)
    text = "\n\n".join(
        ["#!/bin/sh\n# python -m rlhf.migrate " + " ".join(argv)] + [p.render() for p in plans]
    )
    try:
        print(
            f"{text}\n\n# {len(plans)} command(s); {left} flag(s)/key(s) not mapped "
            "(listed under each command)"
        )
    except BrokenPipeError:
        # the reader stopped early (| head): not an error of ours
        sys.stderr.close()


if __name__ == "__main__":
    main()
