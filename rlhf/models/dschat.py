"""DeepSpeed-Chat reward models as input: its step-2 output converted to the sequence classifier
rlhf reads.

What DeepSpeed-Chat writes (``dschat/utils/utils.py``: ``save_hf_format``, or
``save_zero_three_model`` under ZeRO-3): ``pytorch_model.bin``, the state dict of its
``RewardModel`` (``dschat/utils/model/reward_model.py``) — ``rwtransformer.*``, the base transformer
without LM head (``AutoModel``: ``OPTModel``, ``LlamaModel``, ...), and ``v_head.weight``, a
``Linear(d, 1, bias=False)`` (d = ``word_embed_proj_dim`` for OPT, else the hidden size), LoRA keys
dropped; ``config.json``, the base model's config as ``create_hf_model`` left it (``end_token_id`` =
the tokenizer's EOS, ``pad_token_id`` = the model's EOS, the vocabulary grown to a multiple of 8);
the tokenizer's vocabulary files.

How DeepSpeed-Chat reads a score: the head on every position, and a row's end score at the token
before its first ``PAD_ID`` after the prompt (``forward_value(..., prompt_length)``, which step 3
rewards with; step 2's ``forward`` skips ``num_padding_at_beginning`` pads first: OPT's BOS is its
EOS), the last position when there is none. ``PAD_ID`` is its tokenizer's pad
(``dschat/utils/utils.py`` ``get_tokenizer``): for a model named ``llama`` the tokenizer's own pad,
or a ``[PAD]`` appended to it; for every other family the EOS. So the score is the value at the last
token before the trailing pads — and for every family but Llama, before the trailing EOS.

The conversion writes ``<Family>ForSequenceClassification`` (``num_labels=1``): the base weights
under the family's base-model attribute (``model.*`` for OPT and Llama, ``transformer.*`` for GPT-2,
...), ``score.weight`` = ``v_head.weight``, ``pad_token_id`` = ``PAD_ID``. Transformers' pooling
(the last token that is not the pad) then reads the score where DeepSpeed-Chat reads it on batches
padded with that pad, and rlhf's scorer reads it there whatever the padding
(``rlhf.models.value.end_pad``: a model whose pad is its EOS is scored before its trailing EOS).
docs/ppo.md has the measured equivalence.

Nothing here runs on import (the heavy imports are inside the functions): ``python -m rlhf.migrate
reward-model SRC DST`` calls ``convert_dschat_reward_model``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from rlhf.errors import ConfigError
from rlhf.outputs.fileio import atomic_write_json, replace_dir, temp_dir_for

log = logging.getLogger("rlhf")

# DeepSpeed-Chat's RewardModel attributes
BASE, HEAD = "rwtransformer.", "v_head.weight"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# a sharded save's key → file
INDEXES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
# beside a converted model: where it came from (the source's files, for reuse); its presence also
# marks a directory a later conversion may replace
CONVERTED_FILE = "rlhf_converted.json"
# bumped when the conversion's output changes: older conversions are redone
CONVERTER = 1
# the tokenizer files copied as DeepSpeed-Chat saved them (save_vocabulary: vocab.json + merges.txt,
# tokenizer.model, ...; a full save_pretrained too)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
)


def _weight_files(path: Path) -> List[Path]:
    """The files holding the weights: a sharded save's shards (its index), else the one weights
    file."""
    for index in INDEXES:
        if (path / index).is_file():
            try:
                names = json.loads((path / index).read_text(encoding="utf-8"))[
                    "weight_map"
                ].values()
            except (ValueError, KeyError, TypeError, AttributeError):
                return []
            return [path / n for n in sorted(set(names))]
    return [path / w for w in WEIGHTS if (path / w).is_file()][:1]


def _shapes(files: List[Path]) -> Dict[str, Tuple[int, ...]]:
    """Every tensor's name and shape, reading no tensor data (safetensors' header; a torch save
    mapped)."""
    import torch

    out: Dict[str, Tuple[int, ...]] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as sf:
                out.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
        else:
            out.update({k: tuple(v.shape) for k, v in _torch_load(f, torch).items()})
    return out


def _torch_load(f: Path, torch, whole: bool = True) -> dict:
    """A torch save's state dict, mapped (its tensors read when used); ``whole``: a save in the
    legacy (non-zip) format, which cannot be mapped, read whole (else that error)."""
    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        if not whole:
            raise
        sd = torch.load(str(f), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ConfigError(f"{f}: not a state dict ({type(sd).__name__})")
    return sd


def _tensors(files: List[Path]) -> dict:
    import torch

    out = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            out.update(_torch_load(f, torch))
    return out


def is_dschat_reward_model(path) -> bool:
    """Whether ``path`` is a DeepSpeed-Chat reward model (or critic): a directory whose weights
    (pytorch_model.bin or model.safetensors, sharded or not) hold ``v_head.weight`` and
    ``rwtransformer.*``. Reads the keys only."""
    import torch

    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        return False
    keys: list = []
    try:
        index = next((p / i for i in INDEXES if (p / i).is_file()), None)
        files = _weight_files(p)
        if index is not None:
            # a sharded save: its index names every key
            keys = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        elif files and files[0].suffix == ".safetensors":
            keys = list(_shapes(files))
        elif files:
            keys = list(_torch_load(files[0], torch, whole=False))
    except Exception:
        # unreadable, or a legacy save not read whole here: not recognised (loading says why)
        return False
    return HEAD in keys and any(k.startswith(BASE) for k in keys)


@dataclass
class Plan:
    """What a conversion writes: the classifier's class and config, and the key map."""

    cls: type
    config: object  # the classifier's transformers config
    # the family's base-model attribute: rwtransformer.X -> <prefix>.X
    prefix: str
    # the classifier's score weight (score.weight): v_head.weight
    head: str
    # source keys with no place in the classifier (stale buffers), left out
    dropped: List[str]
    # how pad_token_id was found, for the record
    pad_rule: str


