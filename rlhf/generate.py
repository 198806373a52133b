"""Generate from a trained policy through the hybrid engine's inference mode.

    python -m rlhf.generate RUN_DIR/ppo/actor --prompt "What is 03 + 45?"
    python -m rlhf.generate RUN_DIR/sft/model --file prompts.jsonl --n 4 --temperature 0.7
    python -m rlhf.generate RUN_DIR/ppo/actor --chat            # interactive, with the chat
    template

PATH is an exported Hugging Face model directory (``RUN_DIR/sft/model``, ``RUN_DIR/ppo/actor``, any
causal LM). Prompts come from ``--prompt`` (repeatable), ``--file`` (JSONL/JSON records with
``prompt`` — a string or a list of turns — or ``messages``; any other file: one prompt per line) or
``--chat`` (turns typed on stdin, the conversation kept; ``/reset`` starts over, ``/exit`` or EOF
ends). A text prompt is a user turn rendered with the chat template (``--chat-template auto``: the
tokenizer's own; ``none``: the text as it is; or a Jinja file); turns without a template render as
plain "\\n\\nHuman: …\\n\\nAssistant:" text.

Runs on the GPU when there is one (``--device``), in the hybrid engine's injected inference mode
(HF ``generate`` for a model family it has no policy for). Prints one JSON object per sample:
``{"prompt", "sample", "response", "tokens", "finished"}`` (``--text``: the responses only).
Bad input exits 2 with one line.

    python -m rlhf.generate RUN_DIR/ppo/actor --prompt "What is 347 * 86?" --tools calculator,python

``--tools`` (``--max-turns``, ``--tool-parser``) plays each sample as the PPO stage's episodes do
(``rlhf.rl.episodes.EpisodeRunner`` with the environment ``rlhf.envs.builtin.environment`` builds
from ``env.tools``): the prompt rendered with the tools by the chat template, the policy's tool
calls run and their results appended, turn after turn, until it answers without a call. Each JSON
object then also has the conversation after the prompt, ``"turns": [{"role": "assistant",
"content"}, {"role": "tool", "name", "content"}, ...]``, and ``"tool_calls"``; ``"response"`` is the
final answer and ``"tokens"`` the policy's tokens over all turns (``--text``: the turns as
``assistant: ...`` / ``tool[name]: ...`` lines, a blank line between samples). ``--chat`` plays an
episode per message and shows its turns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

# Imports inside functions on purpose: --help and usage errors answer in 0.04 s (measured on the CPU
# dev machine), against 2-5 s once torch/transformers load; they load only when a model is loaded.
PROG = "python -m rlhf.generate"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2 (as every bad input here)."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def quiet_console() -> None:
    """Warnings only (the stages' progress lines and the loading bars are noise here)."""
    import logging

    from transformers.utils import logging as hf_logging

    from rlhf.outputs.log import setup_console

    setup_console(0)
    logging.getLogger("rlhf").setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()


def check_policy_dir(path: str, prog: str = PROG) -> Path:
    """An exported causal LM directory, or a UserError naming what is wrong."""
    from rlhf.errors import ConfigError
    from rlhf.models.loading import check_model_family

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"{path}: no such directory (pass an exported model, e.g. RUN_DIR/sft/model or "
            "RUN_DIR/ppo/actor)"
        )
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ConfigError(
            f"{path}: no config.json (not an exported model; pass e.g. RUN_DIR/sft/model "
            "or RUN_DIR/ppo/actor)"
        )
    check_model_family(p / "config.json", path)
    spec = json.loads((p / "config.json").read_text(encoding="utf-8"))
    archs = spec.get("architectures") or []
    if any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
        raise ConfigError(
            f"{path}: a {archs[0]} (a reward model or critic), not a policy; pass "
            f"RUN_DIR/sft/model or RUN_DIR/ppo/actor"
        )
    return p


def load_policy(
    path: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False, ecfg=None
):
    """(hybrid engine, tokenizer, mesh) for the policy in ``path``, on ``device`` (auto: the GPU
    when there is one)."""
    from transformers import AutoModelForCausalLM

    from rlhf.config import EngineConfig
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.mesh import init_mesh
    from rlhf.engine.train import FrozenModel
    from rlhf.models import loading

    check_policy_dir(path)
    if ecfg is None:
        ecfg = EngineConfig(device=device, precision=dtype, inference_dtype=dtype)
    # one process: the device, the threads, engine.precision resolved
    mesh = init_mesh(ecfg)
    tokenizer = loading.load_tokenizer(path, trust_remote_code)
    model = loading.build_model(
        AutoModelForCausalLM, path=path, trust_remote_code=trust_remote_code
    )
    loading.resize_for_tokenizer(model, tokenizer)
    return HybridEngine(FrozenModel(model, mesh, ecfg), tokenizer, ecfg), tokenizer, mesh


