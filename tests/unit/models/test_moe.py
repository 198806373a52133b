"""rlhf/models/moe.py and the inference mode's routing record: each MoE layer's experts of every
token a rollout forward routed are recorded (the prompt's in the prefill, each new token's in its
decode step, rows that finish early included); replayed in a training forward they are the experts
it uses (a router changed after the rollout flips some tokens' experts, and replay puts them back,
bringing the recompute's log-probs back to the rollout's), with the router's gradient intact."""

import re

import pytest
import torch

from rlhf.engine.logprobs import response_logprobs
from rlhf.models.moe import moe_blocks, replaying, routers
from rlhf.ops import SamplingParams
from tests.infer_helpers import hf_greedy, mixed_prompts, tiny_model
from tests.unit.engine.test_inference import hybrid

MOE = ["qwen3_moe", "mixtral", "qwen2_moe"]


def rollout(family: str, **kw):
    model = tiny_model(family, perturb=True, **kw)
    eng, hy = hybrid(model)
    hy.record_routing = True
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, samples_per_prompt=2, seed=5)
    return model, eng, hy.generate(mixed_prompts(), sp), sp


def own_routing(model, gen) -> torch.Tensor:
    """[B, T, layers, k] the experts a plain training forward picks."""
    picked = []
    handles = [
        r.register_forward_hook(lambda m, i, out: picked.append(out[2])) for r in routers(model)
    ]
    with torch.no_grad():
        model(input_ids=gen.sequences, attention_mask=gen.attention_mask)
    for h in handles:
        h.remove()
    B, T = gen.sequences.shape
    return torch.stack([p.view(B, T, -1) for p in picked], 2)


@pytest.mark.parametrize("family", MOE)
def test_the_rollout_records_what_training_would_route(family):
    model, _, gen, _ = rollout(family)
    B, T = gen.sequences.shape
    assert gen.routing.shape == (B, T, len(routers(model)), 2)
    own = own_routing(model, gen)
    # every real token but the last sampled one was routed by a rollout forward
    real = gen.attention_mask.bool().clone()
    last = gen.prompt_len + gen.response_mask.sum(1) - 1
    real[torch.arange(B), last] = False
    rec = gen.routing.long()
    assert (rec[real] >= 0).all() and (rec[torch.arange(B), last] == -1).all()
    # fp32: the same expert sets (as sets: the order of near-equal probabilities may differ)
    assert torch.equal(rec[real].sort(-1).values, own[real].sort(-1).values)


def test_a_dense_model_records_nothing():
    _, _, gen, _ = rollout("qwen3")
    assert gen.routing is None


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replay_restores_the_rollouts_experts_after_the_router_moved(family):
    model, eng, gen, sp = rollout(family)
    # the routers move (an update, another dtype): some tokens' experts change
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(torch.randn_like(r.weight) * 0.3)
    mask = gen.response_mask.bool()

    def logprob_gap() -> float:
        with torch.no_grad():
            lp = response_logprobs(
                eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
            )
        return (lp - gen.logprobs)[mask].abs().mean().item()

    without = logprob_gap()
    picked = []
    with replaying(model, gen.routing) as stats:
        # (hooks run in order: this one sees what the replay returned)
        hooks = [
            r.register_forward_hook(lambda m, i, o: picked.append(o[2])) for r in routers(model)
        ]
        out = model(input_ids=gen.sequences, attention_mask=gen.attention_mask)
        for h in hooks:
            h.remove()
        replayed = logprob_gap()
    assert stats.compared > 0 and 0 < stats.flip_share < 1
    B, T = gen.sequences.shape
    used = torch.stack([p.view(B, T, -1) for p in picked], 2)
    rec = gen.routing.long()
    routed = (rec >= 0).all(-1)
    assert torch.equal(used[routed], rec[routed])
    # the router still learns: its gradient reaches it through the replayed experts' weights
    out.logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))
    # the recompute with the rollout's experts is nearer the rollout's log-probs (its routers'
    # weights moved, so not equal)
    assert replayed < without
    # outside the context: the model's own routing again
    assert logprob_gap() == pytest.approx(without)


