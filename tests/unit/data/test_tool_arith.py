"""The embedded tool-use task (data.format=tool_arith) and the embedded template's tools and tool
turns."""

import json
import re

import pytest

from rlhf.compose import compose_config
from rlhf.config import DataConfig, SyntheticConfig
from rlhf.data import synthetic, tool_arith
from rlhf.data.chat import Renderer
from rlhf.data.formats import FORMATS
from rlhf.data.pipeline import load_stage_data
from rlhf.data.records import Chat, Example
from rlhf.data.tokenize import encode_prompts, tokenize_sft
from rlhf.data.tokenizer import CHAT_TEMPLATE, train_tokenizer
from rlhf.errors import ConfigError, DataError
from rlhf.runtime.stage import require_pairs
from tests.unit.data.test_chat_data import MULTI

# the embedded template before tools and tool turns: every rendering without them must stay this
# one's
OLD_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(tool_arith.tokenizer_corpus(SyntheticConfig()), 512, 128)


def cfg(**kw):
    return SyntheticConfig(**{"num_records": 400, **kw})


def test_generation_is_deterministic_per_seed_and_held_out_pairs_are_disjoint():
    a, b, c = (tool_arith.generate(cfg(), 64, s) for s in (5, 5, 6))
    assert a == b and a != c
    train, held = a
    assert len(train) == 400 and len(held) == 64
    train_pairs, eval_pairs = tool_arith.operand_pairs(64, 5)
    assert not set(train_pairs) & set(eval_pairs) and len(set(eval_pairs)) == 64
    assert {e.chat.prompt[0]["content"] for e in held}.isdisjoint(
        e.chat.prompt[0]["content"] for e in train
    )
    for e in train + held:
        # 3 digits × 2 digits, the reference the product
        x, y = map(
            int, re.fullmatch(r"What is (\d+) \* (\d+)\?", e.chat.prompt[0]["content"]).groups()
        )
        assert (
            300 <= x <= 999
            and 34 <= y <= 99
            and e.reference == str(x * y)
            and len(e.reference) == 5
        )
        assert e.response == f" The answer is {x * y}." and e.chat.response == e.response[1:]
        assert e.chat.tools == [tool_arith.CALCULATOR] and e.chosen is None and e.rejected is None


@pytest.mark.parametrize("p_tool", [0.0, 0.3, 1.0])
def test_the_share_of_tool_records_is_p_tool(p_tool):
    train, _ = tool_arith.generate(cfg(num_records=4000, p_tool=p_tool), 256, 0)
    share = sum(e.chat.tool_turns is not None for e in train) / len(train)
    assert abs(share - p_tool) < 0.025
    e = next((e for e in train if e.chat.tool_turns), None)
    if p_tool > 0:
        x, y = e.chat.prompt[0]["content"][len("What is ") : -1].split(" * ")
        call = (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "%s * %s"}}</tool_call>'
            % (x, y)
        )
        assert e.chat.tool_turns == [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": e.reference},
        ]


def test_the_call_is_the_environments_string():
    assert tool_arith.tool_call_text(3, 4) == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'
    )
    try:
        from rlhf.envs.toolcalls import ToolCall, format_call
    except ImportError:
        # the environment's module is not there yet
        return
    assert format_call(
        ToolCall("calculator", {"expression": "3 * 4"})
    ) == tool_arith.tool_call_text(3, 4)


def test_sft_trains_on_the_call_and_the_answer_never_on_the_tool_result(tok):
    train, _ = tool_arith.generate(cfg(p_tool=0.5), 16, 1)
    ex = [
        next(e for e in train if e.chat.tool_turns),
        next(e for e in train if not e.chat.tool_turns),
    ]
    cols = tokenize_sft(ex, tok, 96, 64, chat=tok.chat_template)
    for (ids, mask, plen), e in zip(zip(cols["ids"], cols["mask"], cols["prompt_len"]), ex):
        q, n = e.chat.prompt[0]["content"], e.reference
        learnt = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        if e.chat.tool_turns:
            call = e.chat.tool_turns[0]["content"]
            whole = f"<s>Tools: calculator\nQ: {q}\nA: {call}</s>R: {n}\nA: The answer is {n}.</s>"
            assert learnt == f" {call}</s> The answer is {n}.</s>"
        else:
            whole = f"<s>Tools: calculator\nQ: {q}\nA: The answer is {n}.</s>"
            assert learnt == f" The answer is {n}.</s>"
        assert tok.decode(ids, skip_special_tokens=False) == whole
        # the final answer is the response (after prompt_len), every token of it learnt
        assert tok.decode(ids[plen:], skip_special_tokens=False) == f" The answer is {n}.</s>"
        assert mask[plen:] == [1] * (len(ids) - plen)
    # the tool's result is in the sequence and masked out: "R: <n>\nA:" spans only 0s
    ids, mask = cols["ids"][0], cols["mask"][0]
    text_before = [tok.decode(ids[: k + 1], skip_special_tokens=False) for k in range(len(ids))]
    start = next(k for k, t in enumerate(text_before) if t.endswith("</s>R"))
    end = next(k for k, t in enumerate(text_before) if t.endswith(f"R: {ex[0].reference}\nA:"))
    assert mask[start : end + 1] == [0] * (end + 1 - start) and mask[end + 1] == 1


