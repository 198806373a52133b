"""Packed (padding-free) training forwards ≡ the padded reference path (fp32, 1e-5): logits, losses
and gradients, for every stage's step, on several families (a sliding window among them), with left-
and right-padded rows. The 2-rank side: tests/distributed/test_parity.py (zero3_padded) and
test_dpo_parity.py."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch

from rlhf.algorithms.tokens import position_ids
from rlhf.config import DPOConfig, EngineConfig, TrainConfig
from rlhf.engine import packing
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel, TrainEngine, run_forward

TOL = 1e-5
PAD = 0


def _config(family: str, num_labels: int = 0):
    from transformers import AutoConfig

    kw = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "mistral":
        # shorter than most rows: the window is exercised
        kw["sliding_window"] = 5
    if family == "qwen2":
        kw.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if family == "phi3":
        kw.update(sliding_window=6, pad_token_id=PAD)
    if num_labels:
        kw["num_labels"] = num_labels
    return AutoConfig.for_model(family, **kw)


def _model(family: str, seed: int = 0, head: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    if head:
        from rlhf.models.value import ScalarHeadModel, init_head

        model = AutoModelForSequenceClassification.from_config(_config(family, num_labels=1))
        init_head(model)
        return ScalarHeadModel(model)
    return AutoModelForCausalLM.from_config(_config(family))


def _batch(B: int = 6, L: int = 18, seed: int = 0):
    """Rows of different lengths, odd rows left-padded and even rows right-padded, one row full
    length and one of a single token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 61, (B, L), generator=g)
    lens = [L, 1] + torch.randint(2, L, (B - 2,), generator=g).tolist()
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(lens):
        if b % 2:
            mask[b, L - n :] = 1
        else:
            mask[b, :n] = 1
    ids = ids.masked_fill(mask == 0, PAD)
    return ids, mask


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a: dict, b: dict, what: str):
    assert a.keys() == b.keys() and a, what
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=TOL, atol=TOL), (
            what,
            k,
            (a[k] - b[k]).abs().max().item(),
        )


