"""Typed configuration of every group, registered in Hydra's ConfigStore.

This file is the one home of every default (a data format's own, its default lengths, are in its row
of the format table, rlhf/data/formats.py, which this file reads). The YAML files under ``conf/``
only override them (``conf/stage/<stage>.yaml`` holds what differs per stage, e.g. the learning
rate). Validation runs in ``__post_init__`` when ``OmegaConf.to_object`` builds these dataclasses,
i.e. before any work starts; a bad value raises ``ConfigError`` (exit code 2) naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, List, Optional, Tuple

from rlhf.algorithms.ensemble import COMBINE
from rlhf.algorithms.estimators import ESTIMATORS, KL_ESTIMATORS, LOSS_AGG
from rlhf.data.contrast import KINDS as CONTRAST_KINDS
from rlhf.data.formats import FORMATS
from rlhf.data.pipeline import parse_split
from rlhf.data.synthetic import REJECTED_KINDS
from rlhf.errors import ConfigError, one_of


@dataclass(frozen=True)
class Stage:
    """One stage: ``stages/<name>.py``, run as ``python -m rlhf stage=<name>``, writing
    ``<run.dir>/<name>/``. STAGE_TABLE is the one list of stages: config validation, compose
    (recipes, earlier stages' configs), the usage text, summary.json, report.png and
    scripts/run_all.sh all read it."""

    name: str
    # scripts/run_all.sh runs it when given no stages= (the pipeline, in the table's order)
    pipeline: bool
    # the metrics summary.json keeps for it (their last logged values; every stage also keeps its
    # largest mem/peak_gb)
    summary_keys: tuple = ()
    # what it trains, for the usage text
    what: str = ""


STAGE_TABLE = (
    Stage(
        "sft",
        pipeline=True,
        summary_keys=("eval/loss", "gold/score", "gold/score_greedy"),
        what="supervised fine-tuning of the policy",
    ),
    Stage(
        "reward",
        pipeline=True,
        summary_keys=("eval/accuracy",),
        what="a reward model (or an ensemble) on preference pairs",
    ),
    Stage(
        "ppo",
        pipeline=True,
        summary_keys=("gold/score", "gold/score_greedy", "kl/mean", "reward/mean"),
        what="RL: PPO, GRPO, RLOO, REINFORCE++ or distillation (algorithm.estimator)",
    ),
    Stage(
        "dpo",
        pipeline=False,
        summary_keys=(
            "gold/score",
            "gold/score_greedy",
            "eval/rewards/accuracy",
            "eval/rewards/margin",
        ),
        what="direct preference optimisation from the SFT policy",
    ),
)


def stage_names() -> tuple:
    """The stages' names, in STAGE_TABLE's order (read when called)."""
    return tuple(s.name for s in STAGE_TABLE)


def pipeline_stages() -> tuple:
    """The stages scripts/run_all.sh runs when given no stages=, in order."""
    return tuple(s.name for s in STAGE_TABLE if s.pipeline)


def stage_choices() -> str:
    """The stages for a message: 'sft, reward, ppo or dpo'."""
    return one_of(stage_names())


# data.split's shares (SPLIT_SHARES) and its parsing live with the pipeline (rlhf/data/pipeline.py);
# each data.format is one row of rlhf/data/formats.py (fields, default lengths, parser, gold scorer)


def _check(cond: bool, key: str, value, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is invalid: expected {expected}")


def _check_rules(obj, section: str, rules) -> None:
    """``rules``: (key, a test of its value, what it must be), each checked as ``_check`` does, in
    order."""
    for key, ok, expected in rules:
        value = getattr(obj, key)
        _check(ok(value), f"{section}.{key}", value, expected)


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _in(choices) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _or_null(ok) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


@dataclass
class RunConfig:
    dir: str = "runs/default"
    seed: int = 1234
    # true: a rerun continues from the stage's newest checkpoint (if its model, tokenizer, data and
    # lengths match; else exit 2); false: start over; a path: resume from that step_<N> checkpoint
    resume: Any = True
    # tokenized-data cache; default <run.dir>/cache
    cache_dir: Optional[str] = None

    def __post_init__(self):
        _check(bool(self.dir), "run.dir", self.dir, "a directory path")
        _check(
            isinstance(self.resume, bool) or (isinstance(self.resume, str) and bool(self.resume)),
            "run.resume",
            self.resume,
            "true, false or a checkpoint directory",
        )


@dataclass
class LoraConfig:
    """LoRA adapters through PEFT (rlhf/models/lora.py) for stage=sft, reward, dpo and PPO's actor;
    r=0 = off (full fine-tuning)."""

    r: int = 0
    alpha: float = 16.0  # the update is B·A·alpha/r
    # on the adapters' input in training mode (0 keeps PPO's recomputed log-probs exact)
    dropout: float = 0.0
    # module names (the last part, e.g. [q_proj, v_proj]); None = every linear layer of the decoder
    # blocks: the attention and MLP projections of the family
    target_modules: Optional[List[str]] = None
    # modules trained fully beside the adapters and saved with them (PEFT's modules_to_save), e.g.
    # [embed_tokens]; None = none, except for the embedded default (random init with a tokenizer of
    # its own: nothing pretrained to adapt), which trains its (tied) embeddings: [embed_tokens]
    modules_to_save: Optional[List[str]] = None
    # PPO: adapters on the critic too (else it trains fully)
    critic: bool = False
    # a Mixture-of-Experts model: adapters on its routed experts too (a rank-r pair per expert on
    # gate_up_proj and down_proj, PEFT's target_parameters); else the experts stay frozen
    experts: bool = False

    def __post_init__(self):
        _check(self.r >= 0, "model.lora.r", self.r, "a non-negative integer (0 = off)")
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "a positive number")
        _check(
            0.0 <= self.dropout < 1.0, "model.lora.dropout", self.dropout, "a probability below 1"
        )
        _check(
            self.target_modules is None
            or (
                len(self.target_modules) > 0
                and all(isinstance(t, str) and t for t in self.target_modules)
            ),
            "model.lora.target_modules",
            self.target_modules,
            "a non-empty list of module names, e.g. [q_proj,v_proj]",
        )
        _check(
            self.modules_to_save is None
            or all(isinstance(t, str) and t for t in self.modules_to_save),
            "model.lora.modules_to_save",
            self.modules_to_save,
            "a list of module names, e.g. [embed_tokens]",
        )


@dataclass
class ModelConfig:
    # HF id or directory; None = previous stage's output or embedded default
    path: Optional[str] = None
    trust_remote_code: bool = False
    # With no model.path: a tiny Llama built from this config, random init (the agentic recipe's
    # model; the embedded recipe's is 4 layers × 128, conf/recipe/embedded.yaml). 3 layers with a
    # narrow MLP rather than 2 with 512: the same cost per step on a CPU (docs/history.md).
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    # upper bound for the tokenizer trained on the task text
    vocab_size: int = 512
    # > 0: the embedded model is a Mixture-of-Experts one (Mixtral's blocks: this many experts of
    # model.intermediate_size each, every token routed to model.experts_per_token of them)
    num_experts: int = 0
    experts_per_token: int = 2
    # stage=ppo and dpo: every dropout probability of actor, reference, critic and reward model set
    # to 0 (config and modules; TRL's disable_dropout), else the training-mode forwards that PPO's
    # ratio and DPO's log-ratio compare each draw their own masks. SFT and reward keep the model's
    # dropout.
    disable_dropout: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
            "vocab_size",
        ):
            v = getattr(self, key)
            _check(v > 0, f"model.{key}", v, "a positive integer")
        _check(
            self.hidden_size % self.num_heads == 0,
            "model.num_heads",
            self.num_heads,
            f"a divisor of model.hidden_size={self.hidden_size}",
        )
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            self.num_kv_heads,
            f"a divisor of model.num_heads={self.num_heads}",
        )
        _check(self.num_experts >= 0, "model.num_experts", self.num_experts, "0 (dense) or more")
        _check(
            not self.num_experts or 1 <= self.experts_per_token <= self.num_experts,
            "model.experts_per_token",
            self.experts_per_token,
            f"1..model.num_experts={self.num_experts}",
        )


@dataclass
class SourceConfig:
    """One dataset of a blend."""

    path: Optional[str] = None
    format: str = "synthetic"
    weight: float = 1.0
    # the format's field names -> this dataset's, e.g. {prompt: instruction, response: output}
    # (typed Any: a typed dict would refuse new keys from the command line under Hydra's struct
    # mode)
    columns: Any = None
    # split of a DatasetDict folder or hub dataset; None = data.hf_split
    hf_split: Optional[str] = None
    # hub dataset config (subset); None = data.hf_config
    hf_config: Optional[str] = None

    def __post_init__(self):
        _check(self.format in FORMATS, "data.format", self.format, "one of " + ", ".join(FORMATS))
        _check(self.weight > 0, "data.sources[].weight", self.weight, "a positive number")
        _check(
            FORMATS[self.format].generated or bool(self.path),
            "data.path",
            self.path,
            f"a file, directory or hub id for data.format={self.format}",
        )
        key = "data.columns"
        if self.path:
            key = "data.sources[].columns"
        check_columns(self.columns, self.format, key)


def check_columns(columns, fmt: str, key: str) -> None:
    """data.columns maps the format's own field names (keys) to the dataset's (values)."""
    if columns is None:
        return
    if not isinstance(columns, dict):
        raise ConfigError(
            f"{key}={columns!r} is invalid: expected a mapping of the format's fields to the "
            f"dataset's columns, e.g. {key}={{prompt: instruction, response: output}}"
        )
    fields = FORMATS[fmt].fields
    for name, column in columns.items():
        if name not in fields:
            if fields:
                expected = "one of " + ", ".join(fields)
            else:
                expected = f"none: data.format={fmt} is generated"
            raise ConfigError(
                f"{key}.{name}={column!r} is invalid: '{name}' is not a field of "
                f"data.format={fmt} (keys of {key} are the format's fields: {expected})"
            )
        _check(isinstance(column, str) and bool(column), f"{key}.{name}", column, "a column name")


@dataclass
class SyntheticConfig:
    """The embedded default task: 'What is 03 + 45?' -> ' The answer is 48.' (gold = exact sum); the
    generated tool-use task (data.format=tool_arith: num_records and p_tool); arithmetic in words
    for pretrained chat models (data.format=arith: num_records, min_operand, max_operand,
    rejected_kinds)."""

    num_records: int = 20000
    max_operand: int = 49
    # data.format=arith: operands from min_operand to max_operand (the embedded tasks start at 0)
    min_operand: int = 0
    # share of SFT responses that are right; the rest are off by 1..3
    p_correct: float = 0.65
    # tool_arith: share of SFT records that call the calculator (the rest answer at once): the SFT
    # policy calls in about this share of its samples, leaving RL the rest
    # (conf/recipe_stage/agentic/sft.yaml)
    p_tool: float = 0.3
    # the generated records' seed; null = the run's (run.seed, per data source). Set, it fixes the
    # data while run.seed varies the rest (initialisation, order, dropout): e.g. separately trained
    # members of a reward-model ensemble on the same pairs (docs/ppo.md)
    seed: Optional[int] = None
    # the kinds of rejected answer in the preference pairs, an equal share each
    # (rlhf/data/synthetic.py): near (off by 1..3), digit (one digit wrong), length (one digit
    # doubled or dropped), far (off by 4..15). Fewer: a reward model blind to the rest (docs/ppo.md:
    # ensembles with different blind spots)
    rejected_kinds: List[str] = field(default_factory=lambda: list(REJECTED_KINDS))

    def __post_init__(self):
        kinds = list(self.rejected_kinds)
        _check(
            bool(kinds) and len(set(kinds)) == len(kinds) and set(kinds) <= set(REJECTED_KINDS),
            "data.synthetic.rejected_kinds",
            kinds,
            f"a non-empty list of distinct kinds among {', '.join(REJECTED_KINDS)}",
        )
        _check(
            self.num_records > 0,
            "data.synthetic.num_records",
            self.num_records,
            "a positive integer",
        )
        _check(
            0 < self.max_operand < 1000, "data.synthetic.max_operand", self.max_operand, "1..999"
        )
        _check(
            0 <= self.min_operand < self.max_operand,
            "data.synthetic.min_operand",
            self.min_operand,
            f"0..{self.max_operand - 1} (below data.synthetic.max_operand)",
        )
        _check(
            0.0 <= self.p_correct <= 1.0,
            "data.synthetic.p_correct",
            self.p_correct,
            "a probability",
        )
        _check(0.0 <= self.p_tool <= 1.0, "data.synthetic.p_tool", self.p_tool, "a probability")


@dataclass
class DataConfig:
    # a file, a directory of files, a datasets.save_to_disk folder, or a hub id
    path: Optional[str] = None
    format: str = "synthetic"
    # Blend several datasets: a list of {path, format, weight, columns, hf_split, hf_config}; empty
    # = the single (path, format, columns, hf_split, hf_config) of this group.
    sources: List[SourceConfig] = field(default_factory=list)
    # the format's field names -> the dataset's, e.g. {prompt: instruction, response: output}
    # (Alpaca)
    columns: Any = None
    # the split of a DatasetDict folder (save_to_disk) or of a hub dataset
    hf_split: str = "train"
    # a hub dataset's config (subset), e.g. main for openai/gsm8k
    hf_config: Optional[str] = None
    # auto: the tokenizer's chat template where it has one (messages data and the embedded task);
    # none: no template (messages then render as plain "\n\nHuman: ...\n\nAssistant: ..." text);
    # or the path of a Jinja file (it is also saved with the exported tokenizer)
    chat_template: str = "auto"
    # DeepSpeed-Chat's data_split, e.g. "2,4,4": disjoint seeded shares for sft/reward/ppo. None =
    # all.
    split: Optional[str] = None
    # held-out records (eval loss, gold prompts) from this file instead of carved out of data.path
    eval_path: Optional[str] = None
    eval_format: Optional[str] = None  # None = data.format
    eval_hf_split: Optional[str] = None  # None = data.hf_split
    # held-out records (synthetic: held-out operand pairs) for eval and gold score
    eval_size: int = 256
    # None = per format (rlhf/data/formats.py: the synthetic task 64/64, hh 384/192, gsm8k 128/192,
    # ...)
    max_prompt_len: Optional[int] = None
    max_response_len: Optional[int] = None
    # SFT loss only on response (assistant) tokens
    mask_prompt: bool = True
    on_bad_record: str = "error"  # or "skip" (count reported)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self):
        _check(self.format in FORMATS, "data.format", self.format, "one of " + ", ".join(FORMATS))
        _check(
            self.on_bad_record in ("error", "skip"),
            "data.on_bad_record",
            self.on_bad_record,
            "error or skip",
        )
        _check(self.eval_size > 0, "data.eval_size", self.eval_size, "a positive integer")
        if not FORMATS[self.format].generated and not self.path and not self.sources:
            raise ConfigError(f"data.path is required for data.format={self.format}")
        if self.path and self.sources:
            raise ConfigError(
                f"data.path={self.path} and data.sources are both set: use one of them"
            )
        if self.path and FORMATS[self.format].generated:
            # would silently train on the generated task
            raise ConfigError(
                f"data.path={self.path} is set but data.format={self.format} generates its data: "
                f"set data.format ({', '.join(n for n, f in FORMATS.items() if not f.generated)})"
            )
        if not self.sources:
            check_columns(self.columns, self.format, "data.columns")
        _check(bool(self.hf_split), "data.hf_split", self.hf_split, "a split name such as train")
        if self.split is not None:
            parse_split(str(self.split))
        self._check_eval_and_template()
        for key in ("max_prompt_len", "max_response_len"):
            v = getattr(self, key)
            _check(
                v is None or v > 0, f"data.{key}", v, "a positive integer (unset = per data.format)"
            )

    def resolve(self) -> "DataConfig":
        """Unset lengths take the format's defaults (the longest of a blend's). Called when the
        whole config is built (not in __post_init__: Hydra instantiates the default group while
        building its schema, which would freeze the synthetic task's numbers for every format)."""
        formats = [s.format for s in self.source_list()]
        for i, key in enumerate(("max_prompt_len", "max_response_len")):
            if getattr(self, key) is None:
                setattr(self, key, max(FORMATS[f].lengths[i] for f in formats))
        return self

    def _check_eval_and_template(self) -> None:
        if self.eval_format is not None:
            _check(
                self.eval_format in FORMATS,
                "data.eval_format",
                self.eval_format,
                "one of " + ", ".join(FORMATS),
            )
            if not self.eval_path:
                raise ConfigError(
                    f"data.eval_format={self.eval_format} is set but data.eval_path is not"
                )
        if self.eval_path:
            fmt = self.eval_format or self.format
            if FORMATS[fmt].generated:
                raise ConfigError(
                    f"data.eval_path={self.eval_path} needs data.eval_format (the file's format; "
                    f"data.format={fmt} generates its data)"
                )
        if self.eval_hf_split is not None and not self.eval_path:
            raise ConfigError(
                f"data.eval_hf_split={self.eval_hf_split} is set but data.eval_path is not"
            )
        if self.chat_template not in ("auto", "none"):
            import os

            path = os.path.expanduser(str(self.chat_template))
            if not os.path.isfile(path):
                raise ConfigError(
                    f"data.chat_template={self.chat_template}: no such file (expected auto, none "
                    f"or the path of a Jinja chat template)"
                )

    def source_list(self) -> List[SourceConfig]:
        if self.sources:
            return list(self.sources)
        return [
            SourceConfig(
                path=self.path,
                format=self.format,
                weight=1.0,
                columns=dict(self.columns or {}),
                hf_split=self.hf_split,
                hf_config=self.hf_config,
            )
        ]

    def eval_source(self) -> Optional[SourceConfig]:
        """data.eval_path as a source (its format defaults to data.format; data.columns applies when
        the formats agree)."""
        if not self.eval_path:
            return None
        fmt = self.eval_format or self.format
        columns = dict(self.columns or {}) if fmt == self.format else {}
        return SourceConfig(
            path=self.eval_path,
            format=fmt,
            weight=1.0,
            columns=columns,
            hf_split=self.eval_hf_split or self.hf_split,
            hf_config=self.hf_config,
        )

    def default_new_tokens(self) -> int:
        """What eval.max_new_tokens=None resolves to: the formats' own number where each has one
        (the synthetic task: 16, its answers are short), else data.max_response_len (a GSM8K answer
        needs room to reach its '####')."""
        new_tokens = [FORMATS[s.format].new_tokens for s in self.source_list()]
        if all(n is not None for n in new_tokens):
            return max(new_tokens)
        return int(self.resolve().max_response_len)


# train.*'s checks of one value each
TRAIN_RULES = (
    ("max_steps", _or_null(_positive), "a positive integer (null = from train.epochs)"),
    ("epochs", _or_null(_positive), "a positive number"),
    ("global_batch", _positive, "a positive integer"),
    ("micro_batch_per_rank", _non_negative, "a non-negative integer"),
    ("max_tokens_per_micro_batch", _non_negative, "a non-negative integer (0 = off)"),
    ("lr", _positive, "a positive number"),
    ("lora_lr", _or_null(_positive), "a positive number or null"),
    ("min_lr_ratio", lambda v: 0.0 <= v <= 1.0, "0..1"),
    (
        "scheduler",
        _in(("warmup", "warmup_decay", "cosine", "constant")),
        "warmup, warmup_decay, cosine or constant",
    ),
    (
        "warmup_steps",
        _or_null(_non_negative),
        "a non-negative integer (null = from train.warmup_ratio)",
    ),
    ("warmup_ratio", _or_null(lambda v: 0 <= v < 1), "a share of the steps in [0, 1)"),
    ("betas", lambda v: len(v) == 2, "two numbers"),
    ("grad_clip", _non_negative, "a non-negative number"),
    ("capacity_factor", _non_negative, "≥ 0 (0 = none)"),
    ("eval_capacity_factor", _non_negative, "≥ 0 (0 = none)"),
    ("min_capacity", _non_negative, "≥ 0"),
    ("router_z_loss_coef", _non_negative, "a non-negative number"),
    ("expert_lr_scale", _positive, "a positive number"),
    (
        "expert_weight_decay",
        _or_null(_non_negative),
        "a non-negative number (null = train.weight_decay)",
    ),
    ("log_every", _positive, "a positive integer"),
    ("save_every", _non_negative, "a non-negative integer"),
    ("keep_checkpoints", _positive, "a positive integer"),
)


@dataclass
class TrainConfig:
    # optimizer steps; null = from train.epochs over the stage's records (PPO: its prompts), which
    # the recipe for pretrained models uses. Set, it wins over train.epochs.
    max_steps: Optional[int] = 1000
    # passes over the stage's data when train.max_steps is null
    epochs: Optional[float] = None
    # samples per optimizer step, summed over ranks and accumulation
    global_batch: int = 64
    # SFT of a Mixture-of-Experts model: the load-balancing loss's weight (rlhf/models/moe.py);
    # null = the model config's router_aux_loss_coef, 0 = off
    router_aux_loss_coef: Optional[float] = None
    # ... and the router z-loss's (ST-MoE: logsumexp of the router logits, squared; keeps them
    # small), 0 = off
    router_z_loss_coef: float = 0.0
    # ... and each expert's capacity in training (eval: the held-out loss's) forwards, DeepSpeed's:
    # at most max(min_capacity, ⌈factor · tokens · k / experts⌉) (token, slot) pairs, the rest
    # dropped (the token skips that expert); 0 = none
    capacity_factor: float = 0.0
    eval_capacity_factor: float = 0.0
    min_capacity: int = 4
    # 0 = global_batch / world_size (no accumulation)
    micro_batch_per_rank: int = 0
    # SFT, reward, DPO: a rank's rows of the step in micro-batches of at most this many real tokens
    # (a pair: chosen + rejected; a longer row alone), as many on every rank; 0 =
    # micro_batch_per_rank rows
    max_tokens_per_micro_batch: int = 0
    lr: float = 3e-3
    # with LoRA (model.lora.r > 0) the learning rate instead of train.lr, unless train.lr is on the
    # command line (rlhf/compose.py; the log says which it used): the recipes set LoRA's rates here;
    # null = train.lr
    lora_lr: Optional[float] = None
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0  # never applied to norms and biases
    # a Mixture-of-Experts model's experts (their own AdamW group): the learning rate's scale and
    # the weight decay (null = train.weight_decay)
    expert_lr_scale: float = 1.0
    expert_weight_decay: Optional[float] = None
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # DeepSpeed's schedulers: warmup (WarmupLR), warmup_decay (WarmupDecayLR), cosine; or constant
    scheduler: str = "cosine"
    # null = train.warmup_ratio × the stage's steps; set, it wins over train.warmup_ratio
    warmup_steps: Optional[int] = 50
    warmup_ratio: Optional[float] = None
    grad_clip: float = 1.0  # 0 = off
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 200  # checkpoint every N steps (0 = off)
    keep_checkpoints: int = 2

    def __post_init__(self):
        _check_rules(self, "train", TRAIN_RULES)
        if self.max_steps is None and self.epochs is None:
            raise ConfigError("train.max_steps and train.epochs are both null: set one of them")
        if self.warmup_steps is None and self.warmup_ratio is None:
            raise ConfigError(
                "train.warmup_steps and train.warmup_ratio are both null: set one of them"
            )

    def resolve_steps(
        self, items: int, per_step: int, what: str, updates_per_step: int = 1
    ) -> Optional[str]:
        """Fills a null train.max_steps from train.epochs (``items`` records or prompts,
        ``per_step`` of them a step) and a null train.warmup_steps (optimizer steps:
        ``updates_per_step`` a stage step) from train.warmup_ratio. Called by each stage once its
        data is loaded; returns the line that says what was derived (None: nothing was)."""
        said = []
        if self.max_steps is not None and self.epochs is not None:
            said.append(
                f"train.max_steps={self.max_steps} is set: train.epochs={self.epochs:g} "
                "does not apply"
            )
        if self.max_steps is None:
            self.max_steps = max(1, math.ceil(self.epochs * items / per_step))
            said.append(
                f"train.max_steps={self.max_steps} (train.epochs={self.epochs:g} over "
                f"{items} {what}, "
                f"{per_step} a step)"
            )
        if self.warmup_steps is None:
            self.warmup_steps = round(self.warmup_ratio * self.max_steps * updates_per_step)
        elif self.warmup_ratio is not None:
            said.append(
                f"train.warmup_steps={self.warmup_steps} is set: "
                f"train.warmup_ratio={self.warmup_ratio:g} "
                f"does not apply"
            )
            said.append(
                f"train.warmup_steps={self.warmup_steps} (train.warmup_ratio={self.warmup_ratio:g})"
            )
        return "; ".join(said) or None


ROLES = (
    "actor",
    "critic",
    "reference",
    "reward_model",
    "teacher",
    "judge",
    # the models a stage places (engine.<role>.*)
)


@dataclass
class PlacementConfig:
    """Where one model of a stage lives (engine.actor / critic / reference / reward_model / teacher
    / judge); null = the engine.* value. DeepSpeed-Chat's --actor_zero_stage, --critic_zero_stage,
    --offload_reference_model."""

    zero_stage: Optional[int] = None
    offload: Optional[str] = None
    precision: Optional[str] = None
    activation_checkpointing: Optional[bool] = None


# engine.precision and engine.inference_dtype, besides auto
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class FP16Config:
    """engine.fp16.*: the loss scaling of engine.precision=fp16 (rlhf/engine/loss_scale.py),
    DeepSpeed's ``fp16`` keys and defaults. Dynamic (loss_scale=0): the first scale is
    2**initial_scale_power; an overflow (inf/NaN gradients) skips the step and, once ``hysteresis``
    overflows have used up the tolerance, halves the scale (not below min_loss_scale); after
    ``loss_scale_window`` steps without overflow the next one doubles it."""

    loss_scale: float = 0.0  # 0 = dynamic; > 0 = this static scale
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # true: every step without overflow restores the hysteresis
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self):
        _check(
            math.isfinite(self.loss_scale) and self.loss_scale >= 0,
            "engine.fp16.loss_scale",
            self.loss_scale,
            "0 (dynamic) or a positive static scale",
        )
        _check(
            0 <= self.initial_scale_power <= 64,
            "engine.fp16.initial_scale_power",
            self.initial_scale_power,
            "an integer in [0, 64] (the first dynamic scale is 2**power)",
        )
        _check(
            self.loss_scale_window > 0,
            "engine.fp16.loss_scale_window",
            self.loss_scale_window,
            "a positive integer",
        )
        _check(self.hysteresis > 0, "engine.fp16.hysteresis", self.hysteresis, "a positive integer")
        _check(
            math.isfinite(self.min_loss_scale) and self.min_loss_scale > 0,
            "engine.fp16.min_loss_scale",
            self.min_loss_scale,
            "a positive number",
        )
        if self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ConfigError(
                f"engine.fp16.min_loss_scale={self.min_loss_scale:g} is above the first "
                "dynamic scale "
                f"2**engine.fp16.initial_scale_power={2.0**self.initial_scale_power:g}"
            )