def prompt_limit(args, table: int) -> Optional[int]:
    """--max-prompt-len, or by default what a learned position table of ``table`` positions
    (``HybridEngine.positions``; 0: none) leaves beside the new tokens (a ConfigError, one line,
    where it leaves nothing); None: no limit."""
    from rlhf.errors import ConfigError

    if not table:
        return args.max_prompt_len
    room = table - args.max_new_tokens
    if room <= 0:
        raise ConfigError(
            f"--max-new-tokens={args.max_new_tokens}: the model's position table holds "
            f"{table} positions, "
            f"no room for a prompt (give fewer new tokens)"
        )
    return min(args.max_prompt_len or room, room)


def read_prompts(path: str) -> List[object]:
    """Prompts of ``--file``: strings, or lists of turns (JSON records), in file order."""
    from rlhf.data.records import iter_raw_records, turns_of
    from rlhf.errors import DataError

    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"--file {path}: no such file")
    if not p.name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        try:
            lines = p.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"--file {path}: not valid UTF-8 at byte {e.start}") from None
        return [line for line in lines if line.strip()]
    out: List[object] = []
    for rec, where in iter_raw_records(p):
        if isinstance(rec, DataError):
            raise rec
        if "messages" in rec:
            turns = turns_of(rec["messages"], where, "messages")
            while turns and turns[-1]["role"] == "assistant":  # continue from the last user turn
                turns = turns[:-1]
            if not turns:
                raise DataError(f"{where}: field 'messages' has no turn before its assistant turns")
            out.append(turns)
        elif isinstance(rec.get("prompt"), list):
            out.append(turns_of(rec["prompt"], where, "prompt"))
        elif isinstance(rec.get("prompt"), str) and rec["prompt"].strip():
            out.append(rec["prompt"])
        else:
            raise DataError(
                f"{where}: record has no field 'prompt' (a string or a list of turns) nor "
                "'messages'"
            )
    if not out:
        raise DataError(f"--file {path}: no prompts")
    return out


def as_example(prompt, system: Optional[str] = None):
    """A prompt (text or turns) as an Example for ``tokenize.encode_prompts``: text is a user turn
    when there is a template and itself when there is none; turns always go through a template
    (the plain fallback without one)."""
    from rlhf.data.records import Chat, Example, plain_text

    head = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return Example(
            prompt=prompt,
            where="prompt",
            chat=Chat(prompt=head + [{"role": "user", "content": prompt}], needs_template=False),
        )
    return Example(prompt=plain_text(prompt), where="prompt", chat=Chat(prompt=head + list(prompt)))


def generate(hybrid, tokenizer, prompts: List[List[int]], sp, batch_size: int = 32):
    """[(response text, tokens, finished)] per prompt and sample (prompt-major), in batches."""
    from dataclasses import replace

    out = []
    eos = tokenizer.eos_token_id
    for b in range(0, len(prompts), batch_size):
        gen = hybrid.generate(prompts[b : b + batch_size], replace(sp, seed=sp.seed + b))
        for row, mask in zip(gen.responses, gen.response_mask):
            ids = row[mask.bool()].tolist()
            finished = bool(ids) and ids[-1] == eos
            text_ids = ids
            if finished:  # without its EOS
                text_ids = ids[:-1]
            text = tokenizer.decode(text_ids, skip_special_tokens=True)
            out.append((text, len(ids), finished))
    return out


# the env.* keys --tools, --tool-parser and --max-turns set, and the template's: named as options in
# errors
_OPTION_OF = {
    "env.tools": "--tools",
    "env.tool_parser": "--tool-parser",
    "env.max_turns": "--max-turns",
    "data.chat_template": "--chat-template",
}


def _as_options(e: Exception) -> str:
    msg = str(e)
    for key, option in _OPTION_OF.items():
        msg = msg.replace(key, option)
    return msg


