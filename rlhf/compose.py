"""Compose and validate the configuration (Hydra compose API over the typed dataclasses)."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf import config as C
from rlhf import hub
from rlhf.config import Config, register
from rlhf.data.records import DATA_SUFFIXES
from rlhf.errors import ConfigError
from rlhf.models import get as named_models

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
_ABSENT = object()


def compose_config(
    overrides: Sequence[str] = (), base: Optional[dict] = None
) -> Tuple[Config, str]:
    """Returns the validated ``Config`` and its YAML text. Raises ``ConfigError`` on any problem.
    ``base``: values (e.g. a run's saved ``data``/``eval``) that stand over the composed defaults
    and under the keys the overrides name (``rlhf.eval --run-dir``)."""
    register()
    GlobalHydra.instance().clear()
    why = ""
    try:
        overrides, moved_why = renamed(list(overrides))
        overrides, why = choose_recipe(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose(config_name="config", overrides=overrides)
        if base:
            merged = OmegaConf.merge(dcfg, base)
            for o in OverridesParser.create().parse_overrides(overrides):
                # the command line on top again
                if OmegaConf.select(dcfg, o.key_or_group, default=_ABSENT) is not _ABSENT:
                    OmegaConf.update(
                        merged, o.key_or_group, OmegaConf.select(dcfg, o.key_or_group), merge=False
                    )
            dcfg = merged
        resolve_named_models(dcfg)
        hub_why = hub.settle(hub_settings(dcfg))
        lr_why = lora_learning_rate(dcfg, overrides)
        yaml_text = OmegaConf.to_yaml(dcfg)
        # builds the dataclasses: runs every __post_init__ check
        cfg = OmegaConf.to_object(dcfg)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(_describe(e, why)) from None
    finally:
        GlobalHydra.instance().clear()
    cfg.recipe_why = why
    cfg.lr_why = lr_why
    cfg.hub_why = hub_why
    cfg.moved_why = moved_why
    return cfg, yaml_text


def renamed(overrides: List[str]) -> Tuple[List[str], str]:
    """The overrides with the keys of ``MOVED_KEYS`` under their new names (``ppo.tools=[x]`` is
    ``env.tools=[x]``, ``ppo.sandbox.cpu_s=3`` is ``env.sandbox.cpu_s=3``), and the line that says
    so ("" when none moved)."""
    out, said = [], []
    for o in overrides:
        m = re.match(r"^(\+\+|\+|~)?([\w.]+)(=.*)?$", o, re.S)
        key = m.group(2) if m else ""
        for old, new in C.MOVED_KEYS.items():
            if key == old or key.startswith(old + "."):
                now = new + key[len(old) :]
                o = (m.group(1) or "") + now + (m.group(3) or "")
                said.append(f"{key} is now {now}")
                break
        out.append(o)
    if not said:
        return out, ""
    return out, f"renamed keys: {'; '.join(said)} (the old names are read until the next release)"


# keys naming the model a stage starts from: any of them set means a model the user brings
MODEL_KEYS = ("model.path", "ppo.actor_path", "dpo.model_path", "reward.model_path")


# every key that names a model to load (ppo.reward_model_path: a comma-separated list)
MODEL_PATH_KEYS = MODEL_KEYS + ("ppo.reward_model_path", "ppo.critic_path")


def resolve_named_models(dcfg) -> None:
    """Model path settings that name a model of rlhf/models/get.py's table
    (``smollm2-135m-instruct``) become its directory in the cache, fetched there on first use."""
    for key in MODEL_PATH_KEYS:
        value = OmegaConf.select(dcfg, key, default=None)
        if not isinstance(value, str):
            continue
        parts = [p.strip() for p in value.split(",")] if key == "ppo.reward_model_path" else [value]
        if any(named_models.is_named(p) for p in parts):
            paths = [str(named_models.ensure(p)) if named_models.is_named(p) else p for p in parts]
            OmegaConf.update(dcfg, key, ",".join(paths), merge=False)


# data settings that may name a hub dataset
DATA_PATH_KEYS = ("data.path", "data.eval_path")


def hub_settings(dcfg) -> list:
    """``key=id`` of every model or data setting that names a hub id rather than a local path."""
    found = []
    for key in MODEL_PATH_KEYS + DATA_PATH_KEYS:
        value = OmegaConf.select(dcfg, key, default=None)
        if not isinstance(value, str) or not value:
            continue
        parts = [p.strip() for p in value.split(",")] if key == "ppo.reward_model_path" else [value]
        files = DATA_SUFFIXES if key in DATA_PATH_KEYS else ()
        found += [f"{key}={p}" for p in parts if hub.looks_like_hub_id(p, files)]
    for i, source in enumerate(OmegaConf.select(dcfg, "data.sources", default=None) or []):
        path = source.get("path") if hasattr(source, "get") else None
        if isinstance(path, str) and path and hub.looks_like_hub_id(path, DATA_SUFFIXES):
            found.append(f"data.sources[{i}].path={path}")
    return found


def lora_learning_rate(dcfg, overrides: Sequence[str]) -> str:
    """With LoRA (model.lora.r > 0) and a recipe's ``train.lora_lr``, that rate becomes ``train.lr``
    unless the command line sets train.lr; returns what the log says of it ("" when nothing
    changed)."""
    lora_lr, r = (
        OmegaConf.select(dcfg, "train.lora_lr"),
        OmegaConf.select(dcfg, "model.lora.r") or 0,
    )
    if lora_lr is None or r <= 0:
        return ""
    given = {
        o.key_or_group.lstrip("+~")
        for o in OverridesParser.create().parse_overrides(list(overrides))
    }
    if "train.lr" in given:
        return (
            f"train.lr={OmegaConf.select(dcfg, 'train.lr'):g} from the command line (LoRA's "
            f"rate would be {lora_lr:g})"
        )
    OmegaConf.update(dcfg, "train.lr", lora_lr, merge=False)
    return (
        f"train.lr={lora_lr:g}: the recipe's rate for LoRA (model.lora.r={r}; train.lr=... on "
        "the command line wins)"
    )


def recipes() -> list:
    return sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def choose_recipe(overrides: List[str]) -> Tuple[List[str], str]:
    """The recipe when the command line names none, and why: pretrained when it names a model of the
    user's (model.path and the stages' own input paths), else the recipe the run's earlier stages
    used (their saved config.yaml in run.dir), else embedded. An explicit recipe=... is kept as it
    is."""
    given = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        value = o.value()
        given[o.key_or_group] = None if value is None else str(value)
    if given.get("recipe"):
        return overrides, f"recipe={given['recipe']} on the command line"
    for key in MODEL_KEYS:
        if given.get(key) not in (None, "", "null"):
            return overrides + ["recipe=pretrained"], (
                f"{key}={given[key]} is set: settings for a pretrained "
                f"model (recipe=embedded gives the embedded task's)"
            )
    run_dir = Path(given.get("run.dir") or C.RunConfig.dir)
    saved = sorted(
        (p for p in (run_dir / s / "config.yaml" for s in C.stage_names()) if p.is_file()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for path in saved:
        # the newest stage's (rlhf.runtime.stage.CONFIG_FILE)
        m = re.search(r"^recipe: *(\S+)", path.read_text(encoding="utf-8", errors="replace"), re.M)
        if m and m.group(1) in recipes():
            return overrides + [
                f"recipe={m.group(1)}"
            ], f"the recipe of this run's earlier stages ({path})"
    return overrides + ["recipe=embedded"], "no model.path: the embedded model and task"


def _describe(e: Exception, recipe_why: str = "") -> str:
    """One line for a Hydra/OmegaConf error; ``recipe_why``: why the recipe was chosen (for a recipe
    without the stage)."""
    cause = e
    while cause.__cause__ is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__
    if isinstance(cause, ConfigError):
        return str(cause)
    text = " ".join(str(e).split("\n")[0].split())
    if cause is not e and str(cause).strip():
        text += ": " + " ".join(str(cause).split("\n")[0].split())
    hint = _did_you_mean(text)
    if hint:
        text += hint
    m = re.search(r"Could not find 'recipe_stage/([\w.-]+)/(\w+)'", text)
    if m and m.group(1) in recipes():
        have = [
            s
            for s in C.stage_names()
            if (CONF_DIR / "recipe_stage" / m.group(1) / f"{s}.yaml").is_file()
        ]
        return (
            f"recipe={m.group(1)} ({recipe_why}) has no {m.group(2)} stage (its stages: "
            f"{', '.join(have)}); pick another recipe for stage={m.group(2)}"
        )
    if "Could not find 'recipe/" in text or (m and m.group(1) not in recipes()):
        name = re.search(r"Could not find 'recipe(?:_stage)?/([\w.-]+)", text).group(1)
        return f"unknown recipe '{name}' (expected {', '.join(recipes())})"
    if "Could not find 'stage/" in text:
        return (
            text.replace("Could not find 'stage/", "unknown stage '")
            + f" (expected {C.stage_choices()})"
        )
    return text or type(e).__name__


def _did_you_mean(text: str) -> str:
    """ ", did you mean 'max_steps'?" for an unknown key close to a real one of its group."""
    m = re.search(r"Key '([^']+)' not in '(\w+)'", text)
    cls = getattr(C, m.group(2), None) if m else None
    if cls is None or not dataclasses.is_dataclass(cls):
        return ""
    if cls is C.PPOConfig and f"ppo.{m.group(1)}" in C.MOVED_KEYS:
        # a moved key in a YAML file (the command line's are renamed)
        return f" (it is {C.MOVED_KEYS[f'ppo.{m.group(1)}']} now)"
    close = difflib.get_close_matches(
        m.group(1), [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.75
    )
    return f" (did you mean '{close[0]}'?)" if close else ""
