"""DeepSpeed ``ds_config.json`` keys → rlhf keys: one row per key (dotted path), CONFIG_TABLE.

Sections that are all FSDP2's business (ZeRO's buckets and prefetch sizes) or have no counterpart
(compression, curriculum learning, pipeline parallelism, ...) are rows of their own, so that every
key a file holds gets a line: mapped, or not and why. ``"auto"`` values (the Hugging Face Trainer's
integration) are left to rlhf, which derives them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Union

from rlhf.errors import UserError
from rlhf.migrate.plan import Plan

FSDP2 = "FSDP2 gathers and reduces per decoder block (its own buckets and prefetch): no size to set"


@dataclass(frozen=True)
class To:
    key: str
    convert: Callable[[Any], Any] = lambda v: v


@dataclass(frozen=True)
class Off:
    kind: str
    why: str


Rule = Union[To, Off, Callable[[Plan, str, Any, dict], None]]


def _zero_stage(plan: Plan, key: str, value, cfg: dict) -> None:
    """`engine.zero_stage`"""
    plan.set("engine.zero_stage", int(value), key)


def _offload(plan: Plan, key: str, value, cfg: dict) -> None:
    """cpu: `engine.offload=cpu` (parameters, gradients and optimizer state together); nvme: no
    equivalent"""
    device = str(value)
    if device == "cpu":
        plan.set("engine.offload", "cpu", key)
        zero = cfg.get("zero_optimization", {})
        other = "offload_param" if key.endswith("offload_optimizer.device") else "offload_optimizer"
        if str(zero.get(other, {}).get("device", "none")) != "cpu":
            plan.note(
                f"{key}=cpu: FSDP2's CPU offload moves parameters, gradients and optimizer "
                "state together "
                f"(DeepSpeed's {other} was not set: rlhf offloads it too)"
            )
    elif device == "nvme":
        plan.skip(
            f"{key}=nvme", "no equivalent", "no NVMe offload: engine.offload=cpu is the nearest"
        )


def _precision(name: str) -> Callable:
    def rule(plan: Plan, key: str, value, cfg: dict) -> None:
        if value is True or str(value).lower() == "true":
            plan.set("engine.precision", name, key)

    rule.__doc__ = f"`engine.precision={name}`"
    return rule


def _fp16_key(name: str, convert=float) -> Callable:
    def rule(plan: Plan, key: str, value, cfg: dict) -> None:
        if cfg.get("fp16", {}).get("enabled") in (True, "true", "auto"):
            plan.set(f"engine.fp16.{name}", convert(value), key)

    rule.__doc__ = f"`engine.fp16.{name}`"
    return rule


def _optimizer_type(plan: Plan, key: str, value, cfg: dict) -> None:
    """AdamW (Adam, FusedAdam, CPUAdam: AdamW with adam_w_mode); others: no equivalent"""
    kind = str(value).lower()
    if kind in ("adamw", "adam", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        params = cfg.get("optimizer", {}).get("params", {})
        if kind != "adamw" and params.get("adam_w_mode", True) is False:
            plan.skip(
                f"{key}={value}",
                "no equivalent",
                "Adam with L2 weight decay: rlhf's optimizer is AdamW",
            )
        elif kind not in ("adamw",):
            plan.note(
                f"{key}={value}: rlhf trains with AdamW (DeepSpeed's Adam is AdamW by "
                "default, adam_w_mode)"
            )
    else:
        plan.skip(
            f"{key}={value}",
            "no equivalent",
            "rlhf's optimizer is AdamW (train.lr, betas, eps, weight_decay)",
        )


def _scheduler(plan: Plan, key: str, value, cfg: dict) -> None:
    """`train.scheduler`: WarmupLR → warmup, WarmupDecayLR → warmup_decay, WarmupCosineLR →
    cosine"""
    table = {"WarmupLR": "warmup", "WarmupDecayLR": "warmup_decay", "WarmupCosineLR": "cosine"}
    if value in table:
        plan.set("train.scheduler", table[value], key)
        if value != "WarmupLR":
            plan.set("train.min_lr_ratio", 0.0, key)
    else:
        plan.skip(
            f"{key}={value}",
            "no equivalent",
            "rlhf's schedules: warmup, warmup_decay, cosine, constant",
        )


def _warmup_max_lr(plan: Plan, key: str, value, cfg: dict) -> None:
    """`train.lr`"""
    plan.set("train.lr", float(value), key)


def _warmup_min_lr(plan: Plan, key: str, value, cfg: dict) -> None:
    """0: rlhf's; else no equivalent (the warmup starts from 0)"""
    if float(value) != 0.0:
        plan.skip(f"{key}={value}", "no equivalent", "rlhf's warmup starts from 0")


