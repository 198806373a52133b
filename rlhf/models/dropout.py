"""Dropout off for the models of RL and DPO (``model.disable_dropout``, TRL's ``disable_dropout``).

PPO's ratio π/π_old compares log-probs of the same weights computed in separate forwards (the
rollout's scoring, the reference, the update), all in training mode: with dropout each forward draws
its own masks and the ratio is noise before the first update (GPT-2's 0.1 everywhere: approx KL
~1e-3 at the first update instead of 0). DPO's policy/reference log-ratio likewise.

Families name their probabilities differently (attention_dropout, hidden_dropout, resid_pdrop,
embd_pdrop, attn_pdrop, summary_first_dropout, dropout, activation_dropout, classifier_dropout,
layerdrop, ...), and modules either hold an ``nn.Dropout`` or copy the float from the config when
built (OPT's ``self.dropout``, the attention's ``self.attention_dropout``). So every probability is
set to 0 in the config (an exported model keeps it) and on the modules: every ``nn.Dropout``'s ``p``
and every float attribute of that name.
"""

from __future__ import annotations

import logging
import re

from torch import nn

log = logging.getLogger("rlhf")

# a probability of dropping something in training mode (LayerDrop's whole layers included)
_NAME = re.compile(r"dropout|pdrop|layerdrop", re.IGNORECASE)


def _is_rate(name: str, value) -> bool:
    return (
        bool(_NAME.search(name))
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > 0
    )


def _config_rates(config, prefix: str = ""):
    """(config, attribute, dotted name, p) of every non-zero dropout probability of an HF config and
    its sub-configs (text_config, ...)."""
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            yield from _config_rates(value, f"{prefix}{name}.")
        elif _is_rate(name, value):
            yield config, name, prefix + name, float(value)


def _module_rates(model: nn.Module):
    """(module, attribute, p): every ``nn.Dropout``'s p and every float dropout attribute > 0."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            yield mod, "p", float(mod.p)
        for name, value in list(vars(mod).items()):
            if _is_rate(name, value):
                yield mod, name, float(value)


def disable_dropout(model: nn.Module, what: str, disable: bool = True) -> nn.Module:
    """``model`` (an HF model, possibly on the meta device) with every dropout probability set to 0
    when ``disable`` (model.disable_dropout), in its config and on its modules; logs once what it
    found (``what``: "actor", "reference", ...), or that it is kept on. Returns ``model``."""
    config = getattr(model, "config", None)
    in_config = list(_config_rates(config)) if config is not None else []
    in_modules = list(_module_rates(model))
    if not in_config and not in_modules:
        return model
    if in_config:
        seen = ", ".join(f"{full}={p:g}" for _, _, full, p in in_config)
    else:
        seen = ", ".join(sorted({f"{type(m).__name__}.{name}={p:g}" for m, name, p in in_modules}))
    if not disable:
        log.info("dropout kept on in the %s (model.disable_dropout=false): %s", what, seen)
        return model
    for obj, name, *_ in [*in_config, *in_modules]:
        setattr(obj, name, 0.0)
    log.info("dropout off in the %s (model.disable_dropout=true; it had %s)", what, seen)
    return model
