"""Score (prompt, response) pairs with a saved reward model, or with a generative judge.

    python -m rlhf.score RUN_DIR/reward/model --prompt $'Q: What is 03 + 45?\\nA:' --response " The
    answer is 48." python -m rlhf.score RUN_DIR/reward/model --jsonl responses.jsonl   #
    prompt/response, or messages python -m rlhf.score RUN_DIR/reward/model --jsonl pairs.jsonl
    # prompt/chosen/rejected, hh, messages pairs python -m rlhf.score JUDGE_DIR --judge rubric.txt
    [--verdicts Yes No] --jsonl pairs.jsonl

Prints one JSON object per response: {"score": float, "normalized": float}; for preference pairs one
per pair ({"chosen": float, "rejected": float, "correct": bool}) and then {"pairs": n, "accuracy":
a}. ``normalized`` uses the mean/std of held-out scores saved by the reward stage
(reward_stats.json). An ensemble (reward.ensemble=k): the members' mean as the score, their spread
(the std of the normalised members' scores) as ``spread`` (pairs: ``chosen_spread``,
``rejected_spread``), and each member's score in ``members``. ``--judge TEMPLATE``: MODEL_DIR is a
causal LM read as PPO's judge reads it (rlhf/rl/judge.py: the template filled with {prompt},
{response}, {reference}, the judge's chat template, the score P(first verdict) against the second);
the lines are the same, without ``normalized``. A file is read by the stages' readers in the format
its first record has; turns (``messages``) are rendered through the model's chat template
(``--chat-template``) exactly as the reward stage renders them. A prompt needs its real newlines: in
bash write $'...\\n...' (in plain double quotes \\n stays a backslash and an n, which the model
never saw). Runs on the GPU when there is one (--device).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

import torch

# data.max_*_len for scoring: nothing is cut
UNCUT = sys.maxsize

# Imports of transformers and of the project's model code inside functions on purpose: --help
# answers in 2 s (torch alone, measured on the CPU dev machine) rather than 5 s.


class RewardScorer:
    """A reward model (AutoModelForSequenceClassification, num_labels=1; k labels: an ensemble's k
    members) with its tokenizer.

    The score of (prompt, response) is the head's value at the last token of
    prompt + response + EOS, exactly as the reward stage trains and evaluates it ([n, k] for an
    ensemble); for a model whose pad is its EOS (a converted DeepSpeed-Chat one) at the token before
    the EOS."""

    def __init__(self, model_dir: str, device: str = "cpu", trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification

        from rlhf.models.loading import build_model, load_tokenizer
        from rlhf.models.value import REWARD_STATS_FILE, ScalarHeadModel, end_pad, members

        self.dir = Path(model_dir)
        self.tokenizer = load_tokenizer(str(model_dir), trust_remote_code)
        # (a pad that load_tokenizer adds is a row of the embeddings: resized like in the stages)
        self.model = build_model(
            AutoModelForSequenceClassification,
            path=str(model_dir),
            trust_remote_code=trust_remote_code,
            tokenizer=self.tokenizer,
        ).to(device)
        self.model.eval()
        self.values = ScalarHeadModel(self.model)
        # a pad that is the EOS: scored before it (Transformers' pooling)
        self.end_pad = end_pad(self.model.config)
        self.members = members(self.model.config)
        self.device = device
        stats_file = self.dir / REWARD_STATS_FILE
        # a reward model with no reward_stats.json: unnormalised
        self.stats = {"mean": 0.0, "std": 1.0}
        if stats_file.is_file():
            self.stats = json.loads(stats_file.read_text())

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
            chunk = seqs[s : s + batch_size]
            ids = pad_right(chunk, self.tokenizer.pad_token_id).to(self.device)
            lengths = torch.tensor([len(x) for x in chunk], device=self.device)
            mask = (
                torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]
            ).long()
            scores = sequence_scores(
                self.values(input_ids=ids, attention_mask=mask), mask, ids, self.end_pad
            )
            out.append(scores.cpu())
        return torch.cat(out) if out else torch.zeros(0, device="cpu")

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 64
    ) -> torch.Tensor:
        return self.score_ids(self.encode(prompts, responses), batch_size)

    def pair_ids(self, examples: Sequence, chat=None) -> Tuple[List[List[int]], List[List[int]]]:
        """(chosen, rejected) sequences of preference pairs as the reward stage builds them (turns
        through the chat template ``chat``, text as it is; each response with its EOS), uncut."""
        from rlhf.data.tokenize import tokenize_pairs

        cols = tokenize_pairs(list(examples), self.tokenizer, UNCUT, UNCUT, chat)
        return cols["chosen"], cols["rejected"]

    def response_ids(self, examples: Sequence, chat=None) -> List[List[int]]:
        """prompt + response + EOS of each record, built as the stages build them (turns through
        ``chat``)."""
        from rlhf.data.tokenize import tokenize_sft

        return tokenize_sft(list(examples), self.tokenizer, UNCUT, UNCUT, chat)["ids"]

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """By the held-out statistics: an ensemble's scores ([n, k]) member by member."""
        if scores.dim() > 1:
            stats = self.stats.get("members") or [{"mean": 0.0, "std": 1.0}] * scores.shape[1]
            mean = torch.tensor([m["mean"] for m in stats], dtype=scores.dtype)
            std = torch.tensor([max(m["std"], 1e-8) for m in stats], dtype=scores.dtype)
            return (scores - mean) / std
        return (scores - self.stats["mean"]) / max(self.stats["std"], 1e-8)

    def spread(self, scores: torch.Tensor) -> torch.Tensor:
        """[n]: an ensemble's disagreement, the std of its normalised members (what PPO watches)."""
        from rlhf.algorithms.ensemble import disagreement

        return disagreement(self.normalize(scores))


