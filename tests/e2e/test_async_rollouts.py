"""Asynchronous rollouts through the CLI (ppo.rollout_workers=1, ppo.max_staleness=k; docs/ppo.md):
staleness 0 is the colocated run, metric for metric and weight for weight; the bound holds at every
step of a run that runs ahead; a trajectory in flight when an update lands continues with the new
weights; a worker that dies or freezes ends the run with exit 3 naming it; what it does not do is
one line before any model loads."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ENV, ROOT, killed_at, run_cli
from tests.e2e.test_agentic import TEMPLATE
from tests.e2e.test_reward_fn_errors import actor, error_lines, grpo  # noqa: F401 (fixture)

RULE = (
    "ppo.reward_fn=rlhf.rewards.gold",
    "ppo.samples_per_prompt=4",
    "ppo.prompts_per_step=4",
    "ppo.max_new_tokens=8",
)
# the worker generates with its trainer's threads: the same float order
ONE_THREAD = "engine.threads_per_rank=1"


@pytest.fixture(scope="module")
def ending_actor(tmp_path_factory, actor):  # noqa: F811
    """The tiny random Llama made to end about half its turns within 4 tokens (EOS's logit ~5.3
    above the rest: a constant first dimension in every embedding, read by EOS's row of the head
    alone), so that episodes have several turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(actor)
    tok = AutoTokenizer.from_pretrained(actor)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 5.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = 0.66
    out = tmp_path_factory.mktemp("ending") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]


def ppo_run(tmp_path, actor, name, *extra, nproc=1, timeout=300):  # noqa: F811
    run = tmp_path / name
    args = [
        a.replace(str(tmp_path / "run"), str(run))
        for a in grpo(tmp_path, actor, *RULE, ONE_THREAD, *extra)
    ]
    proc = run_cli(*args, nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run / "stderr.txt").write_text(proc.stderr)
    return run


# a worker's timing and utilisation: when it got to a step, not what it sampled
WORKER_TIMING = (
    "async/wait_s",
    "async/worker_idle",
    "async/trainer_idle",
    "async/transfer_s",
    "async/queue_depth",
    "async/in_flight",
    "async/generate_calls",
)


