"""The SFT share of the data inside PPO: PPO-ptx's language-model loss (Ouyang et al. 2022;
``algorithm.ptx_coef``), so that RL does not erase what SFT taught, and the records GKD's divergence
is also taken on (``algorithm.gkd_data_share``: GKD's "fixed dataset" part, Agarwal et al. 2024).
Each draws global batches of its own seeded order of the records."""

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


class SftRecords:
    """The SFT records, tokenized as the SFT stage does; update ``u``'s batch of a use (its seed
    salt) is global batch ``u`` of that use's seeded order, as many records as the update's
    minibatch has rows, this rank's share of them."""

    def __init__(self, cols: dict, seed: int, tokenizer, mesh: Mesh, digest: str = ""):
        self.cols, self.seed, self.tokenizer, self.mesh = cols, seed, tokenizer, mesh
        # the SFT records' (StageData.digest): part of the PPO run's fingerprint
        self.digest = digest

    @classmethod
    def load(cls, cfg: Config, tokenizer, cache_dir: Path, mesh: Mesh, why: str) -> SftRecords:
        """The SFT share of the data, tokenized as the SFT stage does (chat template included, hence
        its cache); ``why``: the key that asks for them (the error's subject)."""
        sft_data = load_stage_data(cfg.data, "sft", cfg.run.seed)
        if sft_data.train[0].response is None:
            raise ConfigError(
                f"{why} needs SFT responses, and "
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

    def batch(self, update: int, size: int, salt: int) -> dict:
        """This rank's share of update ``update``'s ``size`` records in the order of ``salt``
        (a ``collate_sft`` batch: right-padded, labels -100 outside the responses)."""
        cols, mesh = self.cols, self.mesh
        batches = GlobalBatches(len(cols["ids"]), size, seeding.offset(self.seed, 1, salt))
        ix = batches.global_indices(update)[mesh.rank :: mesh.world_size]
        ids, prompt_lens = [cols["ids"][i] for i in ix], [cols["prompt_len"][i] for i in ix]
        masks = None
        if "mask" in cols:
            masks = [cols["mask"][i] for i in ix]
        return collate_sft(ids, prompt_lens, self.tokenizer.pad_token_id, True, masks)

    def ptx_loss(self, actor: TrainEngine, update: int, size: int) -> torch.Tensor:
        """PPO-ptx: ``actor``'s SFT loss on update ``update``'s ``size`` records (a forward with
        gradients), token-weighted over all ranks and scaled for the data-parallel average."""
        mesh = self.mesh
        b = self.batch(update, size, seeding.PTX)
        n_tokens = mesh.sum(int((b["labels"][:, 1:] != -100).sum()))
        nll, _ = nll_sum(actor.forward, b, mesh.device)
        return nll / max(n_tokens, 1) * mesh.world_size