# engine.host_malloc (rlhf/host_memory.py)
HOST_MALLOC = ("reuse", "system")


# engine.*'s checks of one value each
ENGINE_RULES = (
    ("zero_stage", _in((0, 1, 2, 3)), "0, 1, 2 or 3"),
    ("offload", _in(("none", "cpu")), "none or cpu"),
    ("device", _in(("auto", "cpu", "cuda")), "auto, cpu or cuda"),
    ("precision", _in(("auto", *PRECISIONS)), "auto, fp32, bf16 or fp16"),
    ("backend", _in((None, "gloo", "nccl")), "gloo or nccl"),
    ("timeout_s", _positive, "a positive number of seconds"),
    ("host_malloc", _in(HOST_MALLOC), one_of(HOST_MALLOC)),
    ("threads_per_rank", _non_negative, "a non-negative integer"),
    ("inference_tp_size", _positive, "a positive integer"),
    ("expert_parallel", _positive, "a positive integer"),
    ("inference_dtype", _in(("auto", *PRECISIONS)), "auto, fp32, bf16 or fp16"),
    ("inference_kernels", _in(("auto", "reference")), "auto or reference"),
    ("training_gemm", _in(("torch", "onednn", "auto")), "torch, onednn or auto"),
    ("cuda_graphs", _in(("auto", "off")), "auto or off"),
    ("decode_sync_every", _positive, "a positive integer"),
)


