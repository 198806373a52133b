"""DeepSpeed-Chat's main.py flags (training/step1_supervised_finetuning,
step2_reward_model_finetuning, step2_dpo_finetuning, step3_rlhf_finetuning) → rlhf keys: one row per
flag, FLAG_TABLE.

A row names the steps whose main.py has the flag, DeepSpeed-Chat's default there (a run that does
not give the flag gets it: its learning rates, batch sizes, lengths and schedule are carried over
too) and the rule: a key (``Key``), a reason it has no target (``Skip``), or a function of the whole
invocation (batch sizes, LoRA and the learning rate depend on several flags and on the world size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from rlhf.migrate.plan import Plan

ALL = ("sft", "reward", "dpo", "ppo")
TRAIN12 = ("sft", "reward", "dpo")

# DeepSpeed-Chat's datasets (dschat/utils/data/raw_datasets.py) whose columns rlhf reads as they
# are: prompt / chosen / rejected (the prompt holds "\n\nHuman: ... \n\nAssistant:"; SFT trains on
# prompt + chosen) — or Anthropic's chosen / rejected transcripts
DATASETS = {
    "Dahoas/rm-static": "prompt_chosen_rejected",
    "Dahoas/full-hh-rlhf": "prompt_chosen_rejected",
    "Dahoas/synthetic-instruct-gptj-pairwise": "prompt_chosen_rejected",
    "yitingxie/rlhf-reward-datasets": "prompt_chosen_rejected",
    "Anthropic/hh-rlhf": "hh",
}


@dataclass(frozen=True)
class Key:
    key: str
    convert: Callable[[str], Any] = str


@dataclass(frozen=True)
class Skip:
    kind: str
    why: str


Rule = Union[Key, Skip, Callable[["Context", str, Any], None]]


@dataclass(frozen=True)
class Flag:
    name: str
    steps: Sequence[str]
    rule: Rule
    # DeepSpeed-Chat's default where the flag is not given (per step where they differ); None =
    # nothing
    default: Any = None
    # one | many (--data_path) | switch (store_true)
    takes: str = "one"

    def default_for(self, step: str):
        return self.default.get(step) if isinstance(self.default, dict) else self.default


@dataclass
class Context:
    """What the rules read: the invocation's flags (given ones, else DeepSpeed-Chat's defaults), the
    world size, and where earlier migrated steps export (a later step's input path that is an
    earlier step's --output_dir becomes that stage's export)."""

    step: str
    plan: Plan
    values: Dict[str, Any]
    given: set
    world: int
    # DeepSpeed-Chat output_dir -> rlhf export dir
    exports: Dict[str, str] = field(default_factory=dict)
    done: set = field(default_factory=set)

    def once(self, name: str) -> bool:
        if name in self.done:
            return False
        self.done.add(name)
        return True

    def flag(self, name: str) -> str:
        """The flag as given, ``--name words``."""
        v = self.values.get(name)
        if v is True:
            return f"--{name}"
        if isinstance(v, list):
            v = " ".join(v)
        return f"--{name} {v}"

    def path(self, value: str) -> str:
        """An input model path: an earlier step's --output_dir becomes that step's export."""
        norm = str(Path(value))
        return self.exports.get(norm, value)


def targets(text: str) -> Callable:
    """The rlhf keys a rule function sets, as docs/deepspeed.md's flag table shows them."""

    def mark(fn):
        fn.targets = text
        return fn

    return mark


# ---- rules over several flags ----


@targets(
    "train.micro_batch_per_rank = per device; train.global_batch = per device × world × "
    "accumulation"
)
def _batches(ctx: Context, name: str, value) -> None:
    """Steps 1, 2: global batch = per-device batch × world × accumulation; micro-batch =
    per-device."""
    if not ctx.once("batches"):
        return
    per = int(ctx.values["per_device_train_batch_size"])
    acc = int(ctx.values.get("gradient_accumulation_steps") or 1)
    ctx.plan.set("train.micro_batch_per_rank", per, "--per_device_train_batch_size")
    ctx.plan.set(
        "train.global_batch",
        per * ctx.world * acc,
        "--per_device_train_batch_size × world × accumulation",
    )


