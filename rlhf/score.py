"""Score (prompt, response) pairs with a saved reward model.

    python -m rlhf.score RUN_DIR/reward/model --prompt "Q: What is 03 + 45?\\nA:" --response " The answer is 48."
    python -m rlhf.score RUN_DIR/reward/model --jsonl pairs.jsonl      # fields prompt, response

Prints one JSON object per pair: {"score": float, "normalized": float}. ``normalized`` uses the
mean/std of held-out scores saved by the reward stage (reward_stats.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Sequence

import torch


class RewardScorer:
    """A reward model (AutoModelForSequenceClassification, num_labels=1) with its tokenizer.

    The score of (prompt, response) is the head's value at the last token of
    prompt + response + EOS, exactly as the reward stage trains and evaluates it."""

    def __init__(self, model_dir: str, device: str = "cpu", trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification

        from rlhf.models.loading import load_tokenizer
        from rlhf.models.value import ScalarHeadModel
        self.dir = Path(model_dir)
        self.tokenizer = load_tokenizer(str(model_dir), trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code).to(device)
        self.model.eval()
        self.values = ScalarHeadModel(self.model)
        self.device = device
        stats_file = self.dir / "reward_stats.json"
        self.stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {"mean": 0.0, "std": 1.0}

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> List[List[int]]:
        tok = self.tokenizer
        p = tok(list(prompts), add_special_tokens=True)["input_ids"]
        r = tok(list(responses), add_special_tokens=False)["input_ids"]
        return [a + b + [tok.eos_token_id] for a, b in zip(p, r)]

    @torch.no_grad()
    def score_ids(self, seqs: List[List[int]], batch_size: int = 64) -> torch.Tensor:
        from rlhf.data.tokenize import pad_right
        from rlhf.models.value import sequence_scores
        out = []
        for s in range(0, len(seqs), batch_size):
            chunk = seqs[s:s + batch_size]
            ids = pad_right(chunk, self.tokenizer.pad_token_id).to(self.device)
            lengths = torch.tensor([len(x) for x in chunk], device=self.device)
            mask = (torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
            out.append(sequence_scores(self.values(input_ids=ids, attention_mask=mask), mask).cpu())
        return torch.cat(out) if out else torch.zeros(0, device="cpu")

    def score(self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        return self.score_ids(self.encode(prompts, responses), batch_size)

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores - self.stats["mean"]) / max(self.stats["std"], 1e-8)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.score", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--prompt")
    ap.add_argument("--response")
    ap.add_argument("--jsonl", help="a file of {prompt, response} records")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow a model that brings its own code")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the model runs (auto: the GPU when there is one, as engine.device)")
    args = ap.parse_args(argv)
    from rlhf.errors import UserError, one_line
    try:
        if args.jsonl:
            from rlhf.data.records import read_examples
            exs, _ = read_examples(args.jsonl, "prompt_response")
            prompts, responses = [e.prompt for e in exs], [e.response for e in exs]
        elif args.prompt is not None and args.response is not None:
            prompts, responses = [args.prompt], [args.response]
        else:
            ap.error("give --prompt and --response, or --jsonl")
        from rlhf.engine.mesh import choose_device
        scorer = RewardScorer(args.model_dir, device=str(choose_device(args.device, 0, 1)),
                              trust_remote_code=args.trust_remote_code)
    except (UserError, OSError, ValueError) as e:
        print(f"rlhf.score: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    scores = scorer.score(prompts, responses)
    for s, n in zip(scores.tolist(), scorer.normalize(scores).tolist()):
        print(json.dumps({"score": s, "normalized": n}))


if __name__ == "__main__":
    main()
