"""What every stage does around its loop: process group, console, seeds, finding its inputs,
resuming (or finding the stage already done), and the end of each step (evaluate, checkpoint, stop
on a signal)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from rlhf import host_memory
from rlhf.config import ROLES, Config, TrainConfig
from rlhf.data.records import Example
from rlhf.engine.checkpoint import (
    STATE_FILE,
    complete_checkpoints,
    export_hf,
    export_identity,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
    set_aside,
    verify_checkpoint,
)
from rlhf.engine.mesh import Mesh, init_mesh
from rlhf.engine.train import check_offload
from rlhf.errors import ConfigError, DataError
from rlhf.launcher import interrupt
from rlhf.outputs.fileio import atomic_write_json, atomic_write_text
from rlhf.outputs.log import MetricsWriter, setup_console

log = logging.getLogger("rlhf")

# in <run.dir>/<stage>/: the configuration the stage ran with (resolved, YAML), and the mark of a
# stage that ran to its end ({"step", "fingerprint", "outputs"}; docs/contract.md)
CONFIG_FILE, DONE_FILE = "config.yaml", "done.json"


@dataclass
class StageContext:
    cfg: Config
    mesh: Mesh
    out: Path  # <run.dir>/<stage>
    cache_dir: Path
    # what a checkpoint must have been written with to be resumed (run_fingerprint); saved with each
    fingerprint: dict = field(default_factory=dict)
    # complete checkpoints newer than the one resumed that failed verification, with what failed
    # (checkpoint_to_resume); ``resume`` moves them aside once the run starts writing
    damaged: List[Tuple[Path, str]] = field(default_factory=list)

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"


def save_stage(ctx: StageContext, engines: dict, step: int, keep: int, tokenizer=None) -> Path:
    """A checkpoint of a stage whose state is its engines alone (SFT, reward, DPO): ``engines`` by
    name, the stage and its fingerprint, ``keep`` kept (train.keep_checkpoints); ``tokenizer`` saved
    too (the embedded default's is trained)."""
    state = {"stage": ctx.out.name, "fingerprint": ctx.fingerprint}
    return save_checkpoint(
        ctx.ckpt_dir, step, engines, state, ctx.mesh, keep=keep, tokenizer=tokenizer
    )


def start_stage(cfg: Config, stage: str) -> StageContext:
    mesh = init_mesh(cfg.engine, cfg.roles())
    setup_console(mesh.rank)
    cfg.validate_world(mesh.world_size)
    # Model init is seeded by run.seed alone (rank 0 materialises it); per-rank streams differ.
    random.seed(cfg.run.seed + mesh.rank)
    torch.manual_seed(cfg.run.seed + mesh.rank)
    run_dir = Path(cfg.run.dir)
    cache = Path(cfg.run.cache_dir) if cfg.run.cache_dir else run_dir / "cache"
    log.info(
        "stage=%s run.dir=%s world_size=%d device=%s zero_stage=%d precision=%s",
        stage,
        run_dir,
        mesh.world_size,
        mesh.device,
        cfg.engine.zero_stage,
        cfg.engine.precision,
    )
    if mesh.threads_why:
        log.info("%s", mesh.threads_why)
    log.info("recipe=%s (%s)", cfg.recipe, cfg.recipe_why)
    if cfg.lr_why:
        log.info("%s", cfg.lr_why)
    if cfg.hub_why:
        log.warning("%s", cfg.hub_why)
    if cfg.moved_why:
        log.warning("%s", cfg.moved_why)
    placed = cfg.engine.placements(cfg.roles())
    if len(set(placed.values())) > 1:
        # engine.<role>.* differ: say where each model lives
        log.info(
            "placement (zero_stage, offload, precision, activation_checkpointing): %s",
            ", ".join(f"{role} {p}" for role, p in placed.items()),
        )
    unused = [
        r
        for r in ROLES
        if r not in placed and any(v is not None for v in vars(getattr(cfg.engine, r)).values())
    ]
    if unused:
        # set (e.g. by scripts/run_all.sh for every stage) but this stage builds no such model
        log.info(
            "engine.%s.* not used: stage=%s places no %s model here",
            "/".join(unused),
            stage,
            " or ".join(unused),
        )
    for role in placed:
        # engine.offload=cpu applies or stops here, before any model loads
        check_offload(cfg.engine.placement(role), mesh)
    return StageContext(cfg=cfg, mesh=mesh, out=run_dir / stage, cache_dir=cache)


def resolve_steps(
    ctx: StageContext, items: int, per_step: int, what: str, updates_per_step: int = 1
) -> None:
    """The stage's step count once its data is known: train.max_steps from train.epochs and
    train.warmup_steps from train.warmup_ratio where they are null (the pretrained recipes), said in
    the log; ``updates_per_step``: optimizer steps per stage step (PPO), the unit of the warmup."""
    train = ctx.cfg.train
    said = train.resolve_steps(items, per_step, what, updates_per_step)
    if said:
        log.info("%s", said)
    if train.warmup_steps > train.max_steps * updates_per_step:
        log.warning(
            "train.warmup_steps=%d is more than the stage's %d optimizer steps: the "
            "learning rate never "
            "reaches train.lr",
            train.warmup_steps,
            train.max_steps * updates_per_step,
        )


def checkpoint_to_resume(ctx: StageContext) -> Optional[Path]:
    """``run.resume``: true = the newest complete checkpoint of the stage that verifies against its
    manifest (if any; newer damaged ones are kept in ``ctx.damaged``), false = none, or a path: that
    checkpoint (a ``step_<N>`` directory, absolute or inside <stage>/checkpoints/), which must
    verify (else exit 2). Every rank calls it: the files are checked by all, the verdict is rank
    0's."""
    choice = ctx.cfg.run.resume
    if choice is True or choice is None:
        ckpt, ctx.damaged = newest_intact_checkpoint(ctx.ckpt_dir, ctx.mesh)
        return ckpt
    if choice is False:
        return None
    path = Path(str(choice))
    if not path.is_absolute() and not path.exists():
        path = ctx.ckpt_dir / path
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"run.resume={choice}: not a complete checkpoint (no {STATE_FILE} in {path}); "
            f"the stage's checkpoints are in {ctx.ckpt_dir}"
        )
    problem = verify_checkpoint(path, ctx.mesh)
    if problem is not None:
        raise ConfigError(
            f"run.resume={choice}: checkpoint {path} is damaged ({problem}); resume from "
            "another one in "
            f"{ctx.ckpt_dir}, or run.resume=true to take the newest intact one"
        )
    return path