@targets(
    "ppo.prompts_per_step = generation batch × generation_batches × world; "
    "ppo.micro_batch_per_rank = "
    "training batch; ppo.minibatches_per_epoch = generated ÷ (training batch × accumulation); "
    "ppo.samples_per_prompt=1"
)
def _ppo_batches(ctx: Context, name: str, value) -> None:
    """Step 3: each rank generates per_device_generation_batch_size × generation_batches prompts
    (one answer each), then trains on per_device_training_batch_size × gradient_accumulation_steps
    rows an optimizer step, ppo_epochs times over them."""
    if not ctx.once("ppo_batches"):
        return
    gen = int(ctx.values["per_device_generation_batch_size"]) * int(
        ctx.values.get("generation_batches") or 1
    )
    train = int(ctx.values["per_device_training_batch_size"])
    acc = int(ctx.values.get("gradient_accumulation_steps") or 1)
    by = "--per_device_generation_batch_size × --generation_batches × world"
    ctx.plan.set("ppo.prompts_per_step", gen * ctx.world, by)
    ctx.plan.set("ppo.samples_per_prompt", 1, "DeepSpeed-Chat: one answer per prompt")
    ctx.plan.set("ppo.micro_batch_per_rank", train, "--per_device_training_batch_size")
    per_update = train * acc
    if gen % per_update:
        ctx.plan.skip(
            ctx.flag("per_device_training_batch_size"),
            "no equivalent",
            f"{gen} generated rows a rank do not split into updates of {per_update}: "
            "rlhf's updates are "
            f"equal shares (ppo.minibatches_per_epoch); {max(gen // per_update, 1)} used",
        )
    ctx.plan.set(
        "ppo.minibatches_per_epoch",
        max(gen // per_update, 1),
        "generated rows ÷ (training batch × accumulation)",
    )


@targets("train.lr (LoRA: the LoRA learning rate); step 3: ppo.critic_lr")
def _lr(ctx: Context, name: str, value) -> None:
    """The learning rate; with LoRA and --only_optimize_lora DeepSpeed-Chat trains the adapters
    alone at
    --lora_learning_rate (as rlhf does: only the adapters train)."""
    if not ctx.once("lr"):
        return
    actor_lr = "actor_learning_rate" if ctx.step == "ppo" else "learning_rate"
    lora = "actor_lora_dim" if ctx.step == "ppo" else "lora_dim"
    lora_lr = "actor_lora_learning_rate" if ctx.step == "ppo" else "lora_learning_rate"
    if int(ctx.values.get(lora) or 0) > 0:
        ctx.plan.set("train.lr", float(ctx.values[lora_lr]), f"--{lora_lr} (LoRA)")
    else:
        ctx.plan.set("train.lr", float(ctx.values[actor_lr]), f"--{actor_lr}")
    if ctx.step == "ppo":
        critic_lora = int(ctx.values.get("critic_lora_dim") or 0) > 0
        key = "critic_lora_learning_rate" if critic_lora else "critic_learning_rate"
        ctx.plan.set("ppo.critic_lr", float(ctx.values[key]), f"--{key}")


@targets(
    "model.lora.r, model.lora.alpha = r (DeepSpeed-Chat's scaling 1); critic: model.lora.critic"
)
def _lora(ctx: Context, name: str, value) -> None:
    if not ctx.once("lora"):
        return
    prefix = "actor_" if ctx.step == "ppo" else ""
    r = int(ctx.values.get(prefix + "lora_dim") or 0)
    if r <= 0:
        return
    ctx.plan.set("model.lora.r", r, f"--{prefix}lora_dim")
    ctx.plan.set("model.lora.alpha", float(r), "DeepSpeed-Chat's LoRA scaling 1 (alpha = r)")
    scope = str(ctx.values.get(prefix + "lora_module_name") or "")
    if scope not in ("decoder.layers.", "layers.", "h.", "transformer.h.", "model.layers."):
        ctx.plan.skip(
            ctx.flag(prefix + "lora_module_name"),
            "no equivalent",
            "rlhf puts adapters on every linear layer of the decoder blocks, or on the "
            "module names of "
            "model.lora.target_modules (e.g. [q_proj,v_proj]); a name prefix is not a "
            "scope it reads",
        )
    if not ctx.values.get("only_optimize_lora"):
        ctx.plan.note(
            "--only_optimize_lora not given: DeepSpeed-Chat then trains the base weights "
            "beside the "
            "adapters; rlhf trains the adapters only (add modules to "
            "model.lora.modules_to_save to train them too)"
        )
    if ctx.step == "ppo":
        critic_r = int(ctx.values.get("critic_lora_dim") or 0)
        if critic_r > 0:
            ctx.plan.set("model.lora.critic", True, "--critic_lora_dim")
            if critic_r != r:
                ctx.plan.skip(
                    ctx.flag("critic_lora_dim"),
                    "no equivalent",
                    f"rlhf's critic adapters take the actor's rank model.lora.r={r}",
                )


@targets("data.max_prompt_len and data.max_response_len, half each")
def _max_seq_len(ctx: Context, name: str, value) -> None:
    n = int(value)
    prompt = n // 2
    ctx.plan.set("data.max_prompt_len", prompt, "--max_seq_len / 2")
    ctx.plan.set("data.max_response_len", n - prompt, "--max_seq_len / 2")
    ctx.plan.note(
        f"--max_seq_len {n}: DeepSpeed-Chat cuts prompt + response at {n} tokens; rlhf "
        "cuts each apart "
        f"(data.max_prompt_len={prompt}, data.max_response_len={n - prompt}): a long "
        "prompt keeps its response"
    )


@targets(
    "data.path + data.format (several: data.sources); known: Dahoas/rm-static, "
    "Dahoas/full-hh-rlhf, "
    "Dahoas/synthetic-instruct-gptj-pairwise, yitingxie/rlhf-reward-datasets "
    "(prompt_chosen_rejected), "
    "Anthropic/hh-rlhf (hh), local/jsonfile, a local file"
)
def _data(ctx: Context, name: str, value) -> None:
    paths = value if isinstance(value, list) else [value]
    sources, left = [], []
    for p in paths:
        if p in DATASETS:
            sources.append((p, DATASETS[p]))
        elif p == "local/jsonfile":
            sources.append(("data/train.json", "prompt_chosen_rejected"))
            ctx.plan.note(
                "--data_path local/jsonfile: DeepSpeed-Chat reads "
                "<DeepSpeed-Chat>/data/train.json and "
                "eval.json; mapped to data/train.json (give data.path and data.eval_path "
                "where yours are)"
            )
        elif Path(p).exists():
            sources.append((p, "prompt_chosen_rejected"))
        else:
            left.append(p)
    for p in left:
        ctx.plan.skip(
            f"--data_path {p}",
            "no equivalent",
            "a dataset whose columns this migration does not know: add it as a "
            "data.sources entry with its "
            "data.format and data.columns (docs/contract.md, Data formats)",
        )
    if len(sources) == 1:
        ctx.plan.set("data.path", sources[0][0], "--data_path")
        ctx.plan.set("data.format", sources[0][1], "--data_path")
    elif sources:
        items = ",".join(f'{{path:"{p}",format:{f}}}' for p, f in sources)
        ctx.plan.set("data.sources", f"[{items}]", "--data_path")


@targets("data.split")
def _split(ctx: Context, name: str, value) -> None:
    ctx.plan.set("data.split", str(value), "--data_split")


@targets(
    "train.scheduler: cosine, linear → warmup_decay, constant, constant_with_warmup → "
    "warmup (decaying "
    "ones to 0: train.min_lr_ratio=0)"
)
def _scheduler(ctx: Context, name: str, value) -> None:
    table = {
        "cosine": "cosine",
        "linear": "warmup_decay",
        "constant": "constant",
        "constant_with_warmup": "warmup",
    }
    if value in table:
        ctx.plan.set("train.scheduler", table[value], "--lr_scheduler_type")
        if table[value] in ("cosine", "warmup_decay"):
            ctx.plan.set("train.min_lr_ratio", 0.0, "--lr_scheduler_type (decays to 0)")
    else:
        ctx.plan.skip(
            ctx.flag(name),
            "no equivalent",
            "rlhf's schedules: cosine, warmup_decay (linear), warmup, constant",
        )


@targets("train.epochs (train.max_steps=null)")
def _epochs(ctx: Context, name: str, value) -> None:
    ctx.plan.set("train.epochs", float(value), "--num_train_epochs")
    if "test_stop_step" not in ctx.given:
        ctx.plan.set("train.max_steps", None, "--num_train_epochs")


@targets("train.warmup_steps")
def _warmup(ctx: Context, name: str, value) -> None:
    ctx.plan.set("train.warmup_steps", int(value), "--num_warmup_steps")
    ctx.plan.set("train.warmup_ratio", None, "--num_warmup_steps")


@targets("engine.precision (fp16: engine.fp16.loss_scale_window=100, DeepSpeed-Chat's ds_config)")
def _dtype(ctx: Context, name: str, value) -> None:
    ctx.plan.set("engine.precision", value, "--dtype")
    if value == "fp16":
        # dschat/utils/ds_utils.py get_train_ds_config
        ctx.plan.set(
            "engine.fp16.loss_scale_window", 100, "--dtype fp16 (DeepSpeed-Chat's ds_config)"
        )


@targets(
    "model.path (step 1), reward.model_path (step 2), dpo.model_path (DPO); an earlier "
    "step's --output_dir: its export"
)
def _model(ctx: Context, name: str, value) -> None:
    key = {"sft": "model.path", "reward": "reward.model_path", "dpo": "dpo.model_path"}[ctx.step]
    ctx.plan.set(key, ctx.path(value), f"--{name}")


@targets("run.dir")
def _output(ctx: Context, name: str, value) -> None:
    ctx.plan.set("run.dir", value, "--output_dir")


@targets("0.0 in PPO/DPO: model.disable_dropout=true; else no equivalent")
def _dropout(ctx: Context, name: str, value) -> None:
    if value is None:
        return
    if ctx.step in ("ppo", "dpo") and float(value) == 0.0:
        ctx.plan.set("model.disable_dropout", True, f"--{name} 0.0")
        return
    where = "PPO and DPO set every dropout to 0 (model.disable_dropout=true) or keep the model's"
    if ctx.step in ("sft", "reward"):
        where = "SFT and reward train with the model's own dropout (its config.json: edit it there)"
    ctx.plan.skip(ctx.flag(name), "no equivalent", where)


@targets(
    "engine.zero_stage / engine.actor.zero_stage (+ engine.reference.zero_stage: 3 with "
    "the actor's 3, "
    "else 0) / engine.critic.zero_stage + engine.reward_model.zero_stage"
)
def _zero(ctx: Context, name: str, value) -> None:
    stage = int(value)
    if name == "zero_stage":
        ctx.plan.set("engine.zero_stage", stage, "--zero_stage")
        if ctx.step == "dpo":
            # DeepSpeed-Chat's reference: ZeRO-3 with the policy, else 0
            ctx.plan.set(
                "engine.reference.zero_stage",
                3 if stage == 3 else 0,
                "--zero_stage (the reference)",
            )
    elif name == "actor_zero_stage":
        ctx.plan.set("engine.actor.zero_stage", stage, "--actor_zero_stage")
        ctx.plan.set(
            "engine.reference.zero_stage",
            3 if stage == 3 else 0,
            "--actor_zero_stage (the reference)",
        )
    else:
        ctx.plan.set("engine.critic.zero_stage", stage, "--critic_zero_stage")
        ctx.plan.set(
            "engine.reward_model.zero_stage", stage, "--critic_zero_stage (and the reward model)"
        )


@targets("ppo.reward_model_path (the critic starts from the reward model)")
def _critic_path(ctx: Context, name: str, value) -> None:
    """DeepSpeed-Chat's critic and reward model both start from --critic_model_name_or_path (a
    step-2 reward model): rlhf's reward model is that path, and its critic starts from the reward
    model."""
    ctx.plan.set("ppo.reward_model_path", ctx.path(value), "--critic_model_name_or_path")


@targets("ppo.ema_decay=0.992")
def _ema(ctx: Context, name: str, value) -> None:
    if value:
        ctx.plan.set(
            "ppo.ema_decay", 0.992, "--enable_ema (dschat/utils/utils.py moving_average beta)"
        )


@targets("logger.tensorboard=true")
def _tensorboard(ctx: Context, name: str, value) -> None:
    if value:
        ctx.plan.set("logger.tensorboard", True, "--enable_tensorboard")


@targets("logger.tensorboard_dir (where it is not --output_dir)")
def _tensorboard_path(ctx: Context, name: str, value) -> None:
    """Events go to <run.dir>/tensorboard/<stage>/ unless the script names another directory than
    its
    --output_dir (DeepSpeed-Chat's scripts give the output directory)."""
    out = ctx.values.get("output_dir")
    if (
        ctx.values.get("enable_tensorboard")
        and name in ctx.given
        and Path(value) != Path(out or ".")
    ):
        ctx.plan.set("logger.tensorboard_dir", value, "--tensorboard_path")


@targets("train.max_steps (with --enable_test_mode)")
def _test_stop(ctx: Context, name: str, value) -> None:
    if ctx.values.get("enable_test_mode") and int(value) > 0:
        ctx.plan.set("train.max_steps", int(value), "--test_stop_step")


@targets(
    "algorithm.ptx_coef = --unsup_coef; the dataset: no equivalent (PPO-ptx trains on the SFT data)"
)
def _unsup(ctx: Context, name: str, value) -> None:
    if value is None:
        return
    ctx.plan.set("algorithm.ptx_coef", float(ctx.values["unsup_coef"]), "--unsup_coef")
    ctx.plan.skip(
        ctx.flag(name),
        "no equivalent",
        "rlhf's PPO-ptx (algorithm.ptx_coef) trains on the SFT data of data.*, not on a "
        "dataset of its own",
    )


@targets("engine.offload / engine.reference.offload / engine.reward_model.offload = cpu")
def _offload(ctx: Context, name: str, value) -> None:
    if not value:
        return
    key = {
        "offload": "engine.offload",
        "offload_reference_model": "engine.reference.offload",
        "offload_reward_model": "engine.reward_model.offload",
    }[name]
    ctx.plan.set(key, "cpu", f"--{name}")


@targets("engine.activation_checkpointing / engine.actor.* / engine.critic.*")
def _checkpointing(ctx: Context, name: str, value) -> None:
    if not value:
        return
    key = {
        "gradient_checkpointing": "engine.activation_checkpointing",
        "actor_gradient_checkpointing": "engine.actor.activation_checkpointing",
        "critic_gradient_checkpointing": "engine.critic.activation_checkpointing",
    }[name]
    ctx.plan.set(key, True, f"--{name}")


def _switch_skip(kind: str, why: str) -> Callable:
    """A switch that has no target only when it is on (off is rlhf's behaviour too)."""

    def rule(ctx: Context, name: str, value) -> None:
        if value:
            ctx.plan.skip(ctx.flag(name), kind, why)

    rule.targets = f"— {kind}: {why}"
    return rule


@targets("the actor's train.weight_decay (else no equivalent)")
def _critic_wd(ctx: Context, name: str, value) -> None:
    actor = float(ctx.values.get("actor_weight_decay") or 0.0)
    if float(value) != actor:
        ctx.plan.skip(
            ctx.flag(name),
            "no equivalent",
            f"the critic trains with the actor's train.weight_decay={actor}",
        )


@targets("engine.hybrid=true (rlhf's default, given or not)")
def _hybrid(ctx: Context, name: str, value) -> None:
    if value:
        ctx.plan.set("engine.hybrid", True, f"--{name}")
    else:
        ctx.plan.note(
            "--enable_hybrid_engine not given: DeepSpeed-Chat then generates with the "
            "training model; rlhf's "
            "hybrid engine is on (engine.hybrid=true): faster, and rollouts equal what "
            "training recomputes"
        )


@targets("ppo.actor_path (an earlier step's --output_dir: its export)")
def _actor_path(ctx: Context, name: str, value) -> None:
    ctx.plan.set("ppo.actor_path", ctx.path(value), f"--{name}")


@targets(
    "folded into the batch sizes (see --per_device_train_batch_size / "
    "--per_device_training_batch_size)"
)
def _accumulation(ctx: Context, name: str, value) -> None:
    (_ppo_batches if ctx.step == "ppo" else _batches)(ctx, name, value)
    if int(value or 1) > 1:
        into = (
            "ppo.minibatches_per_epoch (an update takes --per_device_training_batch_size × "
            "this many rows a rank, "
            "in micro-batches of ppo.micro_batch_per_rank)"
            if ctx.step == "ppo"
            else "train.global_batch (rlhf accumulates micro-batches of "
            "train.micro_batch_per_rank up to it)"
        )
        ctx.plan.note(f"--{name} {value}: folded into {into}")


@targets("train.log_every=1")
def _print_loss(ctx: Context, name: str, value) -> None:
    if value:
        ctx.plan.set("train.log_every", 1, f"--{name}")


@targets("engine.release_inference_cache=true (rlhf's default)")
def _release_cache(ctx: Context, name: str, value) -> None:
    if value:
        ctx.plan.set("engine.release_inference_cache", True, f"--{name}")


NOT_NEEDED_LAUNCH = Skip("not needed", "torchrun and rlhf's launcher set the local rank")

FLAG_TABLE: tuple = (
    # data
    Flag("data_path", ALL, _data, default=["Dahoas/rm-static"], takes="many"),
    Flag("data_split", ALL, _split, default="2,4,4"),
    Flag(
        "sft_only_data_path",
        ("sft",),
        Skip(
            "no equivalent",
            "add those datasets to data.sources of the SFT command (they then also split "
            "by data.split)",
        ),
        takes="many",
    ),
    Flag("data_output_path", ALL, Key("run.cache_dir")),
    Flag("max_seq_len", TRAIN12, _max_seq_len, default=512),
    Flag("max_prompt_seq_len", ("ppo",), Key("data.max_prompt_len", int), default=256),
    Flag("max_answer_seq_len", ("ppo",), Key("ppo.max_new_tokens", int), default=256),
    Flag("unsupervised_dataset_name", ("ppo",), _unsup),
    Flag(
        "unsupervised_dataset_config_name",
        ("ppo",),
        Skip("no equivalent", "see --unsupervised_dataset_name"),
    ),
    Flag(
        "unsup_coef",
        ("ppo",),
        Skip("different default", "used with --unsupervised_dataset_name (algorithm.ptx_coef)"),
        default=None,
    ),
    Flag(
        "num_padding_at_beginning",
        ("reward", "ppo"),
        Skip(
            "not needed",
            "rlhf's reward models score the last token that is not padding, wherever the "
            "padding is "
            "(a DeepSpeed-Chat reward model is converted on load)",
        ),
    ),
    Flag(
        "preprocessing_num_workers",
        ("ppo",),
        Skip("not needed", "tokenization is cached in run.cache_dir"),
    ),
    Flag(
        "add_eot_token",
        ALL,
        _switch_skip(
            "no equivalent",
            "responses end with the tokenizer's EOS; give a chat template "
            "(data.chat_template) for turn markers",
        ),
        takes="switch",
    ),
    Flag("eot_token", ("sft",), Skip("no equivalent", "see --add_eot_token")),
    # models
    Flag("model_name_or_path", TRAIN12, _model),
    Flag("actor_model_name_or_path", ("ppo",), _actor_path),
    Flag("critic_model_name_or_path", ("ppo",), _critic_path),
    Flag("dropout", TRAIN12, _dropout),
    Flag("actor_dropout", ("ppo",), _dropout),
    Flag("critic_dropout", ("ppo",), _dropout),
    # batches and schedule
    Flag("per_device_train_batch_size", TRAIN12, _batches, default=16),
    Flag(
        "gradient_accumulation_steps",
        ALL,
        _accumulation,
        default=1,
    ),
    Flag(
        "per_device_eval_batch_size",
        TRAIN12,
        Skip("not needed", "held-out forwards take the training micro-batch"),
    ),
    Flag("per_device_generation_batch_size", ("ppo",), _ppo_batches, default=16),
    Flag("per_device_training_batch_size", ("ppo",), _ppo_batches, default=16),
    Flag("generation_batches", ("ppo",), _ppo_batches, default=1),
    Flag("ppo_epochs", ("ppo",), Key("ppo.ppo_epochs", int), default=1),
    Flag("learning_rate", TRAIN12, _lr, default={"sft": 1e-3, "reward": 5e-5, "dpo": 1e-3}),
    Flag("actor_learning_rate", ("ppo",), _lr, default=9.65e-6),
    Flag("critic_learning_rate", ("ppo",), _lr, default=5e-6),
    Flag("weight_decay", TRAIN12, Key("train.weight_decay", float), default=0.0),
    Flag("actor_weight_decay", ("ppo",), Key("train.weight_decay", float), default=0.0),
    Flag("critic_weight_decay", ("ppo",), _critic_wd, default=0.0),
    Flag("num_train_epochs", ALL, _epochs, default=1),
    Flag("lr_scheduler_type", ALL, _scheduler, default="cosine"),
    Flag("num_warmup_steps", ALL, _warmup, default={"sft": 0, "reward": 0, "dpo": 0, "ppo": 100}),
    Flag("seed", ALL, Key("run.seed", int), default={"sft": 1234, "reward": 1234, "dpo": 1234}),
    Flag("eval_interval", ("reward",), Key("train.eval_every", int)),
    Flag(
        "eval_iters",
        ("reward",),
        Skip("no equivalent", "held-out evaluation scores data.eval_size records"),
    ),
    Flag("beta", ("dpo",), Key("dpo.beta", float), default=0.1),
    Flag("label_smoothing", ("dpo",), Key("dpo.label_smoothing", float), default=0.0),
    # output, logging
    Flag("output_dir", ALL, _output),
    Flag("local_rank", ALL, NOT_NEEDED_LAUNCH),
    Flag("enable_tensorboard", ALL, _tensorboard, takes="switch"),
    Flag("tensorboard_path", ALL, _tensorboard_path),
    Flag("print_loss", TRAIN12, _print_loss, takes="switch"),
    Flag(
        "print_answers",
        ("ppo",),
        _switch_skip("no equivalent", "rlhf.generate samples an exported or checkpointed actor"),
        takes="switch",
    ),
    Flag("print_answers_interval", ("ppo",), Skip("no equivalent", "see --print_answers")),
    Flag(
        "enable_test_mode",
        ("ppo",),
        Skip("different default", "see --test_stop_step (train.max_steps)"),
        takes="switch",
    ),
    Flag("test_stop_step", ("ppo",), _test_stop),
    # engine
    Flag("dtype", ALL, _dtype, default="fp16"),
    Flag("zero_stage", TRAIN12, _zero, default=0),
    Flag("actor_zero_stage", ("ppo",), _zero, default=0),
    Flag("critic_zero_stage", ("ppo",), _zero, default=0),
    Flag("offload", ALL, _offload, takes="switch"),
    Flag("offload_reference_model", ("dpo", "ppo"), _offload, takes="switch"),
    Flag("offload_reward_model", ("ppo",), _offload, takes="switch"),
    Flag("gradient_checkpointing", TRAIN12, _checkpointing, takes="switch"),
    Flag("actor_gradient_checkpointing", ("ppo",), _checkpointing, takes="switch"),
    Flag("critic_gradient_checkpointing", ("ppo",), _checkpointing, takes="switch"),
    Flag("enable_hybrid_engine", ("ppo",), _hybrid, takes="switch"),
    Flag("inference_tp_size", ("ppo",), Key("engine.inference_tp_size", int)),
    Flag(
        "tp_gather_partition_size",
        ("ppo",),
        Skip("not needed", "the inference mode gathers each decoder block's shards whole (FSDP2)"),
    ),
    Flag(
        "unpin_actor_parameters",
        ("ppo",),
        _switch_skip("not needed", "no pinned copy of the actor is kept for generation"),
        takes="switch",
    ),
    Flag(
        "release_inference_cache",
        ("ppo",),
        _release_cache,
        takes="switch",
    ),
    Flag("enable_ema", ("ppo",), _ema, takes="switch"),
    Flag(
        "enable_mixed_precision_lora",
        ("ppo",),
        _switch_skip(
            "no equivalent",
            "ZeRO++ quantized frozen weights: rlhf keeps them in the training precision",
        ),
        takes="switch",
    ),
    Flag(
        "compute_fp32_loss",
        ("ppo",),
        _switch_skip(
            "not needed",
            "rlhf computes every loss and log-prob in fp32 (logits cast before log-softmax)",
        ),
        takes="switch",
    ),
    Flag(
        "align_overflow",
        ("ppo",),
        _switch_skip(
            "no equivalent",
            "under fp16 each model skips its own overflowing step (actor and critic apart)",
        ),
        takes="switch",
    ),
    # LoRA
    Flag("lora_dim", TRAIN12, _lora, default=0),
    Flag("actor_lora_dim", ("ppo",), _lora, default=0),
    Flag("critic_lora_dim", ("ppo",), _lora, default=0),
    Flag("lora_module_name", TRAIN12, _lora, default="decoder.layers."),
    Flag("actor_lora_module_name", ("ppo",), _lora, default="decoder.layers."),
    Flag(
        "critic_lora_module_name",
        ("ppo",),
        Skip("different default", "the critic's adapters sit where the actor's do"),
    ),
    Flag("only_optimize_lora", ALL, _lora, takes="switch"),
    Flag("lora_learning_rate", TRAIN12, _lr, default=5e-4),
    Flag("actor_lora_learning_rate", ("ppo",), _lr, default=5e-4),
    Flag("critic_lora_learning_rate", ("ppo",), _lr, default=5e-4),
    # DeepSpeed's own (deepspeed.add_config_arguments); --deepspeed_config is read by
    # rlhf.migrate.ds_config
    Flag(
        "deepspeed",
        ALL,
        Skip("not needed", "rlhf runs on FSDP2: no DeepSpeed engine to enable"),
        takes="switch",
    ),
    Flag("deepscale", ALL, Skip("not needed", "rlhf runs on FSDP2"), takes="switch"),
)
FLAGS: Dict[str, Flag] = {f.name: f for f in FLAG_TABLE}
# a ds_config.json path: read by ds_config.py
CONFIG_FLAGS = ("deepspeed_config", "deepscale_config")


def value_of(flag: Flag, words: Optional[List[str]]):
    """A given flag's words as its rule reads them (a switch: True)."""
    if flag.takes == "switch":
        return True
    if flag.takes == "many":
        return list(words or [])
    return words[0] if words else ""


def apply_flags(ctx: Context, flags: Dict[str, List[str]]) -> None:
    """Every row of the step: the given flags, and DeepSpeed-Chat's defaults of the others."""
    for name in flags:
        if name in CONFIG_FLAGS:
            continue
        row = FLAGS.get(name)
        if row is None:
            ctx.plan.skip(
                f"--{name}", "no equivalent", "not a DeepSpeed-Chat flag this migration knows"
            )
        elif ctx.step not in row.steps:
            ctx.plan.skip(
                f"--{name}", "no equivalent", f"not a flag of DeepSpeed-Chat's {ctx.step} step"
            )
    for row in FLAG_TABLE:
        if ctx.step not in row.steps:
            continue
        if row.name in flags:
            ctx.values[row.name] = value_of(row, flags[row.name])
            ctx.given.add(row.name)
        elif row.default_for(ctx.step) is not None:
            ctx.values[row.name] = row.default_for(ctx.step)
    for row in FLAG_TABLE:
        if ctx.step not in row.steps or row.name not in ctx.values:
            continue
        value = ctx.values[row.name]
        rule = row.rule
        if isinstance(rule, Key):
            ctx.plan.set(rule.key, rule.convert(value), f"--{row.name}")
        elif isinstance(rule, Skip):
            if row.name in ctx.given:
                ctx.plan.skip(ctx.flag(row.name), rule.kind, rule.why)
        else:
            rule(ctx, row.name, value)


def flag_table_markdown() -> str:
    """docs/deepspeed.md's flag table, from FLAG_TABLE (tests/unit/migrate/test_migrate.py keeps the
    page equal)."""
    rows = [
        "| DeepSpeed-Chat flag | steps | DeepSpeed-Chat default | rlhf |",
        "| --- | --- | --- | --- |",
    ]
    for f in FLAG_TABLE:
        rule = f.rule
        if isinstance(rule, Key):
            ours = f"`{rule.key}`"
        elif isinstance(rule, Skip):
            ours = f"— {rule.kind}: {rule.why}"
        else:
            ours = rule.targets
        default = f.default
        if isinstance(default, dict):
            default = ", ".join(f"{k} {v}" for k, v in default.items())
        elif isinstance(default, list):
            default = " ".join(default)
        elif default is None:
            default = ""
        steps = "all" if tuple(f.steps) == ALL else ", ".join(f.steps)
        rows.append(f"| `--{f.name}` | {steps} | {default} | {ours} |")
    return "\n".join(rows)
