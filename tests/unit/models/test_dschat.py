"""DeepSpeed-Chat reward models in (rlhf/models/dschat.py): a DeepSpeed-Chat-shaped RewardModel on a
tiny random OPT (word_embed_proj_dim ≠ hidden size, BOS = EOS = pad) and a tiny Llama, saved in its
layout, converted, and scored by plain Transformers, rlhf's PPO reward path and rlhf.score against
DeepSpeed-Chat's own end-score rules (``forward``'s chosen scores and ``forward_value``'s),
right-padded and in the PPO layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaModel,
    OPTConfig,
    OPTModel,
)

from rlhf.config import EngineConfig, SyntheticConfig
from rlhf.data import synthetic
from rlhf.data.tokenizer import train_tokenizer
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel
from rlhf.errors import ConfigError
from rlhf.models import dschat, loading
from rlhf.models.value import ScalarHeadModel
from rlhf.rl.scorers import RewardModels, reward_scores
from rlhf.score import RewardScorer

TOL = 1e-5


class DSChatRewardModel(nn.Module):
    """DeepSpeed-Chat's RewardModel (dschat/utils/model/reward_model.py) as far as its scores go:
    the base transformer ``rwtransformer`` (called as they call it: no position ids) and ``v_head``
    on every position; a row's end score by their two rules, one row at a time as they loop."""

    def __init__(self, base, pad_id: int, num_padding_at_beginning: int = 0):
        super().__init__()
        self.config = base.config
        if hasattr(self.config, "word_embed_proj_dim"):
            # OPT's output is word_embed_proj_dim wide
            self.v_head = nn.Linear(self.config.word_embed_proj_dim, 1, bias=False)
        else:
            self.config.n_embd = self.config.hidden_size
            self.v_head = nn.Linear(self.config.n_embd, 1, bias=False)
        self.rwtransformer = base
        self.PAD_ID = pad_id
        self.num_padding_at_beginning = num_padding_at_beginning

    def values(self, input_ids, attention_mask):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=False)[0]
        return self.v_head(hidden).squeeze(-1)

    @torch.no_grad()
    def chosen_scores(self, input_ids, attention_mask):
        """``forward``'s chosen_mean_scores (step 2): before the pad after
        ``num_padding_at_beginning`` pads."""
        values, seq_len, out = self.values(input_ids, attention_mask), input_ids.shape[1], []
        for i in range(input_ids.shape[0]):
            c_inds = (input_ids[i] == self.PAD_ID).nonzero()
            n = self.num_padding_at_beginning
            c_ind = c_inds[n].item() if len(c_inds) > n else seq_len
            out.append(values[i][c_ind - 1])
        return torch.stack(out)

    @torch.no_grad()
    def forward_value(self, input_ids, attention_mask, prompt_length):
        """``forward_value(...)['chosen_end_scores']`` (step 3's reward): before the first pad after
        the prompt."""
        assert prompt_length > 1
        values, seq_len, out = self.values(input_ids, attention_mask), input_ids.shape[1], []
        for i in range(input_ids.shape[0]):
            c_inds = (input_ids[i][prompt_length:] == self.PAD_ID).nonzero()
            c_ind = c_inds[0].item() + prompt_length if len(c_inds) > 0 else seq_len
            out.append(values[i][c_ind - 1])
        return torch.stack(out)


def tokenizer():
    return train_tokenizer(synthetic.tokenizer_corpus(SyntheticConfig(num_records=200)), 300, 128)


