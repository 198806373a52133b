"""PPO-ptx (Ouyang et al. 2022): a language-model loss on the SFT share of the data, added to the
policy loss (``algorithm.ptx_coef``) so that RL does not erase what SFT taught."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf import seeding
from rlhf.config import Config
from rlhf.data.chat import resolve_template
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches
from rlhf.data.tokenize import cached, collate_sft, tokenize_sft
from rlhf.engine.logprobs import nll_sum
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError


class PtxTerm:
    """The language-model loss of update ``u``: the SFT loss on global batch ``u`` of a seeded order
    of the SFT records (as many records as the update's minibatch has rows), token-weighted over all
    ranks and scaled for the data-parallel average."""

    def __init__(self, cols: dict, seed: int, tokenizer, mesh: Mesh, digest: str = ""):
        self.cols, self.seed, self.tokenizer, self.mesh = cols, seed, tokenizer, mesh
        # the SFT records' (StageData.digest): part of the PPO run's fingerprint
        self.digest = digest

    @classmethod
    def load(cls, cfg: Config, tokenizer, cache_dir: Path, mesh: Mesh) -> PtxTerm:
        """The SFT share of the data, tokenized as the SFT stage does (chat template included, hence
        its cache)."""
        sft_data = load_stage_data(cfg.data, "sft", cfg.run.seed)
        if sft_data.train[0].response is None:
            raise ConfigError(
                "algorithm.ptx_coef needs SFT responses, and "
                f"data.format={cfg.data.source_list()[0].format} has none"
            )
        lens = dict(
            max_prompt=cfg.data.max_prompt_len,
            max_response=cfg.data.max_response_len,
            chat=resolve_template(tokenizer, cfg.data.chat_template),
        )
        cols = cached(
            "sft",
            sft_data.train,
            tokenizer,
            lens,
            cache_dir,
            mesh,
            lambda: tokenize_sft(sft_data.train, tokenizer, **lens),
        )
        return cls(cols, cfg.run.seed, tokenizer, mesh, sft_data.digest())

    def loss(self, actor: TrainEngine, update: int, batch: int) -> torch.Tensor:
        """``actor``'s loss on update ``update``'s ``batch`` records (a forward with gradients)."""
        cols, mesh = self.cols, self.mesh
        batches = GlobalBatches(len(cols["ids"]), batch, seeding.offset(self.seed, 1, seeding.PTX))
        ix = batches.global_indices(update)[mesh.rank :: mesh.world_size]
        ids, prompt_lens = [cols["ids"][i] for i in ix], [cols["prompt_len"][i] for i in ix]
        masks = None
        if "mask" in cols:
            masks = [cols["mask"][i] for i in ix]
        b = collate_sft(ids, prompt_lens, self.tokenizer.pad_token_id, True, masks)
        n_tokens = mesh.sum(int((b["labels"][:, 1:] != -100).sum()))
        nll, _ = nll_sum(actor.forward, b, mesh.device)
        return nll / max(n_tokens, 1) * mesh.world_size
