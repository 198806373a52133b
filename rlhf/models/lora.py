"""LoRA adapters through PEFT (``model.lora.r > 0``): which modules get them, and the three views of
an adapted model the rest of the project needs.

PEFT is the well-kept implementation every RLHF library builds on (TRL, OpenRLHF, veRL), so we
use it for the adapters themselves — their init, scaling, dropout and file format — rather than a
copy of our own. What PEFT does not do for us, and lives here:
  - ``delta_weight``/``merged``: W + B·A·α/r computed out of place, for the hybrid engine's gathered
    inference weights (the training-mode weights stay unmerged: merging in place and back would
    change them at rounding level).
  - ``merged_state_dict``: a full (possibly FSDP-gathered) state dict of a PEFT model turned into
    the
    plain model's names and merged weights, for the HF export.
  - ``adapters_disabled``: the base model, for PPO's and DPO's reference log-probs without a second
    copy of the weights.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from rlhf.errors import ConfigError
from rlhf.models.loading import BASE_VOCAB_ROWS, decoder_layers

log = logging.getLogger("rlhf")
# PEFT's name of the one adapter we train
ADAPTER = "default"


def lora_enabled(lcfg) -> bool:
    return lcfg is not None and lcfg.r > 0


def is_peft(module: nn.Module) -> bool:
    """A PEFT model (also after FSDP2 swapped its class in place); duck-typed so that a run without
    LoRA never imports PEFT."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def is_param_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (``target_parameters``: a MoE layer's 3-D experts), wrapping the
    module that holds it (nested once per adapted parameter)."""
    return is_lora_layer(module) and hasattr(module, "parameter_name")


def base_of(module: nn.Module) -> nn.Module:
    """The module under PEFT's parameter wrappers (itself when there are none)."""
    while is_param_wrapper(module):
        module = module.base_layer
    return module


def param_weights(module: nn.Module, names) -> Dict[str, torch.Tensor]:
    """``names`` of the parameters of ``base_of(module)`` (``whole``: a sharded one gathered), each
    with its adapter merged in (W + ΔW, out of place) where a parameter wrapper with active adapters
    holds it."""
    deltas = {}
    while is_param_wrapper(module):
        if not (module.disable_adapters or module.merged) and ADAPTER in module.lora_A:
            deltas[module.parameter_name] = module.get_delta_weight(ADAPTER)
        module = module.base_layer
    out = {}
    for name in names:
        w = getattr(module, name).detach()
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        out[name] = w + deltas[name].to(w.dtype) if name in deltas else w
    return out


def has_param_adapters(model: nn.Module) -> bool:
    return any(is_param_wrapper(m) for m in model.modules())


