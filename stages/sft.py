"""Step 1: supervised fine-tuning of the actor.

    python -m rlhf stage=sft [run.dir=D] [data.path=... data.format=...] [model.path=...]

Setup (data, tokenizer, model, engine, resume) → loop (global batches, token-weighted NLL,
accumulation, clipping, logging, eval, checkpoints) → save (eval loss, gold score, HF export).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rlhf.config import Config
from rlhf.data.chat import resolve_template
from rlhf.data.formats import FORMATS
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches, micro_batching, step_micro_batches
from rlhf.data.tokenize import cached, collate_sft, tokenize_sft
from rlhf.data.tokenizer import train_embedded_tokenizer
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import nll_sum
from rlhf.engine.mesh import Mesh, shutdown
from rlhf.engine.train import TrainEngine
from rlhf.envs.builtin import environment, say_sandbox
from rlhf.errors import ConfigError
from rlhf.launcher import interrupt
from rlhf.models import loading, lora
from rlhf.models.moe import Dropped, RouterLosses, RouterTerms, capacity
from rlhf.outputs.log import progress
from rlhf.rl.episodes import EpisodeRunner
from rlhf.runtime.evaluation import stage_gold
from rlhf.runtime.stage import (
    StageContext,
    check_writable,
    checkpoint_to_resume,
    end_of_step,
    export_policy,
    finished,
    log_evaluation,
    mark_finished,
    rank_batches,
    require_batches,
    resolve_steps,
    resume,
    run_fingerprint,
    save_stage,
    start_stage,
    text_corpus,
)

log = logging.getLogger("rlhf")


def run(cfg: Config) -> None:
    ctx = start_stage(cfg, "sft")
    say_sandbox(cfg.env, log)
    mesh, train, data_cfg = ctx.mesh, cfg.train, cfg.data
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- 1. setup: everything is validated before anything is written ----
    if cfg.model.path:
        loading.check_model_path(cfg.model.path)
    # the gold evaluation plays the run's episodes (env.tools, env.name)
    env = environment(cfg.env)
    data = load_stage_data(data_cfg, "sft", cfg.run.seed)
    require_batches(len(data.train), train.global_batch, f"data ({data.description})")
    ckpt = checkpoint_to_resume(ctx)
    tokenizer, model_cfg = tokenizer_and_config(cfg, data, ckpt, mesh)
    # (a file's is exported too)
    chat = resolve_template(tokenizer, data_cfg.chat_template, records=data.train)
    runner = EpisodeRunner.of(cfg.env, env, tokenizer, chat, mesh)
    train_cols, eval_cols = columns(cfg, ctx, data, tokenizer, chat)
    resolve_steps(ctx, len(train_cols["ids"]), train.global_batch, "records")
    model = loading.build_model(
        AutoModelForCausalLM,
        config=model_cfg,
        path=cfg.model.path,
        on_meta=not mesh.is_main,
        seed=cfg.run.seed,
        trust_remote_code=cfg.model.trust_remote_code,
        tokenizer=tokenizer,
    )
    # model.lora.r > 0: the adapters train (and, for the embedded default, its embeddings)
    model = lora.adapt(model, cfg.model.lora, cfg.run.seed, embedded=not cfg.model.path)
    actor = TrainEngine(model, mesh, cfg.engine.placement("actor"), train)
    # generation for the gold score
    hybrid = HybridEngine(actor, tokenizer, cfg.engine.placement("actor"))
    # what a checkpoint must have been written with to be resumed (rank 0's view of it)
    ctx.fingerprint = mesh.broadcast_object(
        run_fingerprint(
            model.config,
            tokenizer,
            data,
            cfg,
            f"model={cfg.model.path or 'embedded'}",
            [cfg.model.path],
        )
    )
    if finished(ctx):
        # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, _, metrics = resume(ctx, {"actor": actor}, ckpt)
    micro = train.micro_batch_per_rank or train.global_batch // mesh.world_size
    batches = GlobalBatches(len(train_cols["ids"]), train.global_batch, cfg.run.seed)
    # what train.max_tokens_per_micro_batch counts
    tokens = [len(x) for x in train_cols["ids"]]
    evaluate = Evaluation(
        cfg, actor, hybrid, runner, data, eval_cols, tokenizer, chat, micro, metrics
    )
    checkpoint = partial(
        save_stage, ctx, {"actor": actor}, keep=train.keep_checkpoints, tokenizer=tokenizer
    )

    # ---- 2. the loop ----
    log.info(
        "sft: %d records (%s), %d steps of %d samples, %s",
        len(train_cols["ids"]),
        data.description,
        train.max_steps,
        train.global_batch,
        micro_batching(
            micro, train.max_tokens_per_micro_batch, train.global_batch, mesh.world_size
        ),
    )
    actor.train()
    router = RouterTerms.of(actor.module, train)
    if router.capacity_factor and actor.ecfg.activation_checkpointing:
        raise ConfigError(
            "train.capacity_factor with activation checkpointing: the recomputed forwards would "
            "route without the capacity (set one of them off)"
        )
    bar = progress(train.max_steps, start, cfg.logger.progress, "sft", mesh.is_main)
    # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    stop = interrupt.listen()
    t0, seen = time.perf_counter(), 0
    for step in range(start, train.max_steps):
        ixs = step_micro_batches(
            batches, step, mesh, micro, train.max_tokens_per_micro_batch, tokens
        )
        mbs = [collate(train_cols, ix, tokenizer.pad_token_id, data_cfg.mask_prompt) for ix in ixs]
        lr = actor.lr
        loss, grad_norm, moe = train_step(actor, mbs, router)
        seen += train.global_batch
        done = step + 1
        bar.step(loss=f"{loss:.3f}")
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(
                done,
                loss=loss,
                lr=lr,
                grad_norm=grad_norm,
                samples_per_s=seen / max(time.perf_counter() - t0, 1e-9),
                epoch=batches.epoch_of(done),
                **moe,
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
    log.info("sft done: %s", ctx.out / "model")
    shutdown(mesh)


def tokenizer_and_config(cfg: Config, data, ckpt, mesh: Mesh):
    """(tokenizer, model config): model.path's, else the embedded default's — a tokenizer trained on
    the task's text (or the one a checkpoint being resumed saved) and a tiny Llama."""
    data_cfg = cfg.data
    if cfg.model.path:
        tokenizer = loading.load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        return tokenizer, loading.load_model_config(cfg.model.path, cfg.model.trust_remote_code)
    if ckpt is not None and (ckpt / "tokenizer").is_dir():
        tokenizer = loading.load_tokenizer(str(ckpt / "tokenizer"))
        return tokenizer, loading.embedded_config(cfg.model, tokenizer)
    if FORMATS[data_cfg.format].generated and not data_cfg.sources:  # the embedded task
        # the generated task's own texts
        corpus = FORMATS[data_cfg.format].corpus(data_cfg.synthetic)
    else:
        corpus = text_corpus(data.train)
    tokenizer = train_embedded_tokenizer(corpus, cfg.model, mesh)
    return tokenizer, loading.embedded_config(cfg.model, tokenizer)


