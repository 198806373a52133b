"""LoRA through the CLI: resume is exact, PPO runs with the adapters-off reference and exports the
merged actor and the adapter, and a model without an injection policy (a GPT-2 with Conv1D layers
and attention scaled by layer, which the inference modules refuse) falls back to HF generate and
still exports correctly."""

import json
import shutil

import torch

from tests.conftest import quick_sft_args, run_cli
from tests.e2e.test_ppo import quick_ppo, rows


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_lora_sft_resume_is_exact_and_exports_merged(tmp_path):
    run = tmp_path / "run"
    args = [
        *quick_sft_args(run, steps=12),
        "train.save_every=6",
        "model.lora.r=8",
        "model.lora.alpha=16",
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA on the model: r=8" in proc.stderr
    sft = run / "sft"
    first = _weights(sft / "model")
    assert not any("lora" in k for k in first)  # merged: a plain HF model
    cfg = json.loads((sft / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    # drop the end of the run and rerun: it resumes from step 6 and lands on the same weights, bit
    # for bit
    shutil.rmtree(sft / "checkpoints" / "step_00000012")
    shutil.rmtree(sft / "model")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_00000006" in proc.stderr
    again = _weights(sft / "model")
    assert first.keys() == again.keys()
    for k in first:
        assert torch.equal(first[k], again[k]), k
    # a rerun with other adapters does not resume from these checkpoints (exit 2, one line)
    proc = run_cli(
        *[a for a in args if a != "model.lora.r=8"], "model.lora.r=4", "train.max_steps=13"
    )
    assert proc.returncode == 2 and "another lora" in proc.stderr, proc.stderr[-2000:]


def test_lora_ppo_uses_the_base_as_reference_and_exports(small_pipeline, tmp_path):
    shutil.copytree(small_pipeline, tmp_path / "run")
    proc = run_cli(
        *quick_ppo(tmp_path / "run", "model.lora.r=8", "model.lora.critic=true", "train.lr=1e-3")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA on the actor" in proc.stderr and "LoRA on the critic" in proc.stderr
    r = [x for x in rows(tmp_path / "run" / "ppo" / "metrics.jsonl") if "reward/mean" in x]
    # the reference is the actor's own base: no KL before the first update
    assert r[0]["kl/mean"] == 0.0
    # ... and the adapters moved the policy away from it
    assert r[-1]["kl/mean"] != 0.0
    ppo = tmp_path / "run" / "ppo"
    for d in ("actor", "critic"):
        assert not any("lora" in k for k in _weights(ppo / d))
    assert (ppo / "adapter" / "adapter_model.safetensors").is_file()
    assert (ppo / "critic_adapter" / "adapter_model.safetensors").is_file()
    # the frozen base weights of the merged actor equal the SFT model's where no adapter applies
    sft, actor = _weights(tmp_path / "run" / "sft" / "model"), _weights(ppo / "actor")
    assert torch.equal(sft["model.embed_tokens.weight"], actor["model.embed_tokens.weight"])
    assert not torch.equal(
        sft["model.layers.0.self_attn.q_proj.weight"],
        actor["model.layers.0.self_attn.q_proj.weight"],
    )


def tiny_gpt2(path, **config):
    """A tiny GPT-2 (Conv1D projections) with a byte-level BPE tokenizer that has a pad token, saved
    as a Hugging Face directory; ``config``: further GPT2Config fields."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = synthetic.tokenizer_corpus(SyntheticConfig()) + [
        "Human: hello Assistant: hi, how can I help?"
    ]
    bpe.train_from_iterator(
        corpus,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<pad>", "<unk>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=256,
    )
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **config,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_lora_on_a_model_without_policy_falls_back_and_exports(tmp_path, real_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tiny_gpt2(tmp_path / "gpt2", scale_attn_by_inverse_layer_idx=True)
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft",
        f"run.dir={run}",
        f"model.path={base_dir}",
        "data.format=hh",
        f"data.path={real_data / 'hh-rlhf' / 'harmless-base-test.jsonl.gz'}",
        "data.max_prompt_len=96",
        "data.max_response_len=64",
        "train.max_steps=3",
        "train.global_batch=8",
        "train.lr=1e-2",
        "train.warmup_steps=0",
        "model.lora.r=4",
        "eval.gold_prompts=4",
        "data.eval_size=8",
        "logger.progress=false",
        "engine.precision=fp32",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "scale_attn_by_inverse_layer_idx=True is not supported by the inference modules"
        in proc.stderr
    )
    assert "generating with HF generate instead" in proc.stderr
    assert "LoRA on the model: r=4 alpha=16 on c_attn,c_fc,c_proj" in proc.stderr
    merged = AutoModelForCausalLM.from_pretrained(run / "sft" / "model").eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), run / "sft" / "adapter"
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-3  # training moved the adapters