def _warmup_steps(plan: Plan, key: str, value, cfg: dict) -> None:
    """`train.warmup_steps`"""
    plan.set("train.warmup_steps", int(value), key)
    plan.set("train.warmup_ratio", None, key)


def _warmup_type(plan: Plan, key: str, value, cfg: dict) -> None:
    """linear: rlhf's; log: no equivalent"""
    if str(value) != "linear":
        plan.skip(f"{key}={value}", "no equivalent", "rlhf's warmup is linear")


def _total_steps(plan: Plan, key: str, value, cfg: dict) -> None:
    """`train.max_steps`"""
    plan.set("train.max_steps", int(value), key)


def _tensorboard(plan: Plan, key: str, value, cfg: dict) -> None:
    """`logger.tensorboard`"""
    if value is True:
        plan.set("logger.tensorboard", True, key)


def _tensorboard_path(plan: Plan, key: str, value, cfg: dict) -> None:
    """`logger.tensorboard_dir`"""
    if cfg.get("tensorboard", {}).get("enabled") is True and value:
        plan.set("logger.tensorboard_dir", str(value), key)


def _wandb(plan: Plan, key: str, value, cfg: dict) -> None:
    """`logger.wandb=online`"""
    if value is True:
        plan.set("logger.wandb", "online", key)


def _hybrid(plan: Plan, key: str, value, cfg: dict) -> None:
    """`engine.hybrid`"""
    plan.set("engine.hybrid", bool(value), key)


def _betas(plan: Plan, key: str, value, cfg: dict) -> None:
    """`train.betas`"""
    plan.set("train.betas", [float(b) for b in value], key)