@dataclass
class EngineConfig:
    # auto = $RLHF_DEVICE if set, else cuda when there is a GPU for every process of this node, else
    # cpu (said in the log); cuda = CUDA or a clear error (exit 2)
    device: str = "auto"  # auto | cpu | cuda
    zero_stage: int = 3
    offload: str = "none"  # none | cpu (FSDP2 CPUOffloadPolicy)
    # fp32 | bf16 (bf16 compute, fp32 master weights and reductions) | fp16 (the same in fp16, with
    # loss scaling: engine.fp16.*) | auto = bf16 on a CUDA device with native bf16 (compute
    # capability ≥ 8), fp16 on an older one (V100, T4), fp32 on the CPU (resolved when the device is
    # known; the log states it)
    precision: str = "auto"
    fp16: FP16Config = field(default_factory=FP16Config)
    activation_checkpointing: bool = False
    # training forwards padding-free: a micro-batch's real tokens run as one packed sequence
    # (positions per sequence, no attention across sequences, a prefix that rows share run once;
    # rlhf/engine/packing.py); false = padded to the longest row (the reference path; also what a
    # family or attention kernel that cannot pack runs)
    packing: bool = True
    backend: Optional[str] = None  # None = nccl on CUDA, else gloo
    # collective timeout: a dead peer ends the job instead of hanging it
    timeout_s: int = 600
    # torch intra-op threads; 0 = cores / local ranks
    threads_per_rank: int = 0
    # the CPU's large allocations: "reuse" keeps freed memory in glibc's heap for the next ones
    # (no page faults on every logits tensor; the process holds its peak), "system" leaves glibc
    # as it is (rlhf/host_memory.py)
    host_malloc: str = "reuse"
    inference_tp_size: int = 1
    # Mixture-of-Experts models under ZeRO-2/3: each rank holds E / ep of every MoE layer's experts
    # and tokens travel to them by all-to-all within groups of ep ranks (rlhf/engine/experts.py);
    # 1 = FSDP2 gathers whole experts like any weight; ep divides the world size and the experts
    expert_parallel: int = 1
    hybrid: bool = True
    release_inference_cache: bool = True
    # weights and activations of the hybrid engine's inference mode (log-softmax and sampling stay
    # fp32); auto = engine.precision (fp16 training on the CPU: fp32, the CPU has no fast fp16
    # GEMMs). bf16 with fp32 training: faster rollouts (oneDNN AMX / AVX-512 BF16 GEMMs on CPU);
    # rollout log-probs within ~2e-2 of the fp32 recompute (as HF's own bf16 model) instead of
    # ~1e-6; PPO recomputes its old log-probs in training mode either way.
    inference_dtype: str = "auto"  # auto | fp32 | bf16 | fp16
    # GEMM kernels of the inference mode: auto = the fast paths where they apply (CPU: MKL-packed
    # fp32 decode GEMMs, oneDNN-packed bf16), reference = plain GEMMs everywhere (fp32 results
    # differ from auto's at rounding level only)
    inference_kernels: str = "auto"  # auto | reference
    # the training forwards' and backwards' fp32 Linear GEMMs on the CPU: torch = F.linear (MKL's
    # sgemm on x86); onednn = oneDNN's (rlhf/ops/train_gemm.py), 1.5–1.8× faster GEMMs where MKL
    # lacks an AVX-512 path (AMD EPYC); results differ from torch's at fp32 rounding level; auto =
    # onednn where this torch build has it (the pretrained recipes), else torch
    training_gemm: str = "torch"  # torch | onednn | auto
    # the decode loop on CUDA: auto = a static decode step (fixed batch, finished rows masked, no
    # host synchronisation) replayed as a CUDA graph per (batch bucket, cache span) — eager static
    # step with inference_tp_size > 1; off = the row-removing loop with a host check per step (the
    # CPU's loop, which the CPU always uses: there it is faster)
    cuda_graphs: str = "auto"  # auto | off
    # the static step's "have all rows finished?" check (a host synchronisation) every this many
    # steps
    decode_sync_every: int = 8
    # set on the copy placement(role) returns
    role: ClassVar[str] = ""
    # per model: ZeRO stage, offload, precision and activation checkpointing of the policy (SFT,
    # DPO, PPO's actor), PPO's critic, the frozen reference (PPO, DPO) and the reward model (trained
    # by stage=reward, frozen in PPO); each key unset = the engine.* value above
    actor: PlacementConfig = field(default_factory=PlacementConfig)
    critic: PlacementConfig = field(default_factory=PlacementConfig)
    reference: PlacementConfig = field(default_factory=PlacementConfig)
    reward_model: PlacementConfig = field(default_factory=PlacementConfig)
    teacher: PlacementConfig = field(default_factory=PlacementConfig)
    judge: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self):
        _check_rules(self, "engine", ENGINE_RULES)
        for role in ROLES:
            p = getattr(self, role)
            _check(
                p.zero_stage in (None, 0, 1, 2, 3),
                f"engine.{role}.zero_stage",
                p.zero_stage,
                "0, 1, 2 or 3 (unset = engine.zero_stage)",
            )
            _check(
                p.offload in (None, "none", "cpu"),
                f"engine.{role}.offload",
                p.offload,
                "none or cpu (unset = engine.offload)",
            )
            _check(
                p.precision in (None, "auto", *PRECISIONS),
                f"engine.{role}.precision",
                p.precision,
                "auto, fp32, bf16 or fp16 (unset = engine.precision)",
            )

    def placement(self, role: str) -> "EngineConfig":
        """This engine configuration with ``engine.<role>.*`` applied: what the model of that role
        is wrapped, offloaded and cast with."""
        chosen = {k: v for k, v in dataclasses.asdict(getattr(self, role)).items() if v is not None}
        placed = dataclasses.replace(self, **chosen)
        placed.role = role
        return placed

    def key(self, name: str) -> str:
        """The setting that decided ``name`` for this placement, for messages: engine.critic.offload
        when the role set it, else engine.offload."""
        if self.role and getattr(getattr(self, self.role), name) is not None:
            return f"engine.{self.role}.{name}"
        return f"engine.{name}"

    def offloads(self, roles=ROLES) -> bool:
        """Whether any of ``roles`` asks for CPU offload (engine.offload or its own)."""
        return any(self.placement(r).offload == "cpu" for r in roles)

    def placements(self, roles=ROLES) -> dict:
        """role -> its resolved (zero_stage, offload, precision, activation_checkpointing), for the
        log."""
        return {
            role: tuple(
                getattr(self.placement(role), k)
                for k in ("zero_stage", "offload", "precision", "activation_checkpointing")
            )
            for role in roles
        }


