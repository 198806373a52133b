"""Tokenizers without a pad token (Llama-2/3, Mistral) or whose pad is EOS (Qwen3, Phi-3): a
distinct pad is added, every model that meets it is resized (every rank, meta models included), and
the exported reward model scores through plain ``AutoModelForSequenceClassification`` exactly as
``rlhf.score`` does (HF pools the last token that is not pad: our EOS only when pad ≠ EOS)."""

from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def raw_model(path: Path, pad_is_eos: bool = False, vocab: int = 300) -> Path:
    """A tiny untied Llama (random init) saved with a byte-level BPE tokenizer trained on the
    synthetic task's text whose vocabulary has no pad token at all — pad unset, or set to EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic

    bpe = Tokenizer(models.BPE(unk_token=UNK))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        synthetic.tokenizer_corpus(SyntheticConfig()),
        trainer=trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=[BOS, EOS, UNK],
            show_progress=False,
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bpe.token_to_id(BOS))]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=EOS if pad_is_eos else None,
        model_max_length=128,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    assert "<pad>" not in tok.get_vocab() and (
        tok.pad_token_id == tok.eos_token_id if pad_is_eos else tok.pad_token is None
    )
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def assert_vocab_agrees(model_dir: Path) -> None:
    """The exported tokenizer (a distinct pad) and the exported embeddings have the same length."""
    import json

    from safetensors import safe_open
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        rows = {
            k: f.get_slice(k).get_shape()[0]
            for k in f.keys()
            if k.endswith(("embed_tokens.weight", "lm_head.weight"))
        }
    assert rows and set(rows.values()) == {len(tok)}, (rows, len(tok))
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == len(tok)


def assert_hf_scores_like_rlhf_score(model_dir: Path) -> None:
    """Plain AutoModelForSequenceClassification on a right-padded batch gives rlhf.score's
    scores."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.data.tokenize import pad_right
    from rlhf.score import RewardScorer

    scorer = RewardScorer(str(model_dir))
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.pad_token_id == scorer.tokenizer.pad_token_id != scorer.tokenizer.eos_token_id
    prompts = ["Q: What is 03 + 45?\nA:", "Q: What is 7 + 8?\nA:", "Q: What is 12 + 30?\nA:"]
    responses = [" The answer is 48.", " 15", " The answer is 42, I think."]
    seqs = scorer.encode(prompts, responses)
    assert len({len(s) for s in seqs}) > 1  # padding in the batch
    ours = scorer.score_ids(seqs)
    ids = pad_right(seqs, scorer.tokenizer.pad_token_id)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (ours - theirs).abs().max().item() <= 1e-5, (ours, theirs)


def test_load_tokenizer_adds_a_distinct_pad(tmp_path):
    from rlhf.models.loading import load_tokenizer

    for pad_is_eos in (False, True):
        raw = raw_model(tmp_path / f"raw{int(pad_is_eos)}", pad_is_eos)
        tok = load_tokenizer(str(raw))
        assert tok.pad_token == "<pad>" and tok.pad_token_id == len(tok) - 1 != tok.eos_token_id


def test_every_rank_builds_the_same_resized_model(tmp_path):
    """Rank 0 loads and resizes, another rank builds on meta: the same parameter shapes and config
    (what FSDP wraps and rank 0 broadcasts into), for a causal LM and a reward model whose config's
    pad is the new token (not an embedding row until the resize)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.models.loading import build_model, load_model_config, load_tokenizer

    raw = raw_model(tmp_path / "raw")
    tok = load_tokenizer(str(raw))
    for cls, head in ((AutoModelForCausalLM, None), (AutoModelForSequenceClassification, 1)):
        built = []
        for on_meta in (False, True):
            cfg = load_model_config(str(raw), False)
            if head:
                cfg.num_labels, cfg.pad_token_id = head, tok.pad_token_id
            built.append(
                build_model(
                    cls,
                    config=cfg,
                    path=None if on_meta else str(raw),
                    on_meta=on_meta,
                    tokenizer=tok,
                )
            )
        real, meta = built
        shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in built]
        assert shapes[0] == shapes[1]
        assert (
            real.get_input_embeddings().weight.shape[0] == len(tok) and meta.device.type == "meta"
        )
        for m in built:
            assert m.config.vocab_size == len(tok)
            assert m.config.pad_token_id == (tok.pad_token_id if head else None)
        if head is None:
            assert real.lm_head.weight.shape[0] == len(tok)
            with torch.no_grad():  # the pad id is a row now
                real(input_ids=torch.tensor([[tok.bos_token_id, tok.pad_token_id]]))


@pytest.mark.parametrize("pad_is_eos", [True, False], ids=["pad_is_eos", "no_pad"])
def test_exported_reward_model_scores_like_hf(tmp_path, pad_is_eos):
    """pad == EOS in the base tokenizer (Qwen3/Phi-3 style), or no pad (Llama style): the reward
    stage trains and exports with a distinct pad, so HF's pooling lands on the EOS rlhf.score scores
    (before: the token before it; or no run at all)."""
    raw = raw_model(tmp_path / "raw", pad_is_eos=pad_is_eos)
    proc = run_cli(
        "stage=reward",
        f"run.dir={tmp_path / 'run'}",
        f"reward.model_path={raw}",
        "train.max_steps=2",
        "train.global_batch=8",
        "train.save_every=0",
        "logger.progress=false",
        "engine.precision=fp32",
        "data.synthetic.num_records=300",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run" / "reward" / "model"
    assert_vocab_agrees(out)
    assert_hf_scores_like_rlhf_score(out)
