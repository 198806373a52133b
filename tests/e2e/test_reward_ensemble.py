"""Reward-model ensembles through the CLI: the reward stage's k-member export (plain Hugging Face
loads it, every member scores as rlhf.score says), PPO rewarded by the conservative combination with
the disagreement logged every step, and the over-optimisation gate (fires, exports the best step's
actor, resumes bit for bit)."""

import json
import shutil

import pytest
import torch

from tests.conftest import killed_at, quick_reward, quick_sft_args, run_cli, score_cli
from tests.e2e.test_ppo import quick_ppo

K = 3


@pytest.fixture(scope="module")
def ensemble_pipeline(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ensemble") / "run"
    assert run_cli(*quick_sft_args(run_dir, steps=60), "train.save_every=0").returncode == 0
    proc = quick_reward(run_dir, "engine.precision=fp32", f"reward.ensemble={K}")
    assert f"an ensemble of {K} heads (bootstrapped pairs)" in proc.stderr
    return run_dir


def test_each_member_loads_in_hf_and_scores_like_rlhf_score(ensemble_pipeline, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic
    from rlhf.score import RewardScorer

    model_dir = ensemble_pipeline / "reward" / "model"
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert hf.config.num_labels == K and hf.config.id2label[2] == "member2"
    scorer = RewardScorer(str(model_dir))
    _, held_out = synthetic.generate(SyntheticConfig(num_records=2000), 256, seed=1234)
    exs = held_out[:16]
    ours = scorer.score([e.prompt for e in exs], [e.chosen for e in exs])
    assert ours.shape == (16, K)
    seqs = scorer.encode([e.prompt for e in exs], [e.chosen for e in exs])
    with torch.no_grad():
        # plain HF, one sequence at a time: member i is logit i
        theirs = torch.stack([hf(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours[:, 0] - ours[:, 1]).abs().max().item() > 1e-3  # the members differ
    stats = json.loads((model_dir / "reward_stats.json").read_text())
    assert len(stats["members"]) == K
    assert stats["eval/member_accuracy_min"] <= stats["eval/member_accuracy_max"]
    # each member's held-out mean is reproduced by the saved model (chosen and rejected of every
    # pair)
    rows = scorer.score(
        [e.prompt for e in held_out] * 2,
        [e.chosen for e in held_out] + [e.rejected for e in held_out],
    )
    for i, m in enumerate(stats["members"]):
        assert abs(rows[:, i].mean().item() - m["mean"]) <= 1e-4, (i, m)
        assert (
            rows[:, i].min().item() >= m["min"] - 1e-4
            and rows[:, i].max().item() <= m["max"] + 1e-4
        )

    proc = score_cli(model_dir, "--prompt", exs[0].prompt, "--response", exs[0].chosen)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.splitlines()[0])
    assert set(line) == {"score", "normalized", "spread", "members"}
    assert line["members"] == pytest.approx(ours[0].tolist(), abs=1e-5)
    assert line["score"] == pytest.approx(ours[0].mean().item(), abs=1e-5) and line["spread"] > 0


GATE = ["train.max_steps=14", "ppo.stop_disagreement=1.05", "train.save_every=3"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]


def test_ppo_watches_disagreement_and_the_gate_stops(ensemble_pipeline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ensemble_pipeline, run)
    proc = run_cli(*quick_ppo(run, *GATE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in _rows(run) if "reward/mean" in r]
    assert all(r["reward/ensemble_std"] > 0 and "reward/ensemble_mean" in r for r in steps)
    stopped = [r for r in steps if r.get("gate/stopped")]
    assert len(stopped) == 1 and stopped[0] is steps[-1], steps[-1]
    best = int(stopped[0]["gate/best_step"])
    assert 5 <= best <= stopped[0]["step"] < 14
    assert (
        "the gate stops the run" in proc.stderr
        and f"exporting the actor of step {best}" in proc.stderr
    )
    done = json.loads((run / "ppo" / "done.json").read_text())
    assert done["gate"]["best_step"] == best and done["gate"]["stopped_at"] == stopped[0]["step"]
    assert "ppo.stop_disagreement=1.05" in done["gate"]["why"]
    # a stopped run is finished: its rerun touches nothing
    rerun = run_cli(*quick_ppo(run, *GATE))
    assert rerun.returncode == 0 and "already" in rerun.stderr.lower(), rerun.stderr[-1000:]
    # the critic started from the members' mean: one head
    assert (
        json.loads((run / "ppo" / "critic" / "config.json").read_text()).get("num_labels", 1) == 1
    )
    assert (run / "ppo" / "actor" / "model.safetensors").is_file()


# three PPO runs; the copy's save/load is the EMA's (test_ppo), the gate's state a unit test's
@pytest.mark.slow
def test_gate_resumes_bit_exactly_after_sigkill(ensemble_pipeline, tmp_path):
    from safetensors.torch import load_file

    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(ensemble_pipeline, ref)
    shutil.copytree(ensemble_pipeline, run)
    assert run_cli(*quick_ppo(ref, *GATE)).returncode == 0
    killed_at(quick_ppo(run, *GATE), run / "ppo/checkpoints/step_00000003/trainer_state.json")
    proc = run_cli(*quick_ppo(run, *GATE))
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-2000:]

    def numbers(rows):
        # the gate's line less what the machine's speed decides
        line = [r for r in rows if r.get("gate/stopped")][-1]
        return {
            k: v
            for k, v in line.items()
            if k.startswith(("reward/", "kl/", "gate/", "rollout/", "step"))
        }

    assert numbers(_rows(run)) == numbers(_rows(ref))
    a = load_file(str(ref / "ppo" / "actor" / "model.safetensors"))
    b = load_file(str(run / "ppo" / "actor" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_disagreement_gate_needs_an_ensemble(small_pipeline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_pipeline, run)
    proc = run_cli(*quick_ppo(run, "ppo.stop_disagreement=2"))
    assert proc.returncode == 2
    assert "ppo.stop_disagreement=2 reads a reward-model ensemble's disagreement" in proc.stderr
    assert "reward.ensemble=k" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "ppo" / "metrics.jsonl").exists()


def test_several_reward_models_are_one_ensemble(ensemble_pipeline, small_pipeline, tmp_path):
    """ppo.reward_model_path=a,b: a one-head reward model and a 3-member one score as 4 members."""
    run = tmp_path / "run"
    shutil.copytree(ensemble_pipeline, run)
    paths = f"{small_pipeline / 'reward' / 'model'},{ensemble_pipeline / 'reward' / 'model'}"
    proc = run_cli(*quick_ppo(run, f"ppo.reward_model_path='{paths}'", "ppo.reward_combine=min"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ppo: reward models " in proc.stderr
    steps = [r for r in _rows(run) if "reward/mean" in r]
    assert steps and all(r["reward/ensemble_std"] > 0 for r in steps)
    # the worst member, below the mean
    assert all(r["reward/model"] < r["reward/ensemble_mean"] for r in steps)


def test_held_out_reward_is_the_reward_models_view_of_greedy_answers(small_pipeline, tmp_path):
    """eval/reward_greedy at step 0 = the reward model's normalised score of the SFT policy's greedy
    answers to the first eval.gold_prompts held-out prompts (plain HF generate and rlhf.score)."""
    from transformers import AutoModelForCausalLM

    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic
    from rlhf.score import RewardScorer

    run = tmp_path / "run"
    shutil.copytree(small_pipeline, run)
    proc = run_cli(*quick_ppo(run, "train.max_steps=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in _rows(run) if "eval/reward_greedy" in r]
    assert [r["step"] for r in evals] == [0, 2], evals
    _, held_out = synthetic.generate(SyntheticConfig(num_records=2000), 256, seed=1234)
    prompts = [e.prompt for e in held_out[:8]]  # quick_ppo: eval.gold_prompts=8
    scorer = RewardScorer(str(run / "reward" / "model"))
    tok = scorer.tokenizer

    def greedy(path):
        policy = AutoModelForCausalLM.from_pretrained(path).eval()
        answers = []
        for p in prompts:  # one at a time: no padding
            ids = torch.tensor([tok(p)["input_ids"]])
            with torch.no_grad():
                out = policy.generate(
                    ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id
                )
            answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return answers

    answers, after = greedy(run / "sft" / "model"), greedy(run / "ppo" / "actor")
    scores, scores_after = (scorer.normalize(scorer.score(prompts, a)) for a in (answers, after))
    assert abs(evals[0]["eval/reward_greedy"] - scores.mean().item()) <= 1e-4, (
        evals[0],
        scores,
        answers,
    )
    # the answers that changed since step 0, and the reward model's mean gain on them
    changed = [i for i in range(len(prompts)) if after[i] != answers[i]]
    assert evals[0]["eval/greedy_changed"] == 0.0
    assert evals[1]["eval/greedy_changed"] == len(changed) / len(prompts), (answers, after)
    gain = (scores_after - scores)[changed].mean().item() if changed else 0.0
    assert abs(evals[1]["eval/reward_gain_changed"] - gain) <= 1e-4, (evals[1], gain)