def run_fingerprint(
    model_config, tokenizer, data, cfg: Config, inputs: str = "", input_models=()
) -> dict:
    """What a run's checkpoints depend on: the model's architecture (dropout aside:
    model.disable_dropout sets it), the tokenizer, the data (``data``: the stage's ``StageData``;
    its sources, and its records' content: another file, seed, split or generator setting is other
    data), the lengths, and ``inputs``: the models the stage starts from (a short digest of each,
    and the data's description and the inputs, for the message on a mismatch). ``input_models``: the
    directories of those models; the identity of each that this project exported (its
    ``export.json``) is ``input_models``' value, so that a model exported again since (the stage
    before rerun with other settings) is another input."""

    def digest(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[
            :12
        ]

    arch = {
        k: v
        for k, v in model_config.to_dict().items()
        if k
        not in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")
        and not any(w in k for w in ("dropout", "pdrop", "layerdrop"))
    }
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    out = {
        "model": digest(arch),
        "tokenizer": digest(sorted(vocab.items())),
        "data": data.description,
        "records": data.digest(),
        "lengths": f"max_prompt_len={cfg.data.max_prompt_len} "
        f"max_response_len={cfg.data.max_response_len}",
    }
    if inputs:
        out["inputs"] = portable(inputs, cfg.run.dir)
    ids = [(Path(p).name, export_identity(Path(p))) for p in input_models if p is not None]
    if any(i is not None for _, i in ids):
        out["input_models"] = " ".join(f"{name}:{i}" for name, i in ids if i is not None)
    lcfg = cfg.model.lora
    if lcfg.r:
        # the adapters' shapes and targets (a full fine-tuning checkpoint has none)
        out["lora"] = (
            f"r={lcfg.r} target_modules={lcfg.target_modules or 'default'} critic={lcfg.critic}"
        )
    return out


def portable(text: str, run_dir) -> str:
    """``text`` with the run directory's paths written ``<run.dir>/…``: a run directory that moves
    (another mount, another node's scratch, a copy) still resumes from its own checkpoints."""
    for root in dict.fromkeys((str(Path(run_dir)), str(Path(run_dir).resolve()))):
        text = text.replace(root.rstrip("/") + "/", "<run.dir>/")
    return text


# fingerprint keys added after run directories existed: one written without it is judged on the rest
# (it stays resumable and, when finished, finished)
ADDED_LATER = ("records", "ptx_records", "input_models")
# how a mismatch of a key is said, where its name alone would not say it
SAY = {
    "records": "other data records (the data's content: its file, run.seed, data.synthetic.*, "
    "data.split, data.eval_size or env.tools changed since)",
    "ptx_records": "other SFT records for PPO-ptx (the data's content changed since)",
    "input_models": "another export of the model(s) it starts from (written again since: the "
    "stage before it was rerun)",
}


def same_setup(saved: dict, now: dict) -> bool:
    """Whether ``saved`` (a done.json's fingerprint) is ``now``, keys of ``ADDED_LATER`` it lacks
    aside."""
    return saved == {k: v for k, v in now.items() if k in saved or k not in ADDED_LATER}


def check_resumable(ctx: StageContext, ckpt: Path, state: dict) -> None:
    """Exit 2 with one line when ``ckpt`` was written by another setup, or is past
    train.max_steps."""
    how = "rerun with run.resume=false to start over (or use another run.dir)"
    saved = state.get("fingerprint") or {}
    for key, now in ctx.fingerprint.items():
        before = saved.get(key)
        if key == "inputs" and before is not None:
            # (written before paths were portable: absolute)
            before = portable(before, ctx.cfg.run.dir)
        if before is not None and before != now:
            raise ConfigError(
                f"{ckpt} was written with {SAY.get(key, 'another ' + key)} ({before} → now "
                f"{now}): {how}"
            )
    if state.get("step", 0) > ctx.cfg.train.max_steps:
        raise ConfigError(
            f"{ckpt} is at step {state['step']}, past train.max_steps={ctx.cfg.train.max_steps}: "
            f"raise train.max_steps to continue it, or {how}"
        )


def finished(ctx: StageContext) -> bool:
    """Whether a rerun finds the stage already done: ``run.resume`` is true, ``<stage>/done.json``
    (``mark_finished``) records train.max_steps and this fingerprint, and every export it lists is
    still there. Then it says so in one line and the stage returns without touching anything (a
    larger train.max_steps resumes from the last checkpoint instead; run.resume=false starts over).
    Call it once ``ctx.fingerprint`` is known, before ``resume``; rank 0 decides for every rank."""
    line = _done_line(ctx) if ctx.mesh.is_main else None
    line = ctx.mesh.broadcast_object(line)
    if line is not None:
        log.info("%s", line)
    return line is not None


def _done_line(ctx: StageContext) -> Optional[str]:
    if ctx.cfg.run.resume not in (True, None):
        return None
    marker = ctx.out / DONE_FILE
    try:
        done = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    outputs = done.get("outputs") or []
    if (
        done.get("step") != ctx.cfg.train.max_steps
        or not same_setup(done.get("fingerprint") or {}, ctx.fingerprint)
        or not outputs
        or not all(_exported(ctx.out / name) for name in outputs)
    ):
        return None
    # failed verification: never what a larger train.max_steps continues
    skip = {c for c, _ in ctx.damaged}
    last = next((c for c in reversed(complete_checkpoints(ctx.ckpt_dir)) if c not in skip), None)
    if last is not None:
        more = f"a larger train.max_steps continues it from {last}"
    else:
        more = (
            "a larger train.max_steps trains it again from the start (no checkpoint kept: "
            "train.save_every=0)"
        )
    return (
        f"{ctx.out.name}: already done (step {done['step']} = train.max_steps, exported to "
        f"{', '.join(str(ctx.out / name) for name in outputs)}; {marker}): nothing to do. "
        f"{more[0].upper()}"
        f"{more[1:]}; run.resume=false trains it again"
    )


def mark_finished(ctx: StageContext, step: int, extra: Optional[dict] = None) -> None:
    """Records, after the stage's exports (rank 0, atomically), that it ran to ``step`` with this
    fingerprint, and which exports it left: ``finished`` reads it on a rerun. ``extra``: more to
    record (PPO: where its gate stopped it)."""
    if not ctx.mesh.is_main:
        return
    outputs = sorted(p.name for p in ctx.out.iterdir() if _exported(p))
    done = {"step": step, "fingerprint": ctx.fingerprint, "outputs": outputs, **(extra or {})}
    atomic_write_json(ctx.out / DONE_FILE, done)


def _exported(path: Path) -> bool:
    """An export (written whole by ``export_hf``): a Hugging Face model or a PEFT adapter
    directory."""
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def log_world_change(saved: Optional[int], now: int) -> None:
    """One line when a checkpoint resumes on another number of processes, saying what carries
    over."""
    if saved is None or saved == now:
        return
    log.info(
        "checkpoint written by %d process%s, resumed on %d: the model and optimizer state "
        "are resharded; the "
        "data order, sampling (keyed per sample), schedulers, KL controller, reward "
        "statistics, EMA and gate "
        "continue as a %d-process run would; only the float order of reductions differs "
        "(docs/architecture.md, world-size invariance)",
        saved,
        "" if saved == 1 else "es",
        now,
        now,
    )


def resume(ctx: StageContext, engines: dict, ckpt: Optional[Path]):
    """Restores ``engines`` from ``ckpt`` (if any, after ``check_resumable``) and opens the stage's
    metrics.jsonl, keeping only the lines up to the checkpoint. Returns (start step, trainer state,
    metrics writer). From here the run writes: rank 0 drops ``done.json`` and saves the
    configuration the stage runs with to ``<stage>/config.yaml`` (``rlhf.eval --run-dir`` reads
    it)."""
    state, start, resume_step = {}, 0, None
    if ckpt is not None:
        check_resumable(ctx, ckpt, json.loads((ckpt / STATE_FILE).read_text()))
        state = load_checkpoint(ckpt, engines, ctx.mesh)
        start = resume_step = state.get("step", 0)
    if ctx.mesh.is_main:
        # the run starts writing: damaged checkpoints aside, not finished any more, ...
        set_aside_damaged(ctx, ckpt)
        (ctx.out / DONE_FILE).unlink(missing_ok=True)
        atomic_write_text(ctx.out / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.structured(ctx.cfg)))
    if ckpt is not None:
        log.info("resumed from %s (step %d)", ckpt, start)
        log_world_change(state.get("world_size"), ctx.mesh.world_size)
    metrics = MetricsWriter(
        ctx.out / "metrics.jsonl",
        is_main=ctx.mesh.is_main,
        resume_step=resume_step,
        cfg=ctx.cfg,
        stage=ctx.out.name,
    )
    return start, state, metrics