@dataclass
class EvalConfig:
    """Gold score: the same seeded held-out prompts and decoding in every stage (docs/keys.md)."""

    gold_prompts: int = 256  # 0 = no gold evaluation at all
    gold_samples: int = 4
    temperature: float = 1.0
    # None = per data format (DataConfig.default_new_tokens): 16 for the synthetic task, else
    # data.max_response_len; resolved when the whole config is built
    max_new_tokens: Optional[int] = None
    # held-out prompts keep their last this many tokens, as training prompts do (one rule for every
    # prompt a stage or rlhf.eval generates from); None = data.max_prompt_len, resolved with the
    # config
    max_prompt_len: Optional[int] = None
    seed: int = 4321
    batch_size: int = 256  # held-out prompts per generate call
    greedy_too: bool = True  # also report gold/score_greedy
    # PPO's held-out reward-model view (data without a gold scorer): also this many samples a prompt
    # at eval.temperature (eval/reward_sampled, _std, eval/response_tokens_sampled); 0 = greedy only
    reward_samples: int = 0

    def __post_init__(self):
        _check(
            self.gold_prompts >= 0,
            "eval.gold_prompts",
            self.gold_prompts,
            "a non-negative integer (0 = no gold evaluation)",
        )
        _check(self.gold_samples > 0, "eval.gold_samples", self.gold_samples, "a positive integer")
        _check(
            self.reward_samples >= 0,
            "eval.reward_samples",
            self.reward_samples,
            "a non-negative integer (0 = the greedy answers only)",
        )
        _check(
            not (self.reward_samples and self.temperature == 0),
            "eval.reward_samples",
            self.reward_samples,
            "0 with eval.temperature=0 (the samples would be the greedy answers)",
        )
        _check(self.temperature >= 0, "eval.temperature", self.temperature, "a non-negative number")
        _check(
            self.max_new_tokens is None or self.max_new_tokens > 0,
            "eval.max_new_tokens",
            self.max_new_tokens,
            "a positive integer",
        )
        _check(self.batch_size > 0, "eval.batch_size", self.batch_size, "a positive integer")
        _check(
            self.max_prompt_len is None or self.max_prompt_len > 0,
            "eval.max_prompt_len",
            self.max_prompt_len,
            "a positive integer (unset = data.max_prompt_len)",
        )

    def resolve(self, data: "DataConfig") -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = data.default_new_tokens()
        if self.max_prompt_len is None:
            self.max_prompt_len = data.max_prompt_len


@dataclass
class LoggerConfig:
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "rlhf"
    progress: bool = True  # tqdm on rank 0
    # every metrics.jsonl line also as TensorBoard scalars (rank 0), in <tensorboard_dir>/<stage>/;
    # tensorboard_dir None = <run.dir>/tensorboard (DeepSpeed-Chat's --enable_tensorboard,
    # --tensorboard_path)
    tensorboard: bool = False
    tensorboard_dir: Optional[str] = None
    # <stage>/samples.jsonl (and wandb / TensorBoard tables): the responses to the first `samples`
    # held-out prompts at every evaluation (one shown on the console), and PPO's first `samples`
    # rollouts with their reward's parts every `samples_every` steps; 0 turns either off
    samples: int = 4
    samples_every: int = 10

    def __post_init__(self):
        _check(
            self.samples >= 0, "logger.samples", self.samples, "a non-negative integer (0 = none)"
        )
        _check(
            self.samples_every >= 0,
            "logger.samples_every",
            self.samples_every,
            "a non-negative integer (0 = never)",
        )
        _check(
            self.wandb in ("disabled", "offline", "online"),
            "logger.wandb",
            self.wandb,
            "disabled, offline or online",
        )
        if self.tensorboard:
            # (the package torch.utils.tensorboard writes with: an optional extra)
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "logger.tensorboard=true needs the tensorboard package, which is not "
                    "installed: "
                    "pip install 'rlhf[tensorboard]' (or pip install 'tensorboard>=2.14'), "
                    "or logger.tensorboard=false"
                ) from None


