"""The gold score of any exported policy on a run's held-out prompts.

    python -m rlhf.eval RUN_DIR/ppo/actor [--run-dir RUN_DIR] [key=value ...]
    python -m rlhf.eval RUN_DIR/sft/model data.path=data/gsm8k.jsonl data.format=gsm8k

The held-out prompts, the decoding and the scorer are the stages' own
(``rlhf.runtime.evaluation.evaluate_gold``, docs/contract.md), with the run's settings: ``data.*``,
``eval.*`` and ``run.seed`` come from the configuration a stage saved in the run
(``<run.dir>/<stage>/config.yaml``: the policy's own stage's when PATH lies in the run directory,
else the newest in ``--run-dir``), and the Hydra overrides given here win over it. A run directory
without one (a run older than those files) takes the overrides alone; then, without any ``data.*``
override, only a policy of the embedded task is scored (on the embedded task) and any other exits 2.
Prints one JSON object: ``{"model", "gold/score", "gold/score_greedy", "prompts", "samples",
"max_new_tokens", "temperature", "data", "config"}`` (``config``: the file read, or null). Runs on
the GPU when there is one (``engine.device``). A path that is not an exported policy, or data
without a gold scorer, exits 2 with one line.

An agentic policy is scored by episodes, as the PPO stage scores it: when the saved run played them
(``env.tools`` set, or an ``env.name`` other than ``single_turn``) its ``env`` group comes with it
(``env_of``), and overrides such as ``env.tools=[calculator]`` or ``env.name=module.Class`` ask for
them on any run. Each held-out prompt is rendered with the tools and played by the stage's
``EpisodeRunner`` (tool calls run, results appended, up to ``env.max_turns``), and the final answer
is scored; the JSON object then also has ``gold/tool_use`` (and ``gold/tool_use_greedy``: the share
of episodes that called a tool), ``env``, ``tools`` and ``max_turns``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

# Imports inside functions on purpose: --help and usage errors answer in 0.04 s (measured on the CPU
# dev machine), against 2-5 s once torch/transformers load; they load only when a model is loaded.
PROG = "python -m rlhf.eval"


def main(argv=None) -> None:
    from rlhf.generate import OneLineParser

    ap = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("path", help="an exported policy (RUN_DIR/sft/model, RUN_DIR/ppo/actor, ...)")
    ap.add_argument(
        "--run-dir", help="the run's directory (run.dir): its saved data and eval settings"
    )
    ap.add_argument(
        "--trust-remote-code", action="store_true", help="allow a model that brings its own code"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of the run: data.*, eval.*, run.seed, engine.device, env.tools, "
        "env.name, ...",
    )
    args = ap.parse_intermixed_args(argv)  # options before or after the overrides

    from omegaconf import OmegaConf

    from rlhf.errors import ConfigError, UserError, one_line
    from rlhf.generate import quiet_console

    quiet_console()
    saved = None
    try:
        bad = [o for o in args.overrides if "=" not in o]
        if bad:
            raise ConfigError(
                f"{bad[0]!r} is not a key=value override (one path only: {args.path})"
            )
        from rlhf.generate import check_policy_dir

        check_policy_dir(args.path)
        if args.run_dir is not None and not Path(args.run_dir).is_dir():
            raise ConfigError(f"--run-dir {args.run_dir}: no such directory")
        run_dir = None
        if args.run_dir:
            run_dir = Path(args.run_dir)
        saved = run_config(Path(args.path), run_dir)
        cfg = compose_for(saved, args.run_dir, args.overrides)
        if saved is None and not any(o.lstrip("+~").startswith("data.") for o in args.overrides):
            check_embedded_task(args.path, args.run_dir, cfg, args.trust_remote_code)
        result = gold_of(args.path, cfg, args.trust_remote_code)
    except UserError as e:
        read = ""
        if saved is not None and str(saved) not in str(e):
            read = f" (the run's settings from {saved})"
        print(f"{PROG}: error: {one_line(e)}{read}", file=sys.stderr)
        sys.exit(2)
    if saved is not None:
        what = "data and eval settings"
        if env_of(OmegaConf.load(saved)):
            what = "data, eval and environment settings"
        print(f"{PROG}: the run's {what} from {saved}", file=sys.stderr, flush=True)
    print(json.dumps({**result, "config": None if saved is None else str(saved)}), flush=True)


# what rlhf.eval takes from a run's saved configuration, with run.seed (engine.* stays this
# machine's)
RUN_KEYS = ("data", "eval")
# and its env group, when the run played episodes (env_of): the environment, its tools and budgets


def env_of(run) -> dict:
    """The saved run's ``env`` group (and the ``ppo.max_new_tokens`` its trajectory budget is
    checked against) as overrides, when its policy played episodes (``env.tools`` set, or an
    environment other than ``single_turn``); {} for a single-turn run (the defaults stay, and
    ``env.tools=[...]`` on the command line makes one agentic). A run saved before the group moved
    out of ``ppo`` (MOVED_KEYS) is read under the new names. ``name: tools`` is carried as ``auto``
    (the same while tools are set), so that ``env.tools=[]`` alone scores the policy without
    them."""
    from rlhf.config import MOVED_KEYS

    ppo = run.get("ppo") or {}
    env = dict(run.get("env") or {})
    for old, new in MOVED_KEYS.items():
        key = old.split(".", 1)[1]
        # (the env group's keys only: MOVED_KEYS holds other moves too)
        if new.startswith("env.") and key in ppo and new.split(".", 1)[1] not in env:
            env[new.split(".", 1)[1]] = ppo[key]
    if not env.get("tools") and env.get("name", "single_turn") in ("single_turn", "auto"):
        return {}
    if env.get("name") == "tools":
        env["name"] = "auto"
    out = {"env": env}
    if "max_new_tokens" in ppo:
        out["ppo"] = {"max_new_tokens": ppo["max_new_tokens"]}
    return out


def plays_episodes(env) -> bool:
    """Whether gold is scored by episodes: tools, or an environment of more than the one turn."""
    return bool(env.tools) or env.name != "single_turn"


def run_config(path: Path, run_dir: Optional[Path]) -> Optional[Path]:
    """The configuration a stage saved (``<run.dir>/<stage>/config.yaml``) that the policy at
    ``path`` was trained with: the one beside it (``path`` = ``<run.dir>/<stage>/<export>``, inside
    ``run_dir`` when given), else the newest in ``run_dir``; None when there is none."""
    from rlhf.config import stage_names
    from rlhf.runtime.stage import CONFIG_FILE

    own = path.resolve().parent / CONFIG_FILE
    if own.is_file() and (run_dir is None or own.parent.parent == run_dir.resolve()):
        return own
    if run_dir is None:
        return None
    saved = [
        run_dir / stage / CONFIG_FILE
        for stage in stage_names()
        if (run_dir / stage / CONFIG_FILE).is_file()
    ]
    return max(saved, key=lambda p: p.stat().st_mtime) if saved else None


def compose_for(saved: Optional[Path], run_dir: Optional[str], overrides: list):
    """The configuration to evaluate with: the defaults, under the saved run's ``data``, ``eval``
    and ``run.seed`` (when ``saved``) and its environment (``env_of``), under the command line's
    overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlhf.compose import compose_config
    from rlhf.errors import ConfigError, one_line

    first = ["stage=sft"]
    if run_dir:
        first.append(f"run.dir={run_dir}")
    if saved is None:
        return compose_config(first + list(overrides))[0]
    try:
        run = OmegaConf.load(saved)
        # a recipe need not have an SFT stage (smollm2_arith: ppo only)
        first[0] = f"stage={run.stage}"
        base = {**{k: run[k] for k in RUN_KEYS}, "run": {"seed": run.run.seed}}
        base.update(env_of(run))
    except (OSError, OmegaConfBaseException, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(
            f"{saved}: not a configuration saved by a stage ({one_line(e)})"
        ) from None
    overrides = first + list(overrides)
    try:
        return compose_config(overrides, base=base)[0]
    except ConfigError as e:
        # a mistake of the command line's own is reported as such
        compose_config(overrides)
        raise ConfigError(f"{saved}: {e}") from None


def check_embedded_task(path: str, run_dir: Optional[str], cfg, trust_remote_code: bool) -> None:
    """Without a saved configuration and without data.* on the command line the embedded task is
    what would be scored: exit 2 unless the policy was trained on it (its tokenizer is the one
    stage=sft trains on the embedded task's text), rather than score another task's policy on
    arithmetic."""
    from rlhf.data.formats import FORMATS
    from rlhf.data.tokenizer import train_tokenizer
    from rlhf.errors import ConfigError
    from rlhf.models.loading import load_tokenizer

    embedded = train_tokenizer(
        FORMATS[cfg.data.format].corpus(cfg.data.synthetic),
        cfg.model.vocab_size,
        cfg.model.max_position_embeddings,
    )
    if load_tokenizer(path, trust_remote_code).get_vocab() == embedded.get_vocab():
        return
    where = f"--run-dir {run_dir} holds" if run_dir else f"{Path(path).resolve().parent} holds"
    raise ConfigError(
        f"{where} no saved stage configuration (<stage>/config.yaml) and {path} was not trained on "
        f"the embedded task: pass the run's data settings (data.path=... data.format=..., and its "
        f"eval.* and run.seed)"
    )


def gold_of(path: str, cfg, trust_remote_code: bool = False) -> dict:
    from rlhf.data.chat import resolve_template
    from rlhf.data.formats import gold_formats
    from rlhf.data.pipeline import load_stage_data
    from rlhf.errors import ConfigError, one_of
    from rlhf.generate import load_policy
    from rlhf.rl.episodes import EpisodeRunner
    from rlhf.runtime.evaluation import evaluate_gold, gold_prompts

    if cfg.eval.gold_prompts == 0:
        raise ConfigError(
            "eval.gold_prompts=0: nothing to evaluate (set a positive eval.gold_prompts)"
        )
    # episodes: the stage's environment, its tools and parser built before anything loads
    env = None
    if plays_episodes(cfg.env):
        from rlhf.envs.builtin import environment

        env = environment(cfg.env)
    # the held-out records as the policy's stage read them
    data = load_stage_data(cfg.data, cfg.stage, cfg.run.seed)
    if data.gold is None:
        raise ConfigError(
            f"data ({data.description}) has no gold scorer (there is one for data.format="
            f"{one_of(gold_formats(), 'and')}, when every source and the held-out set share it)"
        )
    if not gold_prompts(data.eval, cfg.eval):
        raise ConfigError(f"data ({data.description}): no held-out records with a reference answer")
    if env is not None:  # it resets on a held-out record
        from rlhf.envs.base import check as check_env

        check_env(env[0], data.eval[0], cfg.env.name)
    hybrid, tokenizer, mesh = load_policy(
        path, trust_remote_code=trust_remote_code, ecfg=cfg.engine
    )
    chat = resolve_template(tokenizer, cfg.data.chat_template)
    held_out, play, played = data.eval, None, {}
    if env is not None:
        # as the PPO stage evaluates: prompts with the tools, episodes when they have turns
        runner = EpisodeRunner.of(cfg.env, env, tokenizer, chat, mesh)
        held_out = runner.with_tools(data.eval)
        if runner.multi_turn:
            play = runner.player(hybrid)
        played = {"env": cfg.env.name, "tools": list(cfg.env.tools), "max_turns": cfg.env.max_turns}
    res = evaluate_gold(
        hybrid.generate, tokenizer, held_out, data.gold, cfg.eval, mesh, chat, play=play
    )
    return {
        "model": str(path),
        **res,
        "prompts": len(gold_prompts(data.eval, cfg.eval)),
        "samples": cfg.eval.gold_samples,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "temperature": cfg.eval.temperature,
        "data": data.description,
        **played,
    }


if __name__ == "__main__":
    main()
