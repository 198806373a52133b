"""Direct preference optimisation: the SFT policy trained on preference pairs against a frozen copy.

    python -m rlhf stage=dpo [run.dir=D] [dpo.model_path=...] [data.path=...
    data.format=hh|prompt_chosen_rejected]

Setup (pairs, policy and reference from the SFT output, engine, resume) → loop (reference log-probs
without gradient, policy log-probs, DPO / cDPO / IPO loss over the global batch's pairs) → save
(held-out implicit-reward accuracy and margin, gold score, HF export of the policy).

No reward model and no generation while training: the loss (rlhf/algorithms/preference.py) needs
only the summed response log-probs of each pair under the policy and under the reference.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, List, Optional

import torch

from rlhf.algorithms.preference import dpo_loss, response_mask, sequence_logprobs
from rlhf.config import Config, DPOConfig
from rlhf.data.chat import resolve_template
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches, micro_batching, step_micro_batches
from rlhf.data.tokenize import cached_pairs, collate_pairs, pair_tokens
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import target_logprobs
from rlhf.engine.mesh import Mesh, shutdown
from rlhf.engine.train import AdaptersOff, FrozenModel, TrainEngine, reference_for
from rlhf.errors import DataError
from rlhf.launcher import interrupt
from rlhf.models import loading, lora
from rlhf.outputs.log import progress
from rlhf.runtime.evaluation import stage_gold
from rlhf.runtime.stage import (
    check_writable,
    checkpoint_to_resume,
    end_of_step,
    export_policy,
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
    ctx = start_stage(cfg, "dpo")
    mesh, train, data_cfg = ctx.mesh, cfg.train, cfg.data
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- 1. setup: everything is validated before anything is written ----
    source = stage_input(cfg, cfg.dpo.model_path, "dpo.model_path", "dpo")
    loading.check_model_path(source)
    data = load_stage_data(data_cfg, "dpo", cfg.run.seed)
    require_pairs(data, data_cfg.format, "dpo")
    tokenizer = loading.load_tokenizer(source, cfg.model.trust_remote_code)
    chat = resolve_template(tokenizer, data_cfg.chat_template, records=data.train)
    lens = dict(
        max_prompt=data_cfg.max_prompt_len, max_response=data_cfg.max_response_len, chat=chat
    )
    train_cols, eval_cols = cached_pairs(
        data.train, data.eval, tokenizer, lens, ctx.cache_dir, mesh
    )
    require_batches(len(train_cols["chosen"]), train.global_batch, f"data ({data.description})")
    resolve_steps(ctx, len(train_cols["chosen"]), train.global_batch, "pairs")
    if not eval_cols["chosen"]:
        raise DataError(f"data ({data.description}): no held-out pairs to evaluate on")
    # model.lora.r > 0: adapters on the policy, whose base (adapters off) is the reference; else the
    # reference is a second copy of the starting weights
    build = partial(
        loading.causal_lm,
        source,
        mesh,
        tokenizer,
        cfg.model.trust_remote_code,
        cfg.model.disable_dropout,
    )
    policy = lora.adapt(build("policy"), cfg.model.lora, cfg.run.seed, what="policy")
    actor = TrainEngine(policy, mesh, cfg.engine.placement("actor"), train)
    reference = reference_for(
        actor, lambda: build("reference"), mesh, cfg.engine.placement("reference")
    )
    # generation for the gold score
    hybrid = HybridEngine(actor, tokenizer, cfg.engine.placement("actor"))
    ckpt = checkpoint_to_resume(ctx)
    # what a checkpoint must have been written with to be resumed (rank 0's view of it)
    ctx.fingerprint = mesh.broadcast_object(
        run_fingerprint(actor.module.config, tokenizer, data, cfg, f"policy={source}", [source])
    )
    if finished(ctx):
        # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, _, metrics = resume(ctx, {"policy": actor}, ckpt)
    micro = train.micro_batch_per_rank or train.global_batch // mesh.world_size
    batches = GlobalBatches(len(train_cols["chosen"]), train.global_batch, cfg.run.seed)
    # what train.max_tokens_per_micro_batch counts
    tokens = pair_tokens(train_cols)
    pad = tokenizer.pad_token_id
    evaluate = Evaluation(
        cfg, actor, reference, hybrid, data, eval_cols, tokenizer, chat, micro, metrics
    )
    checkpoint = partial(save_stage, ctx, {"policy": actor}, keep=train.keep_checkpoints)

    # ---- 2. the loop ----
    log.info(
        "dpo (%s, beta=%g, label_smoothing=%g, sft_coef=%g): %d pairs (%s) from %s, %d "
        "steps of %d pairs, %s",
        cfg.dpo.loss,
        cfg.dpo.beta,
        cfg.dpo.label_smoothing,
        cfg.dpo.sft_coef,
        len(train_cols["chosen"]),
        data.description,
        source,
        train.max_steps,
        train.global_batch,
        micro_batching(
            micro, train.max_tokens_per_micro_batch, train.global_batch, mesh.world_size
        ),
    )
    if start == 0:
        # the starting policy's numbers (rewards 0 by definition; its gold score)
        evaluate(0)
    actor.train()
    bar = progress(train.max_steps, start, cfg.logger.progress, "dpo", mesh.is_main)
    # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    stop = interrupt.listen()
    t0, seen = time.perf_counter(), 0
    for step in range(start, train.max_steps):
        ixs = step_micro_batches(
            batches, step, mesh, micro, train.max_tokens_per_micro_batch, tokens
        )
        mbs = [collate(train_cols, ix, pad) for ix in ixs]
        lr = actor.lr
        stats, grad_norm = train_step(actor, reference, mbs, cfg.dpo)
        seen += train.global_batch
        done = step + 1
        bar.step(loss=f"{stats['loss']:.3f}", acc=f"{stats['rewards/accuracy']:.2f}")
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(
                done,
                **stats,
                lr=lr,
                grad_norm=grad_norm,
                samples_per_s=seen / max(time.perf_counter() - t0, 1e-9),
                epoch=batches.epoch_of(done),
                **actor.scale_metrics("train"),
            )
        end_of_step(done, train, stop, mesh, checkpoint, evaluate)
    bar.close()
    stop.close()

    # ---- 3. export ----
    results = evaluate(train.max_steps)
    export_policy(actor, ctx, mesh, tokenizer, results, train.max_steps)
    metrics.close()
    mark_finished(ctx, train.max_steps)
    log.info(
        "dpo done: %s (eval/rewards/accuracy=%.4f)",
        ctx.out / "model",
        results["eval/rewards/accuracy"],
    )
    shutdown(mesh)


@dataclass
class Evaluation:
    """The held-out implicit-reward accuracy and margin, and the gold score, logged."""

    cfg: Config
    actor: TrainEngine
    reference: object
    hybrid: HybridEngine
    data: object
    eval_cols: dict
    tokenizer: object
    chat: Optional[str]
    micro: int
    metrics: object

    def __call__(self, step: int):
        cfg, data, mesh, pad = self.cfg, self.data, self.actor.mesh, self.tokenizer.pad_token_id
        results, kept = (
            evaluate_pairs(
                self.actor, self.reference, self.eval_cols, pad, self.micro, mesh, cfg.dpo
            ),
            [],
        )
        if data.gold is not None:
            results.update(
                stage_gold(
                    cfg, self.hybrid, self.tokenizer, data.eval, data.gold, mesh, self.chat, kept
                )
            )
        return log_evaluation(self.metrics, step, results, self.actor, kept)


def collate(cols: dict, indices: List[int], pad: int) -> dict:
    """A ``collate_pairs`` batch (chosen rows, then rejected rows) with each row's prompt length."""
    batch = collate_pairs(
        [cols["chosen"][i] for i in indices], [cols["rejected"][i] for i in indices], pad
    )
    batch["prompt_len"] = torch.tensor([cols["prompt_len"][i] for i in indices] * 2, device="cpu")
    return batch


