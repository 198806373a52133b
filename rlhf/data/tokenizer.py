"""The embedded tokenizer: byte-level BPE trained with `tokenizers` on the task's own text.

Byte-level, so any UTF-8 text encodes (no unknown tokens on real data); digits split one per
token, so arithmetic stays learnable. Saved in Hugging Face format with pad distinct from EOS and
a chat template that renders a user turn exactly as the synthetic task's prompt.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

# A user turn renders as the synthetic prompt ("Q: ...\nA:"), so that the embedded default task
# goes through the chat-template path with the very same tokens; an assistant turn as " <text></s>";
# a system turn as its text and a newline. The user turn ends with the generation prompt ("A:")
# already, so add_generation_prompt adds nothing. Tool use (the tool_arith task): a tool turn (the
# result of an assistant's <tool_call>) renders as "R: <result>\nA:", so the assistant goes on after
# it as after a question; with apply_chat_template(tools=[...]) the conversation opens with one line
# naming the tools ("Tools: calculator\n": names only, a JSON schema would make the tiny model's
# prompts long). Without tools and tool turns the rendering is what it always was.
CHAT_TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}"
    "{{ t['function']['name'] if t['function'] is defined else t['name'] }}{{ ', ' if not "
    "loop.last else '\\n' }}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}R: {{ m['content'] }}\nA:"
    "{% endif %}{% endfor %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int):
    """Returns a ``PreTrainedTokenizerFast`` trained on ``texts`` (deterministic for the same
    input)."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, UNK]
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(specials)),
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return wrap_tokenizer(tok.to_str(), model_max_length)


def wrap_tokenizer(tokenizer_json: str, model_max_length: int):
    """The Hugging Face tokenizer around a trained `tokenizers` model (given as its JSON)."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_embedded_tokenizer(corpus, m, mesh):
    """Rank 0 trains the embedded tokenizer (``m``: the model group, for its vocabulary size and
    length) and broadcasts it as JSON to the other ranks (``mesh``: ``is_main``, ``distributed``,
    ``broadcast_object``)."""
    tok = None
    if mesh.is_main:
        tok = train_tokenizer(corpus, m.vocab_size, m.max_position_embeddings)
    if not mesh.distributed:
        return tok
    if mesh.is_main:
        mesh.broadcast_object(tok.backend_tokenizer.to_str())
        return tok
    text = mesh.broadcast_object(None)
    return wrap_tokenizer(text, m.max_position_embeddings)