CONFIG_TABLE: Dict[str, Rule] = {
    # batch (train_batch_size = micro × accumulation × world; rlhf derives accumulation)
    "train_batch_size": To("train.global_batch", int),
    "train_micro_batch_size_per_gpu": To("train.micro_batch_per_rank", int),
    "gradient_accumulation_steps": Off(
        "different default", "rlhf derives it: train.global_batch ÷ (micro-batch × world)"
    ),
    "steps_per_print": To("train.log_every", int),
    "gradient_clipping": To("train.grad_clip", float),
    # precision
    "fp16.enabled": _precision("fp16"),
    "fp16.loss_scale": _fp16_key("loss_scale"),
    "fp16.initial_scale_power": _fp16_key("initial_scale_power", int),
    "fp16.loss_scale_window": _fp16_key("loss_scale_window", int),
    "fp16.hysteresis": _fp16_key("hysteresis", int),
    "fp16.consecutive_hysteresis": _fp16_key("consecutive_hysteresis", bool),
    "fp16.min_loss_scale": _fp16_key("min_loss_scale"),
    "fp16.auto_cast": Off(
        "not needed", "inputs are token ids; the compute dtype follows engine.precision"
    ),
    "fp16.fp16_master_weights_and_grads": Off(
        "no equivalent", "master weights and gradient reductions are fp32"
    ),
    "bf16.enabled": _precision("bf16"),
    "bfloat16.enabled": _precision("bf16"),
    "bf16.immediate_grad_update": Off("not needed", "gradients are reduced in fp32"),
    "amp.enabled": Off("no equivalent", "NVIDIA apex AMP: use engine.precision=fp16 or bf16"),
    "communication_data_type": Off("not needed", "gradients are reduced in fp32"),
    "data_types.grad_accum_dtype": Off("not needed", "gradients accumulate in fp32"),
    "prescale_gradients": Off("not needed", "gradients are averaged in fp32 after the reduction"),
    "gradient_predivide_factor": Off(
        "not needed", "gradients are averaged in fp32 after the reduction"
    ),
    # ZeRO
    "zero_optimization.stage": _zero_stage,
    "zero_optimization.offload_optimizer.device": _offload,
    "zero_optimization.offload_param.device": _offload,
    "zero_optimization.offload_optimizer.pin_memory": Off(
        "not needed", "FSDP2's CPU offload pins its host memory"
    ),
    "zero_optimization.offload_param.pin_memory": Off(
        "not needed", "FSDP2's CPU offload pins its host memory"
    ),
    "zero_optimization.offload_optimizer.nvme_path": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_param.nvme_path": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_optimizer.buffer_count": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_param.buffer_count": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_param.buffer_size": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_param.max_in_cpu": Off("no equivalent", "no NVMe offload"),
    "zero_optimization.offload_optimizer.fast_init": Off("not needed", FSDP2),
    "zero_optimization.offload_optimizer.ratio": Off(
        "no equivalent", "all or nothing: engine.offload=cpu"
    ),
    "zero_optimization.overlap_comm": Off("not needed", FSDP2),
    "zero_optimization.contiguous_gradients": Off("not needed", FSDP2),
    "zero_optimization.reduce_bucket_size": Off("not needed", FSDP2),
    "zero_optimization.allgather_bucket_size": Off("not needed", FSDP2),
    "zero_optimization.allgather_partitions": Off("not needed", FSDP2),
    "zero_optimization.reduce_scatter": Off("not needed", FSDP2),
    "zero_optimization.round_robin_gradients": Off("not needed", FSDP2),
    "zero_optimization.sub_group_size": Off("not needed", FSDP2),
    "zero_optimization.elastic_checkpoint": Off(
        "not needed", "checkpoints reshard to any world size (DCP)"
    ),
    "zero_optimization.load_from_fp32_weights": Off("not needed", "master weights are fp32"),
    "zero_optimization.stage3_prefetch_bucket_size": Off("not needed", FSDP2),
    "zero_optimization.stage3_param_persistence_threshold": Off("not needed", FSDP2),
    "zero_optimization.stage3_max_live_parameters": Off("not needed", FSDP2),
    "zero_optimization.stage3_max_reuse_distance": Off("not needed", FSDP2),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Off(
        "not needed", "exports gather full weights always"
    ),
    "zero_optimization.gather_16bit_weights_on_model_save": Off(
        "not needed", "exports gather full weights always"
    ),
    "zero_optimization.memory_efficient_linear": Off("not needed", FSDP2),
    "zero_optimization.ignore_unused_parameters": Off("not needed", FSDP2),
    "zero_optimization.zero_hpz_partition_size": Off(
        "no equivalent", "ZeRO++ hierarchical partitioning"
    ),
    "zero_optimization.zero_quantized_weights": Off("no equivalent", "ZeRO++ quantized weights"),
    "zero_optimization.zero_quantized_gradients": Off(
        "no equivalent", "ZeRO++ quantized gradients"
    ),
    "zero_optimization.zero_quantized_nontrainable_weights": Off(
        "no equivalent", "ZeRO++ quantized frozen weights"
    ),
    "zero_optimization.mics_shard_size": Off("no equivalent", "MiCS: FSDP2 shards over every rank"),
    "zero_allow_untested_optimizer": Off("not needed", "one optimizer, AdamW"),
    "zero_force_ds_cpu_optimizer": Off(
        "not needed", "FSDP2's offload steps torch's AdamW on the host"
    ),
    # optimizer and schedule
    "optimizer.type": _optimizer_type,
    "optimizer.params.lr": To("train.lr", float),
    "optimizer.params.betas": _betas,
    "optimizer.params.eps": To("train.eps", float),
    "optimizer.params.weight_decay": To("train.weight_decay", float),
    "optimizer.params.adam_w_mode": Off("different default", "read with optimizer.type"),
    "optimizer.params.torch_adam": Off("not needed", "rlhf uses torch's AdamW (foreach)"),
    "optimizer.params.bias_correction": Off("different default", "AdamW with bias correction"),
    "scheduler.type": _scheduler,
    "scheduler.params.warmup_max_lr": _warmup_max_lr,
    "scheduler.params.warmup_min_lr": _warmup_min_lr,
    "scheduler.params.warmup_num_steps": _warmup_steps,
    "scheduler.params.warmup_type": _warmup_type,
    "scheduler.params.total_num_steps": _total_steps,
    "scheduler.params.cos_min_ratio": To("train.min_lr_ratio", float),
    "scheduler.params.warmup_min_ratio": _warmup_min_lr,
    "scheduler.params.last_batch_iteration": Off(
        "not needed", "resume restores the schedule from the checkpoint"
    ),
    # hybrid engine (DeepSpeed-Chat's actor)
    "hybrid_engine.enabled": _hybrid,
    "hybrid_engine.inference_tp_size": To("engine.inference_tp_size", int),
    "hybrid_engine.release_inference_cache": To("engine.release_inference_cache", bool),
    "hybrid_engine.pin_parameters": Off(
        "not needed", "no pinned copy of the actor is kept for generation"
    ),
    "hybrid_engine.tp_gather_partition_size": Off(
        "not needed", "the inference mode gathers each block's shards whole"
    ),
    "hybrid_engine.max_out_tokens": Off(
        "not needed", "the KV cache is sized from the prompt and response lengths"
    ),
    # logging
    "tensorboard.enabled": _tensorboard,
    "tensorboard.output_path": _tensorboard_path,
    "tensorboard.job_name": Off("different default", "events go under the stage's name"),
    "wandb.enabled": _wandb,
    "wandb.project": To("logger.project", str),
    "wandb.team": Off("no equivalent", "set WANDB_ENTITY"),
    "wandb.group": Off("no equivalent", "set WANDB_RUN_GROUP"),
    "csv_monitor.enabled": Off("different default", "every metric is in <stage>/metrics.jsonl"),
    "csv_monitor.output_path": Off("different default", "every metric is in <stage>/metrics.jsonl"),
    "csv_monitor.job_name": Off("different default", "every metric is in <stage>/metrics.jsonl"),
    "wall_clock_breakdown": Off("not needed", "step timings are logged (perf/*, rollout/*_s)"),
    "memory_breakdown": Off("not needed", "peak memory is logged (mem/peak_gb)"),
    "dump_state": Off("not needed", "<stage>/config.yaml holds the resolved configuration"),
    # activation checkpointing of DeepSpeed's own API (models calling deepspeed.checkpointing)
    "activation_checkpointing.partition_activations": Off(
        "no equivalent",
        "engine.activation_checkpointing recomputes each block (no partitioned activations)",
    ),
    "activation_checkpointing.cpu_checkpointing": Off(
        "no equivalent", "activations are not offloaded"
    ),
    "activation_checkpointing.contiguous_memory_optimization": Off(
        "not needed", "torch's non-reentrant checkpointing"
    ),
    "activation_checkpointing.number_checkpoints": Off(
        "not needed", "one checkpoint per decoder block"
    ),
    "activation_checkpointing.synchronize_checkpoint_boundary": Off(
        "not needed", "torch's non-reentrant checkpointing"
    ),
    "activation_checkpointing.profile": Off("not needed", "torch's non-reentrant checkpointing"),
}
# whole sections with no counterpart: every key under them is one line
SECTIONS: Dict[str, Off] = {
    "flops_profiler": Off("no equivalent", "use torch.profiler"),
    "comms_logger": Off("no equivalent", "use torch.profiler"),
    "autotuning": Off(
        "no equivalent", "set batch sizes by hand (bench/real_size.py measures them)"
    ),
    "aio": Off("no equivalent", "no NVMe offload"),
    "elasticity": Off(
        "different default", "elastic restarts: launcher.max_restarts, resume on any world size"
    ),
    "compression_training": Off("no equivalent", "no compression-aware training"),
    "data_efficiency": Off("no equivalent", "no curriculum or data routing"),
    "curriculum_learning": Off("no equivalent", "no curriculum learning"),
    "sparse_attention": Off("no equivalent", "attention is SDPA (packed where the family allows)"),
    "pipeline": Off("no equivalent", "no pipeline parallelism (FSDP2 + inference TP)"),
    "checkpoint": Off(
        "not needed", "checkpoints are torch.distributed.checkpoint, verified by manifest"
    ),
    "monitor_config": Off("different default", "metrics.jsonl, wandb, TensorBoard (logger.*)"),
    "nebula": Off("no equivalent", "checkpoints are written by DCP"),
    "quantize_training": Off("no equivalent", "no quantized training"),
    "weight_quantization": Off("no equivalent", "no quantized weights"),
    "gradient_compression": Off("no equivalent", "no compressed gradients"),
}


