"""model.disable_dropout (default true): PPO's and DPO's models run without dropout, so the first
PPO update's ratio π/π_old is exactly 1 on a family whose config carries dropout (GPT-2: 0.1
everywhere); with model.disable_dropout=false every training-mode forward draws its own masks and it
is not."""

import logging

import pytest
import torch

from rlhf.config import AlgorithmConfig, Config, EngineConfig, ModelConfig, PPOConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine, reference_for
from rlhf.models import loading
from rlhf.models.dropout import disable_dropout
from rlhf.rl.experience import Collector
from rlhf.rl.prompts import PromptSource
from rlhf.rl.scorers import RewardNormaliser, Scorers
from rlhf.rl.update import Updater
from tests.infer_helpers import BOS, EOS, PAD, mixed_prompts

VOCAB = 97
DROPOUTS = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, summary_first_dropout=0.1)


class Tok:
    """What the PPO pieces ask of a tokenizer: the ids, its length, and text for the rule reward."""

    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, BOS

    def __len__(self):
        return VOCAB

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def tiny_gpt2(path):
    """A tiny GPT-2 with dropout 0.1 everywhere, saved to ``path``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **DROPOUTS,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


def digit_sum(texts, examples, fmt):
    # a rule reward that differs between the samples of a prompt
    return [float(sum(int(t) for t in text.split()) % 7) for text in texts]


def first_update(path, disable: bool):
    """(experience, stats) of one PPO step as stages/ppo.py makes it: actor and reference built by
    ``loading.causal_lm`` with model.disable_dropout=``disable``, GRPO with a rule reward, one
    epoch of one minibatch (the update's forward sees the weights the rollouts were scored with).
    The actor is in training mode when it scores, as from the second step on (the update leaves it
    there)."""
    torch.manual_seed(1)
    mesh, tok = Mesh(), Tok()
    ecfg = EngineConfig(precision="fp32")
    alg, ppo = (
        AlgorithmConfig(estimator="grpo"),
        PPOConfig(
            ppo_epochs=1,
            minibatches_per_epoch=1,
            max_new_tokens=8,
            samples_per_prompt=4,
            prompts_per_step=4,
        ),
    )
    actor = TrainEngine(
        loading.causal_lm(path, mesh, tok, disable_dropout=disable, role="actor"),
        mesh,
        ecfg,
        TrainConfig(lr=1e-3, warmup_steps=0),
        total_steps=1,
    )
    ref = reference_for(
        actor,
        lambda: loading.causal_lm(path, mesh, tok, disable_dropout=disable, role="reference"),
        mesh,
        ecfg,
    )
    scorers = Scorers(
        ref=ref,
        critic=None,
        reward_model=None,
        normalise=RewardNormaliser("none", {}),
        rule=digit_sum,
        rule_weight=1.0,
        data_format="prompt_response",
    )
    actor.train()
    prompts = PromptSource(
        mixed_prompts(4, vocab=VOCAB),
        [None] * 4,
        ppo.prompts_per_step,
        seed=0,
        mesh=mesh,
        max_rounds=0,
    )
    collector = Collector(
        HybridEngine(actor, tok, ecfg), actor, scorers, prompts, alg, ppo, tok, mesh, seed=3
    )
    exp = collector.collect(0, alg.kl_coef)
    stats = Updater(actor, None, alg, ppo, mesh, seed=0).update(exp, 0, alg.kl_coef)
    return exp, stats


def test_first_ppo_update_has_ratio_one_without_dropout_and_not_with_it(tmp_path, caplog):
    path = tiny_gpt2(tmp_path / "gpt2")
    with caplog.at_level(logging.INFO, logger="rlhf"):
        exp, stats = first_update(path, disable=True)
    assert (
        "dropout off in the actor (model.disable_dropout=true; it had resid_pdrop=0.1, "
        "embd_pdrop=0.1, attn_pdrop=0.1"
    ) in caplog.text
    assert "dropout off in the reference" in caplog.text
    assert exp.mask.sum() > 0 and exp.advantages.abs().sum() > 0  # rollouts with a signal
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs)  # the same weights give the same numbers
    assert stats["approx_kl"] == 0.0 and stats["clipfrac"] == 0.0, stats

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhf"):
        exp, stats = first_update(path, disable=False)
    assert (
        "dropout kept on in the actor (model.disable_dropout=false): resid_pdrop=0.1" in caplog.text
    )
    # the actor's own masks (the reference: eval mode)
    assert not torch.equal(exp.old_logprobs, exp.ref_logprobs)
    assert stats["approx_kl"] > 1e-5, stats  # the ratio is noise before any update


@pytest.mark.parametrize(
    "family, config",
    [
        ("gpt2", dict(resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3)),
        ("opt", dict(dropout=0.1, attention_dropout=0.2, activation_dropout=0.3, layerdrop=0.1)),
        ("gpt_neox", dict(hidden_dropout=0.1, attention_dropout=0.2, classifier_dropout=0.3)),
        ("phi", dict(resid_pdrop=0.1, embd_pdrop=0.2, attention_dropout=0.3)),
    ],
)
def test_every_dropout_of_a_family_goes_to_zero_and_training_mode_is_deterministic(family, config):
    """Config (what an export writes) and modules (nn.Dropout, and the floats attention/decoder
    layers copy from the config when built): train-mode forwards equal the eval-mode forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        ffn_dim=128,
        max_position_embeddings=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
    )
    hf_cfg = AutoConfig.for_model(family, **small, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23]])
    model.train()
    with torch.no_grad():
        # dropout on
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    disable_dropout(model, "actor")
    assert all(model.config.to_dict()[k] == 0.0 for k in config)  # what save_pretrained writes
    with torch.no_grad():
        eval_logits = model.eval()(input_ids=ids).logits
        model.train()
        assert torch.equal(model(input_ids=ids).logits, eval_logits)
        assert torch.equal(model(input_ids=ids).logits, eval_logits)


def test_a_model_without_dropout_is_left_as_it_is_and_the_key_defaults_on(caplog):
    """The embedded Llama (attention_dropout=0.0): nothing to change, nothing logged; the key is on
    by default for every stage (only PPO and DPO read it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    before = model.config.to_dict()
    with caplog.at_level(logging.INFO, logger="rlhf"):
        assert disable_dropout(model, "actor") is model
    assert model.config.to_dict() == before and "dropout" not in caplog.text
    assert (
        ModelConfig().disable_dropout is True and Config(stage="ppo").model.disable_dropout is True
    )
