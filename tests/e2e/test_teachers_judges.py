"""On-policy distillation (ppo.teacher_path, algorithm.estimator=distill) and a generative judge
(ppo.judge_path) through the CLI on the embedded task: a teacher equal to the student gives a
reverse KL of 0 and full greedy agreement; another teacher a positive one, its reward the per-token
−reverse KL (alone, or beside a rule with any estimator); a teacher with another tokenizer is
refused before any model loads; GKD's divergence (on the samples and on the dataset's responses) is
0 against itself and positive against another; the judge's reward is its verdict's probability."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import quick_sft_args, run_cli, score_cli
from tests.e2e.test_ppo import quick_ppo, rows


def distill_run(run_dir, teacher, *extra):
    return quick_ppo(
        run_dir,
        f"ppo.teacher_path={teacher}",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=null",
        "algorithm.estimator=distill",
        "algorithm.kl_coef=0",
        *extra,
    )


def steps_of(run_dir):
    return [r for r in rows(run_dir / "ppo" / "metrics.jsonl") if "reward/mean" in r]


@pytest.fixture(scope="module")
def weak_teacher(tmp_path_factory):
    """Another SFT model of the embedded task: 20 steps against the student's 60."""
    run_dir = tmp_path_factory.mktemp("teacher") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=20), "train.save_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir / "sft" / "model"