def _leaves(obj, prefix=""):
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, obj


def read_config(path: str) -> dict:
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{path}: cannot read the DeepSpeed config ({e.strerror or e})") from None
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: a DeepSpeed config is a JSON object")
    return cfg


def apply_config(plan: Plan, cfg: dict) -> None:
    """Every leaf of ``cfg`` through CONFIG_TABLE (or its section's row): a key, a rule, or a
    reason. A section switched off (``"enabled": false``) is rlhf's behaviour too: nothing to say
    about its keys."""
    off = {
        k for k, v in cfg.items() if isinstance(v, dict) and v.get("enabled") in (False, "false")
    }
    if "hybrid_engine" in off:
        plan.note(
            "ds_config hybrid_engine.enabled=false: rlhf's hybrid engine stays on "
            "(engine.hybrid=true; "
            "engine.hybrid=false generates with the training model, slower)"
        )
    for key, value in _leaves(cfg):
        if key.split(".")[0] in off:
            continue
        if value == "auto":
            plan.note(f"ds_config {key}=auto: rlhf derives it")
            continue
        rule = CONFIG_TABLE.get(key)
        section = key.split(".")[0]
        if rule is None and section in SECTIONS:
            rule = SECTIONS[section]
        if rule is None:
            plan.skip(
                f"ds_config {key}={json.dumps(value)}",
                "no equivalent",
                "a DeepSpeed key this migration does not know",
            )
        elif isinstance(rule, To):
            plan.set(rule.key, rule.convert(value), f"ds_config {key}")
        elif isinstance(rule, Off):
            if value is False:
                # a feature said off: rlhf's behaviour too
                continue
            plan.skip(f"ds_config {key}={json.dumps(value)}", rule.kind, rule.why)
        else:
            rule(plan, f"ds_config {key}", value, cfg)


def config_table_markdown() -> str:
    """docs/deepspeed.md's ds_config table, from CONFIG_TABLE and SECTIONS (kept equal by a
    test)."""
    rows = ["| `ds_config.json` key | rlhf |", "| --- | --- |"]
    for key, rule in CONFIG_TABLE.items():
        if isinstance(rule, To):
            ours = f"`{rule.key}`"
        elif isinstance(rule, Off):
            ours = f"— {rule.kind}: {rule.why}"
        else:
            ours = " ".join((rule.__doc__ or "").split()) or rule.__name__
        rows.append(f"| `{key}` | {ours} |")
    for section, rule in SECTIONS.items():
        rows.append(f"| `{section}.*` | — {rule.kind}: {rule.why} |")
    return "\n".join(rows)
