"""Step 2: the reward model — a scalar head on the SFT model, trained on preference pairs.

    python -m rlhf stage=reward [run.dir=D] [model.path=...] [data.path=...
    data.format=hh|prompt_chosen_rejected]

Setup (pairs, SFT model + head, engine, resume) → loop (pairwise loss, chosen and rejected in one
batch) → save (held-out accuracy and scores beside two text-only baselines', score statistics for
PPO, HF export as AutoModelForSequenceClassification with num_labels=1, which also initialises PPO's
critic). An ensemble (reward.ensemble=k): k heads on the backbone, each on its bootstrap half of the
pairs, their losses averaged; exported with num_labels=k (member i = label i).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification

from rlhf.algorithms.preference import pairwise_loss
from rlhf.config import Config
from rlhf.data import contrast, pair_baselines
from rlhf.data.chat import resolve_template
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches, bootstrap_weights, micro_batching, step_micro_batches
from rlhf.data.tokenize import cached_pairs, collate_pairs, pair_tokens
from rlhf.engine.checkpoint import export_hf
from rlhf.engine.mesh import Mesh, shutdown
from rlhf.engine.train import TrainEngine
from rlhf.errors import DataError
from rlhf.launcher import interrupt
from rlhf.models import dschat, loading, lora
from rlhf.models.value import (
    REWARD_STATS_FILE,
    ScalarHeadModel,
    head_name,
    init_head,
    members,
    sequence_scores,
)
from rlhf.outputs.log import progress
from rlhf.runtime.stage import (
    check_writable,
    checkpoint_to_resume,
    end_of_step,
    finished,
    log_evaluation,
    mark_finished,
    rank_batches,
    require_batches,
    require_pairs,
    resolve_steps,
    resume,
    run_fingerprint,
    save_stage,
    stage_input,
    start_stage,
)

log = logging.getLogger("rlhf")


def run(cfg: Config) -> None:
    ctx = start_stage(cfg, "reward")
    mesh, train, data_cfg = ctx.mesh, cfg.train, cfg.data
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- 1. setup: everything is validated before anything is written ----
    source = stage_input(cfg, cfg.reward.model_path, "reward.model_path", "reward")
    # a DeepSpeed-Chat reward model: its conversion in <run.dir>/converted/ (rlhf/models/dschat.py)
    key = "reward.model_path" if cfg.reward.model_path else "model.path"
    source = dschat.reward_model_input(source, key, cfg.run.dir, mesh)
    loading.check_model_path(source)
    data = load_stage_data(data_cfg, "reward", cfg.run.seed)
    require_pairs(data, data_cfg.format, "reward")
    tokenizer = loading.load_tokenizer(source, cfg.model.trust_remote_code)
    chat = resolve_template(tokenizer, data_cfg.chat_template, records=data.train)
    lens = dict(
        max_prompt=data_cfg.max_prompt_len, max_response=data_cfg.max_response_len, chat=chat
    )
    pairs, eval_cols = cached_pairs(data.train, data.eval, tokenizer, lens, ctx.cache_dir, mesh)
    # reward.contrast: pairs whose loser answers nothing (rlhf/data/contrast.py), trained on and
    # scored on the held-out pairs
    rc, eos = cfg.reward, tokenizer.eos_token_id
    train_cols = contrast.with_contrast(pairs, rc.contrast, rc.contrast_share, cfg.run.seed, eos)
    contrast_eval = contrast.held_out(eval_cols, rc.contrast, cfg.run.seed, eos)
    require_batches(len(train_cols["chosen"]), train.global_batch, f"data ({data.description})")
    resolve_steps(ctx, len(train_cols["chosen"]), train.global_batch, "pairs")
    if not eval_cols["chosen"]:
        raise DataError(f"data ({data.description}): no held-out pairs to evaluate on")
    model_cfg, model = scalar_head_model(cfg, source, tokenizer, mesh)
    reward_model = TrainEngine(
        ScalarHeadModel(model), mesh, cfg.engine.placement("reward_model"), train
    )
    ckpt = checkpoint_to_resume(ctx)
    # what a checkpoint must have been written with to be resumed (rank 0's view of it)
    inputs = " ".join(
        filter(None, (f"backbone={source}", contrast.describe(rc.contrast, rc.contrast_share)))
    )
    fingerprint = run_fingerprint(model_cfg, tokenizer, data, cfg, inputs, [source])
    ctx.fingerprint = mesh.broadcast_object(fingerprint)
    if finished(ctx):
        # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, _, metrics = resume(ctx, {"reward": reward_model}, ckpt)
    micro = train.micro_batch_per_rank or train.global_batch // mesh.world_size
    batches = GlobalBatches(len(train_cols["chosen"]), train.global_batch, cfg.run.seed)
    # what train.max_tokens_per_micro_batch counts
    tokens = pair_tokens(train_cols)
    pad, k = tokenizer.pad_token_id, cfg.reward.ensemble
    evaluate = partial(
        evaluate_logged,
        reward_model,
        eval_cols,
        pad,
        micro,
        cfg.reward.margin,
        metrics,
        contrast_eval,
    )
    checkpoint = partial(save_stage, ctx, {"reward": reward_model}, keep=train.keep_checkpoints)

    # ---- 2. the loop ----
    say_plan(cfg, len(train_cols["chosen"]), data.description, source, micro, mesh.world_size)
    reward_model.train()
    bar = progress(train.max_steps, start, cfg.logger.progress, "reward", mesh.is_main)
    # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    stop = interrupt.listen()
    t0, seen = time.perf_counter(), 0
    for step in range(start, train.max_steps):
        ixs = step_micro_batches(
            batches, step, mesh, micro, train.max_tokens_per_micro_batch, tokens
        )
        mbs = [collate(train_cols, ix, pad) for ix in ixs]
        weights = [member_weights(cfg, ix) for ix in ixs]
        lr = reward_model.lr
        loss, acc, grad_norm = train_step(reward_model, mbs, cfg.reward.margin, weights)
        seen += train.global_batch
        done = step + 1
        bar.step(loss=f"{loss:.3f}", acc=f"{acc:.2f}")
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(
                done,
                loss=loss,
                accuracy=acc,
                lr=lr,
                grad_norm=grad_norm,
                samples_per_s=seen / max(time.perf_counter() - t0, 1e-9),
                **reward_model.scale_metrics("train"),
            )
        end_of_step(done, train, stop, mesh, checkpoint, evaluate)
    bar.close()
    stop.close()

    # ---- 3. export ----
    res = evaluate(train.max_steps, text_baselines(pairs, eval_cols, tokenizer, mesh))
    extra = {REWARD_STATS_FILE: held_out_stats(res, k, train.max_steps)}
    export_hf(
        reward_model,
        ctx.out / "model",
        mesh,
        tokenizer=tokenizer,
        extra_files=extra,
        adapter_dir=ctx.out / "adapter",
    )
    metrics.close()
    mark_finished(ctx, train.max_steps)
    log.info(
        "reward done: %s (eval/accuracy=%.4f%s)",
        ctx.out / "model",
        res["eval/accuracy"],
        pair_baselines.said(res),
    )
    shutdown(mesh)


def say_plan(cfg: Config, pairs: int, description: str, source: str, micro: int, world: int):
    """The run's shape in one line."""
    train, k, rc = cfg.train, cfg.reward.ensemble, cfg.reward
    ensemble_note = ""
    if rc.contrast:
        ensemble_note = f", with {contrast.describe(rc.contrast, rc.contrast_share)}"
    if k > 1:
        ensemble_note += f", an ensemble of {k} heads" + (
            " (bootstrapped pairs)" if cfg.reward.bootstrap else ""
        )
    log.info(
        "reward: %d pairs (%s) from %s, %d steps of %d pairs, %s%s",
        pairs,
        description,
        source,
        train.max_steps,
        train.global_batch,
        micro_batching(micro, train.max_tokens_per_micro_batch, train.global_batch, world),
        ensemble_note,
    )