def pair_logprobs(forward: Callable[..., Any], batch: dict, device: torch.device):
    """(chosen, rejected) [n] summed log-probs of the response tokens (EOS included, prompt and
    padding excluded) under ``forward`` (an engine's or the reference's)."""
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    # [B, L-1]: token t+1 is the response's
    targets = response_mask(mask, batch["prompt_len"].to(device))
    seq = sequence_logprobs(target_logprobs(forward, ids, mask, targets), targets)
    pairs = ids.shape[0] // 2
    return seq[:pairs], seq[pairs:]


def train_step(
    actor: TrainEngine,
    reference: AdaptersOff | FrozenModel,
    micro_batches: List[dict],
    dcfg: DPOConfig,
) -> tuple[dict, float]:
    """One optimizer step of the DPO loss, averaged over the global batch's pairs.

    Each micro-batch contributes sum(loss) / (pairs in the whole global batch) × world size
    (FSDP/DDP average gradients over ranks), so the gradient does not depend on how the batch is
    split over ranks and accumulation steps. The reference runs once per micro-batch, without
    gradient."""
    mesh = actor.mesh
    n_pairs = mesh.sum(sum(b["input_ids"].shape[0] // 2 for b in micro_batches))
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device="cpu")
    for i, b in enumerate(micro_batches):
        with torch.no_grad():
            ref_c, ref_r = pair_logprobs(reference.forward, b, mesh.device)
        pol_c, pol_r = pair_logprobs(actor.forward, b, mesh.device)
        losses, chosen, rejected = loss_of(pol_c, pol_r, ref_c, ref_r, b, dcfg)
        actor.backward(losses.sum() / n_pairs * mesh.world_size, sync=i == len(micro_batches) - 1)
        sums += pair_sums(losses.detach(), chosen, rejected, pol_c.detach(), pol_r.detach())
    grad_norm = actor.step()
    means = (mesh.all_reduce(sums.to(mesh.device)).cpu() / n_pairs).tolist()
    return dict(zip(SUMS, means)), grad_norm


def loss_of(
    pol_c: torch.Tensor,
    pol_r: torch.Tensor,
    ref_c: torch.Tensor,
    ref_r: torch.Tensor,
    batch: dict,
    dcfg: DPOConfig,
):
    """``dpo_loss`` with the stage's settings (the chosen token counts for dpo.sft_coef)."""
    tokens = chosen_tokens(batch).to(pol_c.device) if dcfg.sft_coef else None
    return dpo_loss(
        pol_c,
        pol_r,
        ref_c,
        ref_r,
        dcfg.beta,
        dcfg.loss,
        dcfg.label_smoothing,
        dcfg.sft_coef,
        tokens,
    )


def chosen_tokens(batch: dict) -> torch.Tensor:
    """[n] response tokens (EOS included) of each chosen sequence of a ``collate`` batch."""
    pairs = batch["input_ids"].shape[0] // 2
    return response_mask(batch["attention_mask"][:pairs], batch["prompt_len"][:pairs]).sum(-1)


# what train_step and evaluate_pairs average over pairs (metrics keys; evaluation prefixes eval/)
SUMS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
)