def plan(src, what: Optional[str] = None) -> Plan:
    """Checks that ``src`` converts (a known family with a sequence classifier, every weight of it
    there with its shape, nothing else but buffers) and says how, reading no tensor data. Exit 2
    with one line naming ``what`` (default: the directory) and the problem."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    src = Path(os.path.expanduser(str(src)))
    what = what or str(src)

    def fail(why: str) -> ConfigError:
        return ConfigError(f"{what}: a DeepSpeed-Chat reward model that cannot be converted: {why}")

    files = _weight_files(src)
    shapes = _shapes(files) if files else {}
    if HEAD not in shapes or not any(k.startswith(BASE) for k in shapes):
        raise fail(
            f"no {HEAD} and {BASE}* weights in "
            f"{', '.join(f.name for f in files) or 'the directory'}"
        )
    if not (src / "config.json").is_file():
        raise fail("no config.json (save_hf_format writes the base model's)")
    try:
        spec = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise fail(f"config.json is not JSON ({e})") from None
    family = spec.get("model_type") if isinstance(spec, dict) else None
    if family not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise fail(
            f"model_type={family!r} in config.json has no sequence-classification model in "
            "Transformers "
            f"(known: llama, opt, gpt2, qwen2, mistral, ...)"
        )
    try:
        # a family Transformers has
        config = AutoConfig.from_pretrained(str(src), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise fail(f"config.json does not load ({' '.join(str(e).split())})") from None
    config.num_labels = 1
    config.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[family]]
    config.pad_token_id, pad_rule = _dschat_pad(src, spec, config)
    pad = config.pad_token_id
    if pad is not None and pad >= config.vocab_size:
        # (not an embedding row: nn.Embedding refuses it)
        config.pad_token_id = None
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    config.pad_token_id = pad
    prefix = type(model).base_model_prefix
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    head = [k for k in want if not k.startswith(prefix + ".")]
    if len(head) != 1 or want[head[0]][0] != 1:
        raise fail(
            f"{type(model).__name__} has no one-row score head beside {prefix}.* "
            f"({', '.join(head)})"
        )
    got = {prefix + "." + k[len(BASE) :]: s for k, s in shapes.items() if k.startswith(BASE)}
    got[head[0]] = shapes[HEAD]
    others = [k for k in shapes if k != HEAD and not k.startswith(BASE)]
    if others:
        raise fail(f"keys outside {BASE}* and {HEAD}: {', '.join(sorted(others)[:3])}")
    # (stale persistent buffers of older saves)
    buffers = {name for name, _ in model.named_buffers()}
    dropped = sorted(k for k in got if k not in want and k in buffers)
    unknown = sorted(k for k in got if k not in want and k not in buffers)
    missing = sorted(k for k in want if k not in got)
    if unknown or missing:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} weights of {type(model).__name__} missing "
                f"({', '.join(missing[:3])})"
            )
        if unknown:
            parts.append(f"{len(unknown)} not in it ({', '.join(unknown[:3])})")
        raise fail("; ".join(parts) + f": not a {family} model as config.json describes it")
    for k, s in want.items():
        if got[k] != s:
            src_key = HEAD if k == head[0] else BASE + k[len(prefix) + 1 :]
            raise fail(f"{src_key} has shape {list(got[k])}, the {family} config wants {list(s)}")
    return Plan(
        type(model),
        config,
        prefix,
        head[0],
        [BASE + k[len(prefix) + 1 :] for k in dropped],
        pad_rule,
    )


def _dschat_pad(src: Path, spec: dict, config) -> Tuple[Optional[int], str]:
    """DeepSpeed-Chat's PAD_ID (``dschat/utils/utils.py`` get_tokenizer, by the model's name): for a
    ``llama`` name the tokenizer's pad, else a ``[PAD]`` it appended (its id: the tokenizer's
    length); for every other family the EOS (``end_token_id``, the tokenizer's EOS create_hf_model
    recorded)."""
    name = str(spec.get("_name_or_path") or spec.get("model_type") or "")
    if "llama" not in name and spec.get("model_type") != "llama":
        eos = spec.get("end_token_id", getattr(config, "eos_token_id", None))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos, "the EOS (DeepSpeed-Chat pads every family but Llama with it)"
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        return None, "unknown (a Llama model saved without its tokenizer)"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{src}: the tokenizer does not load ({' '.join(str(e).split())})"
        ) from None
    if tok.pad_token is not None:
        return tok.pad_token_id, "the tokenizer's pad"
    return len(tok), "the [PAD] DeepSpeed-Chat appends to a Llama tokenizer without one"


def _fingerprint(src: Path) -> dict:
    """The source's files (name, size, modification time): a conversion is reused while they
    stand."""
    files = {}
    for f in sorted(src.iterdir()):
        if f.is_file():
            st = f.stat()
            files[f.name] = [st.st_size, st.st_mtime_ns]
    return {"converter": CONVERTER, "source": str(src.resolve()), "files": files}


def convert_dschat_reward_model(src, dst) -> Path:
    """Writes DeepSpeed-Chat reward model ``src`` to ``dst`` as a sequence classifier
    (model.safetensors, config.json, the tokenizer files as they are, rlhf_converted.json) and
    returns ``dst``. ``dst`` must not exist, be empty, or hold an earlier conversion (replaced
    whole). Exit 2 (a ConfigError) when ``src`` does not convert, before anything is written."""
    src = Path(os.path.expanduser(str(src)))
    dst = Path(os.path.expanduser(str(dst)))
    return _convert(src, dst, plan(src))


def _convert(src: Path, dst: Path, p: Plan) -> Path:
    from safetensors.torch import save_file

    if dst.exists() and (
        not dst.is_dir() or (any(dst.iterdir()) and not (dst / CONVERTED_FILE).is_file())
    ):
        raise ConfigError(
            f"{dst}: exists and is not a converted model (pick a new or empty directory)"
        )
    state = _tensors(_weight_files(src))
    out = {}
    for k, v in state.items():
        if k == HEAD:
            out[p.head] = v
        elif k.startswith(BASE) and k not in p.dropped:
            out[p.prefix + "." + k[len(BASE) :]] = v
    tmp = temp_dir_for(dst)
    try:
        save_file(_unshared(out), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        p.config.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        record = {
            "from": "DeepSpeed-Chat reward model (rwtransformer.* + v_head.weight)",
            "architecture": p.cls.__name__,
            "pad_token_id": p.config.pad_token_id,
            "pad_token_id_is": p.pad_rule,
            "dropped": p.dropped,
            **_fingerprint(src),
        }
        atomic_write_json(tmp / CONVERTED_FILE, record)
        dst.parent.mkdir(parents=True, exist_ok=True)
        replace_dir(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _unshared(sd: dict) -> dict:
    """safetensors refuses tensors that share memory: each one after the first is copied."""
    seen, out = set(), {}
    for k, v in sd.items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else None
        v = v.contiguous()
        if ptr is not None and ptr in seen:
            v = v.clone()
        seen.add(ptr)
        out[k] = v
    return out


def converted_dir(src: Path, run_dir) -> Path:
    """Where a run keeps its conversion of ``src``:
    ``<run.dir>/converted/reward_model_<name>-<hash>`` (the hash of the source's absolute path: two
    sources of one name stay apart)."""
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]
    return Path(run_dir) / "converted" / f"reward_model_{src.name or 'root'}-{digest}"


def reward_model_input(path: str, key: str, run_dir, mesh) -> str:
    """``path`` as a stage reads a reward model (``key`` named it): a DeepSpeed-Chat reward model is
    converted once, by rank 0, into ``converted_dir`` and that directory is returned (a conversion
    of the same files is reused), said in one log line; any other path comes back as it is. Every
    rank checks that it converts first (exit 2 before anything is written). ``mesh``: ``is_main``
    and ``barrier()``."""
    src = Path(os.path.expanduser(str(path)))
    if not is_dschat_reward_model(src):
        return path
    p = plan(src, f"{key}={path}")
    dst = converted_dir(src, run_dir)
    reuse = _reusable(dst, src)
    if mesh.is_main and not reuse:
        _convert(src, dst, p)
    mesh.barrier()
    how = "reusing its conversion" if reuse else "converted"
    log.info(
        "%s=%s: a DeepSpeed-Chat reward model (%s, v_head as the score, pad %s: %s): %s in %s",
        key,
        path,
        p.config.model_type,
        p.config.pad_token_id,
        p.pad_rule,
        how,
        dst,
    )
    return str(dst)


def _reusable(dst: Path, src: Path) -> bool:
    try:
        record = json.loads((dst / CONVERTED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    now = _fingerprint(src)
    return all(record.get(k) == v for k, v in now.items()) and (dst / "model.safetensors").is_file()