def save_dschat(tmp_path, family: str):
    """A DeepSpeed-Chat step-2 output: create_hf_model's config changes, RewardModel's state dict in
    pytorch_model.bin (save_hf_format), the base config, the tokenizer's files. Returns (dir,
    model)."""
    tok = tokenizer()
    torch.manual_seed(0)
    if family == "opt":
        # OPT: BOS = EOS = </s>; DeepSpeed-Chat pads with the EOS (get_tokenizer)
        cfg = OPTConfig(
            vocab_size=len(tok),
            hidden_size=32,
            # project_in / project_out, and a 16-wide v_head
            word_embed_proj_dim=16,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            do_layer_norm_before=False,
            dropout=0.0,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        base, pad_id, skip = OPTModel(cfg), tok.eos_token_id, 1
    else:
        # Llama: the tokenizer without a pad, DeepSpeed-Chat appends [PAD]
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        tok.pad_token = None
        base, pad_id, skip = LlamaModel(cfg), len(tok), 0
    base.config.end_token_id = tok.eos_token_id  # create_hf_model
    base.config.pad_token_id = base.config.eos_token_id
    base.resize_token_embeddings(8 * math.ceil((len(tok) + (family == "llama")) / 8))
    rm = DSChatRewardModel(base, pad_id, skip).eval()
    with torch.no_grad():
        rm.v_head.weight.normal_(0.0, 1.0)
    out = tmp_path / f"dschat_{family}"
    out.mkdir()
    torch.save(rm.state_dict(), out / "pytorch_model.bin")
    rm.config.to_json_file(str(out / "config.json"))
    tok.save_pretrained(str(out))
    return out, rm


@pytest.fixture(scope="module", params=["opt", "llama"])
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    src, rm = save_dschat(tmp, request.param)
    dst = dschat.convert_dschat_reward_model(src, tmp / "converted")
    return request.param, src, dst, rm


def words(n, gen, vocab):
    return torch.randint(4, vocab, (n,), generator=gen).tolist()


def right_padded(family, rm, pad, gen):
    """Step-2 rows: [BOS] text [EOS?] + pads (half of them end with the EOS), and their mask."""
    bos = rm.config.eos_token_id if family == "opt" else rm.config.bos_token_id
    eos, vocab = rm.config.eos_token_id, 200
    rows = [[bos] + words(3 + i, gen, vocab) + ([eos] if i % 2 else []) for i in range(6)]
    n = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (n - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
    return ids, mask


def ppo_layout(family, rm, pad, gen, prompt_len=6, n_resp=7):
    """Step-3 rows: prompts left-padded to ``prompt_len``, responses right-padded to ``n_resp``
    (some end with the EOS, one is cut at the length), and rlhf's mask (every real token)."""
    bos = rm.config.eos_token_id if family == "opt" else rm.config.bos_token_id
    eos, vocab = rm.config.eos_token_id, 200
    rows, mask = [], []
    for i in range(6):
        prompt = [bos] + words(1 + i % 5, gen, vocab)
        resp = (
            words(2 + i, gen, vocab)[: n_resp - 1] + [eos] if i != 5 else words(n_resp, gen, vocab)
        )
        left, right = prompt_len - len(prompt), n_resp - len(resp)
        rows.append([pad] * left + prompt + resp + [pad] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(resp)) + [0] * right)
    return torch.tensor(rows), torch.tensor(mask)


def rlhf_reward_path(dst):
    """The converted model as PPO builds its reward model (rlhf/rl/models.py scalar_model):
    FrozenModel over ScalarHeadModel, packed forwards where the family packs."""
    tok = loading.load_tokenizer(str(dst))
    model = loading.build_model(AutoModelForSequenceClassification, path=str(dst), tokenizer=tok)
    return FrozenModel(ScalarHeadModel(model), Mesh(), EngineConfig(precision="fp32")), tok


def test_converted_layout(converted):
    family, src, dst, rm = converted
    spec = json.loads((dst / "config.json").read_text())
    assert spec["architectures"] == [
        f"{'OPT' if family == 'opt' else 'Llama'}ForSequenceClassification"
    ]
    assert len(spec["id2label"]) == 1
    # DeepSpeed-Chat's pad: OPT's EOS, Llama's appended [PAD]
    assert spec["pad_token_id"] == rm.PAD_ID
    from safetensors.torch import load_file

    w = load_file(str(dst / "model.safetensors"))
    sd = rm.state_dict()
    assert torch.equal(w["score.weight"], sd["v_head.weight"])
    assert {k for k in w if k != "score.weight"} == {
        "model." + k[len("rwtransformer.") :] for k in sd if k != "v_head.weight"
    }
    for k, v in sd.items():
        if k.startswith("rwtransformer."):
            assert torch.equal(w["model." + k[len("rwtransformer.") :]], v), k
    record = json.loads((dst / dschat.CONVERTED_FILE).read_text())
    assert record["source"] == str(src.resolve()) and "pytorch_model.bin" in record["files"]
    assert dschat.is_dschat_reward_model(src) and not dschat.is_dschat_reward_model(dst)


def test_scores_equal_dschat(converted):
    """Right-padded (DeepSpeed-Chat's forward and forward_value) and PPO-layout rows (forward_value
    with the prompt length): plain Transformers on rows padded with the converted pad, and rlhf's
    PPO reward path on the same tokens padded with rlhf's pad, equal DeepSpeed-Chat's scores within
    1e-5."""
    family, _, dst, rm = converted
    gen = torch.Generator().manual_seed(1)
    hf = AutoModelForSequenceClassification.from_pretrained(str(dst), dtype=torch.float32).eval()
    frozen, tok = rlhf_reward_path(dst)
    pad = tok.pad_token_id
    # rlhf pads with a pad of its own (OPT: not the EOS; Llama: not the [PAD])
    assert pad != rm.PAD_ID

    def check(ids_ds, mask, want, ids_rlhf):
        with torch.no_grad():
            plain = hf(input_ids=ids_ds, attention_mask=mask).logits[:, 0]
        ours = reward_scores(frozen, ids_rlhf, mask)
        assert (plain - want).abs().max() < TOL, (plain, want)
        assert (ours - want).abs().max() < TOL, (ours, want)
        return float((ours - want).abs().max())

    # step 2: right-padded, [BOS] text [EOS] pads
    ids, mask = right_padded(family, rm, rm.PAD_ID, gen)
    ours_ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    check(ids, mask, rm.chosen_scores(ids, mask), ours_ids)
    check(ids, mask, rm.forward_value(ids, mask, prompt_length=2), ours_ids)
    # step 3: left-padded prompts, right-padded responses; DeepSpeed-Chat's mask is ids != PAD_ID
    ids, mask = ppo_layout(family, rm, rm.PAD_ID, gen)
    ds_mask = ids.ne(rm.PAD_ID).long()
    ours_ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    check(ids, ds_mask, rm.forward_value(ids, ds_mask, prompt_length=6), ours_ids)
    if family == "llama":
        # the pad is no real token: DeepSpeed-Chat's mask is rlhf's
        assert torch.equal(ds_mask, mask)
    else:
        # OPT: the same score position under rlhf's own mask (the BOS and the EOS attended)
        ours = reward_scores(frozen, ours_ids, mask)
        with torch.no_grad():
            values = rm.values(ids, mask)
        rows = torch.arange(len(ids))
        before_eos = (torch.arange(ids.shape[1]) * (mask.bool() & ids.ne(rm.PAD_ID))).argmax(-1)
        assert (ours - values[rows, before_eos]).abs().max() < TOL


def test_score_cli_reads_like_dschat(converted):
    """rlhf.score's scorer (the converted directory's own tokenizer and pad) on step-2 rows."""
    family, _, dst, rm = converted
    gen = torch.Generator().manual_seed(2)
    ids, mask = right_padded(family, rm, rm.PAD_ID, gen)
    seqs = [row[: int(m.sum())].tolist() for row, m in zip(ids, mask)]
    got = RewardScorer(str(dst)).score_ids(seqs, batch_size=4)
    assert (got - rm.chosen_scores(ids, mask)).abs().max() < TOL


def test_ensemble_of_a_converted_and_another(converted):
    """Several reward models side by side (ppo.reward_model_path=a,b): each read at its own position
    — the converted one as DeepSpeed-Chat reads it, the other (its pad not its EOS: an rlhf reward
    model) at the last real token —, each column what the model gives alone."""
    family, _, dst, rm = converted
    frozen, tok = rlhf_reward_path(dst)
    other, _ = rlhf_reward_path(dst)
    # the same weights, read as rlhf's own models are
    other.module.config.pad_token_id = tok.pad_token_id
    ids, mask = ppo_layout(family, rm, tok.pad_token_id, torch.Generator().manual_seed(3))
    both = reward_scores(RewardModels([frozen, other]), ids, mask)
    assert both.shape == (len(ids), 2)
    assert torch.equal(both[:, 0], reward_scores(frozen, ids, mask))
    assert torch.equal(both[:, 1], reward_scores(other, ids, mask))
    ends = (
        ids.gather(1, (torch.arange(ids.shape[1]) * mask).argmax(-1, keepdim=True))[:, 0]
        == rm.config.eos_token_id
    )
    differs = (both[:, 0] - both[:, 1]).abs() > 1e-6
    # OPT (its pad is its EOS): the rows that end with the EOS are read one token earlier; Llama:
    # nowhere
    assert torch.equal(differs, ends) if family == "opt" else not differs.any()


def test_reuse_and_refusals(tmp_path):
    src, _ = save_dschat(tmp_path, "llama")

    class OneProcess:
        is_main = True

        def barrier(self):
            pass

    run = tmp_path / "run"
    first = dschat.reward_model_input(str(src), "ppo.reward_model_path", run, OneProcess())
    assert first.startswith(str(run / "converted" / "reward_model_dschat_llama-"))
    stamp = (tmp_path / "run").stat().st_mtime_ns
    mtime = (dschat.Path(first) / "model.safetensors").stat().st_mtime_ns
    assert dschat.reward_model_input(str(src), "ppo.reward_model_path", run, OneProcess()) == first
    # reused, not rewritten
    assert (dschat.Path(first) / "model.safetensors").stat().st_mtime_ns == mtime
    (src / "pytorch_model.bin").touch()  # the source changed: converted again
    dschat.reward_model_input(str(src), "ppo.reward_model_path", run, OneProcess())
    assert (dschat.Path(first) / "model.safetensors").stat().st_mtime_ns != mtime
    assert stamp  # (the run directory existed)
    with pytest.raises(
        ConfigError,
        match=r"DeepSpeed-Chat's: python -m rlhf.migrate reward-model .* DST converts it",
    ):
        # (rlhf.score's check says how to convert it)
        loading.check_scalar_model(str(src), "MODEL_DIR")
    other = tmp_path / "rlhf_rm"  # not DeepSpeed-Chat's: as it is
    other.mkdir()
    assert dschat.reward_model_input(str(other), "k", run, OneProcess()) == str(other)

    # a directory that is not empty and not a conversion is never replaced
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a converted model"):
        dschat.convert_dschat_reward_model(src, busy)
    # unknown family; a missing weight; a wrong shape: one line each, nothing written
    sd = torch.load(src / "pytorch_model.bin")
    spec = json.loads((src / "config.json").read_text())
    cases = {
        "family": ({**spec, "model_type": "no_such_family"}, sd, "model_type='no_such_family'"),
        "missing": (
            spec,
            {k: v for k, v in sd.items() if "layers.1.mlp" not in k},
            "weights of LlamaForSequenceClassification missing",
        ),
        "shape": (
            spec,
            {**sd, "v_head.weight": torch.zeros(1, 7)},
            "v_head.weight has shape [1, 7]",
        ),
    }
    for name, (cfg, state, says) in cases.items():
        bad = tmp_path / f"bad_{name}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        torch.save(state, bad / "pytorch_model.bin")
        assert dschat.is_dschat_reward_model(bad)
        with pytest.raises(ConfigError) as e:
            dschat.reward_model_input(str(bad), "ppo.reward_model_path", run, OneProcess())
        msg = str(e.value)
        assert msg.startswith(
            f"ppo.reward_model_path={bad}: a DeepSpeed-Chat reward model that cannot be converted"
        )
        assert says in msg and "\n" not in msg, msg
        assert not any(
            p.name.startswith(f"reward_model_{bad.name}") for p in (run / "converted").iterdir()
        )


def test_safetensors_and_sharded_saves(tmp_path):
    """The same RewardModel saved as model.safetensors, and as two shards with an index: recognised
    by their keys (the index's, for shards) and converted to the same weights as from
    pytorch_model.bin."""
    from safetensors.torch import load_file, save_file

    src, _ = save_dschat(tmp_path, "llama")
    sd = torch.load(src / "pytorch_model.bin")
    want = load_file(
        str(dschat.convert_dschat_reward_model(src, tmp_path / "from_bin") / "model.safetensors")
    )
    keys = sorted(sd)
    layouts = {
        "single": {"model.safetensors": keys},
        "sharded": {
            "model-00001-of-00002.safetensors": keys[::2],
            "model-00002-of-00002.safetensors": keys[1::2],
        },
    }
    for name, shards in layouts.items():
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            if f.name != "pytorch_model.bin":
                (d / f.name).write_bytes(f.read_bytes())
        for file, ks in shards.items():
            save_file({k: sd[k].contiguous() for k in ks}, str(d / file), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {k: file for file, ks in shards.items() for k in ks}
            (d / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
        assert dschat.is_dschat_reward_model(d), name
        got = load_file(
            str(
                dschat.convert_dschat_reward_model(d, tmp_path / f"from_{name}")
                / "model.safetensors"
            )
        )
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