@dataclass
class RewardConfig:
    # pairwise loss -log σ(r_chosen - r_rejected - margin)
    margin: float = 0.0
    # the model the reward model starts from: None = the SFT output in run.dir, else model.path
    model_path: Optional[str] = None
    # members of a reward-model ensemble: k scalar heads on the one backbone, each with its own
    # initialisation and (reward.bootstrap) its own half of the pairs; exported as one
    # sequence classifier with k labels, member i = label i (docs/ppo.md, "Reward-model ensembles")
    ensemble: int = 1
    # each member's pairs: a double-or-nothing bootstrap of the data
    bootstrap: bool = True
    # contrast pairs added to the training pairs (rlhf/data/contrast.py): `other` (the prompt's
    # chosen response beats another prompt's response), `empty` (… beats EOS alone); [] = none
    contrast: List[str] = field(default_factory=list)
    # contrast pairs of each kind, per training pair
    contrast_share: float = 0.25

    def __post_init__(self):
        _check(
            self.ensemble >= 1,
            "reward.ensemble",
            self.ensemble,
            "a positive integer (1 = one reward model)",
        )
        self.contrast = list(self.contrast or [])
        for kind in self.contrast:
            _check(kind in CONTRAST_KINDS, "reward.contrast", kind, " or ".join(CONTRAST_KINDS))
        _check(
            len(set(self.contrast)) == len(self.contrast),
            "reward.contrast",
            self.contrast,
            "each kind once",
        )
        _check(
            0 < self.contrast_share <= 1,
            "reward.contrast_share",
            self.contrast_share,
            "a share in (0, 1]",
        )


@dataclass
class DPOConfig:
    """Direct preference optimisation (rlhf/algorithms/preference.py): the policy against a frozen
    reference."""

    # β: strength of the implicit KL to the reference (rewards are β·log π/π_ref)
    beta: float = 0.1
    # sigmoid (DPO; cDPO with label_smoothing) | ipo
    loss: str = "sigmoid"
    # cDPO: the share of pairs assumed mislabelled (sigmoid loss only; 0 = plain DPO)
    label_smoothing: float = 0.0
    # RPO: + sft_coef × the chosen response's NLL per token, per pair (0 = plain DPO; TRL's
    # rpo_alpha). Keeps the chosen responses likely where pairs differ in a token or two (the
    # embedded task)
    sft_coef: float = 0.0
    # the policy and reference to start from: None = the SFT output in run.dir, else model.path
    model_path: Optional[str] = None

    def __post_init__(self):
        _check(self.beta > 0, "dpo.beta", self.beta, "a positive number")
        _check(self.loss in ("sigmoid", "ipo"), "dpo.loss", self.loss, "sigmoid or ipo")
        _check(
            0.0 <= self.label_smoothing < 0.5,
            "dpo.label_smoothing",
            self.label_smoothing,
            "a number in [0, 0.5)",
        )
        _check(self.sft_coef >= 0, "dpo.sft_coef", self.sft_coef, "a non-negative number (0 = off)")
        if self.loss == "ipo" and self.label_smoothing:  # would be silently ignored
            raise ConfigError(
                f"dpo.label_smoothing={self.label_smoothing} applies to dpo.loss=sigmoid "
                f"(cDPO), not dpo.loss=ipo: set it to 0 or use dpo.loss=sigmoid"
            )


@dataclass
class AlgorithmConfig:
    """RL estimator and its coefficients (rlhf/algorithms/ppo.py)."""

    # a row of rlhf/algorithms/estimators.py: gae (PPO with critic) | grpo | rloo | reinforce_pp
    # (critic-free) | distill (on-policy distillation: each token's advantage its own reward; needs
    # ppo.teacher_path)
    estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    # β of the per-token KL penalty (GRPO: of the KL loss term)
    kl_coef: float = 0.05
    # k1 | k2 | k3; None = k3 for GRPO's KL loss term, else k1
    kl_estimator: Optional[str] = None
    kl_target: Optional[float] = None  # adaptive β (Ziegler et al.) when set
    kl_horizon: int = 10000
    clip_ratio: float = 0.2
    # asymmetric clipping: ratio clipped to [1 − low, 1 + high]; None = clip_ratio (DAPO's
    # clip-higher: high 0.28)
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    dual_clip: Optional[float] = None  # e.g. 3.0
    # how per-token policy losses become one number (every mode independent of micro-batch size and
    # world size): token_mean (over the global minibatch's tokens), seq_mean_token_mean,
    # seq_mean_token_sum, token_sum_norm (Dr.GRPO: token sum / (sequences × loss_norm_tokens))
    loss_agg: str = "token_mean"
    # token_sum_norm's constant; 0 = ppo.max_new_tokens
    loss_norm_tokens: int = 0
    # GRPO: divide by the group's std; false = Dr.GRPO
    std_normalize: bool = True
    # rollout/training log-prob mismatch: none | tis (truncated importance weight
    # min(π_train/π_rollout, tis_cap) per token) | mis (mask tokens whose ratio is outside
    # [1/tis_cap, tis_cap])
    mismatch_correction: str = "none"
    tis_cap: float = 2.0
    value_clip: Optional[float] = 0.2
    whiten_advantages: bool = True
    entropy_coef: float = 0.0
    # a Mixture-of-Experts actor: the load-balancing loss in the update (the SFT stage's, over
    # every rank's tokens of each micro-batch; rlhf/models/moe.py), 0 = off
    router_aux_loss_coef: float = 0.0
    # ... and the router z-loss (the SFT stage's train.router_z_loss_coef), 0 = off
    router_z_loss_coef: float = 0.0
    # PPO-ptx: language-model loss on SFT data
    ptx_coef: float = 0.0
    reward_clip: Optional[float] = 5.0
    # stats (reward stage's mean/std) | running | none
    reward_norm: str = "stats"
    # added to the score of a response that never ends (0 = off)
    no_eos_penalty: float = -1.0
    # GKD (docs/ppo.md): a loss term gkd_coef × the generalised JSD between the teacher's
    # (ppo.teacher_path) and the actor's next-token distributions at every policy token, over the
    # vocabulary or the teacher's gkd_top_k likeliest tokens and the rest as one (0 = all tokens);
    # gkd_beta 0 = forward KL(teacher ‖ actor), 1 = reverse KL
    gkd_coef: float = 0.0
    gkd_beta: float = 0.5
    gkd_top_k: int = 0
    # the share of GKD's weight taken on the dataset's SFT responses instead of the actor's samples
    # (GKD's fixed-dataset part: 1 − its λ)
    gkd_data_share: float = 0.0

    def __post_init__(self):
        _check(
            0 <= self.gkd_data_share <= 1,
            "algorithm.gkd_data_share",
            self.gkd_data_share,
            "0..1 (0 = the actor's samples alone)",
        )
        _check(
            self.gkd_coef >= 0,
            "algorithm.gkd_coef",
            self.gkd_coef,
            "a non-negative number (0 = off)",
        )
        _check(
            0 <= self.gkd_beta <= 1,
            "algorithm.gkd_beta",
            self.gkd_beta,
            "0..1 (0 forward KL, 1 reverse KL)",
        )
        _check(
            self.gkd_top_k >= 0,
            "algorithm.gkd_top_k",
            self.gkd_top_k,
            "a non-negative integer (0 = the vocabulary)",
        )
        _check(
            self.estimator in ESTIMATORS, "algorithm.estimator", self.estimator, one_of(ESTIMATORS)
        )
        _check(
            self.kl_estimator is None or self.kl_estimator in KL_ESTIMATORS,
            "algorithm.kl_estimator",
            self.kl_estimator,
            one_of(KL_ESTIMATORS),
        )
        _check(
            self.reward_norm in ("stats", "running", "none"),
            "algorithm.reward_norm",
            self.reward_norm,
            "stats, running or none",
        )
        _check(
            0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
            "algorithm.gamma/lam",
            (self.gamma, self.lam),
            "0..1",
        )
        _check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "a non-negative number")
        for key in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, key)
            _check(v is None or v >= 0, f"algorithm.{key}", v, "a non-negative number")
        _check(self.loss_agg in LOSS_AGG, "algorithm.loss_agg", self.loss_agg, one_of(LOSS_AGG))
        _check(
            self.loss_norm_tokens >= 0,
            "algorithm.loss_norm_tokens",
            self.loss_norm_tokens,
            "a non-negative integer (0 = ppo.max_new_tokens)",
        )
        _check(
            self.mismatch_correction in ("none", "tis", "mis"),
            "algorithm.mismatch_correction",
            self.mismatch_correction,
            "none, tis or mis",
        )
        _check(self.tis_cap >= 1.0, "algorithm.tis_cap", self.tis_cap, "a number >= 1")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, key)
            _check(value >= 0, f"algorithm.{key}", value, "a non-negative number")


# ppo.rollout_guard_max=0: the threshold of each compared precision, nats per response token
ROLLOUT_GUARD_MAX = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
# the default ppo.min_rm_accuracy: on the embedded task (a generated format), and on any other data
MIN_RM_ACCURACY_EMBEDDED, MIN_RM_ACCURACY_OTHER = 0.9, 0.55
# env.sandbox.isolation: the strongest mode, the strongest or exit 2 without namespaces, or a mode
# by name (rlhf/envs/sandbox/modes.py MODE_CHOICES, kept equal by tests/unit/envs/test_sandbox.py)
SANDBOX_ISOLATION = ("auto", "namespaces", "root", "user", "guard")