def text_baselines(train_cols: dict, eval_cols: dict, tokenizer, mesh: Mesh) -> dict:
    """What the text alone gets right on the same held-out pairs (logged with eval/*; rank 0)."""
    if not mesh.is_main:
        return {}
    fit, test = (pair_baselines.response_texts(c, tokenizer) for c in (train_cols, eval_cols))
    return pair_baselines.baselines(fit, test)


def scalar_head_model(cfg: Config, source: str, tokenizer, mesh: Mesh):
    """(config, model): the backbone with a score head of reward.ensemble outputs (member i = label
    i), the head initialised from run.seed on rank 0 (the other ranks on meta, filled by FSDP), LoRA
    adapters on the backbone with model.lora.r > 0 (the head fully trained and saved with them)."""
    model_cfg = loading.load_model_config(source, cfg.model.trust_remote_code)
    model_cfg.num_labels, model_cfg.pad_token_id = cfg.reward.ensemble, tokenizer.pad_token_id
    if cfg.reward.ensemble > 1:
        model_cfg.id2label = {i: f"member{i}" for i in range(cfg.reward.ensemble)}
        model_cfg.label2id = {v: k for k, v in model_cfg.id2label.items()}
    if mesh.is_main:
        model = loading.build_model(
            AutoModelForSequenceClassification,
            path=source,
            config=model_cfg,
            trust_remote_code=cfg.model.trust_remote_code,
            tokenizer=tokenizer,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            init_head(model)
    else:
        model = loading.build_model(
            AutoModelForSequenceClassification,
            config=model_cfg,
            on_meta=True,
            trust_remote_code=cfg.model.trust_remote_code,
            tokenizer=tokenizer,
        )
    return model_cfg, lora.adapt(model, cfg.model.lora, cfg.run.seed, head=head_name(model))


def collate(cols: dict, indices: List[int], pad: int) -> dict:
    return collate_pairs(
        [cols["chosen"][i] for i in indices], [cols["rejected"][i] for i in indices], pad
    )


def member_weights(cfg: Config, indices: List[int]) -> Optional[torch.Tensor]:
    """An ensemble's bootstrap: each pair's weight per member ([n, k]); None for one head or without
    it."""
    k = cfg.reward.ensemble
    if k == 1 or not cfg.reward.bootstrap:
        return None
    return torch.tensor(bootstrap_weights(indices, k, cfg.run.seed), dtype=torch.float32).view(
        -1, k
    )


def evaluate_logged(
    reward_model: TrainEngine,
    cols: dict,
    pad: int,
    micro: int,
    margin: float,
    metrics,
    contrast_cols: dict,
    step: int,
    extra=None,
):
    """``evaluate_pairs`` with ``extra`` figures and each contrast kind's held-out accuracy
    (``eval/contrast_<kind>_accuracy``), its eval/* logged."""
    mesh = reward_model.mesh
    res = {**evaluate_pairs(reward_model, cols, pad, micro, mesh, margin), **(extra or {})}
    for kind, kind_cols in contrast_cols.items():
        kind_res = evaluate_pairs(reward_model, kind_cols, pad, micro, mesh, margin)
        res[f"eval/contrast_{kind}_accuracy"] = kind_res["eval/accuracy"]
    log_evaluation(
        metrics, step, {k: v for k, v in res.items() if k.startswith("eval/")}, reward_model
    )
    return res


def held_out_stats(res: dict, k: int, step: int) -> dict:
    """reward_stats.json: the held-out scores' mean, std, min, max and eval/*; for an ensemble each
    member's too (PPO normalises, and clips, each member by its own)."""
    stats = {
        "mean": res["scores/mean"],
        "std": res["scores/std"],
        "min": res["scores/min"],
        "max": res["scores/max"],
        "step": step,
        **{key: v for key, v in res.items() if key.startswith("eval/")},
    }
    if k > 1:
        stats["members"] = res["members"]
    return stats


def _pair_scores(reward_model: TrainEngine, batch: dict, device: torch.device):
    """(chosen, rejected) scores of a collated batch of pairs: [n] each, [n, k] for an ensemble."""
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    scores = sequence_scores(reward_model.forward(input_ids=ids, attention_mask=mask), mask)
    n = ids.shape[0] // 2
    return scores[:n], scores[n:]


def train_step(
    reward_model: TrainEngine,
    micro_batches: List[dict],
    margin: float = 0.0,
    weights: Optional[list] = None,
) -> tuple[float, float, float]:
    """One optimizer step of the pairwise loss, averaged over the global batch's pairs. An
    ensemble's loss is the mean over its members of each member's loss, a pair weighted per member
    by ``weights[i]`` ([n, k] for micro-batch i, the bootstrap; None = every pair in every member);
    its accuracy is the members' mean score's."""
    mesh = reward_model.mesh
    n_pairs = mesh.sum(sum(b["input_ids"].shape[0] // 2 for b in micro_batches))
    loss_sum, correct = 0.0, 0.0
    for i, b in enumerate(micro_batches):
        chosen, rejected = _pair_scores(reward_model, b, mesh.device)
        loss = pairwise_loss(chosen, rejected, margin)
        if loss.dim() > 1:  # an ensemble: [n, k]
            w = weights[i] if weights is not None and weights[i] is not None else None
            if w is not None:
                loss = loss * w.to(loss.device)
            loss = loss.mean(1)
            chosen, rejected = chosen.mean(1), rejected.mean(1)
        loss = loss.sum()
        reward_model.backward(loss / n_pairs * mesh.world_size, sync=i == len(micro_batches) - 1)
        loss_sum += float(loss.detach())
        correct += float((chosen > rejected).sum())
    grad_norm = reward_model.step()
    return mesh.sum(loss_sum) / n_pairs, mesh.sum(correct) / n_pairs, grad_norm


def evaluate_pairs(
    reward_model: TrainEngine, cols: dict, pad: int, micro: int, mesh: Mesh, margin: float = 0.0
) -> dict:
    """Held-out accuracy, mean chosen/rejected scores and loss; the mean/std/min/max of all scores.
    An ensemble: those of the members' mean score (the loss: the members' mean), and per member
    (``members``: accuracy, mean, std, min, max) with the worst and best member's accuracy."""
    # per column (the mean score, then each member): see ``columns``
    sums, lo, hi = None, None, None
    reward_model.eval()
    with torch.no_grad():
        for ix in rank_batches(len(cols["chosen"]), micro, mesh):
            b = collate_pairs(
                [cols["chosen"][i] for i in ix or [0]],
                [cols["rejected"][i] for i in ix or [0]],
                pad,
            )
            c, r = _pair_scores(reward_model, b, mesh.device)
            if not ix:
                continue
            c, r = c.double().cpu(), r.double().cpu()
            if c.dim() == 1:  # one reward model: one column
                c, r = c[:, None], r[:, None]
            else:
                # an ensemble: the members' mean first, then each member
                c, r = (
                    torch.cat([c.mean(1, keepdim=True), c], 1),
                    torch.cat([r.mean(1, keepdim=True), r], 1),
                )
            n = torch.full((c.shape[1],), float(len(ix)), dtype=torch.float64)
            part = torch.stack(
                [
                    n,
                    (c > r).sum(0).double(),
                    pairwise_loss(c, r, margin).sum(0).double(),
                    c.sum(0),
                    r.sum(0),
                    (c * c).sum(0) + (r * r).sum(0),
                ]
            )
            sums = part if sums is None else sums + part
            both = torch.cat([c, r])
            lo = both.min(0).values if lo is None else torch.minimum(lo, both.min(0).values)
            hi = both.max(0).values if hi is None else torch.maximum(hi, both.max(0).values)
    columns = _members(reward_model)
    columns += 1 if columns > 1 else 0
    if sums is None:  # this rank held no pairs
        sums = torch.zeros(6, columns, dtype=torch.float64)
        lo = torch.full((columns,), float("inf"), dtype=torch.float64)
        hi = torch.full((columns,), float("-inf"), dtype=torch.float64)
    sums = mesh.all_reduce(sums.to(mesh.device)).cpu()
    lo = -mesh.all_reduce((-lo).to(mesh.device), op=dist.ReduceOp.MAX).cpu()
    hi = mesh.all_reduce(hi.to(mesh.device), op=dist.ReduceOp.MAX).cpu()
    cols_stats = []
    for j in range(columns):
        pairs, correct, loss, cs, rs, sq = sums[:, j].tolist()
        mean = (cs + rs) / (2 * pairs)
        cols_stats.append(
            {
                "accuracy": correct / pairs,
                "loss": loss / pairs,
                "chosen": cs / pairs,
                "rejected": rs / pairs,
                "mean": mean,
                "std": max(sq / (2 * pairs) - mean * mean, 0.0) ** 0.5,
                "min": float(lo[j]),
                "max": float(hi[j]),
            }
        )
    ens = cols_stats[0]
    out = {
        "eval/accuracy": ens["accuracy"],
        "eval/loss": ens["loss"],
        "eval/chosen_score": ens["chosen"],
        "eval/rejected_score": ens["rejected"],
        "scores/mean": ens["mean"],
        "scores/std": ens["std"],
        "scores/min": ens["min"],
        "scores/max": ens["max"],
    }
    if columns > 1:
        members = [
            {key: m[key] for key in ("accuracy", "mean", "std", "min", "max")}
            for m in cols_stats[1:]
        ]
        out["eval/loss"] = sum(m["loss"] for m in cols_stats[1:]) / len(members)
        out["eval/member_accuracy_min"] = min(m["accuracy"] for m in members)
        out["eval/member_accuracy_max"] = max(m["accuracy"] for m in members)
        out["members"] = members
    return out


def _members(reward_model: TrainEngine) -> int:
    return members(reward_model.module.config)