def test_the_opening_prompt_is_the_prefix_of_the_sft_rendering(tok):
    train, held = tool_arith.generate(cfg(p_tool=0.5), 16, 2)
    render = Renderer(tok, tok.chat_template)
    records = train[:20] + held
    cols = tokenize_sft(records, tok, 96, 64, chat=tok.chat_template)
    prompts = encode_prompts(records, tok, tok.chat_template)  # PPO and gold prompts
    for e, ids, p in zip(records, cols["ids"], prompts):
        opening = render.prompt_ids(e.chat.prompt, e.chat.tools)
        assert p == opening and ids[: len(opening)] == opening
        # Example.prompt is the opening
        assert tok.decode(opening, skip_special_tokens=False) == "<s>" + e.prompt
    # a later turn's ids: the last piece of the conversation so far (what a rollout appends)
    e = next(e for e in train if e.chat.tool_turns)
    ids, _, last = render.encode([e.chat.prompt + e.chat.tool_turns], ["x"], tools=[e.chat.tools])[
        0
    ]
    assert tok.decode(ids[last:]) == f"R: {e.reference}\nA:"


def test_the_template_renders_every_earlier_conversation_unchanged(tok):
    for turns in (MULTI, MULTI[:2], MULTI[:4], MULTI[1:2], MULTI[1:3]):
        for gen in (True, False):
            old = tok.apply_chat_template(
                turns, chat_template=OLD_TEMPLATE, tokenize=False, add_generation_prompt=gen
            )
            assert old == tok.apply_chat_template(
                turns, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=gen
            )
            assert old == tok.apply_chat_template(
                turns,
                chat_template=CHAT_TEMPLATE,
                tokenize=False,
                add_generation_prompt=gen,
                tools=None,
            )
    # the synthetic prompt, through the Renderer (tools None: the call of before)
    ex = synthetic.generate(SyntheticConfig(num_records=8), 4, 0)[0][0]
    assert Renderer(tok, CHAT_TEMPLATE).prompt_ids(ex.chat.prompt) == tok(ex.prompt)["input_ids"]
    two = [{"type": "function", "function": {"name": "calculator"}}, {"name": "search"}]
    assert tok.apply_chat_template(MULTI[1:2], tokenize=False, tools=two).startswith(
        "Tools: calculator, search\nQ:"
    )


def test_tools_without_a_template_are_refused(tok):
    e = tool_arith.generate(cfg(p_tool=1.0), 4, 0)[0][0]
    with pytest.raises(
        DataError,
        match=r"x:1: this conversation has tools or tool results, which the plain fallback",
    ):
        Renderer(tok, None).prompt_ids(e.chat.prompt, e.chat.tools, where="x:1")
    with pytest.raises(DataError, match=r"tool_arith\[0\]: this conversation has tools"):
        tokenize_sft([e], tok, 96, 64, chat=None)


def test_tokenizer_digits_stay_one_a_token_and_the_markup_merges(tok):
    ids = tok(" " + tool_arith.tool_call_text(347, 86), add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("34786")
    assert len(ids) <= 30 and "calculator" in pieces and "expression" in pieces
    assert tool_arith.tokenizer_corpus(cfg()) == tool_arith.tokenizer_corpus(
        cfg(num_records=7, p_tool=0.9)
    )


def test_gold_and_the_stages_it_serves():
    fmt = FORMATS["tool_arith"]
    assert fmt.generated and fmt.gold is synthetic.gold_score
    assert fmt.gold(" The answer is 29842.", "29842") == 1.0
    assert fmt.gold("The answer is 29842. \n", "29842") == 1.0
    for wrong in (
        " The answer is 29843.",
        " The answer is 29842",
        " <tool_call>{}</tool_call>",
        " 29842",
        "",
    ):
        assert fmt.gold(wrong, "29842") == 0.0
    # the pipeline dispatches to the format's generator; the synthetic task is its own generator's
    # output
    sd = load_stage_data(DataConfig(format="tool_arith", eval_size=8, synthetic=cfg()), "sft", 0)
    assert (
        sd.gold is synthetic.gold_score
        and len(sd.train) == 400
        and sd.train[0].where.startswith("tool_arith[")
    )
    syn = load_stage_data(
        DataConfig(eval_size=8, synthetic=SyntheticConfig(num_records=50)), "sft", 0
    )
    assert syn.train[0].where.startswith("synthetic[") and syn.train[0].chat.tools is None
    # no preference pairs: the reward stage and DPO say so
    with pytest.raises(
        ConfigError, match=r"data.format=tool_arith has no preference pairs \(stage=reward"
    ):
        require_pairs(sd, "tool_arith", "reward")
    with pytest.raises(ConfigError, match=r"data.synthetic.p_tool=1.5 is invalid"):
        SyntheticConfig(p_tool=1.5)


def test_the_agentic_recipe():
    c, _ = compose_config(["stage=sft", "recipe=agentic"])
    assert (c.recipe, c.data.format, c.data.max_prompt_len, c.data.max_response_len) == (
        "agentic",
        "tool_arith",
        96,
        64,
    )
    assert c.eval.max_new_tokens == 48 and c.model.path is None
    with pytest.raises(ConfigError, match=r"recipe=agentic .* has no reward stage"):
        compose_config(["stage=reward", "recipe=agentic"])


def test_a_record_without_tools_has_no_tools_line(tok):
    e = Example(prompt="Q: hi\nA:", chat=Chat(prompt=[{"role": "user", "content": "hi"}], tools=[]))
    assert encode_prompts([e], tok, tok.chat_template) == [tok("Q: hi\nA:")["input_ids"]]
    assert (
        json.dumps(tool_arith.CALCULATOR["function"]["parameters"]["required"]) == '["expression"]'
    )