@dataclass
class SandboxConfig:
    """The limits of the Python tool's sandbox, per call (rlhf/envs/sandbox/, docs/agents.md)."""

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 256
    # processes the code may start besides itself
    processes: int = 0
    # stdout + stderr kept (the rest cut, the run stopped)
    output_bytes: int = 10_000
    # the largest file it may write (in its own directory)
    file_bytes: int = 1_000_000
    # all its files together (its directory is a tmpfs of this size)
    disk_bytes: int = 16_000_000
    # files and directories it may have, main.py included
    files: int = 256
    open_files: int = 64  # file descriptors open at once
    # SANDBOX_ISOLATION: auto = the strongest the kernel allows
    isolation: str = "auto"

    def __post_init__(self):
        for key in (
            "cpu_s",
            "wall_s",
            "memory_mb",
            "output_bytes",
            "file_bytes",
            "disk_bytes",
            "files",
        ):
            _check(
                getattr(self, key) > 0,
                f"env.sandbox.{key}",
                getattr(self, key),
                "a positive number",
            )
        _check(
            self.processes >= 0, "env.sandbox.processes", self.processes, "a non-negative integer"
        )
        _check(self.open_files >= 8, "env.sandbox.open_files", self.open_files, "an integer >= 8")
        _check(
            self.files >= 2,
            "env.sandbox.files",
            self.files,
            "an integer >= 2 (its directory and main.py)",
        )
        _check(
            self.memory_mb >= 16,
            "env.sandbox.memory_mb",
            self.memory_mb,
            "at least 16 (the interpreter's own)",
        )
        _check(
            self.isolation in SANDBOX_ISOLATION,
            "env.sandbox.isolation",
            self.isolation,
            one_of(SANDBOX_ISOLATION),
        )


def score_pattern(pattern: str, key: str = "ppo.judge_score_pattern") -> "re.Pattern":
    """A judge's score pattern compiled: exit 2 (one line) when it does not compile or has no group
    (rlhf/rl/judge.py reads the number in its first group)."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{key}={pattern!r}: not a regular expression: {e}") from None
    if compiled.groups < 1:
        raise ConfigError(
            f"{key}={pattern!r}: needs a group around the number, e.g. 'Score: (\\d+)'"
        )
    return compiled


# env.name: these, or a dotted path module.Class (rlhf/envs/builtin.py)
ENV_BUILTINS = ("auto", "single_turn", "tools")


@dataclass
class EnvConfig:
    """The environment each trajectory plays, its tools, its turns and the Python tool's sandbox
    (docs/agents.md); PPO's episodes, and the held-out gold of SFT, PPO and ``rlhf.eval``."""

    # the environment of each trajectory: single_turn (one response), tools (env.tools' calls
    # answered turn after turn until the policy answers without one), or module.Class of the
    # user's; auto = tools when env.tools is set, else single_turn
    name: str = "auto"
    # keyword arguments of the environment's constructor (a user's class)
    args: Any = None
    # the tools offered: calculator, python (sandboxed: env.sandbox), or module.attr of a Tool
    tools: List[str] = field(default_factory=list)
    # <tool_call>{json}</tool_call>; or module.function(text) -> Parsed
    tool_parser: str = "hermes"
    # policy turns per episode; None = 1 for single_turn, else 4
    max_turns: Optional[int] = None
    # tokens after the prompt (the policy's and the observations'); None = ppo.max_new_tokens for
    # one turn, else 2 × max_turns × ppo.max_new_tokens
    max_trajectory_tokens: Optional[int] = None
    # a reset or step that takes longer fails its trajectory
    timeout_s: float = 30.0
    # stop the run (exit 2) when more than this share of a generation's episodes fail
    max_failed_share: float = 0.1
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self):
        _check(
            self.name in ENV_BUILTINS or "." in self.name,
            "env.name",
            self.name,
            f"{one_of(ENV_BUILTINS)} or a dotted path module.Class",
        )
        _check(
            self.max_turns is None or self.max_turns > 0,
            "env.max_turns",
            self.max_turns,
            "a positive integer",
        )
        _check(self.timeout_s > 0, "env.timeout_s", self.timeout_s, "a positive number of seconds")
        _check(
            0 <= self.max_failed_share <= 1, "env.max_failed_share", self.max_failed_share, "0..1"
        )

    def resolve(self, max_new_tokens: int) -> None:
        """env.name=auto, env.max_turns and env.max_trajectory_tokens=None: from the environment,
        the tools and the tokens of a turn (``ppo.max_new_tokens``); then the checks that depend on
        them."""
        if self.name == "auto":
            self.name = "tools" if self.tools else "single_turn"
        if self.tools and self.name == "single_turn":
            raise ConfigError(
                f"env.tools={list(self.tools)} is set but env.name=single_turn never answers a "
                "tool call: use env.name=tools (or leave env.name=auto)"
            )
        if self.name == "tools" and not self.tools:
            raise ConfigError(
                "env.name=tools needs tools: set env.tools, e.g. env.tools=[calculator]"
            )
        if self.max_turns is None:
            self.max_turns = 1 if self.name == "single_turn" else 4
        if self.max_trajectory_tokens is None:
            self.max_trajectory_tokens = max_new_tokens
            if self.max_turns > 1:
                self.max_trajectory_tokens = 2 * self.max_turns * max_new_tokens
        _check(
            self.max_trajectory_tokens >= max_new_tokens,
            "env.max_trajectory_tokens",
            self.max_trajectory_tokens,
            f"at least ppo.max_new_tokens={max_new_tokens}",
        )


# keys that moved to another group: the old name still read, for one release, with a warning line
# naming the new one (rlhf/compose.py ``renamed``); a key under a moved group moves with it
MOVED_KEYS = {
    "ppo.env": "env.name",
    "ppo.env_args": "env.args",
    "ppo.tools": "env.tools",
    "ppo.tool_parser": "env.tool_parser",
    "ppo.max_turns": "env.max_turns",
    "ppo.max_trajectory_tokens": "env.max_trajectory_tokens",
    "ppo.env_timeout_s": "env.timeout_s",
    "ppo.env_max_failed_share": "env.max_failed_share",
    "ppo.sandbox": "env.sandbox",
    # (algorithm.reward_clip is another thing: the normalised score's bound)
    "ppo.reward_clip": "ppo.reward_clip_to_heldout",
}
# ppo.rollout_guard (rlhf/rl/rollout_guard.py)
ROLLOUT_GUARD = ("stop", "rebuild", "off")
# ppo.lm_head
LM_HEAD = ("all", "response")
# ppo.update_rows
UPDATE_ROWS = ("all", "live")
# ppo.staleness_policy (rlhf/rl/async_rollouts.py)
STALENESS_POLICIES = ("newest", "fixed")


# ppo.*'s checks of one value each (PPOConfig.__post_init__ adds those of several)
PPO_RULES = (
    *(
        (k, _positive, "a positive integer")
        for k in ("prompts_per_step", "samples_per_prompt", "ppo_epochs", "minibatches_per_epoch")
    ),
    ("max_new_tokens", _or_null(_positive), "a positive integer (unset = per data format)"),
    ("micro_batch_per_rank", _non_negative, "a non-negative integer (0 = auto)"),
    ("max_tokens_per_micro_batch", _non_negative, "a non-negative integer (0 = off)"),
    ("temperature", _non_negative, "a non-negative number (0 = greedy)"),
    ("top_k", _non_negative, "a non-negative integer (0 = off)"),
    ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("dynamic_sampling_max_rounds", _non_negative, "a non-negative integer"),
    ("overlong_penalty", _non_negative, "a non-negative number"),
    ("judge_max_new_tokens", _positive, "a positive integer"),
    ("judge_max_tokens", _positive, "a positive integer"),
    ("distill_coef", _non_negative, "a non-negative number (0 = watch only)"),
    ("min_rm_accuracy", _or_null(lambda v: 0 <= v <= 1), "0..1, or null for the default"),
    ("reward_combine", _in(COMBINE), one_of(COMBINE)),
    ("reward_lcb_coef", _non_negative, "a non-negative number"),
    (
        "stop_disagreement",
        _or_null(lambda v: v > 1),
        "a multiple of the first steps' disagreement above 1, or null (off)",
    ),
    ("stop_kl", _or_null(_positive), "a positive number or null"),
    ("warn_heldout_drop", _or_null(_non_negative), "a non-negative number or null"),
    ("warn_greedy_changed", _or_null(lambda v: 0 <= v <= 1), "a share in [0, 1] or null"),
    ("rollout_workers", _in((0, 1)), "0 or 1"),
    ("rollout_ranks", _non_negative, "an integer >= 0"),
    ("rollout_tp_size", _positive, "a positive integer"),
    ("max_staleness", _non_negative, "an integer >= 0"),
    ("staleness_policy", _in(STALENESS_POLICIES), one_of(STALENESS_POLICIES)),
    ("rollout_worker_threads", _non_negative, "an integer >= 0"),
    ("lm_head", _in(LM_HEAD), one_of(LM_HEAD)),
    ("update_rows", _in(UPDATE_ROWS), one_of(UPDATE_ROWS)),
    ("rollout_guard", _in(ROLLOUT_GUARD), one_of(ROLLOUT_GUARD)),
    (
        "rollout_guard_max",
        lambda v: 0 <= v < float("inf"),
        "a non-negative number of nats per token (0 = the inference dtype's default)",
    ),
)