def same_run(a, b, tol=0.0, ignore=()):
    """Every metric both runs logged (times, memory and the keys starting with ``ignore`` aside)
    within ``tol``, and the same exported actor."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    compared = 0
    for x, y in zip(ma, mb):
        for k, v in x.items():
            if k in y and not k.startswith(("time/", "mem/", *ignore)) and "per_s" not in k:
                assert abs(v - y[k]) <= tol, (x["step"], k, v, y[k])
                compared += 1
    wa, wb = (
        load_file(a / "ppo/actor/model.safetensors"),
        load_file(b / "ppo/actor/model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return compared


def test_staleness_0_is_the_colocated_run(tmp_path, actor):  # noqa: F811
    sync = ppo_run(tmp_path, actor, "sync", "train.max_steps=3")
    worker = ppo_run(tmp_path, actor, "worker", "train.max_steps=3", "ppo.rollout_workers=1")
    assert same_run(sync, worker) > 40
    rows = metrics(worker)
    assert all(r["async/staleness_max"] == 0 and r["async/dropped"] == 0 for r in rows)
    assert all(r["async/transfer_bytes"] > 0 for r in rows)
    assert "async/staleness_max" not in metrics(sync)[0]


@pytest.mark.slow
def test_staleness_0_is_the_colocated_run_on_two_ranks(tmp_path, actor):  # noqa: F811
    sync = ppo_run(tmp_path, actor, "sync", "train.max_steps=2", nproc=2)
    worker = ppo_run(
        tmp_path, actor, "worker", "train.max_steps=2", "ppo.rollout_workers=1", nproc=2
    )
    assert same_run(sync, worker, tol=1e-6) > 25


def test_the_bound_holds_at_every_step_of_a_run_that_runs_ahead(tmp_path, actor):  # noqa: F811
    run = ppo_run(
        tmp_path, actor, "k2", "train.max_steps=8", "ppo.rollout_workers=1", "ppo.max_staleness=2"
    )
    rows = metrics(run)
    assert len(rows) == 8
    for r in rows:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2, r
        assert r["async/dropped"] == 0
        lags = sum(v for k, v in r.items() if k.startswith("async/tokens_lag"))
        assert lags == pytest.approx(r["response/length"])  # every policy token has its version
        if r["async/staleness_max"] > 0:
            # the parity guard reads the fresh tokens only
            assert r.get("rollout/logprob_abs_diff_mean", 0.0) < 1e-3
    assert rows[0]["async/staleness_max"] == 0  # the first step: the weights there are
    assert max(r["async/staleness_max"] for r in rows) >= 1  # the worker ran ahead


def test_a_trajectory_in_flight_continues_with_the_new_weights(tmp_path, ending_actor):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    run = ppo_run(
        tmp_path,
        ending_actor,
        "partial",
        # (steps enough for the steps in flight to fall out of step: an update then lands between
        # two turns of a step's trajectories)
        "train.max_steps=8",
        "ppo.rollout_workers=1",
        "ppo.max_staleness=1",
        "env.name=tests.e2e.agent_envs.SlowEcho",
        "+env.args={delay_s: 0.4}",
        "env.max_turns=4",
        "ppo.max_new_tokens=4",
        "ppo.reward_fn=null",
        f"data.chat_template={template}",
    )
    rows = metrics(run)
    # an update lands while the worker waits on a tool: the rest of the step's turns sample with it
    mixed = [r for r in rows if r["async/swaps"] > 0]
    assert mixed, [(r["step"], r["async/swaps"], r["async/staleness_max"]) for r in rows]
    assert any(
        r.get("async/tokens_lag0", 0) > 0 and r.get("async/tokens_lag1", 0) > 0 for r in mixed
    )
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert max(r["env/turns"] for r in rows) > 1.5
    # the next step's episodes started while a step's waited on the tool
    assert max(r["async/in_flight"] for r in rows) == 2


def misbehaving(tmp_path, actor, env: str, placement: str) -> list:  # noqa: F811
    """A run whose rollout worker (``placement``) meets ``tests.e2e.agent_envs.<env>`` at its
    first tool step, the engine's timeout 8 s."""
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    return grpo(
        tmp_path,
        actor,
        *RULE,
        ONE_THREAD,
        placement,
        f"env.name=tests.e2e.agent_envs.{env}",
        "env.max_turns=2",
        "ppo.reward_fn=null",
        f"data.chat_template={template}",
        "engine.timeout_s=8",
    )


@pytest.mark.parametrize(
    "env, says", [("WorkerDies", "died"), ("WorkerHangs", "sent no episodes for 8 s")]
)
def test_a_lost_worker_ends_the_run_with_exit_3(tmp_path, ending_actor, env, says):
    args = misbehaving(tmp_path, ending_actor, env, "ppo.rollout_workers=1")
    proc = run_cli(*args, timeout=180)
    assert proc.returncode == 3, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert (
        "the rollout worker of rank 0" in line
        and says in line
        and "rerun the same command to resume" in line
    )


