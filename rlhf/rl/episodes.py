"""Multi-turn rollouts, token in and token out (docs/agents.md).

``EpisodeRunner.run(generate, prompts, examples, sp)`` plays one environment per row: the first turn
is one generation of every prompt's ``samples_per_prompt`` samples (the single-turn call,
unchanged), then, while any row on any rank is still going, each environment answers its policy's
turn (in parallel threads, each bounded by ``env.timeout_s``), the answer is rendered by the
chat template and appended as tokens, and the rows still going are generated together for one more
turn. The sampled ids are never decoded and re-encoded: a row's sequence is its prompt, its sampled
tokens and the observations' tokens, back to back, and the inference mode's log-probs of the sampled
tokens are kept beside them. Each turn re-prefills its rows from their full context (prefill is a
small share of a turn: docs/agents.md). Collective: every rank runs as many turns (a rank with
nothing left joins each generation with no rows).

The result is one ``Generation`` in the layout every PPO step uses — prompts left-padded, then the
trajectories right-padded to the longest — whose ``response_mask`` marks the policy's tokens only:
observation tokens carry no loss, KL, entropy or value. A row whose environment raised or timed out
is ``failed`` (the collector takes it out of the loss) and its error is kept for the run's one line.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlhf import seeding
from rlhf.config import EnvConfig
from rlhf.data.chat import render
from rlhf.data.records import Chat, Example, Turn
from rlhf.data.tokenize import encode_prompts
from rlhf.engine.draws import row_keys, strided_keys
from rlhf.engine.infer import Generation, left_pad
from rlhf.engine.mesh import Mesh
from rlhf.engine.rows import join, joined, per_row
from rlhf.envs.base import check_opening, check_step
from rlhf.errors import ConfigError, first_line
from rlhf.ops import SamplingParams
from rlhf.ops.sampling import prompt_major

# HybridEngine.generate
Generate = Callable[[List[List[int]], SamplingParams, Optional[List[int]]], Generation]
STAT_KEYS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "tool_limits",
    "used_tools",
    "failed",
    "truncated",
)
# Episodes.stats key prefix of an environment's own ``StepResult.info`` keys (metrics env/<key>)
INFO = "info:"


@dataclass
class Episodes:
    """One generation's trajectories (rows prompt-major, like ``Generation``'s)."""

    # response_mask: 1 on the policy's tokens only
    gen: Generation
    # each row's last policy turn, decoded (what rule rewards and gold scorers read)
    texts: List[str] = field(metadata=per_row())
    # [B] the sum of the environment's turn rewards
    env_rewards: torch.Tensor = field(metadata=per_row())
    # [B, N] each turn's reward at its last policy token; None when all 0
    turn_rewards: Optional[torch.Tensor] = field(metadata=per_row("response", 0.0, fill="zeros"))
    # [B] bool: the environment raised or timed out
    failed: torch.Tensor = field(metadata=per_row())
    # this rank's sums: STAT_KEYS, env_s, tokens_policy, tokens_observation, rows (groups played at
    # once: env_s their longest)
    stats: Dict[str, float] = field(metadata=joined(lambda parts: join_stats(parts)))
    # one line per failed row
    errors: List[str] = field(default_factory=list, metadata=joined("concat"))
    # per row: the conversation after the prompt (its assistant turns as sampled, decoded, and the
    # observations appended after them, as the environment returned them) and its STAT_KEYS counts
    conversations: List[List[Turn]] = field(default_factory=list, metadata=per_row())
    row_counts: List[Dict[str, float]] = field(default_factory=list, metadata=per_row())


@dataclass
class _Row:
    prompt: List[int]
    example: Example
    env: object = None
    # after the prompt: sampled and observation tokens
    tokens: List[int] = field(default_factory=list)
    policy: List[int] = field(default_factory=list)  # 1 on sampled tokens
    logprobs: List[float] = field(default_factory=list)
    # the weights' version of each token (-1: an observation)
    versions: List[int] = field(default_factory=list)
    rewards: List[Tuple[int, float]] = field(default_factory=list)  # (index in tokens, reward)
    text: str = ""
    done: bool = False
    error: Optional[str] = None
    counts: Dict[str, float] = field(default_factory=dict)
    turns: List[Turn] = field(default_factory=list)  # the conversation after the prompt
    # a MoE policy's routing (``Generation.routing``) of the prompt and the tokens up to the end of
    # the last turn, from that turn's generation (its prefill and decode): [tokens, MoE layers, k]
    routing: Optional[torch.Tensor] = None


class ObservationEncoder:
    """An observation's token ids: the text the chat template writes after an assistant turn's EOS
    up to the next generation prompt, tokenized on its own (no special prefix). ``check`` refuses a
    template that does not render the observation's roles."""

    def __init__(self, tokenizer, template: Optional[str]):
        from rlhf.data.chat import FALLBACK_TEMPLATE

        self.tok, self.template = tokenizer, template or FALLBACK_TEMPLATE
        self.eos_text = getattr(tokenizer, "eos_token", None) or ""
        self._before: Optional[str] = None
        self._tail = ""

    # an assistant content no template rewrites
    MARKER = "\u2063ASSISTANT\u2063"
    BASE = ({"role": "user", "content": "?"}, {"role": "assistant", "content": MARKER})

    def text(self, messages: Sequence[Turn]) -> str:
        if self._before is None:
            # the conversation before any observation, and what follows its EOS
            self._before = render(self.tok, self.template, list(self.BASE), False)
            tail = self._before[self._before.rindex(self.MARKER) + len(self.MARKER) :]
            if self.eos_text and self.eos_text in tail:
                # the policy sampled up to its EOS: the rest follows it
                tail = tail[tail.index(self.eos_text) + len(self.eos_text) :]
            self._tail = tail
        before = self._before
        after = render(self.tok, self.template, list(self.BASE) + list(messages), True)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template does not render an observation after an assistant turn without "
                "rewriting the turn (docs/agents.md: templates); set data.chat_template to "
                "one that does"
            )
        return self._tail + after[len(before) :]

    def ids(self, messages: Sequence[Turn]) -> List[int]:
        return self.tok(self.text(messages), add_special_tokens=False)["input_ids"]

    def check(self, role: str = "tool") -> None:
        probe = f"\u2063{role}-result\u2063"
        if probe not in self.text([{"role": role, "content": probe, "name": "probe"}]):
            raise ConfigError(
                f"the chat template does not render '{role}' messages (their content is lost): an "
                "environment's observations cannot reach the policy; use a "
                "data.chat_template that "
                f"renders them (docs/agents.md)"
            )