@dataclass
class PPOConfig:
    """Experience and update sizes (units in the names: docs/architecture.md, habit 6)."""

    prompts_per_step: int = 32  # over all ranks
    samples_per_prompt: int = 4
    ppo_epochs: int = 4
    minibatches_per_epoch: int = 2
    # rows per forward/backward in experience scoring and updates (gradients accumulate within a
    # minibatch; results do not depend on it); 0 = auto: as many rows as keep one micro-batch's fp32
    # logits within 256 MiB (all rows for a small vocabulary, a few for a 152k one)
    micro_batch_per_rank: int = 0
    # > 0: those forwards group rows by real tokens instead, at most this many a micro-batch (a
    # longer row alone), as many on every rank; 0 = off (rows as above)
    max_tokens_per_micro_batch: int = 0
    # the positions the LM head runs over in the step's scoring and update forwards: "all" (every
    # position: the fixed-seed reference) or "response" (the response tokens alone: packed forwards
    # skip the prompt's and the padding's vocabulary-wide logits; the same numbers up to a GEMM's
    # rounding, since its weight gradient sums fewer rows)
    lm_head: str = "all"
    # the rows the update's forwards and backwards run over: "all" (the fixed-seed reference) or
    # "live" (those with a nonzero advantage on a loss token: a GRPO group whose samples all scored
    # alike adds nothing to the gradient while the loss has no term over every row — KL in the loss
    # at kl_coef > 0, entropy, GKD, a critic, a MoE router's terms: then all run; the same gradient
    # up to a GEMM's rounding; the entropy, clipfrac and approx-KL metrics then over the rows run)
    update_rows: str = "all"
    # None = per data format (DataConfig.default_new_tokens): 16 for the synthetic task, else
    # data.max_response_len; resolved when the whole config is built
    max_new_tokens: Optional[int] = None
    min_new_tokens: int = 0
    # 0 = greedy (log-probs then at temperature 1)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    critic_lr: float = 1e-4
    # the actor (and reference) to start from: None = the SFT output in run.dir, else model.path
    actor_path: Optional[str] = None
    # an exported reward model (a sequence-classification directory) to score with: None = the
    # reward stage's output in run.dir
    reward_model_path: Optional[str] = None
    # the critic's starting weights (GAE): None = the reward model (ppo.reward_model_path or
    # run.dir's)
    critic_path: Optional[str] = None
    use_reward_model: bool = True
    # refuse a reward model whose held-out pair accuracy (its reward_stats.json) is below this: PPO
    # would optimise its errors. None = 0.9 on the embedded task (where a weaker one is known to get
    # hacked: gold falls), 0.55 on other data (just above chance: real preference data tops out
    # near 0.7); 0 = off
    min_rm_accuracy: Optional[float] = None
    # a reward-model ensemble (reward.ensemble > 1; docs/ppo.md): its members, each normalised,
    # combined into the reward by mean, lcb (mean − ppo.reward_lcb_coef × the members' std), min
    # (the worst) or first (the first member alone; the others only watch: they count in the logged
    # spread and mean)
    reward_combine: str = "lcb"
    reward_lcb_coef: float = 1.0
    # each member's score clipped to the range of its held-out scores (reward_stats.json), where it
    # was calibrated
    reward_clip_to_heldout: bool = False
    # the reward model's part of each step's rewards with its linear dependence on response length
    # taken out (every rank's rows: score - slope x (length - mean length), slope by least squares;
    # reward/length_slope): a policy gains nothing from answering longer or shorter (docs/ppo.md)
    reward_length_debias: bool = False
    # the gate (docs/ppo.md, "The over-optimisation gate"): stop the run and export the actor of the
    # best step by the reward (mean over 5 steps) once, over the last 5 steps, the ensemble's
    # disagreement passes this multiple of its first 5 steps' (ppo.stop_disagreement) or the KL per
    # sequence passes ppo.stop_kl; null = off
    stop_disagreement: Optional[float] = None
    stop_kl: Optional[float] = None
    # a warning when the final eval/reward_greedy (the reward model's reward of the exported actor's
    # greedy answers to held-out prompts) is this far below step 0's: the policy may have got worse
    # where it does not train (0.03 parts the embedded task's unseen seeds whose greedy gold PPO
    # lowered; docs/ppo.md); null = off
    warn_heldout_drop: Optional[float] = 0.03
    # a warning when the final evaluation's greedy answers to held-out prompts differ from step 0's
    # on more than this share of them while the reward model prefers the new ones by less than
    # rlhf/rl/gate.py's CHANGED_GAIN: it cannot tell them apart (docs/ppo.md); null = off
    warn_greedy_changed: Optional[float] = 0.05
    # dotted path of a rule reward, e.g. rlhf.rewards.gold
    reward_fn: Optional[str] = None
    reward_fn_weight: float = 1.0
    # on-policy distillation (docs/ppo.md): a frozen teacher (an HF causal LM with the actor's
    # tokenizer) scores every sampled token, and each policy token's reward is −distill_coef × (log
    # π_actor − log π_teacher), the per-token reverse KL, added to any other reward (none needed);
    # distill_coef 0: no such reward (the teacher only watched, distill/* logged, unless
    # algorithm.gkd_coef > 0 learns from it: with estimator=distill, GKD alone)
    teacher_path: Optional[str] = None
    distill_coef: float = 1.0
    # a generative judge (docs/ppo.md, rlhf/rl/judge.py): an HF causal LM reads each prompt and
    # response through the template file judge_template ({prompt}, {response}, {reference}); the
    # reward is judge_weight × its probability of the first of judge_verdicts against the second
    # (one token each)
    judge_path: Optional[str] = None
    judge_template: Optional[str] = None
    judge_verdicts: List[str] = field(default_factory=lambda: ["Yes", "No"])
    judge_weight: float = 1.0
    # a longer rendering keeps its last tokens
    judge_max_tokens: int = 1024
    # the score form (rlhf/rl/judge.py): a regular expression whose first group is a number; the
    # judge then writes up to judge_max_new_tokens tokens greedily, the reward is the number mapped
    # from judge_score_range onto 0..1, and an answer without a match gets judge_failure_reward
    # (counted: judge/parse_failures). None: the verdict form
    judge_score_pattern: Optional[str] = None
    judge_score_range: List[float] = field(default_factory=lambda: [0.0, 10.0])
    judge_max_new_tokens: int = 16
    judge_failure_reward: float = 0.0
    ema_decay: Optional[float] = None  # EMA actor when set, e.g. 0.99
    max_nonfinite_in_a_row: int = 3
    # the rollout-parity guard (docs/ppo.md): every step that generated in the inference mode
    # compares its log-probs of the sampled tokens with the training recompute
    # (rollout/logprob_abs_diff_mean) before the update; above ppo.rollout_guard_max: stop = exit 2
    # (the last checkpoint kept), rebuild = rebuild the inference weights and regenerate the step
    # once, then exit 2 if still above; off = no check
    rollout_guard: str = "stop"
    # the threshold on the mean |log π_rollout − log π_old| per response token, in nats; 0 = the
    # default of the compared precision (ROLLOUT_GUARD_MAX: fp32 1e-3, bf16 5e-2, fp16 2e-2)
    rollout_guard_max: float = 0.0
    # asynchronous rollouts (docs/ppo.md): 1 = each trainer rank starts a rollout worker process
    # beside it (the inference mode only) that plays the episodes ahead of training, fed the weights
    # after each update; 0 = the colocated hybrid engine (generation between updates)
    rollout_workers: int = 0
    # asynchronous rollouts on ranks of their own: the last rollout_ranks ranks of the torchrun
    # world play the episodes (the inference mode only, the weights sent over a process group after
    # each update), the others train (rlhf/rl/rollout_link.py); it or the trainers' count must
    # divide the other; 0 = none
    rollout_ranks: int = 0
    # the tensor-parallel degree of each rollout worker on ranks of its own: rollout_ranks /
    # rollout_tp_size workers, each generating at TP rollout_tp_size over that many rollout ranks
    # (each with its slices of the weights, the trainer sending each its own)
    rollout_tp_size: int = 1
    # a sample trained on at update t was generated by weights of version >= t - max_staleness
    # (version v: after v updates); 0 = on-policy, the synchronous run's samples and updates
    max_staleness: int = 0
    # which weights play a step ahead of training (ppo.max_staleness > 0): newest = the newest
    # that have arrived, taken before every generation (a trajectory in flight goes on with new
    # weights: partial rollouts; timing decides the versions); fixed = step s wholly by version
    # s - k (k steps off-policy: a run is reproducible, and a resume equals the uninterrupted run,
    # the steps in flight saved with each checkpoint)
    staleness_policy: str = "newest"
    # CPU threads of each rollout worker; 0 = its trainer rank's (engine.threads_per_rank)
    rollout_worker_threads: int = 0
    # Mixture-of-Experts actors: the experts each token was routed to in the rollout are the ones
    # the actor's training forwards use (rlhf/models/moe.py; moe/routing_flips logs how many the
    # recompute would have changed); no effect on a dense actor
    routing_replay: bool = True
    # DAPO's dynamic sampling (group estimators): drop prompts whose samples all scored alike and
    # generate for further prompts until the step has prompts_per_step with a signal, at most
    # dynamic_sampling_max_rounds extra rounds (then the step keeps what it has, topped up with
    # dropped groups)
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 3
    # no loss on responses cut at max_new_tokens (no EOS)
    overlong_filter: bool = False
    # DAPO's soft overlong penalty: 0 up to max_new_tokens − overlong_buffer tokens, then linearly
    # to −overlong_penalty at max_new_tokens (0 = off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        _check_rules(self, "ppo", PPO_RULES)
        if self.judge_path and not self.judge_template:
            raise ConfigError(
                f"ppo.judge_path={self.judge_path} needs ppo.judge_template: a file with "
                f"the rubric and {{response}}"
            )
        _check(
            len(self.judge_verdicts) == 2
            and len(set(self.judge_verdicts)) == 2
            and all(self.judge_verdicts),
            "ppo.judge_verdicts",
            list(self.judge_verdicts),
            "two different verdicts, the first the good one (e.g. [Yes, No])",
        )
        if self.judge_score_pattern is not None:
            score_pattern(self.judge_score_pattern)
        lo_hi = list(self.judge_score_range)
        _check(
            len(lo_hi) == 2 and lo_hi[0] < lo_hi[1],
            "ppo.judge_score_range",
            lo_hi,
            "two numbers, the lowest score and the highest",
        )
        _check(
            not self.max_staleness or self.remote,
            "ppo.max_staleness",
            self.max_staleness,
            "0 without rollout workers (set ppo.rollout_workers=1 or ppo.rollout_ranks to "
            "generate ahead of training)",
        )
        _check(
            not (self.rollout_workers and self.rollout_ranks),
            "ppo.rollout_workers",
            self.rollout_workers,
            "0 with ppo.rollout_ranks (the workers are either beside each trainer or on ranks "
            "of their own)",
        )
        _check(
            self.rollout_tp_size == 1 or self.rollout_ranks,
            "ppo.rollout_tp_size",
            self.rollout_tp_size,
            "1 without ppo.rollout_ranks (the TP degree of workers on ranks of their own)",
        )
        _check(
            self.rollout_tp_size == 1 or self.rollout_ranks % self.rollout_tp_size == 0,
            "ppo.rollout_tp_size",
            self.rollout_tp_size,
            f"a divisor of ppo.rollout_ranks={self.rollout_ranks} (its workers' TP degree)",
        )

    @property
    def remote(self) -> str:
        """Which key makes the episodes played apart from the trainers ('' for neither)."""
        if self.rollout_ranks:
            return f"ppo.rollout_ranks={self.rollout_ranks}"
        return "ppo.rollout_workers=1" if self.rollout_workers else ""

    def resolve(self, data: "DataConfig") -> None:
        """ppo.max_new_tokens=None: per data format; then the checks that depend on it."""
        if self.max_new_tokens is None:
            self.max_new_tokens = data.default_new_tokens()
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "ppo.min_new_tokens",
            self.min_new_tokens,
            f"0..ppo.max_new_tokens={self.max_new_tokens}",
        )
        _check(
            0 <= self.overlong_buffer < self.max_new_tokens,
            "ppo.overlong_buffer",
            self.overlong_buffer,
            f"0..ppo.max_new_tokens-1={self.max_new_tokens - 1}",
        )