def columns(cfg: Config, ctx: StageContext, data, tokenizer, chat) -> tuple:
    """(train, held-out or None) records tokenized, through the cache."""
    data_cfg, mesh = cfg.data, ctx.mesh
    lens = dict(
        max_prompt=data_cfg.max_prompt_len, max_response=data_cfg.max_response_len, chat=chat
    )
    train_cols = cached(
        "sft",
        data.train,
        tokenizer,
        lens,
        ctx.cache_dir,
        mesh,
        lambda: tokenize_sft(data.train, tokenizer, **lens),
    )
    eval_cols = None
    if data.eval:
        make = lambda: tokenize_sft(data.eval, tokenizer, **lens)  # noqa: E731
        eval_cols = cached("sft-eval", data.eval, tokenizer, lens, ctx.cache_dir, mesh, make)
    return train_cols, eval_cols


def collate(cols: dict, indices: List[int], pad: int, mask_prompt: bool) -> dict:
    return collate_sft(
        [cols["ids"][i] for i in indices],
        [cols["prompt_len"][i] for i in indices],
        pad,
        mask_prompt,
        [cols["mask"][i] for i in indices],
    )


# a dense model's (or one trained without router terms)
DENSE = RouterTerms()


@dataclass
class Evaluation:
    """The held-out loss and the gold score (episodes where the run plays them), logged."""

    cfg: Config
    actor: TrainEngine
    hybrid: HybridEngine
    runner: EpisodeRunner
    data: object
    eval_cols: Optional[dict]
    tokenizer: PreTrainedTokenizerBase
    chat: Optional[str]
    micro: int
    metrics: object

    def __call__(self, step: int):
        cfg, data, mesh = self.cfg, self.data, self.actor.mesh
        results, kept = {}, []
        if self.eval_cols is not None:
            pad = self.tokenizer.pad_token_id
            router = RouterTerms.of(self.actor.module, cfg.train)
            results["eval/loss"] = eval_loss(
                self.actor, self.eval_cols, pad, cfg.data.mask_prompt, self.micro, mesh, router
            )
        if data.gold is not None:
            # episodes: tools used
            play = self.runner.player(self.hybrid) if self.runner.multi_turn else None
            held_out = self.runner.with_tools(data.eval)
            gold = stage_gold(
                cfg, self.hybrid, self.tokenizer, held_out, data.gold, mesh, self.chat, kept, play
            )
            results.update(gold)
        return log_evaluation(self.metrics, step, results, self.actor, kept)


