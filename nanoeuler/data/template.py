"""The chat template: how an instruction becomes a prompt, for every stage that talks to a chat model.

`nanoeuler sft` trains on it, `nanoeuler dpo` scores preference pairs in it, and `nanoeuler chat` and `serve`
wrap each conversation in it, so a model always sees at inference the token boundary it was trained on.

A model that brings its own template (an imported -Instruct model: `tok.chat_template`, rendered by
jinja_template.py) is given its own: an instruction is the user message (its input after a blank line), a
response the assistant message, and the reply's tokens are the template's, through its end token. Our own
models (no template in their tokenizer) use the standard Alpaca template (the variant with an input when
there is one):

    Below is an instruction that describes a task. Write a response that appropriately completes the request.

    ### Instruction:
    {instruction}

    ### Response:
    {response}</s>

The prompt and the response are tokenized separately (as chat tokenizes the prompt and then generates), and
the sequence ends with the tokenizer's end-of-text token `</s>`.
"""
import numpy as np

from nanoeuler.data import jinja_template

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n")


def render_prompt(instruction, input=""):
    """The Alpaca prompt, up to and including "### Response:\\n"; the response follows it directly."""
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def own_template(tok):
    """Whether the model brings its own chat template (an imported chat model), rather than our Alpaca one."""
    return getattr(tok, "chat_template", None) is not None


def user_text(instruction, input=""):
    """An instruction and its input as one user message, for a model's own template."""
    return f"{instruction}\n\n{input}" if input else instruction


def encode(tok, instruction, response, input=""):
    """(ids, n_prompt): the prompt's tokens, then the response's and its end (</s>, or the end token of the
    model's own template); ids[n_prompt:] are the reply."""
    if own_template(tok):
        messages = [{"role": "user", "content": user_text(instruction, input)},
                    {"role": "assistant", "content": response}]
        ids, spans = jinja_template.conversation_spans(tok, messages)
        start, end = spans[-1]
        return np.array(ids[:end], dtype=np.int32), start
    prompt = tok.encode(render_prompt(instruction, input))
    return np.array(prompt + tok.encode(response, add_bos=False) + [tok.eos_id], dtype=np.int32), len(prompt)


def sample_prompt(tok, instruction, input=""):
    """The prompt of the samples printed while training: the Alpaca text, or the ids of the model's own
    template (its special tokens are not text to encode)."""
    return prompt_ids(tok, instruction, input) if own_template(tok) else render_prompt(instruction, input)


def prompt_ids(tok, instruction, input=""):
    """The tokens a chat model is given to answer `instruction`."""
    if own_template(tok):
        return jinja_template.prompt_ids(tok, [{"role": "user", "content": user_text(instruction, input)}])
    return tok.encode(render_prompt(instruction, input))


def conversation_ids(tok, turns, system=""):
    """The tokens a chat model is given to answer the last of `turns`, a list of (instruction, reply) pairs
    whose last reply is None. With the model's own template: the system text, then a user and an assistant
    message a turn, rendered with its generation prompt. With ours: the turns one after the other, each laid
    out as encode() lays out a fine-tuning example (the instruction in the template, the reply, </s>), the
    last one's prompt alone; a system text (instructions for the whole conversation) leads, followed by a
    blank line. `nanoeuler chat` and `serve` render a conversation with it."""
    if own_template(tok):
        messages = [{"role": "system", "content": system}] if system else []
        for instruction, reply in turns:
            messages.append({"role": "user", "content": instruction})
            if reply is not None:
                messages.append({"role": "assistant", "content": reply})
        return jinja_template.prompt_ids(tok, messages)
    ids = tok.encode(system + "\n\n") if system else []
    for instruction, reply in turns[:-1]:
        ids += _continued(tok, ids, encode(tok, instruction, reply)[0].tolist())
    return ids + _continued(tok, ids, prompt_ids(tok, turns[-1][0]))


def _continued(tok, ids, more):
    """more, to follow ids: a tokenizer that starts a text with a BOS (an imported one) has it once, first."""
    return more[1:] if ids and tok.bos_id is not None and more[:1] == [tok.bos_id] else more


# The same template in Jinja, for tools that render conversations themselves (Hugging Face's
# tokenizer_config.json chat_template, GGUF's tokenizer.chat_template read by llama.cpp and Ollama): the text
# conversation_ids encodes: a system message and a blank line, each user message as render_prompt(content),
# each assistant message as its content and the end-of-text token. Those tools tokenize the rendered text
# whole, so the ids are conversation_ids' except where a system text's blank line meets the template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% if message['content'] %}{{ message['content'] + '\\n\\n' }}{% endif %}"
    "{% elif message['role'] == 'user' %}"
    + PROMPT_NO_INPUT.replace("{instruction}", "{{ message['content'] }}")
    + "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
