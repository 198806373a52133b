"""Building and loading models: the embedded tiny Llama, or a Hugging Face directory / hub id.

Every rank but rank 0 builds the architecture on the meta device. Rank 0 builds the model: from a
seeded random init, or from a checkpoint. In a job of several processes a safetensors checkpoint's
bulk (decoder blocks, embeddings) is left unloaded there too, and each rank reads only the rows it
holds when the engine wraps the model (rlhf/models/streaming.py, ``rlhf.engine.train``); everything
else rank 0 holds reaches the other ranks by broadcast then. One process loads the checkpoint whole.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MixtralConfig,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from rlhf import hub
from rlhf.config import ModelConfig
from rlhf.errors import ConfigError
from rlhf.models import dropout, streaming


def embedded_config(m: ModelConfig, tokenizer):
    """The embedded model's config: a tiny Llama, or with ``model.num_experts`` > 0 the same shape
    with Mixtral's Mixture-of-Experts blocks."""
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
    )
    if m.num_experts:
        moe = dict(num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token)
        return MixtralConfig(**fields, **moe)
    return LlamaConfig(**fields)


def check_model_path(path: str, key: str = "model.path") -> None:
    """A local directory must hold a Hugging Face model. A path that does not exist is a hub id only
    where it reads as one (``name`` or ``org/name``) and nothing local says it is a path (``runs/x``
    with a ``runs/`` directory here is a missing run, not a hub id); with HF_HUB_OFFLINE=1 that hub
    id must be in the local cache. ``key``: the setting that named it (model.path,
    ppo.reward_model_path, ...)."""
    p = Path(os.path.expanduser(path))
    if p.exists():
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"{key}={path}: directory has no config.json (not a Hugging Face model)"
            )
        check_model_family(p / "config.json", path)
        return
    if not _hub_id(path):
        raise ConfigError(f"{key}={path}: no such directory")
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(path, "config.json"), str
    ):
        raise ConfigError(
            f"{key}={path}: no such directory, and no hub model {path} in the local cache "
            f"({hub.offline_why()})"
        )


def check_scalar_model(path: str, key: str, hint: str = "") -> None:
    """Exit 2 unless ``path`` holds a saved reward model or critic: a local directory whose
    config.json names a sequence classifier (what ``stage=reward`` and PPO's critic export; k
    labels: an ensemble's k members, ``reward.ensemble``). ``key``: the setting that named it;
    ``hint``: what to pass instead, for the message."""
    p = Path(os.path.expanduser(path))
    if not p.is_dir():
        raise ConfigError(f"{key}={path}: no such directory{hint}")
    check_model_path(path, key)
    try:
        spec = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{key}={path}: config.json is not JSON ({e})") from None
    archs = spec.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        from rlhf.models.dschat import is_dschat_reward_model

        if is_dschat_reward_model(p):
            # (the stages convert one themselves: rlhf/models/dschat.py)
            hint = (
                f" (DeepSpeed-Chat's: python -m rlhf.migrate reward-model {path} DST converts "
                f"it){hint}"
            )
        raise ConfigError(
            f"{key}={path}: not a reward model ({', '.join(archs) or 'no architecture'}, not a "
            f"sequence classifier){hint}"
        )