def train_step(
    actor: TrainEngine, micro_batches: List[dict], router: RouterTerms = DENSE
) -> tuple[float, float, dict]:
    """One optimizer step over this rank's micro-batches: the token-weighted NLL of the global
    batch; for a MoE model (``router``) the load-balancing loss and router z-loss, the means of the
    terms of the ranks' i-th micro-batches taken together (the same on any number of ranks when
    each runs one micro-batch), each expert's capacity; returned as ``moe/aux_loss``,
    ``moe/z_loss``, ``moe/load_max_mean`` and ``moe/dropped`` (the share of token-slots past their
    expert's capacity).

    Each micro-batch contributes sum(NLL) / (response tokens in the whole global batch), so the
    gradient does not depend on how the batch is split over ranks and accumulation steps."""
    mesh = actor.mesh
    n_tokens = mesh.sum(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches))
    loss_sum, dropped = 0.0, Dropped()
    terms = RouterLosses(actor.module, router, mesh, len(micro_batches))
    for i, b in enumerate(micro_batches):
        mask = b["attention_mask"]
        limit = capacity(actor.module, mask, router.capacity_factor, router.min_capacity, dropped)
        with terms.micro_batch(mask), limit:
            nll, _ = nll_sum(actor.forward, b, mesh.device)
        # FSDP/DDP average gradients over ranks: scale by the world size to keep the global mean
        # (the NLL's and the router terms': each rank holds its share of them).
        loss = nll / max(n_tokens, 1) * mesh.world_size
        term = terms.loss()
        if term is not None:
            loss = loss + term
        actor.backward(loss, sync=i == len(micro_batches) - 1)
        loss_sum += float(nll.detach())
    grad_norm = actor.step()
    moe = {}
    if router.losses:
        # per MoE layer, its load over the micro-batches (the same on every rank: over the ranks)
        loads = terms.balance.loads
        layers = len(loads) // len(micro_batches)
        per_layer = torch.tensor(loads).view(-1, layers).mean(0).tolist()
        moe = {
            "moe/aux_loss": mesh.sum(terms.aux),
            "moe/z_loss": mesh.sum(terms.z),
            "moe/load_max_mean": sum(per_layer) / layers,
            **{f"moe/load_max_mean/{j}": load for j, load in enumerate(per_layer)},
        }
    if router.capacity_factor:
        moe["moe/dropped"] = dropped.share(mesh)
    return mesh.sum(loss_sum) / max(n_tokens, 1), grad_norm, moe


def eval_loss(
    actor: TrainEngine,
    cols: dict,
    pad: int,
    mask_prompt: bool,
    micro: int,
    mesh: Mesh,
    router: RouterTerms = DENSE,
) -> float:
    """Token-weighted NLL over the held-out records (split over ranks); a MoE model's experts at
    ``router.eval_capacity_factor``."""
    total, count = 0.0, 0
    actor.eval()
    with torch.no_grad():
        for ix in rank_batches(len(cols["ids"]), micro, mesh):
            b = collate_sft(
                [cols["ids"][i] for i in ix or [0]],
                [cols["prompt_len"][i] for i in ix or [0]],
                pad,
                mask_prompt,
                [cols["mask"][i] for i in ix or [0]],
            )
            factor, least = router.eval_capacity_factor, router.min_capacity
            with capacity(actor.module, b["attention_mask"], factor, least, Dropped()):
                nll, tokens = nll_sum(actor.forward, b, mesh.device)
            if ix:
                # a turn with no records of its own ran record 0 and ignores it
                total, count = total + float(nll), count + tokens
    return mesh.sum(total) / max(mesh.sum(count), 1)