def test_a_teacher_equal_to_the_student_gives_no_signal(small_pipeline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    # one update
    gkd = [
        "algorithm.gkd_coef=1.0",
        "algorithm.gkd_beta=0.5",
        "algorithm.gkd_data_share=0.5",
        "ppo.minibatches_per_epoch=1",
    ]
    proc = run_cli(*distill_run(run, small_pipeline / "sft" / "model", "train.max_steps=1", *gkd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distilling from teacher" in proc.stderr and "ppo (distill)" in proc.stderr
    # the actor before its first update is the teacher, token for token
    (first,) = steps_of(run)
    assert abs(first["distill/reverse_kl"]) < 1e-6 and abs(first["reward/distill"]) < 1e-5
    assert first["distill/agreement"] == 1.0 and first["reward/mean"] == pytest.approx(
        first["reward/distill"]
    )
    # GKD's JSD, computed before the update: the same distributions, on the samples and on the
    # dataset's responses
    assert abs(first["distill/gkd"]) < 1e-6 and abs(first["distill/gkd_data"]) < 1e-6


@pytest.mark.slow
def test_gkd_alone_trains_without_a_per_token_reward(small_pipeline, weak_teacher, tmp_path):
    """estimator=distill with ppo.distill_coef=0 and algorithm.gkd_coef > 0 (and no other score: no
    penalty for a cut answer either): no token is rewarded (advantages 0, the policy loss 0) and the
    actor moves by GKD's divergence alone."""
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    gkd = ["ppo.distill_coef=0", "algorithm.gkd_coef=1", "algorithm.gkd_beta=1"]
    proc = run_cli(
        *distill_run(run, weak_teacher, "train.max_steps=2", "algorithm.no_eos_penalty=0", *gkd)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "by GKD, without the per-token reward" in proc.stderr
    for r in steps_of(run):
        assert r["reward/distill"] == 0.0 and r["actor/loss"] == 0.0
        assert r["distill/reverse_kl"] > 0.01 and r["distill/gkd"] > 1e-4
    start = load_file(str(small_pipeline / "sft" / "model" / "model.safetensors"))
    end = load_file(str(run / "ppo" / "actor" / "model.safetensors"))
    assert max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-6


def test_a_lora_student_learns_from_a_teacher_of_its_own(small_pipeline, tmp_path):
    """Under LoRA the student's adapters train and the teacher is a model apart: equal to the
    student's base before the first update (reverse KL 0, full agreement), an adapter exported."""
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    lora = ["model.lora.r=4", "train.max_steps=1", "ppo.minibatches_per_epoch=1"]
    proc = run_cli(*distill_run(run, small_pipeline / "sft" / "model", *lora))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (first,) = steps_of(run)
    assert abs(first["distill/reverse_kl"]) < 1e-6 and first["distill/agreement"] == 1.0
    assert "LoRA on the actor" in proc.stderr
    assert (run / "ppo" / "adapter" / "adapter_model.safetensors").is_file()


# (two PPO runs and a second SFT model: about a minute each)
@pytest.mark.slow
def test_another_teacher_rewards_each_token_by_its_reverse_kl(
    small_pipeline, weak_teacher, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    proc = run_cli(
        *distill_run(
            run,
            weak_teacher,
            "train.max_steps=2",
            "algorithm.gkd_coef=0.5",
            "algorithm.gkd_top_k=8",
            "algorithm.gkd_data_share=0.25",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in steps_of(run):
        assert (
            r["distill/reverse_kl"] > 0.01
            and 0.0 < r["distill/agreement"] < 1.0
            and r["distill/gkd"] > 1e-4
            and r["distill/gkd_data"] > 1e-4
        )
        assert r["reward/distill"] == pytest.approx(-r["distill/reverse_kl_seq"], rel=1e-5)
        assert r["reward/mean"] == pytest.approx(
            r["reward/distill"] + r.get("reward/penalty", 0.0), abs=1e-5
        )
    # beside a rule, with a group estimator: the reverse KL summed into each sequence's score
    run2 = tmp_path / "run2"
    shutil.copytree(small_pipeline / "sft", run2 / "sft")
    mixed = quick_ppo(
        run2,
        f"ppo.teacher_path={weak_teacher}",
        "ppo.distill_coef=0.5",
        "ppo.use_reward_model=false",
    )
    proc = run_cli(
        *mixed, "ppo.reward_fn=rlhf.rewards.gold", "algorithm.estimator=grpo", "train.max_steps=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = steps_of(run2)
    assert r["reward/distill"] == pytest.approx(-0.5 * r["distill/reverse_kl_seq"], rel=1e-5)
    parts = r["reward/rule"] + r["reward/distill"] + r.get("reward/penalty", 0.0)
    assert r["reward/mean"] == pytest.approx(parts, abs=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_model_loads(
    small_pipeline, user_model, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    proc = run_cli(*distill_run(run, user_model))
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert (
        f"ppo.teacher_path={user_model}: its tokenizer" in line and "is not the one of" in line
    ), line
    assert not (run / "ppo" / "metrics.jsonl").exists()
    proc = run_cli(*quick_ppo(run, "algorithm.estimator=distill"))
    assert proc.returncode == 2 and "set ppo.teacher_path" in proc.stderr.strip().splitlines()[-1]


def test_a_generative_judge_rewards_by_its_verdicts_probability(small_pipeline, tmp_path):
    """The embedded SFT model as the judge (its digits '1' / '0' as the verdicts): GRPO on its
    reward alone; a verdict that is not one token of the judge's, and a template without {response},
    exit 2 with one line before any model loads."""
    run = tmp_path / "run"
    shutil.copytree(small_pipeline / "sft", run / "sft")
    template = tmp_path / "judge.txt"
    template.write_text("{prompt} {response} right=")
    judge = small_pipeline / "sft" / "model"
    args = quick_ppo(
        run,
        f"ppo.judge_path={judge}",
        f"ppo.judge_template={template}",
        "ppo.judge_verdicts=[1,0]",
        "ppo.judge_weight=2.0",
        "ppo.use_reward_model=false",
        "algorithm.estimator=grpo",
        "train.max_steps=1",
    )
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ppo: judge {judge} with {template}" in proc.stderr
    (r,) = steps_of(run)
    assert 0.0 < r["reward/judge"] < 2.0 and 0.0 < r["time/judge_s"] <= r["time/score_s"]
    assert r["reward/mean"] == pytest.approx(
        r["reward/judge"] + r.get("reward/penalty", 0.0), abs=1e-5
    )
    # the score form: the judge writes its answer (the embedded model writes digits) and the
    # number read from it is the reward; unread answers counted
    score_run = tmp_path / "score_run"
    shutil.copytree(small_pipeline / "sft", score_run / "sft")
    score_args = [a.replace(str(run), str(score_run)) for a in args]
    proc = run_cli(*score_args, r"ppo.judge_score_pattern='(\d+)'", "ppo.judge_score_range=[0,200]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = steps_of(score_run)
    # at most quick_ppo's 8 prompts × 2 samples
    assert 0.0 <= r["reward/judge"] <= 2.0 and 0 <= r["judge/parse_failures"] <= 16, r
    proc = run_cli(*args, "ppo.judge_verdicts=[Yes,No]")
    assert proc.returncode == 2
    assert (
        "ppo.judge_verdicts: 'Yes' is 3 tokens for the tokenizer of"
        in proc.stderr.strip().splitlines()[-1]
    )
    template.write_text("{prompt} right=")
    proc = run_cli(*args)
    assert (
        proc.returncode == 2
        and "the template has no {response}" in proc.stderr.strip().splitlines()[-1]
    )


def test_score_reads_pairs_with_the_judge(small_pipeline, tmp_path):
    """rlhf.score --judge: each pair's two responses by the judge's verdict probability, then the
    accuracy."""
    import json

    template = tmp_path / "judge.txt"
    template.write_text("{prompt} {response} right=")
    pairs = tmp_path / "pairs.jsonl"
    recs = [
        {"prompt": f"Q: {a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"}
        for a, b in ((3, 4), (12, 7))
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in recs))
    judge = small_pipeline / "sft" / "model"
    proc = score_cli(
        str(judge), "--judge", str(template), "--verdicts", "1", "0", "--jsonl", str(pairs)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 3 and all(
        0.0 < x["chosen"] < 1.0 and 0.0 < x["rejected"] < 1.0 for x in lines[:2]
    )
    assert (
        lines[2]["pairs"] == 2 and lines[2]["accuracy"] == sum(x["correct"] for x in lines[:2]) / 2
    )
    # the score form: the answers' numbers, and how many had none
    proc = score_cli(
        str(judge), "--judge", str(template), "--score-pattern", r"(\d+)", "--jsonl", str(pairs)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.splitlines()[-1])
    assert last["pairs"] == 2 and 0 <= last["parse_failures"] <= 4, last
    # Yes / No: not one token
    proc = score_cli(str(judge), "--judge", str(template), "--jsonl", str(pairs))
    assert proc.returncode == 2 and "'Yes' is 3 tokens" in proc.stderr.strip().splitlines()[-1]


def test_the_score_forms_answers_decoded_by_the_inference_mode_equal_a_forward_a_token(
    small_pipeline,
):
    """The judge's score form decodes in the inference mode (a hybrid engine over the frozen judge:
    one prefill, then its KV cache) and reads the same greedy answers as a full forward a token."""
    from transformers import AutoModelForCausalLM

    from rlhf.config import EngineConfig
    from rlhf.data.records import Example
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.mesh import init_mesh
    from rlhf.engine.train import FrozenModel
    from rlhf.models.loading import load_tokenizer
    from rlhf.rl.judge import Judge, Plain

    path = small_pipeline / "sft" / "model"
    tokenizer = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    # (host_malloc=system: glibc's settings are process-wide, and this is pytest's process)
    ecfg = EngineConfig(device="cpu", host_malloc="system")
    decoder = HybridEngine(FrozenModel(model, init_mesh(ecfg), ecfg), tokenizer, ecfg)
    assert decoder.inject
    exs = [Example(prompt=f"Q: {a}+{b}=") for a, b in ((3, 4), (12, 7), (40, 2), (5, 5), (9, 81))]
    texts = [" 7", " 19", " 41", "", " 99"]
    judges = [
        Judge(
            Plain(model),
            tokenizer,
            "{prompt}{response} Q: 2+2=",
            [],
            64,
            "j",
            score=r"(\d+)",
            score_range=(0.0, 1000.0),
            max_new_tokens=6,
            decoder=d,
        )
        for d in (None, decoder)
    ]
    plain, decoded = (j(texts, exs, 2, torch.device("cpu")) for j in judges)
    assert judges[1].decoder is not None and judges[0].decoder is None
    assert torch.equal(plain.isnan(), decoded.isnan()) and torch.equal(
        plain.nan_to_num(-1.0), decoded.nan_to_num(-1.0)
    )
    assert bool((~plain.isnan()).any()), plain  # answers with a number, compared


# (two PPO runs and a second SFT model: about a minute each)
@pytest.mark.slow
def test_a_watched_teacher_changes_nothing(small_pipeline, weak_teacher, tmp_path):
    """ppo.distill_coef=0: the teacher is scored and its distance logged, and the run is plain GRPO
    — the same metrics and the same exported weights as without a teacher."""

    runs = []
    for name, extra in (
        ("plain", []),
        ("watched", [f"ppo.teacher_path={weak_teacher}", "ppo.distill_coef=0"]),
    ):
        run = tmp_path / name
        shutil.copytree(small_pipeline / "sft", run / "sft")
        args = quick_ppo(
            run,
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "train.max_steps=2",
            *extra,
        )
        proc = run_cli(*args, "ppo.reward_fn=rlhf.rewards.gold")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(run)
    assert "watched only" in proc.stderr
    plain, watched = (steps_of(r) for r in runs)
    for a, b in zip(plain, watched):
        assert b["distill/reverse_kl"] > 0 and "reward/distill" in b
        same = [
            k
            for k in a
            if not k.startswith("time/") and not k.endswith("per_s") and "mem/" not in k
        ]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    wa, wb = (load_file(r / "ppo" / "actor" / "model.safetensors") for r in runs)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