def format_of(record) -> str:
    """The data format (data.format) a record is in, from its fields: pairs with turn lists are
    ``messages`` pairs, with a ``prompt`` ``prompt_chosen_rejected``, else ``hh`` dialogues; a
    ``messages`` conversation; else ``prompt_response``."""
    rec = record if isinstance(record, dict) else {}
    if "chosen" in rec or "rejected" in rec:
        if isinstance(rec.get("chosen"), list) or isinstance(rec.get("rejected"), list):
            return "messages"
        return "prompt_chosen_rejected" if "prompt" in rec else "hh"
    return "messages" if "messages" in rec else "prompt_response"


def read_records(path: str):
    """(kind, examples): 'pairs' when the records hold chosen/rejected (prompt_chosen_rejected, hh
    dialogues or messages pairs), else 'responses' (prompt_response, or messages conversations
    ending with the assistant turn to score). The format is the first record's; every record must
    have it."""
    from rlhf.data.records import data_files, iter_raw_records, read_examples
    from rlhf.errors import DataError

    files = data_files(path, key="--jsonl")
    first_record = None
    if files:
        first = next(iter(iter_raw_records(files[0])), None)  # (record, where)
        if first is not None:
            first_record = first[0]
    fmt = format_of(first_record)
    exs = read_examples(path, fmt, key="--jsonl", skip_key=None)[0]
    kind = "pairs" if exs[0].chosen is not None else "responses"
    for e in exs:
        if kind == "pairs" and (e.chosen is None or e.rejected is None):
            raise DataError(
                f"{e.where}: not a preference pair (chosen and rejected), as the file's "
                "first record is"
            )
        if kind == "responses" and e.response is None:
            raise DataError(
                f"{e.where}: no response to score (a messages record needs a last assistant turn)"
            )
    return kind, exs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.score", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--prompt")
    ap.add_argument("--response")
    ap.add_argument("--jsonl", help="a file of {prompt, response} records, or of preference pairs")
    ap.add_argument(
        "--chat-template",
        default="auto",
        help="for turns (messages): auto (the tokenizer's, as the reward stage used it), none, "
        "or a Jinja file",
    )
    ap.add_argument(
        "--trust-remote-code", action="store_true", help="allow a model that brings its own code"
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (auto: the GPU when there is one, as engine.device)",
    )
    ap.add_argument(
        "--judge", metavar="TEMPLATE", help="MODEL_DIR is a generative judge; its template file"
    )
    ap.add_argument(
        "--verdicts", nargs=2, default=["Yes", "No"], help="the judge's good and bad verdict"
    )
    ap.add_argument(
        "--score-pattern",
        metavar="REGEX",
        help="the judge's score form: it writes an answer and the number in the pattern's first "
        "group, mapped from --score-range onto 0..1, is the score (an answer without one: 0, "
        "counted as parse_failures)",
    )
    ap.add_argument("--score-range", nargs=2, type=float, default=[0.0, 10.0], metavar=("LO", "HI"))
    ap.add_argument(
        "--max-new-tokens", type=int, default=16, help="the score form's answer length (16)"
    )
    args = ap.parse_args(argv)
    from rlhf.errors import UserError, one_line

    try:
        kind = "responses"
        if args.jsonl:
            kind, exs = read_records(args.jsonl)
        elif args.prompt is not None and args.response is not None:
            exs = None
        else:
            ap.error("give --prompt and --response, or --jsonl")
        if args.judge:
            return judge_main(args, kind, exs)
        from rlhf.models.loading import check_scalar_model

        check_scalar_model(args.model_dir, "MODEL_DIR", "; pass RUN_DIR/reward/model")
        from rlhf.data.chat import resolve_template
        from rlhf.engine.mesh import choose_device

        scorer = RewardScorer(
            args.model_dir,
            device=str(choose_device(args.device, 0, 1)),
            trust_remote_code=args.trust_remote_code,
        )
        chat = resolve_template(scorer.tokenizer, args.chat_template, key="--chat-template")
        if kind == "pairs":
            seqs = scorer.pair_ids(exs, chat)
        elif exs is not None:
            seqs = scorer.response_ids(exs, chat)
        else:
            seqs = scorer.encode([args.prompt], [args.response])
    except (UserError, OSError, ValueError) as e:
        print(f"rlhf.score: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    if kind == "pairs":
        chosen, rejected = (scorer.score_ids(ids) for ids in seqs)
        extra = [{}] * len(chosen)
        if scorer.members > 1:
            # an ensemble: the members' mean, and their spread
            extra = [
                {"chosen_spread": a, "rejected_spread": b}
                for a, b in zip(scorer.spread(chosen).tolist(), scorer.spread(rejected).tolist())
            ]
            chosen, rejected = chosen.mean(1), rejected.mean(1)
        chosen, rejected = chosen.tolist(), rejected.tolist()
        for c, r, e in zip(chosen, rejected, extra):
            print(json.dumps({"chosen": c, "rejected": r, "correct": c > r, **e}))
        correct = sum(c > r for c, r in zip(chosen, rejected))
        print(json.dumps({"pairs": len(chosen), "accuracy": correct / max(len(chosen), 1)}))
        return
    scores = scorer.score_ids(seqs)
    if scorer.members > 1:
        rows = zip(
            scores.mean(1).tolist(),
            scorer.normalize(scores).mean(1).tolist(),
            scorer.spread(scores).tolist(),
        )
        for (s, n, sp), m in zip(rows, scores.tolist()):
            print(json.dumps({"score": s, "normalized": n, "spread": sp, "members": m}))
        return
    for s, n in zip(scores.tolist(), scorer.normalize(scores).tolist()):
        print(json.dumps({"score": s, "normalized": n}))


def judge_main(args, kind: str, exs) -> None:
    """``--judge``: each response's (each pair's two) probability of the good verdict by the
    judge, or with ``--score-pattern`` its parsed score (rlhf/rl/judge.py, as PPO's judge)."""
    from transformers import AutoModelForCausalLM

    from rlhf.config import EngineConfig
    from rlhf.data.records import Example
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.mesh import choose_device, init_mesh
    from rlhf.engine.train import FrozenModel
    from rlhf.errors import ConfigError
    from rlhf.models.loading import check_model_path, load_tokenizer, resize_for_tokenizer
    from rlhf.rl.judge import Judge, Plain, read_template

    check_model_path(args.model_dir, "MODEL_DIR")
    template = read_template(args.judge, "--judge")
    tokenizer = load_tokenizer(args.model_dir, args.trust_remote_code)
    device = choose_device(args.device, 0, 1)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, trust_remote_code=args.trust_remote_code
    )
    if args.score_range[0] >= args.score_range[1] or args.max_new_tokens < 1:
        raise ConfigError("--score-range: LO < HI, and --max-new-tokens: a positive integer")
    model = model.to(device).eval()
    decoder = None
    if args.score_pattern is not None:
        # the answers decoded in the inference mode (one process: the hybrid engine over the judge,
        # its embeddings holding the tokenizer's pad as PPO's judge's and rlhf.generate's do)
        resize_for_tokenizer(model, tokenizer)
        ecfg = EngineConfig(device=device.type)
        decoder = HybridEngine(FrozenModel(model, init_mesh(ecfg), ecfg), tokenizer, ecfg)
    judge = Judge(
        Plain(model),
        tokenizer,
        template,
        args.verdicts,
        4096,
        args.model_dir,
        score=args.score_pattern,
        score_range=args.score_range,
        max_new_tokens=args.max_new_tokens,
        decoder=decoder,
    )
    if exs is None:
        exs = [Example(prompt=args.prompt, response=args.response)]
    failures = []

    def scores(texts: List[str]) -> List[float]:  # 16 responses a forward
        out = []
        for i in range(0, len(exs), 16):
            out += judge(texts[i : i + 16], exs[i : i + 16], 0, device).tolist()
            failures.extend(judge.failed.tolist())
        return out

    said = {}
    if kind == "pairs":
        chosen, rejected = scores([e.chosen for e in exs]), scores([e.rejected for e in exs])
        for c, r in zip(chosen, rejected):
            print(json.dumps({"chosen": c, "rejected": r, "correct": c > r}))
        correct = sum(c > r for c, r in zip(chosen, rejected))
        said = {"pairs": len(chosen), "accuracy": correct / max(len(chosen), 1)}
    else:
        for s in scores([e.response or "" for e in exs]):
            print(json.dumps({"score": s}))
    if args.score_pattern is not None:
        said["parse_failures"] = sum(failures)
    if said:
        print(json.dumps(said))


if __name__ == "__main__":
    main()