def tool_environment(
    tools: str, max_turns: Optional[int], tool_parser: Optional[str], max_new_tokens: int
):
    """(the ``env`` group, ``environment(env)``: the maker of its environments and their class) for
    ``--tools`` (comma-separated), ``--max-turns``, ``--tool-parser``: the stage's own construction
    (``rlhf.envs.builtin.environment``), before any model loads. A bad name is a ConfigError naming
    the option."""
    from rlhf.config import EnvConfig
    from rlhf.envs.builtin import environment
    from rlhf.errors import ConfigError

    names = [n.strip() for n in tools.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--tools={tools!r}: give tool names, e.g. --tools calculator,python")
    try:
        parser = tool_parser or "hermes"
        env = EnvConfig(tools=names, tool_parser=parser, max_turns=max_turns)
        # env.max_trajectory_tokens: 2 × turns × tokens a turn
        env.resolve(max_new_tokens)
        return env, environment(env)
    except ConfigError as e:
        raise ConfigError(_as_options(e)) from None


def play_episodes(
    hybrid, runner, tokenizer, examples, sp, batch_size: int = 32, max_prompt=None
) -> List[dict]:
    """Each prompt's samples played as episodes (prompt-major, as ``generate``'s rows): per row
    ``{"response", "tokens", "finished", "turns", "tool_calls"}`` (and ``"error"`` when its
    environment failed). The prompts are rendered with the runner's tools."""
    from dataclasses import replace

    from rlhf.data.tokenize import encode_prompts

    examples = runner.with_tools(examples)
    ids = encode_prompts(examples, tokenizer, runner.template, max_prompt)
    out: List[dict] = []
    with hybrid.holding():
        # the inference model kept across the turns
        for b in range(0, len(ids), batch_size):
            ep = runner.run(
                hybrid.generate,
                ids[b : b + batch_size],
                examples[b : b + batch_size],
                replace(sp, seed=sp.seed + b),
                positions=hybrid.positions,
            )
            errors = iter(ep.errors)
            for i, text in enumerate(ep.texts):
                counts = ep.row_counts[i]
                row = {
                    "response": text,
                    "tokens": int(ep.gen.response_mask[i].sum()),
                    "finished": not (bool(ep.failed[i]) or counts.get("truncated", 0.0)),
                    "turns": [_turn(m) for m in ep.conversations[i]],
                    "tool_calls": int(counts.get("tool_calls", 0.0)),
                }
                if bool(ep.failed[i]):
                    row["error"] = next(errors, "failed")
                out.append(row)
    return out


def _turn(m: dict) -> dict:
    return {k: m[k] for k in ("role", "name", "content") if k in m}


def turn_line(m: dict) -> str:
    """One turn, readably: ``assistant: ...``, ``tool[calculator]: 42``."""
    role = m["role"]
    if m.get("name"):
        role = f"{role}[{m['name']}]"
    return f"{role}: {m['content']}"


def _chat_loop(hybrid, tokenizer, template, sp, args, runner=None) -> None:
    from dataclasses import replace

    from rlhf.data.tokenize import encode_prompts

    history: List[dict] = []
    # a long conversation keeps its end, as --file's prompts
    limit = prompt_limit(args, hybrid.positions)
    tty = sys.stdin.isatty()
    if template is None:
        print(
            f"{PROG}: no chat template: turns render as plain '\\n\\nHuman: "
            "…\\n\\nAssistant:' text",
            file=sys.stderr,
        )
    turn = 0
    while True:
        if tty:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            history = []
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        if runner is not None:
            # an episode: its tool turns shown and kept in the conversation
            spt = replace(sp, samples_per_prompt=1, seed=sp.seed + turn)
            (row,) = play_episodes(
                hybrid, runner, tokenizer, [as_example(history, args.system)], spt, 1, limit
            )
            turn += 1
            for m in row["turns"]:
                print(turn_line(m), flush=True)
                if m["role"] == "assistant":
                    m = {**m, "content": m["content"].strip()}
                history.append(m)
            if "error" in row:
                print(f"{PROG}: the episode failed: {row['error']}", file=sys.stderr, flush=True)
            continue
        ids = encode_prompts([as_example(history, args.system)], tokenizer, template, limit)
        ((reply, _, _),) = generate(
            hybrid, tokenizer, ids, replace(sp, samples_per_prompt=1, seed=sp.seed + turn)
        )
        turn += 1
        history.append({"role": "assistant", "content": reply.strip()})
        print(reply.strip(), flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "path", help="an exported model directory (RUN_DIR/sft/model, RUN_DIR/ppo/actor, ...)"
    )
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument(
        "--file",
        help="JSONL/JSON records with 'prompt' or 'messages', or a text file: one prompt a line",
    )
    ap.add_argument(
        "--chat", action="store_true", help="interactive: turns from stdin, the conversation kept"
    )
    ap.add_argument(
        "--chat-template", default="auto", help="auto (the tokenizer's), none, or a Jinja file"
    )
    ap.add_argument("--system", help="a system turn before every prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--max-prompt-len",
        type=int,
        help="a longer prompt keeps its last this many tokens (as training's "
        "data.max_prompt_len); default: "
        "what a learned position table (GPT-2, OPT) leaves beside --max-new-tokens, else no limit",
    )
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: the GPU when there is one (as engine.device)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="of the inference mode; auto = bf16 on a GPU that has it, else fp32",
    )
    ap.add_argument(
        "--tools",
        help="play episodes with these tools, comma-separated: calculator, python, module.attr",
    )
    ap.add_argument("--max-turns", type=int, help="with --tools: policy turns per episode (4)")
    ap.add_argument(
        "--tool-parser",
        help="with --tools: hermes (<tool_call>{json}</tool_call>) or module.function",
    )
    ap.add_argument("--text", action="store_true", help="print the responses only, not JSON")
    ap.add_argument(
        "--trust-remote-code", action="store_true", help="allow a model that brings its own code"
    )
    return ap