def check_same_tokenizer(
    path: str, key: str, tokenizer, other: str, trust_remote_code: bool = False
) -> None:
    """Exit 2 when the model at ``path`` (``key``) has a tokenizer of its own that is not
    ``tokenizer`` (the one of ``other``): it would score token ids it does not know. A directory
    without tokenizer files is taken to share it."""
    p = Path(os.path.expanduser(path))
    if not any(
        (p / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return
    own = load_tokenizer(path, trust_remote_code)
    if own.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{key}={path}: its tokenizer ({len(own)} tokens) is not the one of {other} "
            f"({len(tokenizer)} tokens): it would read the policy's token ids as other tokens; "
            f"train it from the same base model"
        )


def _hub_id(path: str) -> bool:
    """``path`` (which does not exist) may be a hub id: ``name`` or ``org/name``, no ``~``, and no
    ``org`` that is a local directory."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) or path.startswith("."):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return "/" not in path or not Path(path.split("/")[0]).is_dir()


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _load_error(path: str, what: str, e: Exception) -> ConfigError:
    """The error of loading ``what`` from ``path`` in one line (a missing path: as a hub id)."""
    if Path(os.path.expanduser(path)).exists():
        return ConfigError(f"model.path={path}: cannot load {what}: {_one_line(e)}")
    if hub.offline():
        return ConfigError(
            f"model.path={path}: no such directory, and no copy of hub model {path} in the "
            "local cache to load "
            f"{what} from ({hub.offline_why()})"
        )
    return ConfigError(
        f"model.path={path}: no such directory, and no hub model {path} to load {what} "
        f"from: {_one_line(e)}"
    )


def check_model_family(config_file: Path, path: str) -> None:
    """config.json must parse, and name a model family Transformers knows (or bring its own code
    through ``auto_map``, which loads only with model.trust_remote_code=true)."""
    try:
        spec = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"model.path={path}: {config_file.name} is not valid JSON ({e})"
        ) from None
    if not isinstance(spec, dict):
        raise ConfigError(f"model.path={path}: {config_file.name} does not hold a JSON object")
    family = spec.get("model_type")
    if family is not None and family not in CONFIG_MAPPING and "auto_map" not in spec:
        raise ConfigError(
            f"model.path={path}: unknown model family model_type={family!r} in "
            f"{config_file.name} (not an architecture of this Transformers version)"
        )


def load_model_config(path: str, trust_remote_code: bool):
    """The Hugging Face model config (AutoConfig) at ``path`` (the run's own config is composed by
    ``rlhf.compose.compose_config``)."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(path, "a model config", e) from None


# what AutoTokenizer reads: one of these in a model directory (else it fails with a cut-off message)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    local = Path(os.path.expanduser(path))
    if (
        local.is_dir()
        and not any((local / f).is_file() for f in TOKENIZER_FILES)
        and not any(local.glob("*.tiktoken"))
    ):
        raise ConfigError(
            f"model.path={path}: no tokenizer files ({' / '.join(TOKENIZER_FILES[:4])} / "
            f"...) in {path}"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(path, "a tokenizer", e) from None
    # pad must differ from EOS, so that EOS is learnt and never masked, and so that HF's
    # sequence-classification pooling (the last token that is not pad) lands on the EOS we score
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:
        tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def build_model(
    model_cls,
    *,
    config=None,
    path: Optional[str] = None,
    on_meta: bool = False,
    seed: int = 0,
    trust_remote_code: bool = False,
    tokenizer=None,
    disable_dropout: Optional[bool] = None,
    role: str = "model",
    **kwargs,
) -> torch.nn.Module:
    """``model_cls`` (an HF Auto class or model class) from ``path`` or from ``config`` (seeded
    init).

    ``on_meta``: build the architecture only (weights arrive when the engine wraps it). In a job of
    several processes a model from ``path`` may come with its bulk unloaded
    (rlhf/models/streaming.py): the engine's wrapping loads it; a model used without it needs
    ``streaming.materialise``. ``tokenizer``: grow the embeddings to its length where it has more
    tokens than the model (the pad ``load_tokenizer`` adds), on every rank — a meta model too, so
    that FSDP wraps the same shapes and config as rank 0 and the broadcast fills them.
    ``disable_dropout`` (model.disable_dropout, RL and DPO): true sets every dropout probability to
    0, false keeps it (both logged, naming the model's ``role``); None leaves the model as it is."""
    model = _build_resized(
        model_cls, config, path, on_meta, seed, trust_remote_code, tokenizer, **kwargs
    )
    if disable_dropout is not None:
        dropout.disable_dropout(model, role, disable_dropout)
    return model


def _build_resized(model_cls, config, path, on_meta, seed, trust_remote_code, tokenizer, **kwargs):
    """The model, grown to ``tokenizer``'s length when one is given (see ``build_model``)."""
    if tokenizer is None:
        return _build(model_cls, config, path, on_meta, seed, trust_remote_code, **kwargs)
    if config is None:
        config = load_model_config(path, trust_remote_code)
    text = config.get_text_config()
    pad = text.pad_token_id
    if pad is not None and pad >= text.vocab_size:
        # not a row until the resize (nn.Embedding's padding_idx)
        text.pad_token_id = None
    try:
        model = _build(model_cls, config, path, on_meta, seed, trust_remote_code, **kwargs)
    finally:
        text.pad_token_id = pad
    resize_for_tokenizer(model, tokenizer)
    model.config.get_text_config().pad_token_id = pad
    return model


def _build(model_cls, config, path, on_meta, seed, trust_remote_code, **kwargs) -> torch.nn.Module:
    if on_meta:
        cfg = config if config is not None else load_model_config(path, trust_remote_code)
        with torch.device("meta"):
            if hasattr(model_cls, "from_config"):
                # fp32 as rank 0 loads it (not the config's bf16)
                return model_cls.from_config(
                    cfg, trust_remote_code=trust_remote_code, dtype=torch.float32, **kwargs
                )
            return model_cls(cfg)
    if path is not None:
        if config is not None:
            kwargs["config"] = config

        def load():
            return model_cls.from_pretrained(
                path, trust_remote_code=trust_remote_code, dtype=torch.float32, **kwargs
            )

        if streaming.wanted():
            # several processes: the bulk is read where it is sharded, at wrapping
            return streaming.load_deferred(load, f"model {path}")
        return load()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls.from_config(config, trust_remote_code=trust_remote_code, **kwargs)


# the attribute that records, on a model ``resize_for_tokenizer`` grew, how many embedding rows its
# checkpoint had: a LoRA adapter is exported for that vocabulary (``lora.save_adapter``)
BASE_VOCAB_ROWS = "rlhf_base_vocab_rows"


def resize_for_tokenizer(model, tokenizer) -> None:
    """Embedding rows (and an untied LM head) grown to ``len(tokenizer)`` where the model has fewer;
    the config's vocab_size follows, and the rows it had are kept as ``model.rlhf_base_vocab_rows``.
    A meta model gets the shapes only (its weights arrive when wrapped). Unloaded embeddings (a
    streamed load) are read for the resize, whose mean-resizing reads every row, and left unloaded
    again with their new rows kept: the same new rows as a model loaded whole."""
    rows = model.get_input_embeddings().weight
    if rows.shape[0] < len(tokenizer):
        setattr(model, BASE_VOCAB_ROWS, getattr(model, BASE_VOCAB_ROWS, rows.shape[0]))
        with streaming.loaded_for_resize(model):
            model.resize_token_embeddings(len(tokenizer), mean_resizing=not rows.is_meta)


def causal_lm(
    src: str,
    mesh,
    tokenizer,
    trust_remote_code: bool = False,
    disable_dropout: Optional[bool] = None,
    role: str = "model",
) -> torch.nn.Module:
    """The causal LM at ``src`` (rank 0 builds it; the other ranks build it on meta; several ranks
    read their shares of a safetensors checkpoint when the engine wraps it, see the module's
    docstring), grown to the tokenizer's length; its dropout as ``build_model`` says."""
    model_cfg = load_model_config(src, trust_remote_code)
    return build_model(
        AutoModelForCausalLM,
        config=model_cfg,
        path=src,
        on_meta=not mesh.is_main,
        trust_remote_code=trust_remote_code,
        tokenizer=tokenizer,
        disable_dropout=disable_dropout,
        role=role,
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF model (``model.layers`` in Llama/Qwen2/Mistral, ``h`` in
    GPT-2)."""
    for name, mod in model.named_modules():
        if (
            isinstance(mod, nn.ModuleList)
            and name.split(".")[-1] in ("layers", "h", "blocks")
            and len(mod)
        ):
            return mod
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
