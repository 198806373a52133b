"""Models built from saved directories as the stages build them (``build_model`` on rank 0, the meta
device elsewhere), wrapped for a ZeRO stage; per case it writes rank 0's full state dict, every
rank's parameters (DDP) and buffers, what each rank read from the checkpoint files and the log
lines.

    torchrun --nproc-per-node=2 tests/distributed/streaming_worker.py MODELS_DIR OUT_DIR

Imported: ``make_models(dir)`` saves the models, ``build(case, dir, mesh)`` builds one (in one
process: the reference, loaded whole as before).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the stages' torch.manual_seed(run.seed + rank)
SEED = 100
# ZeRO-1 wraps the model frozen (FrozenModel's DDP path), the others trainable
ALL = (3, 2, 0, 1)
# case -> (model directory, model kind, extra, the ZeRO stages it runs under)
CASES = {
    # an index and 4 shards, bf16; the tokenizer adds a pad
    "untied_sharded": ("untied", "lm", {}, ALL),
    # one model.safetensors, tied embeddings, grown
    "tied_single": ("tied", "lm", {}, ALL),
    # the tokenizer fits: nothing grown, rank 0 reads half
    "tied_fits": ("tied_fit", "lm", {}, ALL),
    # a new score head (missing from the checkpoint), init_head
    "reward": ("untied", "reward", {}, (3, 0)),
    # a saved reward model, its head scaled on rank 0
    "critic": ("rm", "critic", {}, (2, 1)),
    # adapters + a trained copy of the embeddings
    "lora": ("untied", "lm", {"lora": True}, (3, 0)),
    # pytorch_model.bin: loaded whole (a log line)
    "bin": ("bin", "lm", {}, (3,)),
    # stacked experts (a Transformers conversion): loaded whole (a log line)
    "moe": ("moe", "lm", {}, (3,)),
}
FALLBACK = {"bin": "not a safetensors checkpoint", "moe": "Transformers converts"}


def make_models(root: Path) -> None:
    """The saved models of CASES (random init, fp32 files; the untied one in bf16 shards)."""
    from transformers import (
        AutoModelForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    from rlhf.models.loading import load_tokenizer
    from rlhf.models.value import init_head
    from tests.e2e.test_tokenizer_pad import raw_model

    # a BPE without a pad (load_tokenizer adds one: one row more)
    raw = raw_model(root / "tok")
    tok = load_tokenizer(str(raw))
    small = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4)
    small.update(num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tok.bos_token_id)
    small.update(eos_token_id=tok.eos_token_id)
    # embedding rows: one fewer than the tokenizer with its pad, or as many
    grown, fits = len(tok) - 1, len(tok)
    for name, tied, rows in (
        ("untied", False, grown),
        ("tied", True, grown),
        ("tied_fit", True, fits),
    ):
        torch.manual_seed(len(name))
        model = LlamaForCausalLM(LlamaConfig(vocab_size=rows, tie_word_embeddings=tied, **small))
        if name == "untied":
            # also as a .bin checkpoint; bf16 on disk (fp32 on load), sharded with an index
            model.config.save_pretrained(root / "bin")
            torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
            tok.save_pretrained(root / "bin")
            model.to(torch.bfloat16).save_pretrained(root / name, max_shard_size="100KB")
        else:
            model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    assert (root / "untied" / "model.safetensors.index.json").is_file()
    assert (root / "bin" / "pytorch_model.bin").is_file()
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_pretrained(
        root / "tied", num_labels=1, pad_token_id=0
    )
    init_head(rm)
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    moe = MixtralConfig(vocab_size=len(tok), num_local_experts=2, num_experts_per_tok=1, **small)
    torch.manual_seed(4)
    MixtralForCausalLM(moe).save_pretrained(root / "moe")
    tok.save_pretrained(root / "moe")


def build(case: str, root: Path, mesh):
    """The case's model as the stage builds it (rank 0 seeded with SEED, as the stages do)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.config import LoraConfig
    from rlhf.models import loading
    from rlhf.models.lora import apply_lora
    from rlhf.models.value import ScalarHeadModel, head_module, init_head

    folder, kind, extra, _ = CASES[case]
    src = str(root / folder)
    torch.manual_seed(SEED + mesh.rank)
    tok = loading.load_tokenizer(src)
    if kind == "lm":  # stages/sft.py, causal_lm
        model = loading.causal_lm(src, mesh, tok)
        if extra.get("lora"):
            model = apply_lora(
                model, LoraConfig(r=4, alpha=8.0, modules_to_save=["embed_tokens"]), seed=3
            )
        return model
    cfg = loading.load_model_config(src, False)
    if kind == "reward":  # stages/reward.py
        cfg.num_labels, cfg.pad_token_id = 1, tok.pad_token_id
        model = loading.build_model(
            AutoModelForSequenceClassification,
            config=cfg,
            path=src,
            on_meta=not mesh.is_main,
            tokenizer=tok,
        )
        if mesh.is_main:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                init_head(model)
        return ScalarHeadModel(model)
    # the critic (rlhf/rl/models.py scalar_model): the reward model's head scaled
    model = loading.build_model(
        AutoModelForSequenceClassification,
        config=cfg,
        path=src,
        on_meta=not mesh.is_main,
        tokenizer=tok,
    )
    if mesh.is_main:
        with torch.no_grad():
            head_module(model).weight.mul_(0.5)
    return ScalarHeadModel(model)


def main(root: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlhf.config import EngineConfig
    from rlhf.engine.mesh import init_mesh, shutdown
    from rlhf.engine.train import wrap_model
    from rlhf.models import streaming

    mesh = init_mesh(EngineConfig(timeout_s=120))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("rlhf").addHandler(handler)
    logging.getLogger("rlhf").setLevel(logging.INFO)
    out_dir = Path(out)
    for case, (*_, stages) in CASES.items():
        for zero in stages:
            lines.clear()
            before = streaming.read_counts()
            model = build(case, Path(root), mesh)
            wrapped = wrap_model(
                model, mesh, EngineConfig(zero_stage=zero, precision="fp32"), trainable=zero != 1
            )
            after = streaming.read_counts()
            read = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            module = getattr(wrapped, "module", wrapped)
            if zero >= 2:
                full = get_model_state_dict(
                    wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
            else:
                full = {k: v.detach().cpu() for k, v in module.state_dict().items()}
            tag = f"{case}_zero{zero}_rank{mesh.rank}"
            torch.save(
                {k: v.detach().cpu().clone() for k, v in module.named_buffers()},
                out_dir / f"{tag}_buffers.pt",
            )
            if mesh.is_main or zero < 2:
                torch.save(full, out_dir / f"{tag}_state.pt")
            (out_dir / f"{tag}.json").write_text(json.dumps({"read": read, "log": list(lines)}))
            del model, wrapped, module, full
    shutdown(mesh)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from rlhf.engine.mesh import end_process

    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