@pytest.mark.parametrize(
    "extra, says",
    [
        (
            ("ppo.max_staleness=1",),
            "ppo.max_staleness=1 is invalid: expected 0 without rollout workers",
        ),
        (("ppo.rollout_workers=2",), "ppo.rollout_workers=2 is invalid: expected 0 or 1"),
        (
            ("ppo.rollout_workers=1", "ppo.dynamic_sampling=true"),
            "does not work with ppo.dynamic_sampling=true",
        ),
        (
            ("ppo.rollout_workers=1", "engine.hybrid=false"),
            "does not work with engine.hybrid=false",
        ),
    ],
)
def test_what_the_workers_do_not_do_is_one_line(tmp_path, actor, extra, says):  # noqa: F811
    proc = run_cli(*grpo(tmp_path, actor, *RULE, *extra), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert says in line
    assert not (tmp_path / "run" / "ppo").exists()


def test_killed_and_resumed_at_staleness_0_is_the_uninterrupted_run(tmp_path, actor):  # noqa: F811
    steps = ("train.max_steps=6", "train.save_every=2", "ppo.rollout_workers=1")
    ref = ppo_run(tmp_path, actor, "ref", *steps)
    run = tmp_path / "run"
    args = grpo(tmp_path, actor, *RULE, ONE_THREAD, *steps)
    killed_at(args, run / "ppo/checkpoints/step_00000002/trainer_state.json")
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-2000:]
    wa, wb = (
        load_file(ref / "ppo/actor/model.safetensors"),
        load_file(run / "ppo/actor/model.safetensors"),
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def agentic(tmp_path, delay_s=0.05):
    """Multi-turn episodes behind a slow tool: the worker plays two steps at once, in groups."""
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    return (
        "env.name=tests.e2e.agent_envs.SlowEcho",
        f"+env.args={{delay_s: {delay_s}}}",
        "env.max_turns=3",
        "ppo.max_new_tokens=4",
        "ppo.reward_fn=null",
        f"data.chat_template={template}",
    )


def fixed_lag_rows(run_dir, k):
    """The fixed policy's promise, read off a run: step s (1-based) trained on tokens exactly
    min(s − 1, k) updates old, and no trajectory of two versions."""
    rows = metrics(run_dir)
    for r in rows:
        lag = min(r["step"] - 1, k)
        assert r["async/staleness_max"] == lag and r["async/staleness_mean"] == lag, r
        assert r["async/swaps"] == 0 and r["async/dropped"] == 0
    return rows


def test_fixed_staleness_is_reproducible_and_a_resume_is_the_uninterrupted_run(
    tmp_path, ending_actor
):
    """ppo.staleness_policy=fixed, k = 1, two steps in flight over a slow tool: a killed run resumed
    from its checkpoint (the step in flight restored from it) logs the metrics and exports the
    weights of the uninterrupted run, bit for bit."""
    steps = (
        "train.max_steps=5",
        "train.save_every=2",
        "ppo.rollout_workers=1",
        "ppo.max_staleness=1",
        "ppo.staleness_policy=fixed",
        *agentic(tmp_path),
    )
    ref = ppo_run(tmp_path, ending_actor, "ref", *steps)
    rows = fixed_lag_rows(ref, 1)
    assert max(r["env/turns"] for r in rows) > 1.5
    run = tmp_path / "run"
    args = grpo(tmp_path, ending_actor, *RULE, ONE_THREAD, *steps)
    ckpt = run / "ppo/checkpoints/step_00000002"
    killed_at(args, ckpt / "trainer_state.json")
    assert (ckpt / "rollouts_in_flight_rank0.pt").exists()
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-2000:]
    assert "step(s) in flight at the checkpoint restored" in proc.stderr
    fixed_lag_rows(run, 1)
    assert same_run(ref, run, ignore=WORKER_TIMING) > 100
    # a Ctrl-C (the whole process group, the worker too) after the first step: the trainer saves
    # with the step in flight (the worker ignores it and plays on) and the rerun resumes there
    stopped = tmp_path / "stopped"
    args = [a.replace(str(run), str(stopped)) for a in args]
    p = subprocess.Popen(
        [sys.executable, "-m", "rlhf", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rows = stopped / "ppo/metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (rows.is_file() and rows.read_text().strip()):
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=240)
    assert p.returncode == 130 and "stopped by SIGINT after step" in err, err[-2000:]
    assert list((stopped / "ppo/checkpoints").glob("step_*/rollouts_in_flight_rank0.pt"))
    proc = run_cli(*args, timeout=300)
    assert "step(s) in flight at the checkpoint restored" in proc.stderr, proc.stderr[-2000:]
    assert same_run(ref, stopped, ignore=WORKER_TIMING) > 100


@pytest.mark.slow
def test_fixed_staleness_resumed_on_two_ranks_is_the_uninterrupted_run(tmp_path, ending_actor):
    """The same on 2 trainer ranks, each with its worker and its file of the steps in flight."""
    steps = (
        "train.max_steps=4",
        "train.save_every=2",
        "ppo.rollout_workers=1",
        "ppo.max_staleness=1",
        "ppo.staleness_policy=fixed",
        *agentic(tmp_path),
    )
    ref = ppo_run(tmp_path, ending_actor, "ref", *steps, nproc=2)
    run = tmp_path / "run"
    args = grpo(tmp_path, ending_actor, *RULE, ONE_THREAD, *steps)
    ckpt = run / "ppo/checkpoints/step_00000002"
    killed_at(args, ckpt / "trainer_state.json", nproc=2)
    assert all((ckpt / f"rollouts_in_flight_rank{r}.pt").exists() for r in (0, 1))
    proc = run_cli(*args, nproc=2, timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-2000:]
    fixed_lag_rows(run, 1)
    assert same_run(ref, run, ignore=WORKER_TIMING) > 60


# ---- rollout workers on ranks of their own (ppo.rollout_ranks; rlhf/rl/rollout_link.py) ----


def test_rollout_ranks_at_staleness_0_are_the_colocated_run(tmp_path, actor):  # noqa: F811
    """ppo.rollout_ranks=1 on a world of 2: one trainer rank and one rollout rank (the weights
    over the process group) give the one-rank colocated run, metric for metric and weight for
    weight."""
    sync = ppo_run(tmp_path, actor, "sync", "train.max_steps=3")
    ranks = ppo_run(tmp_path, actor, "ranks", "train.max_steps=3", "ppo.rollout_ranks=1", nproc=2)
    assert same_run(sync, ranks) > 40
    rows = metrics(ranks)
    assert all(r["async/staleness_max"] == 0 and r["async/dropped"] == 0 for r in rows)
    assert all(r["async/transfer_bytes"] > 0 for r in rows)


def test_two_rollout_ranks_as_two_workers_or_one_tp_2_worker_are_the_colocated_run(
    tmp_path,
    actor,  # noqa: F811
):
    """A world of 3: one trainer whose 3 prompts a step two rollout ranks share (1 and 2, each with
    their keys: ppo.rollout_ranks=2), or one rollout worker over both ranks at TP 2 (each with its
    slices of the weights, the second following the first's generations: ppo.rollout_tp_size=2),
    gives the one-rank colocated run: its samples, every metric within 1e-6 (shares generate in
    smaller batches) or 1e-5 (TP's sums in another order), and the same exported weights."""
    common = ("train.max_steps=3", "ppo.prompts_per_step=3")
    sync = ppo_run(tmp_path, actor, "sync", *common)
    shares = ppo_run(tmp_path, actor, "shares", *common, "ppo.rollout_ranks=2", nproc=3)
    assert same_run(sync, shares, tol=1e-6, ignore=WORKER_TIMING) > 40
    assert all(r["async/generate_calls"] >= 2 for r in metrics(shares))
    tp = ("ppo.rollout_ranks=2", "ppo.rollout_tp_size=2")
    ranks = ppo_run(tmp_path, actor, "tp", *common, *tp, nproc=3)
    assert same_run(sync, ranks, tol=1e-5, ignore=WORKER_TIMING) > 40
    assert "rollout worker on ranks 1–2 (TP 2)" in (ranks / "stderr.txt").read_text()


def test_a_tp_2_rollout_worker_follows_its_leader_across_versions_and_turns(tmp_path, ending_actor):
    """staleness_policy=fixed, k = 1, multi-turn episodes over a slow tool (two steps in flight,
    each in groups: generations of two weights versions interleaved, models built and released
    as the versions change): a TP 2 worker's run is the worker process's, every metric within
    1e-5 and the same export."""
    steps = (
        "train.max_steps=3",
        "ppo.max_staleness=1",
        "ppo.staleness_policy=fixed",
        *agentic(tmp_path),
    )
    beside = ppo_run(tmp_path, ending_actor, "beside", *steps, "ppo.rollout_workers=1")
    tp = ("ppo.rollout_ranks=2", "ppo.rollout_tp_size=2")
    ranks = ppo_run(tmp_path, ending_actor, "ranks", *steps, *tp, nproc=3)
    fixed_lag_rows(ranks, 1)
    # (the weights' bytes: each TP rank gets the whole root beside its slices)
    ignore = (*WORKER_TIMING, "async/transfer_bytes")
    assert same_run(beside, ranks, tol=1e-5, ignore=ignore) > 60
    sent = [
        (a["async/transfer_bytes"], b["async/transfer_bytes"])
        for a, b in zip(*map(metrics, (beside, ranks)))
    ]
    assert all(b > a for a, b in sent)


@pytest.mark.slow
def test_one_rollout_rank_serving_two_trainers_is_the_two_rank_colocated_run(
    tmp_path,
    actor,  # noqa: F811
):
    sync = ppo_run(tmp_path, actor, "sync", "train.max_steps=2", nproc=2)
    ranks = ppo_run(tmp_path, actor, "ranks", "train.max_steps=2", "ppo.rollout_ranks=1", nproc=3)
    assert same_run(sync, ranks, tol=1e-6) > 25


def test_a_rollout_rank_plays_what_a_worker_process_plays_and_restarts_after_a_kill(
    tmp_path, ending_actor
):
    """staleness_policy=fixed, k = 1, two steps in flight over a slow tool: a rollout rank's run
    is the worker process's, bit for bit; the rollout rank SIGKILLed after the first checkpoint
    under launcher.max_restarts=1: the job restarts, resumes (the step in flight from the
    checkpoint) and ends as the uninterrupted run."""
    from tests.reliability.conftest import one_node
    from tests.reliability.helpers import Job, When, workers

    steps = (
        "train.max_steps=4",
        "train.save_every=2",
        "ppo.max_staleness=1",
        "ppo.staleness_policy=fixed",
        *agentic(tmp_path),
    )
    beside = ppo_run(tmp_path, ending_actor, "beside", *steps, "ppo.rollout_workers=1")
    ranks = ppo_run(tmp_path, ending_actor, "ranks", *steps, "ppo.rollout_ranks=1", nproc=2)
    fixed_lag_rows(ranks, 1)
    assert same_run(beside, ranks, ignore=WORKER_TIMING) > 80
    run = tmp_path / "restarted"
    args = [
        a.replace(str(tmp_path / "run"), str(run))
        for a in grpo(tmp_path, ending_actor, *RULE, ONE_THREAD, *steps, "ppo.rollout_ranks=1")
    ]
    job = Job(*args, *one_node(2, max_restarts=1), log=tmp_path / "restarted.txt")
    ckpt = run / "ppo/checkpoints/step_00000002/trainer_state.json"

    def kill_rollout_rank():
        ranks = workers(job.pid)
        os.kill(ranks[1], signal.SIGKILL)
        return ranks

    kill = When(ckpt.exists, kill_rollout_rank, job, 300, "the first checkpoint")
    assert job.wait(300) == 0, job.tail()
    kill.result()
    log = job.log.read_text()
    assert "resumed from" in log and "step(s) in flight at the checkpoint restored" in log
    assert same_run(ranks, run, ignore=WORKER_TIMING) > 80


@pytest.mark.slow
def test_a_hanging_rollout_rank_ends_the_run_with_exit_3(tmp_path, ending_actor):
    from tests.reliability.conftest import one_node

    args = misbehaving(tmp_path, ending_actor, "WorkerHangs", "ppo.rollout_ranks=1")
    t0 = time.time()
    proc = run_cli(*args, *one_node(2), timeout=180)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.time() - t0 < 120
    said = [x for x in error_lines(proc.stderr) if x.startswith("rlhf: error:")]
    assert (
        len(said) == 1
        and "the rollout rank 1 of trainer rank 0 sent no episodes for 8 s" in (said[0])
    ), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "nproc, extra, says",
    [
        (2, ("ppo.rollout_ranks=2",), "ppo.rollout_ranks=2 leaves no trainer in a world of 2"),
        (1, ("ppo.rollout_ranks=1",), "ppo.rollout_ranks=1 leaves no trainer in a world of 1"),
        (
            1,
            ("ppo.rollout_ranks=1", "ppo.rollout_workers=1"),
            "ppo.rollout_workers=1 is invalid: expected 0 with ppo.rollout_ranks",
        ),
        (1, ("ppo.rollout_ranks=1", "engine.hybrid=false"), "ppo.rollout_ranks=1 does not work"),
        (
            1,
            ("launcher.nproc_per_node=5", "ppo.rollout_ranks=2"),
            "ppo.rollout_ranks=2 and the 3 trainer ranks of a world of 5 do not divide one another",
        ),
    ],
)
def test_a_world_the_rollout_ranks_cannot_split_is_one_line(
    tmp_path,
    actor,  # noqa: F811
    nproc,
    extra,
    says,
):
    from tests.reliability.conftest import one_node

    launch = one_node(nproc) if nproc > 1 else ()
    proc = run_cli(*grpo(tmp_path, actor, *RULE, *extra), *launch, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert says in line
    assert not (tmp_path / "run" / "ppo").exists()