@pytest.mark.parametrize(
    "family,call_cost",
    [
        ("llama", None),
        ("qwen2", None),
        ("mistral", None),
        ("phi3", None),
        ("llama", 0),
        ("mistral", 40),
    ],
)
def test_logits_and_gradients_equal_the_padded_forward(family, call_cost, monkeypatch):
    """``call_cost`` 0: one attention call per sequence; 40: groups of similar length; None: the
    default (one group at these lengths)."""
    if call_cost is not None:
        monkeypatch.setattr(packing, "CALL_COST", call_cost)
    padded = _model(family)
    packed = copy.deepcopy(padded)
    assert packing.install(packed), packing.why_not(packed)
    ids, mask = _batch()
    weights = torch.randn(*ids.shape, 61, generator=torch.Generator().manual_seed(1))
    real = mask.bool()

    ref = padded(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    out = packing.forward(packed, ids, mask, position_ids=position_ids(mask)).logits
    assert out.shape == ref.shape
    assert (out - ref)[real].abs().max() <= TOL
    # the padding holds zeros, not the padded forward's garbage
    assert (out[~real] == 0).all()
    ((ref * weights)[real].sum()).backward()
    ((out * weights)[real].sum()).backward()
    _assert_close(_grads(packed), _grads(padded), family)

    # logits of the last k columns only (PPO's response positions): the same numbers
    k = 7
    kept = packing.forward(packed, ids, mask, logits_to_keep=k).logits
    assert kept.shape == (ids.shape[0], k, 61)
    assert (kept - ref[:, -k:])[real[:, -k:]].abs().max() <= TOL

    # logits of chosen real positions only (DPO's response-predicting ones): [K, V], row-major, the
    # padded forward's rows at those positions, gradients through them alike
    at = real & (torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.5)
    for m in (packed, padded):
        m.zero_grad()
    sel = packing.forward(packed, ids, mask, logits_at=at).logits
    ref_sel = run_forward(
        padded, False, dict(input_ids=ids, attention_mask=mask, logits_at=at)
    ).logits
    assert sel.shape == ref_sel.shape == (int(at.sum()), 61)
    assert torch.equal(ref_sel, padded(input_ids=ids, attention_mask=mask).logits[at])
    assert (sel - ref_sel).abs().max() <= TOL
    (sel * weights[at]).sum().backward()
    (ref_sel * weights[at]).sum().backward()
    _assert_close(_grads(packed), _grads(padded), family)
    with pytest.raises(ValueError, match="padding"):
        packing.forward(packed, ids, mask, logits_at=~real)


def test_the_padded_path_is_unchanged_by_the_installed_attention():
    """A padded batch through a model that packs runs Transformers' SDPA attention: bit for bit."""
    plain = _model("mistral")
    installed = copy.deepcopy(plain)
    packing.install(installed)
    ids, mask = _batch()
    a = plain(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    b = installed(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert torch.equal(a, b)


def test_pack_layout():
    """Rows whole (nothing shared): in row order, positions from 0; shared: the rows in the order of
    their tokens, each after what it has in common with the one before."""
    ids, mask = _batch()
    ids[:, :] = torch.where(mask.bool(), ids, PAD)
    shared = packing.pack(ids, mask)
    assert torch.equal(shared.unpack(shared.input_ids[..., None])[..., 0], ids * mask)
    assert torch.equal(
        shared.unpack(shared.position_ids[..., None])[..., 0], position_ids(mask) * mask
    )
    p = packing.pack(ids, mask, share=False)
    lens = mask.sum(1)
    assert p.input_ids.shape == (1, int(lens.sum()))
    assert p.cu_seqlens.tolist() == [0, *lens.cumsum(0).tolist()]
    assert torch.equal(p.input_ids[0], ids[mask.bool()])
    # positions restart per row
    assert torch.equal(p.position_ids[0], position_ids(mask)[mask.bool()])
    assert torch.equal(p.unpack(p.input_ids[..., None])[..., 0], ids * mask)


def test_bounds_without_their_layout_are_refused():
    """The bounds alone cannot say which rows share a prefix: attention never guesses."""
    model = _model("llama")
    packing.install(model)
    ids, mask = _batch()
    p = packing.pack(ids, mask)
    kw = p.model_kwargs()
    kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = p.cu_seqlens.clone()  # a copy: the layout is lost
    with pytest.raises(RuntimeError, match="without their layout"):
        model(**kw)


def test_a_mask_with_holes_runs_padded():
    ids, mask = _batch()
    mask[0, 3] = 0  # not one contiguous run
    assert packing.pack(ids, mask) is None
    model = _model("llama")
    packing.install(model)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert torch.equal(
        packing.forward(model, ids, mask, position_ids=position_ids(mask)).logits, ref
    )


def test_a_model_that_cannot_pack_runs_padded_and_says_so(caplog):
    model = _model("llama")
    model.config._attn_implementation = "eager"
    with caplog.at_level(logging.INFO, logger="rlhf"):
        engine = FrozenModel(model, Mesh(), EngineConfig(precision="fp32"))
    assert not engine.packs
    assert sum("engine.packing: padded forwards" in r.message for r in caplog.records) == 1
    assert "'eager'" in caplog.text


# ---- every stage's real step, packed vs padded: loss and gradients ----


def _engines(family: str, head: bool = False):
    """(padded, packed) TrainEngines on the same starting weights; each engine's ``step`` records
    the gradients instead of stepping."""
    tcfg = TrainConfig(max_steps=2, global_batch=4, lr=1e-2, warmup_steps=1)
    model = _model(family, head=head)
    out = []
    for packs in (False, True):
        engine = TrainEngine(
            copy.deepcopy(model), Mesh(), EngineConfig(precision="fp32", packing=packs), tcfg
        )
        assert engine.packs == packs

        def step(engine=engine):
            engine.grads = _grads(engine.model)
            engine.optimizer.zero_grad(set_to_none=True)
            return 0.0

        engine.step = step
        out.append(engine)
    return out


def _records(n: int = 8, seed: int = 0):
    import random

    rng = random.Random(seed)
    return [
        ([rng.randint(3, 60) for _ in range(rng.randint(4, 20))], rng.randint(1, 4))
        for _ in range(n)
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sft_step(family):
    from rlhf.data.tokenize import collate_sft
    from stages.sft import train_step

    recs = _records()
    mbs = [
        collate_sft([r[0] for r in recs[i : i + 4]], [r[1] for r in recs[i : i + 4]], PAD, True)
        for i in (0, 4)
    ]
    padded, packed = _engines(family)
    loss_a, _, _ = train_step(padded, mbs)
    loss_b, _, _ = train_step(packed, mbs)
    assert abs(loss_a - loss_b) <= TOL * abs(loss_a)
    _assert_close(packed.grads, padded.grads, f"sft {family}")


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_reward_step(family):
    import random

    from rlhf.data.tokenize import collate_pairs
    from stages.reward import train_step

    recs = _records()
    rng = random.Random(1)
    rejected = [rng.sample(r[0], len(r[0]))[: rng.randint(2, len(r[0]))] for r in recs]
    mbs = [collate_pairs([r[0] for r in recs[i : i + 4]], rejected[i : i + 4], PAD) for i in (0, 4)]
    padded, packed = _engines(family, head=True)
    a = train_step(padded, mbs)
    b = train_step(packed, mbs)
    assert abs(a[0] - b[0]) <= TOL * abs(a[0]) and a[1] == b[1]
    _assert_close(packed.grads, padded.grads, f"reward {family}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dpo_step(family):
    from stages.dpo import collate, train_step
    from tests.distributed.dpo_worker import pairs

    cols = pairs(8)
    mbs = [collate(cols, list(range(i, i + 4)), PAD) for i in (0, 4)]
    padded, packed = _engines(family)
    ref = FrozenModel(_model(family, seed=1), Mesh(), EngineConfig(precision="fp32", packing=False))
    ref_packed = FrozenModel(_model(family, seed=1), Mesh(), EngineConfig(precision="fp32"))
    a, _ = train_step(padded, ref, mbs, DPOConfig(beta=0.5, sft_coef=0.5))
    b, _ = train_step(packed, ref_packed, mbs, DPOConfig(beta=0.5, sft_coef=0.5))
    for k in a:
        assert abs(a[k] - b[k]) <= TOL * max(abs(a[k]), 1.0), k
    _assert_close(packed.grads, padded.grads, f"dpo {family}")


@pytest.mark.parametrize("family,group", [("llama", 1), ("mistral", 1), ("llama", 3)])
def test_ppo_scoring_and_update_forwards(family, group):
    """PPO's sequences: left-padded prompts, right-padded responses; the response log-probs (only
    the response positions through the LM head), the entropy and the critic's values, and their
    gradients. ``group`` 3: GRPO's rows, each prompt answered three times (packed once per
    group)."""
    from rlhf.engine.logprobs import response_stats
    from rlhf.rl.experience import critic_values

    B, P, N = 6, 7, 9
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(3, 61, (B, P + N), generator=g)
    att = torch.ones(B, P + N, dtype=torch.long)
    for b in range(B):
        att[b, : (b - b % group) % 4] = 0  # prompt padding
        att[b, P + N - (b * 2) % N :] = 0 if b else 1  # response padding after "EOS"
        seq[b, :P] = seq[b - b % group, :P]
    seq = seq.masked_fill(att == 0, PAD)
    if group > 1:  # each group's prompt once
        assert packing.pack(seq, att).input_ids.shape[1] <= int(att.sum()) - (B - B // group) * (
            P - 2
        )
    resp = att[:, P:].bool()
    for head in (False, True):
        padded, packed = _engines(family, head=head)
        outs = []
        for engine in (padded, packed):
            if head:
                v = critic_values(engine, seq, att, P)
                loss = (v * resp).pow(2).sum()
                outs.append(v.detach())
            else:
                lp, ent = response_stats(
                    engine.forward, seq, att, P, 0.7, entropy="loss", keep_logits=True
                )
                loss = (lp * resp).sum() + (ent * resp).sum()
                outs.append(torch.stack([lp, ent]).detach())
            engine.backward(loss)
            engine.step()
        assert (outs[0] - outs[1])[..., resp].abs().max() <= TOL, (family, head)
        _assert_close(packed.grads, padded.grads, f"ppo {family} head={head}")


def _ran_packed(model, monkeypatch) -> list:
    """Whether each forward of ``model`` ran packed (its attention got sequence bounds)."""
    seen = []
    monkeypatch.setattr(
        model,
        "forward",
        lambda *a, fwd=model.forward, **kw: seen.append("cu_seq_lens_q" in kw) or fwd(*a, **kw),
    )
    return seen


def test_a_batch_without_padding_runs_padded(monkeypatch):
    """Below packing.MIN_PADDING saved (no padding, nothing in common) the padded forward runs
    (packing would only cost): bit for bit."""
    model = _model("llama")
    packing.install(model)
    ids = torch.randint(3, 61, (4, 12), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = torch.tensor([3, 4, 5, 6])  # nothing in common
    mask = torch.ones_like(ids)
    ref = model(input_ids=ids, attention_mask=mask).logits
    seen = _ran_packed(model, monkeypatch)
    out = packing.forward(model, ids, mask).logits
    assert seen == [False]
    assert torch.equal(out, ref)


def test_a_batch_without_padding_packs_a_common_prefix(monkeypatch):
    """Rows of one length that begin alike (a GRPO group: one prompt, several answers) pack."""
    padded = _model("llama")
    packed = copy.deepcopy(padded)
    packing.install(packed)
    ids = torch.randint(3, 61, (4, 12), generator=torch.Generator().manual_seed(2))
    ids[:, :8] = ids[0, :8]
    mask = torch.ones_like(ids)
    assert packing.pack(ids, mask).input_ids.shape[1] == 8 + 4 * 4
    ref = padded(input_ids=ids, attention_mask=mask).logits
    seen = _ran_packed(packed, monkeypatch)
    out = packing.forward(packed, ids, mask).logits
    assert seen == [True]
    assert (out - ref).abs().max() <= TOL


def test_length_groups():
    lengths = [5, 300, 7, 290, 6, 40]
    for cost in (0, 100, 10**9):
        groups = packing.length_groups(lengths, cost)
        assert sorted(i for g in groups for i in g) == list(range(6))
        assert all(lengths[a] <= lengths[b] for g in groups for a, b in itertools.pairwise(g))
    assert len(packing.length_groups(lengths, 0)) == 6  # calls are free: every sequence alone
    assert len(packing.length_groups(lengths, 10**9)) == 1  # calls are dear: one call
    # the short ones together (3 × 7² + 100 < 3 singles), the long ones alone (2 × 300² > 300² +
    # 290² + 100)
    assert packing.length_groups(lengths, 100) == [[0, 4, 2], [5], [3], [1]]


def _pair_batch(seed: int = 0):
    """``collate_pairs``-like rows with shared prefixes of every kind: a long one, none, a whole row
    (the rejected one a prefix of the chosen one, and equal rows), one across pairs, an empty row;
    left- and right-padded."""
    g = torch.Generator().manual_seed(seed)
    chosen = [torch.randint(3, 61, (n,), generator=g).tolist() for n in (14, 9, 12, 6, 10)] + [[]]
    rejected = [
        chosen[0][:10] + [5, 6, 7],  # shares 10
        [c + 1 if c < 60 else 3 for c in chosen[1][:4]] + chosen[1][4:],  # shares none
        # a prefix of the chosen row: no tokens of its own
        chosen[2][:7],
        list(chosen[3]),  # the same row
        chosen[4][:1] + [60, 59],  # shares 1
        # shares 3 with another pair's rows; its chosen row is empty
        chosen[0][:3] + [4, 4, 4],
    ]
    rows = chosen + rejected
    L = max(map(len, rows)) + 2
    ids = torch.full((len(rows), L), PAD)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        at = slice(L - len(r), L) if b % 3 == 1 else slice(0, len(r))  # some left-padded
        ids[b, at], mask[b, at] = torch.tensor(r), 1
    return ids, mask, rows


@pytest.mark.parametrize(
    "family,call_cost", [("llama", None), ("mistral", None), ("qwen2", None), ("llama", 0)]
)
def test_shared_prefixes_equal_the_padded_forward(family, call_cost, monkeypatch):
    """Rows that begin like another (a pair's prompt) pack the common prefix once: logits (all, the
    last k columns, chosen positions), per-token values and every gradient equal the padded
    forward's. ``call_cost`` 0: every row its own attention call (a prefix read across groups)."""
    if call_cost is not None:
        monkeypatch.setattr(packing, "CALL_COST", call_cost)
    ids, mask, rows = _pair_batch()
    real = mask.bool()
    p = packing.pack(ids, mask)
    # each common prefix once: as many packed tokens as the rows have distinct prefixes
    assert p.input_ids.shape[1] == len({tuple(r[:k]) for r in rows for k in range(1, len(r) + 1)})
    assert p.input_ids.shape[1] < int(mask.sum()) - 20
    assert packing.pack(ids, mask, share=False).input_ids.shape[1] == int(mask.sum())
    assert torch.equal(p.unpack(p.input_ids[..., None])[..., 0], ids * mask)
    weights = torch.randn(*ids.shape, 61, generator=torch.Generator().manual_seed(1))
    at = real & (torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.6)
    padded = _model(family)
    packed = copy.deepcopy(padded)
    packing.install(packed)
    pos = position_ids(mask)
    checks = [
        (
            "logits",
            lambda m, **kw: m(input_ids=ids, attention_mask=mask, position_ids=pos, **kw).logits,
            real,
            None,
        ),
        (
            "last 6",
            lambda m, **kw: m(input_ids=ids, attention_mask=mask, logits_to_keep=6, **kw).logits,
            real[:, -6:],
            None,
        ),
        ("logits_at", None, None, at),
    ]
    for what, fn, where, at_ in checks:
        for m in (packed, padded):
            m.zero_grad()
        if at_ is None:
            ref = fn(padded)
            out = packing.forward(
                packed, ids, mask, **({"logits_to_keep": 6} if what == "last 6" else {})
            ).logits
            w = weights[:, -ref.shape[1] :]
            ((ref * w)[where].sum()).backward()
            ((out * w)[where].sum()).backward()
            assert (out - ref)[where].abs().max() <= TOL, what
        else:
            ref = run_forward(
                padded, False, dict(input_ids=ids, attention_mask=mask, logits_at=at_)
            ).logits
            out = packing.forward(packed, ids, mask, logits_at=at_).logits
            assert out.shape == ref.shape == (int(at_.sum()), 61)
            (ref * weights[at_]).sum().backward()
            (out * weights[at_]).sum().backward()
            assert (out - ref).abs().max() <= TOL, what
        _assert_close(_grads(packed), _grads(padded), f"{family} {what}")

    head_padded = _model(family, head=True)
    head_packed = copy.deepcopy(head_padded)
    packing.install(head_packed)
    ref = head_padded(input_ids=ids, attention_mask=mask, position_ids=pos)
    out = packing.forward(head_packed, ids, mask)
    assert (out - ref)[real].abs().max() <= TOL
    w = weights[..., 0]
    (ref * w)[real].sum().backward()
    (out * w)[real].sum().backward()
    _assert_close(_grads(head_packed), _grads(head_padded), f"{family} values")


@pytest.mark.parametrize("stage", ["reward", "dpo"])
def test_pair_steps_share_the_prompt(stage, monkeypatch):
    """The reward and DPO steps: the packed forwards run each pair's prompt once, and the step's
    loss and gradients equal the padded path's."""
    from rlhf.data.tokenize import collate_pairs

    recs = _records()
    prompts = [r[0][: r[1] + 2] for r in recs]
    chosen = [p + [7, 8, 9][: 1 + i % 3] for i, p in enumerate(prompts)]
    rejected = [p + [11, 12][: 1 + i % 2] for i, p in enumerate(prompts)]
    sizes = []
    real_pack = packing.pack
    monkeypatch.setattr(
        packing, "pack", lambda *a: sizes.append(real_pack(*a).input_ids.shape[1]) or real_pack(*a)
    )
    if stage == "reward":
        from stages.reward import train_step

        mbs = [collate_pairs(chosen[i : i + 4], rejected[i : i + 4], PAD) for i in (0, 4)]
        padded, packed = _engines("llama", head=True)
        a, b = train_step(padded, mbs), train_step(packed, mbs)
        assert abs(a[0] - b[0]) <= TOL * abs(a[0]) and a[1] == b[1]
    else:
        from stages.dpo import collate, train_step

        cols = {"chosen": chosen, "rejected": rejected, "prompt_len": [len(p) for p in prompts]}
        mbs = [collate(cols, list(range(i, i + 4)), PAD) for i in (0, 4)]
        padded, packed = _engines("llama")
        ref = FrozenModel(
            _model("llama", seed=1), Mesh(), EngineConfig(precision="fp32", packing=False)
        )
        ref_packed = FrozenModel(_model("llama", seed=1), Mesh(), EngineConfig(precision="fp32"))
        a, _ = train_step(padded, ref, mbs, DPOConfig(beta=0.5, sft_coef=0.5))
        b, _ = train_step(packed, ref_packed, mbs, DPOConfig(beta=0.5, sft_coef=0.5))
        for k in a:
            assert abs(a[k] - b[k]) <= TOL * max(abs(a[k]), 1.0), k
    _assert_close(packed.grads, padded.grads, stage)

    # every packed forward ran each prompt once: as many tokens as its rows have distinct prefixes
    # (the padded path never packs)
    def distinct(rows):
        return len({tuple(r[:k]) for r in rows for k in range(1, len(r) + 1)})

    micro = [distinct(chosen[i : i + 4] + rejected[i : i + 4]) for i in (0, 4)]
    assert micro[0] < sum(map(len, chosen[:4] + rejected[:4])) - sum(map(len, prompts[:4])) + 4
    assert sizes and set(sizes) <= set(micro), (sizes, micro)