@dataclass
class LauncherConfig:
    """Self-launch through torch.distributed.run (docs/keys.md); nproc_per_node=0 = no
    self-launch."""

    nnodes: int = 1
    nproc_per_node: int = 0
    node_rank: int = 0
    rdzv_endpoint: str = "127.0.0.1:29500"
    rdzv_id: str = "rlhf"
    max_restarts: int = 0


@dataclass
class Config:
    stage: str = "sft"
    # the settings a stage starts from (conf/recipe_stage/<recipe>/<stage>.yaml; docs/recipes.md):
    # embedded when no model is given, pretrained when model.path is (rlhf/compose.py decides and
    # says why: recipe_why); any explicit key=value wins over the recipe
    recipe: str = "embedded"
    recipe_why: ClassVar[str] = "the default"
    # why this process works offline (rlhf/hub.py; compose)
    hub_why: ClassVar[str] = ""
    # where train.lr came from when the recipe's LoRA rate replaced it (compose)
    lr_why: ClassVar[str] = ""
    # the moved keys the command line used, and their new names (MOVED_KEYS; compose)
    moved_why: ClassVar[str] = ""
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self):
        _check(
            self.stage in stage_names(), "stage", self.stage, "one of " + ", ".join(stage_names())
        )
        # unset data.max_prompt_len / max_response_len: per data format
        self.data.resolve()
        # eval.max_new_tokens=None: per data format
        self.eval.resolve(self.data)
        # ppo.max_new_tokens=None: per data format
        self.ppo.resolve(self.data)
        # env.name=auto, env.max_turns, env.max_trajectory_tokens=None: from the tools and turns
        self.env.resolve(self.ppo.max_new_tokens)
        if self.stage == "ppo":
            self.check_ppo()
        tp, m = self.engine.inference_tp_size, self.model
        if self.stage == "sft" and m.path is None and self.engine.hybrid and tp > 1:
            # The embedded model is built from model.*: its inference TP split is known already.
            for key in ("num_heads", "num_kv_heads", "intermediate_size"):
                _check(
                    getattr(m, key) % tp == 0,
                    f"model.{key}",
                    getattr(m, key),
                    f"a multiple of engine.inference_tp_size={tp}",
                )

    def roles(self) -> tuple:
        """The models this stage places apart (engine.<role>.*): a reference under LoRA is the actor
        with its adapters off, and PPO builds a critic for GAE only, a reference when the KL is on
        and a reward model when it scores with one."""
        if self.stage == "sft":
            return ("actor",)
        if self.stage == "reward":
            return ("reward_model",)
        own_reference = () if self.model.lora.r else ("reference",)
        if self.stage == "dpo":
            return ("actor",) + own_reference
        roles = ("actor",)
        if ESTIMATORS[self.algorithm.estimator].critic:
            roles += ("critic",)
        if self.algorithm.kl_coef > 0:
            roles += own_reference
        if self.ppo.use_reward_model:
            roles += ("reward_model",)
        if self.ppo.teacher_path:
            roles += ("teacher",)
        if self.ppo.judge_path:
            roles += ("judge",)
        return roles

    def check_ppo(self) -> None:
        """PPO settings that only make sense together (exit 2 naming the key)."""
        a, p = self.algorithm, self.ppo
        grouped = [e.name for e in ESTIMATORS.values() if e.grouped]
        if ESTIMATORS[a.estimator].grouped and p.samples_per_prompt < 2:
            raise ConfigError(
                f"ppo.samples_per_prompt={p.samples_per_prompt} is invalid for "
                f"algorithm.estimator={a.estimator}: its baseline compares a prompt's samples, "
                f"so it needs at least 2"
            )
        if p.stop_kl is not None and a.kl_coef <= 0:
            raise ConfigError(
                f"ppo.stop_kl={p.stop_kl:g} reads the KL to the reference, which "
                f"algorithm.kl_coef={a.kl_coef:g} "
                "does not compute (no reference model): set algorithm.kl_coef > 0, or "
                "gate on ppo.stop_disagreement"
            )
        if a.gkd_data_share and not a.gkd_coef:
            raise ConfigError(
                f"algorithm.gkd_data_share={a.gkd_data_share:g} shares GKD's loss with the "
                "dataset's responses, and algorithm.gkd_coef=0 turns GKD off: set "
                "algorithm.gkd_coef > 0"
            )
        if a.gkd_coef and not p.teacher_path:
            raise ConfigError(
                f"algorithm.gkd_coef={a.gkd_coef:g} compares the actor with a teacher: set "
                "ppo.teacher_path "
                f"(an HF causal LM with the actor's tokenizer)"
            )
        if (
            ESTIMATORS[a.estimator].needs_teacher
            and p.teacher_path
            and not (p.distill_coef or a.gkd_coef)
        ):
            raise ConfigError(
                f"algorithm.estimator={a.estimator} learns from the teacher's reward, "
                "which ppo.distill_coef=0 "
                "turns off: set ppo.distill_coef > 0, algorithm.gkd_coef > 0 (GKD alone), or "
                "another estimator to only watch the teacher"
            )
        if ESTIMATORS[a.estimator].needs_teacher and not p.teacher_path:
            raise ConfigError(
                f"algorithm.estimator={a.estimator} learns from a teacher's per-token "
                "log-probs: set ppo.teacher_path "
                f"(an HF causal LM with the actor's tokenizer)"
            )
        if p.remote:
            # what the rollout workers do not (yet) do
            e = self.engine
            why = (
                (
                    p.dynamic_sampling,
                    "ppo.dynamic_sampling=true (its refills are generated in the trainer)",
                ),
                (not e.hybrid, "engine.hybrid=false (a worker generates in the inference mode)"),
                (
                    e.inference_tp_size > 1,
                    f"engine.inference_tp_size={e.inference_tp_size} (a worker generates at TP 1)",
                ),
                (p.rollout_guard == "rebuild", "ppo.rollout_guard=rebuild (use stop or off)"),
            )
            for bad, what in why:
                if bad:
                    raise ConfigError(f"{p.remote} does not work with {what}")
            launched = self.launcher.nproc_per_node * self.launcher.nnodes
            if p.rollout_ranks and launched:
                # (under torchrun the ranks check the world they find: rlhf/rl/rollout_link.py)
                rollout_layout(launched, p.rollout_ranks, p.rollout_tp_size, p.prompts_per_step)
        if p.dynamic_sampling and not ESTIMATORS[a.estimator].grouped:
            raise ConfigError(
                f"ppo.dynamic_sampling=true needs a group estimator (algorithm.estimator="
                f"{one_of(grouped)}), not {a.estimator}"
            )

    def validate_world(self, world_size: int) -> None:
        """Checks that need the world size (sizes that must divide). The parallel degrees are
        checked where the mesh is built (``rlhf.engine.mesh.init_mesh``), before this can run."""
        t = self.train
        micro = t.micro_batch_per_rank or max(t.global_batch // world_size, 1)
        if t.global_batch % (micro * world_size) != 0:
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by "
                f"train.micro_batch_per_rank={micro}"
                f" x world size {world_size}"
            )


def rollout_layout(
    world: int, rollout_ranks: int, tp: int = 1, prompts: int = 0
) -> Tuple[int, int]:
    """(trainers, rollout workers) of a world of ``world`` ranks with ``ppo.rollout_ranks``, its
    workers each ``tp`` (``ppo.rollout_tp_size``) of them; exit 2 where they cannot serve it (none
    left to train, an uneven share: the trainers' and the workers' counts must divide one another,
    or fewer than ``prompts`` (``ppo.prompts_per_step``) than workers: one would play nothing)."""
    r = rollout_ranks
    if r >= world:
        raise ConfigError(
            f"ppo.rollout_ranks={r} leaves no trainer in a world of {world} rank(s): launch "
            f"{r + 1} or more (launcher.nproc_per_node, or torchrun's --nproc-per-node)"
        )
    t, w = world - r, r // tp
    if t % w and w % t:
        workers = f"the {w} rollout workers of ppo.rollout_tp_size={tp}" if tp > 1 else ""
        raise ConfigError(
            f"ppo.rollout_ranks={r} {'(' + workers + ') ' if workers else ''}and the {t} trainer "
            f"ranks of a world of {world} do not divide one another: each rollout worker serves "
            "the same number of trainers, or each trainer the same number of rollout workers"
        )
    if prompts and prompts < w:
        raise ConfigError(
            f"ppo.prompts_per_step={prompts} leaves some of the {w} rollout workers without a "
            f"prompt to play (each plays a share of its trainer's): at least {w} prompts a step, "
            "or fewer rollout workers"
        )
    return t, w


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)