def test_the_balancing_term_is_hfs_per_layer():
    """Each MoE layer's term equals Transformers' load_balancing_loss_func on that layer's router
    logits (padding masked), its z-loss the direct formula, and their gradient reaches the
    router."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from rlhf.models.moe import Balance, balancing

    model = tiny_model("mixtral", perturb=True)
    ids = torch.randint(3, 90, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits = []
    hooks = [r.register_forward_hook(lambda m, i, o: logits.append(o[0])) for r in routers(model)]
    balance = Balance()
    with balancing(model, mask, balance):
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    assert len(balance.losses) == len(logits) == 2
    for term, z, layer_logits in zip(balance.losses, balance.z_losses, logits):
        want = load_balancing_loss_func((layer_logits.detach(),), 4, 2, mask)
        assert float(term) == pytest.approx(float(want), rel=1e-5)
        # the router z-loss: the real tokens' mean of logsumexp(logits)²
        real = layer_logits.detach()[mask.reshape(-1).bool()]
        assert float(z) == pytest.approx(float(real.logsumexp(-1).square().mean()), rel=1e-5)
    assert all(load >= 1.0 for load in balance.loads)
    (balance.mean_loss() + balance.mean_z()).backward()
    assert all(r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_the_balancing_term_over_ranks_is_each_ranks_share():
    """With ``reduce`` (a sum over ranks; here two "ranks" holding the same batch), each rank's term
    is its share of the term over every rank's tokens: half of one process's, the same loads."""
    from rlhf.models.moe import Balance, balancing

    model = tiny_model("mixtral", perturb=True)
    ids = torch.randint(3, 90, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    one, halves = Balance(), Balance()
    with torch.no_grad():
        with balancing(model, mask, one):
            model(input_ids=ids, attention_mask=mask)
        with balancing(model, mask, halves, reduce=lambda t: 2 * t):
            model(input_ids=ids, attention_mask=mask)
    assert len(one.losses) == len(halves.losses) == 2
    for a, b in zip(one.losses, halves.losses):
        assert float(b) == pytest.approx(float(a) / 2, rel=1e-6)
    assert halves.loads == pytest.approx(one.loads, rel=1e-6)


def test_router_losses_add_the_weighted_terms_of_each_micro_batch():
    """``RouterLosses``: each micro-batch's term is (aux_coef · its balancing mean + z_coef · its
    z-loss mean) ÷ the micro-batches × the world size, the z-term absent at z_coef 0; sums and the
    last micro-batch's values for the metrics; off for a dense model's terms (no hooks, no term)."""
    from types import SimpleNamespace

    from rlhf.models.moe import Balance, RouterLosses, RouterTerms, balancing

    model = tiny_model("mixtral", perturb=True)
    mesh = SimpleNamespace(world_size=2, all_reduce=lambda t: t)
    batches = [torch.randint(3, 90, (2, 6)) for _ in range(3)]
    for z_coef in (0.0, 0.1):
        terms = RouterLosses(model, RouterTerms(aux_coef=0.02, z_coef=z_coef), mesh, 3)
        ref = Balance()
        for ids in batches:
            mask = torch.ones_like(ids)
            with torch.no_grad(), terms.micro_batch(mask):
                model(input_ids=ids, attention_mask=mask)
            with torch.no_grad(), balancing(model, mask, ref):
                model(input_ids=ids, attention_mask=mask)
            aux, z = ref.mean_loss(len(ref.losses) - 2) / 3, ref.mean_z(len(ref.z_losses) - 2) / 3
            want = (0.02 * aux + (z_coef * z if z_coef else 0.0)) * 2
            assert float(terms.loss()) == pytest.approx(float(want), rel=1e-6)
            assert terms.last == pytest.approx((float(aux), float(z)), rel=1e-6)
        assert terms.aux == pytest.approx(float(ref.mean_loss()), rel=1e-6)
    dense = RouterLosses(model, RouterTerms(), mesh, 1)
    with dense.micro_batch(None):
        pass
    assert dense.loss() is None and not dense.balance.losses


def test_experts_have_their_own_optimizer_group():
    """``train.expert_lr_scale`` / ``train.expert_weight_decay``: the experts' AdamW group (and its
    schedule) runs at the scaled rate with its decay; a step with scale 0.5 moves the experts as a
    run at half the rate does; a dense model keeps two groups."""
    from rlhf.config import EngineConfig, TrainConfig
    from rlhf.engine.mesh import Mesh
    from rlhf.engine.train import TrainEngine

    def engine(model, **train):
        train = {"weight_decay": 0.1, **train}
        tcfg = TrainConfig(lr=1e-2, warmup_steps=0, scheduler="constant", **train)
        return TrainEngine(model, Mesh(), EngineConfig(precision="fp32"), tcfg)

    assert len(engine(tiny_model("llama")).optimizer.param_groups) == 2
    torch.manual_seed(0)
    a = engine(tiny_model("mixtral", perturb=True), expert_lr_scale=0.5, expert_weight_decay=0.0)
    experts = a.optimizer.param_groups[2]
    assert experts["lr"] == pytest.approx(5e-3) and experts["weight_decay"] == 0.0
    assert {id(p) for p in experts["params"]} == {
        id(getattr(e, n)) for _, e in moe_blocks(a.module) for n in ("gate_up_proj", "down_proj")
    }
    # the same step at lr 5e-3 without decay everywhere moves the experts alike
    torch.manual_seed(0)
    b = engine(tiny_model("mixtral", perturb=True), weight_decay=0.0)
    b.optimizer.param_groups[2]["lr"] = 5e-3
    ids = torch.randint(3, 90, (2, 6))
    for eng in (a, b):
        eng.forward(input_ids=ids, labels=ids).loss.backward()
        eng.step()
    for (_, ea), (_, eb) in zip(moe_blocks(a.module), moe_blocks(b.module)):
        assert torch.allclose(ea.gate_up_proj, eb.gate_up_proj, atol=1e-7)


def test_capacity_keeps_first_choices_first_and_drops_the_rest():
    from rlhf.models.moe import kept_slots

    # 4 experts, 6 real tokens, top 2 (+1 padding): capacity max(1, ceil(0.5 · 6 · 2 / 4)) = 2
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [3, 0], [2, 3], [0, 0]])
    real = torch.tensor([True] * 6 + [False])
    keep = kept_slots(experts, real, 4, 0.5, 1)
    # expert 0: first choices of tokens 0, 1 (token 2's first choice and every second choice of
    # expert 0 dropped); expert 1: token 3's first, token 0's second; expert 2: token 5's first,
    # token 1's second; expert 3: token 4's first, token 5's second; padding kept
    want = torch.tensor([[1, 1], [1, 1], [0, 0], [1, 0], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    assert torch.equal(keep, want)
    # a large factor drops nothing; min capacity wins over a small factor
    assert kept_slots(experts, real, 4, 100.0, 1).all()
    assert kept_slots(experts, real, 4, 0.01, 6).all()


def test_capacity_in_a_forward_drops_and_counts():
    from rlhf.models.moe import Dropped, capacity

    model = tiny_model("mixtral", perturb=True)
    ids = torch.randint(3, 90, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        roomy, tight = Dropped(), Dropped()
        with capacity(model, mask, 100.0, 1, roomy):
            same = model(input_ids=ids, attention_mask=mask).logits
        with capacity(model, mask, 0.25, 1, tight):
            cut = model(input_ids=ids, attention_mask=mask).logits
    assert roomy.dropped == 0 and roomy.routed == 18 * 2 * 2  # real tokens × k × MoE layers
    assert torch.equal(same, plain)
    assert tight.dropped > 0 and not torch.allclose(cut[mask.bool()], plain[mask.bool()])


def test_lora_on_the_experts_serves_merges_and_turns_off():
    """``model.lora.experts=true``: PEFT's per-expert adapters on the 3-D expert weights; the
    inference mode serves the adapted model (HF's greedy tokens), the export merge equals PEFT's
    own, the adapters off give the base experts, and a dense model is refused."""
    from rlhf.config import LoraConfig
    from rlhf.errors import ConfigError
    from rlhf.models import lora

    model = lora.apply_lora(tiny_model("mixtral", perturb=True), LoraConfig(r=4, experts=True), 0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    assert len(moe_blocks(model)) == len(routers(model)) == 2
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "experts" in n}
    assert len(trained) == 2 * 2 * 2  # 2 layers × 2 weights × (A, B)
    prompts = mixed_prompts()
    ref = hf_greedy(model, prompts, 12)
    _, hy = hybrid(model)
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)
    experts = moe_blocks(model)[0][1]
    wrapped = lora.unwrap(model).model.layers[0].mlp.experts
    with lora.adapters_disabled(model):
        off = lora.param_weights(wrapped, ("gate_up_proj",))["gate_up_proj"]
    assert torch.equal(off, experts.gate_up_proj)
    on = lora.param_weights(wrapped, ("gate_up_proj",))["gate_up_proj"]
    assert not torch.allclose(on, off)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    merged = lora.merged_state_dict(sd, lora.scaling(model))
    plain = model.merge_and_unload().state_dict()
    assert merged.keys() == plain.keys()
    assert all(torch.allclose(merged[k], plain[k], atol=1e-6) for k in plain)
    with pytest.raises(ConfigError, match="no Mixture-of-Experts layers"):
        lora.apply_lora(tiny_model("llama"), LoraConfig(r=4, experts=True), 0)


def test_balancing_under_activation_checkpointing_gives_the_same_gradients():
    """The router hooks' tensors are kept as usual, not by checkpointing (whose recompute of the
    layer runs without the hooks): the gradients equal the run without checkpointing."""
    from rlhf.models.moe import Balance, balancing

    grads = []
    for ac in (False, True):
        model = tiny_model("mixtral", perturb=True)
        if ac:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
        balance = Balance()
        with balancing(model, None, balance):
            loss = model(input_ids=ids, labels=ids).loss
        (loss + balance.mean_loss() + balance.mean_z()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_which_models_expert_parallelism_takes():
    """The trained policy takes it or the run stops (exit 2) saying why; the job's other models
    take it where they are MoE models under ZeRO-2/3 and are otherwise left alone."""
    from rlhf.config import EngineConfig
    from rlhf.engine.experts import applies
    from rlhf.errors import ConfigError

    moe, dense = tiny_model("mixtral"), tiny_model("llama")
    ep2 = EngineConfig(expert_parallel=2)
    assert applies(moe, ep2.placement("actor"), 2)
    assert applies(moe, ep2.placement("reference"), 2)
    assert not applies(dense, ep2.placement("reward_model"), 2)
    assert not applies(moe, EngineConfig(expert_parallel=2, zero_stage=1).placement("critic"), 2)
    assert not applies(moe, EngineConfig(), 2)
    for model, ecfg, world, says in (
        (dense, ep2.placement("actor"), 2, "no Mixture-of-Experts layers"),
        (moe, ep2, 3, "does not divide the world size (3)"),
        (moe, EngineConfig(expert_parallel=2, zero_stage=1), 2, "needs ZeRO-2 or 3"),
        (moe, EngineConfig(expert_parallel=2, offload="cpu"), 2, "not FSDP2's to offload"),
        (moe, EngineConfig(expert_parallel=3), 3, "does not divide the model's 4 experts"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            applies(model, ecfg, world)


def test_a_scalar_head_on_a_moe_model_finds_its_blocks():
    """A reward model or critic (the causal LM under a scalar head) of a MoE family."""
    from rlhf.models.value import ScalarHeadModel

    head = ScalarHeadModel(tiny_model("mixtral"))
    assert len(moe_blocks(head)) == 2 and len(routers(head)) == 2