def pair_sums(
    losses: torch.Tensor,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    logp_chosen: torch.Tensor,
    logp_rejected: torch.Tensor,
) -> torch.Tensor:
    """The sums over a micro-batch's pairs of each of ``SUMS`` (float64, CPU); accuracy counts the
    pairs whose chosen reward is strictly higher (0 for the starting policy, whose rewards are all
    0)."""
    c, r = chosen.double().cpu(), rejected.double().cpu()
    return torch.stack(
        [
            losses.double().sum().cpu(),
            c.sum(),
            r.sum(),
            (c > r).double().sum(),
            (c - r).sum(),
            logp_chosen.double().sum().cpu(),
            logp_rejected.double().sum().cpu(),
        ]
    )


def evaluate_pairs(
    actor: TrainEngine,
    reference: AdaptersOff | FrozenModel,
    cols: dict,
    pad: int,
    micro: int,
    mesh: Mesh,
    dcfg: DPOConfig,
) -> dict:
    """``SUMS`` over the held-out pairs as eval/<key>: loss, implicit-reward accuracy, margin,
    ..."""
    sums = torch.zeros(len(SUMS) + 1, dtype=torch.float64, device="cpu")  # and the pair count
    actor.eval()
    with torch.no_grad():
        for ix in rank_batches(len(cols["chosen"]), micro, mesh):
            # a turn with no pairs of its own runs pair 0 and ignores it
            b = collate(cols, ix or [0], pad)
            ref_c, ref_r = pair_logprobs(reference.forward, b, mesh.device)
            pol_c, pol_r = pair_logprobs(actor.forward, b, mesh.device)
            if not ix:
                continue
            losses, chosen, rejected = loss_of(pol_c, pol_r, ref_c, ref_r, b, dcfg)
            sums[:-1] += pair_sums(losses, chosen, rejected, pol_c, pol_r)
            sums[-1] += len(ix)
    *totals, pairs = mesh.all_reduce(sums.to(mesh.device)).cpu().tolist()
    return {f"eval/{k}": v / pairs for k, v in zip(SUMS, totals)}