def parallel(
    calls: List[Callable[[], object]], timeout_s: float
) -> List[Tuple[object, Optional[str]]]:
    """``(result, None)`` or ``(None, error)`` of each call, all started at once in daemon threads;
    a call still running after ``timeout_s`` is abandoned (its thread never blocks the exit) and is
    ``timed out``."""
    out: List[Tuple[object, Optional[str]]] = [(None, f"timed out after {timeout_s:g} s")] * len(
        calls
    )
    done = threading.Semaphore(0)

    def run(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = (fn(), None)
        except Exception as e:
            # the environment's code: its error is the row's
            out[i] = (None, f"{type(e).__name__}: {first_line(e)}")
        finally:
            done.release()

    for i, fn in enumerate(calls):
        threading.Thread(target=run, args=(i, fn), daemon=True, name=f"env-{i}").start()
    deadline = time.monotonic() + timeout_s
    for _ in calls:
        if not done.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            break
    return list(out)


def _routing(rows: List[_Row], first: Generation, p: int, n: int, device) -> Optional[torch.Tensor]:
    """The episodes' routing in the assembled layout ([B, p + n, MoE layers, k]: prompts
    left-padded to ``p``, ``n`` tokens after): each row's from its last turn's generation, −1 where
    none was recorded (padding, the observations after the last turn, a row that failed at reset);
    None when the generations record none (``first``'s). Under bf16 or stale weights a token an
    earlier turn sampled may have been routed otherwise then; in fp32 the turns agree."""
    if first.routing is None:
        return None
    shape, dtype = first.routing.shape[2:], first.routing.dtype
    out = torch.full((len(rows), p + n, *shape), -1, dtype=dtype)
    for i, r in enumerate(rows):
        if r.routing is not None:
            start = p - len(r.prompt)
            out[i, start : start + r.routing.shape[0]] = r.routing
    return out.to(device)


class EpisodeRunner:
    """Plays ``make_env()`` environments over generations (see the module docstring)."""

    def __init__(
        self,
        make_env: Callable[[], object],
        env_name: str,
        tokenizer,
        template: Optional[str],
        mesh: Mesh,
        max_turns: int,
        max_tokens: Optional[int],
        timeout_s: float,
        single_turn: bool = False,
        max_failed_share: float = EnvConfig.max_failed_share,
    ):
        self.make_env, self.env_name, self.tok, self.template, self.mesh = (
            make_env,
            env_name,
            tokenizer,
            template,
            mesh,
        )
        self.max_turns, self.max_tokens, self.timeout_s = max_turns, max_tokens, timeout_s
        # more failed episodes than this share of a generation's stop the run (the collector)
        self.max_failed_share = max_failed_share
        # the built-in single-turn environment: no turn, no reward of its own
        self.single_turn = single_turn
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.observations = ObservationEncoder(tokenizer, template)
        self.tools = list(getattr(make_env(), "tools", ()) or ())

    @classmethod
    def of(
        cls,
        cfg,
        env: Tuple[Callable[[], object], type],
        tokenizer,
        template: Optional[str],
        mesh: Mesh,
    ):
        """The runner of the ``env`` group's episodes (``cfg``: its ``max_turns``,
        ``max_trajectory_tokens``, ``timeout_s``) for ``env = rlhf.envs.builtin.environment(cfg)``:
        the stage's, and
        ``rlhf.generate`` / ``rlhf.eval``'s. A ConfigError when episodes can have several turns and
        the chat template does not render the environment's observations."""
        from rlhf.envs.builtin import SingleTurn

        make_env, env_cls = env
        runner = cls(
            make_env,
            cfg.name,
            tokenizer,
            template,
            mesh,
            cfg.max_turns,
            cfg.max_trajectory_tokens,
            cfg.timeout_s,
            single_turn=env_cls is SingleTurn,
            max_failed_share=cfg.max_failed_share,
        )
        if runner.multi_turn:
            # observations must reach the policy through the template
            runner.observations.check()
        return runner

    @classmethod
    def single(cls, tokenizer, mesh: Mesh):
        """The built-in single-turn environment's runner: one generation, PPO as it always was."""
        from rlhf.envs.builtin import SingleTurn

        return cls(
            SingleTurn,
            "single_turn",
            tokenizer,
            None,
            mesh,
            1,
            None,
            EnvConfig.timeout_s,
            single_turn=True,
        )

    @property
    def multi_turn(self) -> bool:
        """Whether an episode can have more than one turn (observations are appended)."""
        return self.max_turns > 1 and not self.single_turn

    def tool_schemas(self) -> Optional[List[dict]]:
        return [t.schema() for t in self.tools] or None

    def with_tools(self, examples: List[Example]) -> List[Example]:
        """The records with the environment's tools on their conversations, so that their prompts
        render with them (a record without turns becomes one user turn of its prompt); unchanged
        without tools."""
        schemas = self.tool_schemas()
        if not schemas:
            return examples
        out = []
        for e in examples:
            chat = e.chat or Chat(prompt=[{"role": "user", "content": e.prompt}])
            out.append(replace(e, chat=replace(chat, tools=schemas, needs_template=True)))
        return out

    def player(self, hybrid) -> Callable:
        """``play(prompts, examples, sp, keys) -> (final texts, stats)`` of the gold evaluation:
        episodes on the hybrid engine, the inference model kept across their turns."""

        def play(ids, examples, sp, keys):
            with hybrid.holding():
                ep = self.run(hybrid.generate, ids, examples, sp, keys, hybrid.positions)
            return ep.texts, ep.stats

        return play

    # ---- one generation's episodes ----
    def run(
        self,
        generate: Generate,
        prompts: List[List[int]],
        examples: List[Example],
        sp: SamplingParams,
        keys: Optional[List[int]] = None,
        positions: int = 0,
    ) -> Episodes:
        """``keys``: the prompts' keys (``HybridEngine.generate``; default: the strided layout);
        every turn of an episode samples under its first row's key, so the episodes are the same on
        any world size. ``positions``: a learned position table's size (``HybridEngine.positions``;
        0: none): an episode whose next turn would not fit it ends there, cut (``env/truncated``),
        as at the token budget."""
        t_env = 0.0
        # tokens after the prompt (None: one generation's)
        budget = self.max_tokens or sp.max_new_tokens
        room = positions - sp.max_new_tokens if positions else None  # a later turn's prompt at most
        rows = [
            _Row(p, e)
            for p, e in zip(
                prompt_major(prompts, sp.samples_per_prompt),
                prompt_major(examples, sp.samples_per_prompt),
            )
        ]
        t0 = time.perf_counter()
        openings = self._start(rows)
        t_env += time.perf_counter() - t0
        if keys is None:
            rank, world = (
                (self.mesh.rank, self.mesh.world_size) if self.mesh is not None else (0, 1)
            )
            keys = strided_keys(len(prompts), rank, world)
        keyed = row_keys(keys, sp.samples_per_prompt)  # each trajectory's key
        if openings is None:
            # every row opens with its record's prompt: the single-turn call
            first = generate(prompts, sp, keys)
        else:
            # a row's environment chose its opening: one row per trajectory
            first = generate([r.prompt for r in rows], replace(sp, samples_per_prompt=1), keyed)
        timings = dict(first.timings)
        self._take(rows, first, list(range(len(rows))), budget)
        turn = 1
        while True:
            t0 = time.perf_counter()
            self._answer(rows, turn >= self.max_turns, budget, room)
            t_env += time.perf_counter() - t0
            going = [i for i, r in enumerate(rows) if not r.done]
            if turn >= self.max_turns or not self.mesh.sum(float(len(going))):
                break
            spt = replace(
                sp, samples_per_prompt=1, seed=seeding.offset(sp.seed, turn, seeding.TURN)
            )
            gen = generate(
                [rows[i].prompt + rows[i].tokens for i in going], spt, [keyed[i] for i in going]
            )
            for k, v in gen.timings.items():
                timings[k] = timings.get(k, 0.0) + v
            self._take(rows, gen, going, budget)
            turn += 1
        # one turn each with nothing appended, at the single-turn length: the first generation
        # itself
        single = (
            openings is None
            and budget >= sp.max_new_tokens
            and all(0 not in r.policy for r in rows)
        )
        out = self._assemble(rows, first, t_env, single)
        out.gen.timings = timings
        return out

    def _start(self, rows: List[_Row]) -> Optional[bool]:
        """Makes and resets each row's environment; True when any chose its own opening."""

        def start(r: _Row):
            env = self.make_env()
            r.env = env
            turns = env.reset(r.example)
            check_opening(turns, "reset")
            return turns

        own = False
        for r, (turns, err) in zip(rows, self._call([lambda r=r: start(r) for r in rows])):
            if err is not None:
                self._fail(r, f"reset: {err}")
            elif turns is not None:
                ex = Example(
                    prompt="",
                    chat=Chat(prompt=turns, tools=self.tool_schemas()),
                    where=r.example.where,
                )
                r.prompt = encode_prompts([ex], self.tok, self.template)[0]
                own = True
        return True if own else None

    def _take(self, rows: List[_Row], gen: Generation, which: List[int], budget: int) -> None:
        """Appends each generated row's sampled tokens (to its EOS) within ``budget`` tokens after
        the prompt."""
        resp, mask = gen.responses, gen.response_mask.bool()
        logp = gen.logprobs
        routing = None if gen.routing is None else gen.routing.cpu()
        turns = [resp[k][mask[k]].tolist() for k in range(len(which))]
        texts = self.tok.batch_decode(turns, skip_special_tokens=True) if turns else []
        for k, i in enumerate(which):
            r = rows[i]
            if r.done:
                # a failed row generated with the others: its tokens are not kept
                continue
            ids = turns[k]
            lps = [0.0] * len(ids) if logp is None else logp[k][mask[k]].tolist()
            vers = [-1] * len(ids) if gen.versions is None else gen.versions[k][mask[k]].tolist()
            room = budget - len(r.tokens)
            ended = bool(ids) and ids[-1] == self.eos_id and len(ids) <= room
            ids, lps, vers = ids[:room], lps[:room], vers[:room]
            if routing is not None:
                # this turn's input (prompt and tokens so far, left-padded to the call's prompt
                # length) and the kept new tokens
                p, seen = gen.prompt_len, len(r.prompt) + len(r.tokens)
                r.routing = routing[k, p - seen : p + len(ids)]
            r.counts["turns"] = r.counts.get("turns", 0.0) + 1
            r.tokens += ids
            r.policy += [1] * len(ids)
            r.logprobs += lps
            r.versions += vers
            r.text = (
                texts[k]
                if len(ids) == len(turns[k])
                else self.tok.decode(ids, skip_special_tokens=True)
            )
            r.turns.append({"role": "assistant", "content": r.text})
            if not ended:
                # cut at max_new_tokens or at the budget: the episode ends unanswered
                r.done = True
                r.counts["truncated"] = 1.0

    def _answer(self, rows: List[_Row], last_turn: bool, budget: int, room: Optional[int]) -> None:
        """Each going row's environment answers its last turn (in parallel); observations appended
        while they fit ``budget`` tokens after the prompt and, with a learned position table,
        ``room`` (the longest prompt a later turn may have)."""
        going = [r for r in rows if not r.done]
        results = self._call([lambda r=r: check_step(r.env.step(r.text), "step") for r in going])
        for r, (res, err) in zip(going, results):
            if err is not None:
                self._fail(r, f"step: {err}")
                continue
            for k, v in (getattr(res, "info", None) or {}).items():  # numbers (check_step)
                r.counts[k] = r.counts.get(k, 0.0) + float(v)
            if float(res.reward):
                r.rewards.append((len(r.tokens) - 1, float(res.reward)))
            if res.done or last_turn:
                r.done = True
                continue
            try:
                obs = self.observations.ids(res.messages)
            except Exception as e:  # the template refuses these messages
                self._fail(
                    r,
                    f"step: its observation cannot be rendered: {type(e).__name__}: "
                    f"{first_line(e)}",
                )
                continue
            fits = room is None or len(r.prompt) + len(r.tokens) + len(obs) <= room
            if not obs or len(r.tokens) + len(obs) >= budget or not fits:
                r.done = True
                r.counts["truncated"] = 1.0
                continue
            r.tokens += obs
            r.policy += [0] * len(obs)
            r.logprobs += [0.0] * len(obs)
            r.versions += [-1] * len(obs)
            r.turns += [dict(m) for m in res.messages]
        for r in rows:
            if r.done and r.env is not None:
                env, r.env = r.env, None
                try:
                    env.close()
                except Exception:
                    # closing is best effort: the trajectory is complete
                    pass

    def _call(self, calls: List[Callable[[], object]]) -> List[Tuple[object, Optional[str]]]:
        """The environment's calls: in threads, bounded by the timeout (``parallel``); the built-in
        single-turn environment's (which neither waits nor fails) in this thread, at no thread's
        cost."""
        if self.single_turn:
            return [(fn(), None) for fn in calls]
        return parallel(calls, self.timeout_s)

    def _fail(self, r: _Row, error: str) -> None:
        r.done, r.error = True, f"{self.env_name}: {error}"
        r.counts["failed"] = 1.0

    # ---- the trajectories as one Generation ----
    def _assemble(
        self, rows: List[_Row], first: Generation, t_env: float, single: bool
    ) -> Episodes:
        device = first.sequences.device
        if single:
            gen = first
        else:
            ids, pmask = left_pad([r.prompt for r in rows] or [[self.eos_id]], self.pad_id, device)
            # the longest trajectory (within the budget)
            n = max([len(r.tokens) for r in rows] + [1])
            B = len(rows)
            tokens = torch.full((B, n), self.pad_id, dtype=torch.long)
            policy = torch.zeros((B, n), dtype=torch.long)
            real = torch.zeros((B, n), dtype=torch.long)
            logprobs = torch.zeros((B, n), dtype=torch.float32)
            versions = torch.full((B, n), -1, dtype=torch.long, device=device)
            for i, r in enumerate(rows):
                k = len(r.tokens)
                tokens[i, :k] = torch.tensor(r.tokens, dtype=torch.long)
                policy[i, :k] = torch.tensor(r.policy, dtype=torch.long)
                real[i, :k] = 1
                logprobs[i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
                versions[i, :k] = torch.tensor(r.versions, dtype=torch.long)
            ids, pmask = ids[:B], pmask[:B]
            if first.versions is None:
                # (the colocated run: the weights of the moment)
                versions = None
            gen = Generation(
                sequences=torch.cat([ids, tokens.to(device)], 1),
                attention_mask=torch.cat([pmask, real.to(device)], 1),
                response_mask=policy.to(device),
                logprobs=None if first.logprobs is None else logprobs.to(device),
                prompt_len=ids.shape[1],
                timings=first.timings,
                versions=versions,
                routing=_routing(rows, first, ids.shape[1], n, device),
            )
        B, n = gen.response_mask.shape
        if single:
            # the rows' text as the single-turn path always decoded it
            texts = self.tok.batch_decode(
                [row[m.bool()].tolist() for row, m in zip(gen.responses, gen.response_mask)],
                skip_special_tokens=True,
            )
        else:
            texts = [r.text for r in rows]
        env_rewards = torch.tensor(
            [sum(v for _, v in r.rewards) for r in rows], dtype=torch.float32, device=device
        )
        turn_rewards = None
        if any(r.rewards for r in rows):
            turn_rewards = torch.zeros((B, n), dtype=torch.float32)
            for i, r in enumerate(rows):
                for pos, v in r.rewards:
                    turn_rewards[i, pos] += v
            turn_rewards = turn_rewards.to(device)
        stats = {k: sum(r.counts.get(k, 0.0) for r in rows) for k in STAT_KEYS}
        # the environment's own info keys
        own = sorted({k for r in rows for k in r.counts} - set(STAT_KEYS))
        stats.update({INFO + k: sum(r.counts.get(k, 0.0) for r in rows) for k in own})
        stats["used_tools"] = float(sum(r.counts.get("tool_calls", 0.0) > 0 for r in rows))
        policy_tokens = float(gen.response_mask.sum())
        stats.update(
            env_s=t_env,
            rows=float(B),
            tokens_policy=policy_tokens,
            tokens_observation=float(gen.attention_mask[:, gen.prompt_len :].sum()) - policy_tokens,
        )
        failed = torch.tensor([r.error is not None for r in rows], dtype=torch.bool, device=device)
        errors = [r.error for r in rows if r.error]
        conversations, counts = [r.turns for r in rows], [r.counts for r in rows]
        return Episodes(
            gen, texts, env_rewards, turn_rewards, failed, stats, errors, conversations, counts
        )


def concat_episodes(parts: List[Episodes], pad_id: int) -> Episodes:
    """The episodes of one generation played in groups of consecutive rows (a rollout worker's),
    laid out as if played together (``rlhf.engine.rows.join``: prompts left-padded to the longest,
    trajectories right-padded to the longest; the groups' seconds and counts summed)."""
    return join(parts, pad_id)


def join_stats(parts: List[Dict[str, float]]) -> Dict[str, float]:
    """Groups' statistics played at once: summed, their seconds in the environment the longest."""
    return {**merge_stats(parts), "env_s": max(p.get("env_s", 0.0) for p in parts)}


def merge_stats(parts: List[Dict[str, float]]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def describe(messages: Sequence[Turn]) -> str:
    """Messages as one JSON line (logs, ``rlhf.generate``)."""
    return json.dumps(list(messages), ensure_ascii=False)
