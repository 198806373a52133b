"""Compose and validate the configuration (Hydra compose API over the typed dataclasses)."""
from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Sequence, Tuple

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf import config as C
from rlhf.config import Config, register
from rlhf.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(overrides: Sequence[str] = ()) -> Tuple[Config, str]:
    """Returns the validated ``Config`` and its YAML text. Raises ``ConfigError`` on any problem."""
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose(config_name="config", overrides=list(overrides))
        yaml_text = OmegaConf.to_yaml(dcfg)
        cfg = OmegaConf.to_object(dcfg)  # builds the dataclasses: runs every __post_init__ check
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(_describe(e)) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg, yaml_text


def _describe(e: Exception) -> str:
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
    if "Could not find 'stage/" in text:
        return text.replace("Could not find 'stage/", "unknown stage '") + " (expected sft, reward, ppo or dpo)"
    return text or type(e).__name__


def _did_you_mean(text: str) -> str:
    """", did you mean 'max_steps'?" for an unknown key close to a real one of its group."""
    m = re.search(r"Key '([^']+)' not in '(\w+)'", text)
    cls = getattr(C, m.group(2), None) if m else None
    if cls is None or not dataclasses.is_dataclass(cls):
        return ""
    close = difflib.get_close_matches(m.group(1), [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""