def main(argv=None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    if not (args.prompt or args.file or args.chat):
        ap.error("give --prompt, --file or --chat")
    if args.tools is None and (args.max_turns is not None or args.tool_parser is not None):
        ap.error("--max-turns and --tool-parser go with --tools")

    from rlhf.errors import ConfigError, UserError, one_line

    quiet_console()
    try:
        _check_args(args)
        prompts: List[object] = list(args.prompt)
        if args.file:
            prompts += read_prompts(args.file)
        env_cfg, env = None, None
        if args.tools is not None:
            # the tools resolved before any model loads
            env_cfg, env = tool_environment(
                args.tools, args.max_turns, args.tool_parser, args.max_new_tokens
            )
        hybrid, tokenizer, mesh = load_policy(
            args.path, args.device, args.dtype, args.trust_remote_code
        )
        from rlhf.data.chat import resolve_template

        template = resolve_template(tokenizer, args.chat_template, key="--chat-template")
        runner = None
        if env is not None:
            from rlhf.rl.episodes import EpisodeRunner

            try:
                runner = EpisodeRunner.of(env_cfg, env, tokenizer, template, mesh)
            except ConfigError as e:
                raise ConfigError(_as_options(e)) from None
        from rlhf.ops import SamplingParams

        sp = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            samples_per_prompt=args.n,
            seed=args.seed,
        )
        if args.chat:
            _chat_loop(hybrid, tokenizer, template, sp, args, runner)
            return
        from rlhf.data.tokenize import encode_prompts

        examples = [as_example(p, args.system) for p in prompts]
        limit = prompt_limit(args, hybrid.positions)
        if runner is not None:
            episodes = play_episodes(
                hybrid, runner, tokenizer, examples, sp, args.batch_size, limit
            )
        else:
            full = encode_prompts(examples, tokenizer, template)
            ids = encode_prompts(examples, tokenizer, template, limit)
            cut = sum(len(a) != len(b) for a, b in zip(full, ids))
            if cut:
                print(
                    f"{PROG}: {cut} prompt(s) longer than {limit} tokens keep their last "
                    f"{limit} (--max-prompt-len)",
                    file=sys.stderr,
                )
            results = generate(hybrid, tokenizer, ids, sp, args.batch_size)
    except (UserError, OSError) as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    if runner is not None:
        print_episodes(prompts, episodes, args)
        return
    print_results(prompts, results, args)


def _check_args(args) -> None:
    """The options' values: a ConfigError naming the first out of range."""
    from rlhf.errors import ConfigError

    for key, ok, expected in (
        ("--temperature", args.temperature >= 0, "a non-negative number"),
        ("--top-k", args.top_k >= 0, "a non-negative integer"),
        ("--top-p", 0 < args.top_p <= 1, "a number in (0, 1]"),
        ("--max-new-tokens", args.max_new_tokens > 0, "a positive integer"),
        ("--n", args.n > 0, "a positive integer"),
        ("--batch-size", args.batch_size > 0, "a positive integer"),
        ("--max-turns", args.max_turns is None or args.max_turns > 0, "a positive integer"),
        (
            "--max-prompt-len",
            args.max_prompt_len is None or args.max_prompt_len > 0,
            "a positive integer",
        ),
    ):
        if not ok:
            raise ConfigError(
                f"{key}={getattr(args, key[2:].replace('-', '_'))} is invalid: expected {expected}"
            )


def print_results(prompts: List[object], results: list, args) -> None:
    """The output without tools: a JSON object per sample, or (--text) its response."""
    for i, (text, tokens, finished) in enumerate(results):
        # rows are prompt-major (rlhf.ops.sampling.prompt_major)
        prompt_ix, sample = divmod(i, args.n)
        if args.text:
            print(text, flush=True)
            continue
        record = {
            "prompt": prompts[prompt_ix],
            "sample": sample,
            "response": text,
            "tokens": tokens,
            "finished": finished,
        }
        print(json.dumps(record, ensure_ascii=False), flush=True)


def print_episodes(prompts: List[object], episodes: List[dict], args) -> None:
    """--tools' output: a JSON object per sample with its turns, or (--text) its turns as lines."""
    for i, row in enumerate(episodes):
        prompt_ix, sample = divmod(i, args.n)  # prompt-major rows
        if args.text:
            if i:
                print(flush=True)
            for m in row["turns"]:
                print(turn_line(m), flush=True)
        else:
            print(
                json.dumps(
                    {"prompt": prompts[prompt_ix], "sample": sample, **row}, ensure_ascii=False
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