def is_saved_module(module: nn.Module) -> bool:
    """PEFT's wrapper of a module that trains fully (modules_to_save): a trained copy beside the
    original."""
    return hasattr(module, "original_module") and hasattr(module, "modules_to_save")


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT model (its LoRA layers injected in place), else
    ``module``."""
    return module.get_base_model() if is_peft(module) else module


def default_targets(model: nn.Module) -> List[str]:
    """The attention and MLP projections: names of the linear layers inside the decoder blocks
    (q/k/v/o_proj, gate/up/down_proj for Llama-likes; qkv_proj, gate_up_proj for Phi-3; c_attn,
    c_proj, c_fc for GPT-2), not the embeddings, the LM head or a score head."""
    names = set()
    for layer in decoder_layers(model):
        for name, mod in layer.named_modules():
            if is_lora_layer(mod):
                names.add(name.split(".")[-1])
            elif (
                isinstance(mod, (nn.Linear, Conv1D))
                and ".lora_" not in name
                and not name.endswith("base_layer")
            ):
                names.add(name.split(".")[-1])
    return sorted(names)


def adapt(
    model: nn.Module,
    lcfg,
    seed: int,
    head: Optional[str] = None,
    what: str = "model",
    embedded: bool = False,
) -> nn.Module:
    """``model`` with LoRA adapters when ``model.lora.r > 0`` (logged with the trainable share),
    else as is. ``embedded``: the embedded default (random init, its own tokenizer), whose
    embeddings train fully unless model.lora.modules_to_save says otherwise."""
    if not lora_enabled(lcfg):
        return model
    if lcfg.modules_to_save is not None:
        full = list(lcfg.modules_to_save)
    elif embedded:
        full = ["embed_tokens"]
    else:
        full = []
    model = apply_lora(model, lcfg, seed, head, full)
    targets = sorted(model.peft_config[ADAPTER].target_modules)
    targets += sorted(model.peft_config[ADAPTER].target_parameters or [])
    fully_trained = f", fully trained: {','.join(full)}" if full else ""
    log.info(
        "LoRA on the %s: r=%d alpha=%g on %s%s; %s",
        what,
        lcfg.r,
        lcfg.alpha,
        ",".join(targets),
        fully_trained,
        trainable_share(model),
    )
    return model


def apply_lora(
    model: nn.Module, lcfg, seed: int, head: Optional[str] = None, full: Optional[List[str]] = None
) -> nn.Module:
    """``model`` with LoRA adapters (PEFT) on ``model.lora.target_modules`` (default: the attention
    and MLP projections); every other weight frozen. ``head``: a module that stays fully trainable
    (the score head of a reward model or critic), saved with the adapter (PEFT's modules_to_save),
    as are the modules named in ``full`` (a tied LM head follows its embedding). The adapters' init
    is seeded (A: Kaiming-uniform, B: zeros, so the adapted model starts as the base); a model on
    the meta device gets the shapes only (its weights arrive by broadcast)."""
    # lazy: 5 s to import (measured), used only with model.lora.r > 0
    from peft import LoraConfig, get_peft_model

    targets = list(lcfg.target_modules) if lcfg.target_modules else default_targets(model)
    present = {name.split(".")[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules={targets}: {', '.join(missing)} not a module of "
            f"{type(model).__name__} (its projections: {', '.join(default_targets(model))})"
        )
    saved = list(full or [])
    if head:
        saved.append(head)
    missing = [t for t in saved if t not in present]
    if missing:
        raise ConfigError(
            f"model.lora.modules_to_save={saved}: {', '.join(missing)} not a module of "
            f"{type(model).__name__}"
        )
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    config = LoraConfig(
        r=lcfg.r,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=targets,
        target_parameters=expert_targets(model) if lcfg.experts else None,
        bias="none",
        modules_to_save=saved or None,
        ensure_weight_tying=tied and bool(saved),
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT asks the model about gradient checkpointing through a name Transformers deprecated
        warnings.filterwarnings(
            "ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*"
        )
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def expert_targets(model: nn.Module) -> List[str]:
    """``model.lora.experts=true``: the routed experts' 3-D weights of a Mixture-of-Experts model as
    PEFT's ``target_parameters`` (a rank-r adapter per expert; their path in a decoder layer), or
    exit 2 for a model without them."""
    paths = set()
    for layer in decoder_layers(model):
        for name, mod in layer.named_modules():
            w = getattr(mod, "gate_up_proj", None)
            if isinstance(w, nn.Parameter) and w.dim() == 3 and hasattr(mod, "down_proj"):
                paths.add(name)
    if not paths:
        raise ConfigError(
            f"model.lora.experts=true: {type(model).__name__} has no Mixture-of-Experts layers of "
            f"a family this project knows (Qwen3-MoE, Mixtral, Qwen2-MoE)"
        )
    return [f"{p}.{w}" for p in sorted(paths) for w in ("gate_up_proj", "down_proj")]


def adapters_disabled(module: nn.Module):
    """Context: ``module`` (a PEFT model, possibly wrapped by FSDP2 in place or by DDP) runs as its
    base model — adapters off, a modules_to_save head back to its original weights."""
    inner = getattr(module, "module", module)  # DDP
    return inner.disable_adapter() if is_peft(inner) else contextlib.nullcontext()


def scaling(module: nn.Module) -> float:
    """α/r (or α/√r with rsLoRA) of the adapter."""
    for mod in module.modules():
        if is_lora_layer(mod) and ADAPTER in mod.scaling:
            return float(mod.scaling[ADAPTER])
    raise ValueError("no LoRA layer")


def weight(module: nn.Module, what: str = "weight") -> torch.Tensor:
    """A linear layer's ``weight`` with its adapter merged in (W + B·A·α/r, out of place) when it is
    a LoRA layer with active adapters; its ``bias`` (or a plain layer's weight) as it is."""
    if is_saved_module(module):
        # a module trained fully: its trained copy unless the adapters are off
        if module.disable_adapters:
            return getattr(module.original_module, what)
        return getattr(module.modules_to_save[ADAPTER], what)
    if not is_lora_layer(module):
        return getattr(module, what)
    base = getattr(module.get_base_layer(), what)
    if what != "weight" or module.disable_adapters or module.merged or ADAPTER not in module.lora_A:
        return base
    return base + module.get_delta_weight(ADAPTER).to(base.dtype)


# a linear layer's ``<mod>.lora_A.default.weight``, an embedding's
# ``<mod>.lora_embedding_A.default``
_LORA_KEY = re.compile(
    r"^(?P<mod>.*)\.lora_(?P<emb>embedding_)?(?P<ab>[AB])\.(?P<name>[^.]+)(?(emb)|\.weight)$"
)


def merged_state_dict(
    sd: Dict[str, torch.Tensor], scale: float, fan_in_fan_out: bool = False
) -> Dict[str, torch.Tensor]:
    """A PEFT model's full state dict (``base_model.model.`` names) as the plain HF model's: each
    LoRA layer's base weight + B·A·``scale`` (computed in fp32; an embedding's (B·A)ᵀ, as PEFT
    stores it), adapters dropped, a modules_to_save head taken from its trained copy."""
    out: Dict[str, torch.Tensor] = {}
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        key = key.removeprefix("base_model.model.")
        m = _LORA_KEY.match(key)
        if m:
            if m.group("name") == ADAPTER:
                pairs.setdefault(m.group("mod"), {"embedding": bool(m.group("emb"))})[
                    m.group("ab")
                ] = value
            continue
        if ".original_module." in key:
            continue
        key = key.replace(f".modules_to_save.{ADAPTER}.", ".")
        while ".base_layer." in key:  # (nested: one per adapted parameter of a module)
            key = key.replace(".base_layer.", ".")
        out[key] = value
    for mod, ab in pairs.items():
        A, B = ab["A"].float(), ab["B"].float()
        if f"{mod}.weight" not in out:
            # a parameter wrapper (a MoE layer's experts [E, out, in]): per expert e the rank-r
            # factors A[e·r:(e+1)·r] and B's columns r_i·E + e, PEFT's layout
            name = _wrapped_param(out, mod, B.shape[0], A.shape[1])
            w = out[name]
            E = w.shape[0]
            delta = torch.einsum(
                "ore,eri->eoi", B.reshape(B.shape[0], -1, E), A.reshape(E, -1, A.shape[1])
            )
            out[name] = (w.float() + delta * scale).to(w.dtype)
            continue
        w = out[f"{mod}.weight"]
        delta = (B @ A) * scale
        if fan_in_fan_out or ab["embedding"]:
            # the weight is [in, out] (GPT-2's Conv1D, an embedding)
            delta = delta.T
        out[f"{mod}.weight"] = (w.float() + delta).to(w.dtype)
    return out


def _wrapped_param(out: Dict[str, torch.Tensor], mod: str, rows: int, cols: int) -> str:
    """The name of the 3-D parameter [E, ``rows``, ``cols``] of the module at ``mod`` (its
    ``.base_layer`` parts dropped) that an adapter of those shapes wraps."""
    while mod.endswith(".base_layer"):
        mod = mod[: -len(".base_layer")]
    names = [
        k
        for k, v in out.items()
        if k.rpartition(".")[0] == mod and v.dim() == 3 and tuple(v.shape[1:]) == (rows, cols)
    ]
    if len(names) != 1:
        raise ValueError(f"LoRA merge: no single [E, {rows}, {cols}] parameter of {mod}: {names}")
    return names[0]


def save_adapter(peft_model: nn.Module, sd: Dict[str, torch.Tensor], out_dir) -> None:
    """The adapter alone in PEFT's format (adapter_config.json + adapter_model.safetensors), from
    the full state dict ``sd`` (PEFT names, as ``peft_model.state_dict()`` has them): loadable with
    ``PeftModel.from_pretrained(base, out_dir)`` onto the base checkpoint as the user has it. When
    the tokenizer's added pad grew the embeddings (``loading.resize_for_tokenizer``), the adapter is
    written for the checkpoint's vocabulary: the pad row left out of what it carries of the
    embeddings and LM head, and PEFT's copy of the resized base embeddings not saved (the base's
    rows are unchanged), so it loads onto the original base and gives the merged export's logits on
    text without the pad."""
    rows = getattr(unwrap(peft_model), BASE_VOCAB_ROWS, None)
    extra = {}
    if rows is not None:
        sd = base_vocabulary(peft_model, sd, rows)
        extra["save_embedding_layers"] = False
    peft_model.save_pretrained(str(out_dir), state_dict=sd, safe_serialization=True, **extra)


def base_vocabulary(
    peft_model: nn.Module, sd: Dict[str, torch.Tensor], rows: int
) -> Dict[str, torch.Tensor]:
    """``sd`` with the tensors of the input embeddings and LM head (their adapters, trained copies)
    cut back to the first ``rows`` tokens along every dimension of the grown vocabulary's size."""
    base = unwrap(peft_model)
    grown = base.config.get_text_config().vocab_size
    layers = [
        m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None
    ]
    prefixes = tuple(
        f"{name}." for name, m in peft_model.named_modules() if any(m is layer for layer in layers)
    )
    out = dict(sd)
    for key, t in sd.items():
        if key.startswith(prefixes):
            for dim, size in enumerate(t.shape):
                if size == grown:
                    t = t.narrow(dim, 0, rows)
            out[key] = t.contiguous()
    return out


def fan_in_fan_out(module: nn.Module) -> bool:
    """Whether the adapted layers store weights transposed (GPT-2's Conv1D)."""
    return any(getattr(m, "fan_in_fan_out", False) for m in module.modules() if is_lora_layer(m))


def trainable_share(module: nn.Module) -> str:
    n_train = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in module.parameters())
    return f"{n_train:,} of {n_all:,} parameters trainable ({100 * n_train / max(n_all, 1):.2f}%)"


def plain_model(module: nn.Module) -> nn.Module:
    """An empty (meta-device) model of the base architecture without adapters: what writes a merged
    state dict as a plain Hugging Face checkpoint (same class, same config)."""
    base = unwrap(module)
    with torch.device("meta"):
        return type(base)(base.config)