def set_aside_damaged(ctx: StageContext, resumed: Optional[Path]) -> None:
    """Moves the checkpoints that failed verification out of the ``step_<N>`` pattern (rank 0; kept,
    never deleted) with one warning each naming the file and the check, and says where the run goes
    on."""
    then = (
        f"resuming from {resumed}"
        if resumed is not None
        else "no intact checkpoint left: the stage starts over"
    )
    for ckpt, problem in ctx.damaged:
        aside = set_aside(ckpt)
        log.warning(
            "checkpoint %s is damaged (%s): moved aside to %s (kept); %s",
            ckpt,
            problem,
            aside.name,
            then,
        )
    ctx.damaged = []


def rank_batches(n: int, micro: int, mesh: Mesh):
    """This rank's share of range(n) in micro-batches, the same number of batches on every rank
    (FSDP forwards are collective); an empty list is a turn with nothing of its own to do."""
    idx = list(range(n))[mesh.rank :: mesh.world_size]
    for s in range(0, -(-n // mesh.world_size), micro):
        yield idx[s : s + micro]


def end_of_step(
    done: int,
    train: TrainConfig,
    stop: interrupt.StopRequest,
    mesh: Mesh,
    checkpoint: Callable[[int], object],
    evaluate: Optional[Callable[[int], object]] = None,
) -> None:
    """What every stage's loop does after its step ``done``: evaluate every ``train.eval_every``
    steps (the last step's evaluation is the export's), checkpoint every ``train.save_every`` and at
    the last step (a finished stage keeps its final state: a larger train.max_steps continues it),
    and after a first SIGINT/SIGTERM checkpoint (unless just done) and stop
    (``rlhf.launcher.interrupt``); then the heap's free memory goes back to the system once the
    process has grown past its bound (``host_memory.settle``)."""
    if (
        evaluate is not None
        and train.eval_every
        and done % train.eval_every == 0
        and done != train.max_steps
    ):
        evaluate(done)
    saved = train.save_every and (done % train.save_every == 0 or done == train.max_steps)
    if saved:
        checkpoint(done)

    def save_on_stop(step: int):
        if saved:  # saved above, at this very step
            return None
        return checkpoint(step)

    interrupt.stop_here(stop, mesh, done, save_on_stop)
    host_memory.settle()


def show_samples(metrics, step: int, rows: List[dict]) -> None:
    """``evaluate_gold``'s kept rows (or rollouts') to samples.jsonl and the loggers' tables by
    kind, and the first held-out one on the console."""
    kinds: Dict[str, List[dict]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append({k: v for k, v in r.items() if k != "kind"})
    for kind, part in kinds.items():
        metrics.samples(step, kind, part)
    first = (kinds.get("eval") or kinds.get("eval_greedy") or kinds.get("eval_reward") or [None])[0]
    if first is not None:
        how = "sampled" if kinds.get("eval") else "greedy"
        score = (
            f"gold {first['gold']:g}" if "gold" in first else f"reward model {first['reward']:.3f}"
        )
        log.info(
            "step %d sample (held-out prompt %d, %s): %s → %s (%s)",
            step,
            first["index"],
            how,
            short(first["prompt"]),
            short(first["response"]),
            score,
        )


def short(text: str, limit: int = 160) -> str:
    """``text`` on one line (JSON-quoted, so that newlines and spaces show), cut to ``limit``
    characters."""
    import json

    quoted = json.dumps(text, ensure_ascii=False)
    return quoted if len(quoted) <= limit else quoted[: limit - 4] + '…"'


def log_evaluation(
    metrics: MetricsWriter, step: int, results: dict, engine, kept: Optional[List[dict]] = None
) -> dict:
    """Logs a mid-run or final evaluation (metrics.jsonl and one console line) and puts the engine
    back in training mode (evaluation left it in eval mode); returns ``results``. ``kept``: the
    responses ``evaluate_gold`` kept (``show_samples``)."""
    metrics.log(step, **results)
    log.info("step %d: %s", step, " ".join(f"{k}={v:.4f}" for k, v in results.items()))
    show_samples(metrics, step, kept or [])
    engine.train()
    return results


def export_policy(
    engine, ctx: StageContext, mesh: Mesh, tokenizer, results: dict, step: int
) -> None:
    """A policy stage's export (SFT, DPO): ``<stage>/model`` (merged HF model, with its final
    evaluation in rlhf_eval.json) and, with LoRA, ``<stage>/adapter``."""
    export_hf(
        engine,
        ctx.out / "model",
        mesh,
        tokenizer=tokenizer,
        extra_files={"rlhf_eval.json": {"step": step, **results}},
        adapter_dir=ctx.out / "adapter",
    )


def check_writable(path: Path) -> None:
    """Fails early (exit 2) when the run directory cannot be created or written. A real probe (a
    temporary directory made and removed in the nearest existing ancestor): permission bits do not
    stop root, while a regular file in the way or a read-only file system does."""
    p = Path(path)
    probe = p
    while not (probe.exists() or probe.is_symlink()) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        why = "it exists and is not a directory" if probe == p else f"{probe} is not a directory"
        raise ConfigError(f"run.dir={path}: not a writable directory ({why})")
    try:
        tempfile.TemporaryDirectory(dir=probe, prefix=".rlhf-write-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"run.dir={path}: not a writable directory ({e.strerror or e})") from None


def require_pairs(data, data_format: str, stage: str) -> None:
    """Exit 2 unless the stage's records are preference pairs (reward, DPO)."""
    for e in data.train[:1] + data.eval[:1]:
        if e.chosen is None or e.rejected is None:
            raise ConfigError(
                f"data.format={data_format} has no preference pairs (stage={stage} needs "
                "pairs: use "
                f"prompt_chosen_rejected, hh, messages with chosen/rejected, or synthetic)"
            )


def require_batches(n_records: int, global_batch: int, what: str) -> None:
    if n_records < global_batch:
        raise DataError(
            f"{what}: {n_records} training records, fewer than one batch "
            f"(train.global_batch={global_batch})"
        )


def text_corpus(examples: List[Example], limit: int = 20000) -> List[str]:
    texts: List[str] = []
    for e in examples[:limit]:
        texts += [t for t in (e.prompt, e.response, e.chosen, e.rejected) if t]
    return texts


def previous_output(run_dir: str, stage: str, what: str) -> Optional[Path]:
    p = Path(run_dir) / stage / what
    return p if (p / "config.json").is_file() else None


def stage_input(cfg: Config, explicit: Optional[str], key: str, stage: str) -> str:
    """The model a later stage starts from: ``key`` (e.g. ppo.actor_path) when set, else the SFT
    output in run.dir, else model.path (a stage run on its own). model.path is the SFT stage's
    input, so a whole-pipeline run given model.path still hands each stage the previous one's
    output."""
    sft = previous_output(cfg.run.dir, "sft", "model")
    if explicit:
        source, why = explicit, key
    elif sft is not None:
        source, why = str(sft), f"the SFT output; set {key} to start elsewhere"
    elif cfg.model.path:
        source, why = cfg.model.path, "model.path (no SFT output in run.dir)"
    else:
        raise ConfigError(
            f"no SFT model in {cfg.run.dir}/sft/model: run stage=sft first or set "
            f"model.path (or {key})"
        )
    log.info("%s: starting from %s (%s)", stage, source, why)
    return source
