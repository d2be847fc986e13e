"""A model's own chat template: the Jinja text of an imported model's tokenizer_config.json (or
chat_template.jinja), rendered and tokenized as Hugging Face transformers' `apply_chat_template` does.

    ids = prompt_ids(tok, [{"role": "user", "content": "Hi"}])       # the conversation, then the reply's header
    ids, spans = conversation_spans(tok, messages)                     # a whole conversation, its replies' spans

Rendering follows transformers (utils/chat_template_utils.py): a sandboxed environment that lets a template
read but not change what it is given (`ImmutableSandboxedEnvironment`, trim_blocks and lstrip_blocks, the
loop-control extension), a `tojson` filter that does not escape HTML, the globals `raise_exception`,
`strftime_now`, `dict` and `namespace`, and the variables `messages` (the keys whose value is None dropped),
`tools` and `documents` (None), `add_generation_prompt` and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...: tokenizer_config.json's). A template that refuses a conversation
(raise_exception) or fails is a one-line UserError.

Tokenizing: the rendered text is encoded with the added tokens the template wrote recognised and no BOS from
the tokenizer (a template that wants one writes `{{ bos_token }}`). What the user wrote is never a control
token: before rendering, every control token (the special tokens, and the other added tokens the template's
literal text holds) in a message is wrapped in two private markers, and after it each wrapped one is encoded
as ordinary text, the text around it apart, as transformers' `sanitize_control_tokens=True` encodes it.

The replies of a conversation (for `sft` and `dpo`'s loss) are found by rendering its prefixes: the tokens of
the conversation before assistant message i with the generation prompt, and through message i without it;
reply i runs from where the first stops agreeing with the whole conversation's tokens to where the second
does, cut after the first end id in it (what follows an end token is never generated).
"""
import datetime
import functools
import json
import re

from nanoeuler.errors import UserError

# Private-use code points (planes 15's first two, as transformers picks) that wrap a control token a user wrote.
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


@functools.lru_cache(maxsize=8)
def compiled(source):
    """The jinja2 Template of a chat template's text, in transformers' environment (module docstring)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("a model's own chat template needs jinja2: pip install 'jinja2>=3.1.6'") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # dict() for a template, without the class's attributes to reach through
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # namespace() that refuses underscore attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the model's chat template is not valid Jinja: {e}") from None


@functools.lru_cache(maxsize=8)
def _literal_text(source):
    """The template's literal text and string constants, joined by NULs (a search cannot span two of them)."""
    import jinja2.nodes
    ast = compiled(source).environment.parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def control_tokens(tok):
    """The added tokens that a user's text may not produce: every special one, and the non-special ones the
    template writes itself (but whitespace), as transformers infers them."""
    literal = _literal_text(tok.chat_template)
    return tuple(t for t in tok.special_tokens
                 if t not in tok.nonspecial or (t in literal and not t.isspace()))


@functools.lru_cache(maxsize=8)
def _patterns(tokens):
    """(a regex of any of the tokens, a regex of a marked token or a lone marker), longest tokens first."""
    alternatives = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
    return re.compile(alternatives), re.compile(f"{MARK_START}({alternatives}){MARK_END}|[{MARK_START}{MARK_END}]")


def _marked(value, control):
    """value (a message's strings, recursively) with each control token wrapped in the markers; markers
    already there are dropped, so that none can be forged."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return control.sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {k: _marked(v, control) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(v, control) for v in value]
    return value


def render(tok, messages, add_generation_prompt):
    """The text of the conversation in the tokenizer's chat template, control tokens in the messages marked.
    A template that refuses it (raise_exception) or fails is a one-line UserError."""
    import jinja2
    control, _ = _patterns(control_tokens(tok))
    messages = [_marked({k: v for k, v in m.items() if v is not None}, control) for m in messages]
    try:
        return compiled(tok.chat_template).render(messages=messages, tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt, **tok.named_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the model's chat template refuses this conversation: {e}") from None
    except Exception as e:  # a template's own bug (a wrong type, a missing key): its message, one line
        raise UserError(f"the model's chat template fails on this conversation: {type(e).__name__}: {e}") from None


def encode_rendered(tok, text):
    """The ids of rendered text: control tokens the template wrote are theirs, marked ones (a user's) ordinary
    text encoded apart, lone markers dropped but still breaking the text; no BOS beyond what the template wrote.
    A piece after the first is encoded after a newline whose ids are then dropped (where they lead), as
    transformers' encode_marked_chat does, so that a SentencePiece-style tokenizer puts no `▁` in front of it."""
    _, markers = _patterns(control_tokens(tok))
    pieces = markers.split(text)  # text, marked token or None (a lone marker), text, ...

    def encode(piece, as_text):
        return tok.encode_ordinary(piece) if as_text else tok.encode(piece, allow_special=True, add_bos=False)

    newline = encode("\n", False)
    ids = encode(pieces[0], False)
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        after = encode("\n" + piece, i % 2 == 1)
        ids += after[len(newline):] if after[:len(newline)] == newline else encode(piece, i % 2 == 1)
    return ids


def prompt_ids(tok, messages):
    """The tokens a chat model is given to answer the conversation: its messages and the generation prompt."""
    return encode_rendered(tok, render(tok, messages, add_generation_prompt=True))


def _agreeing(a, b):
    """The length of the common prefix of two lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def conversation_spans(tok, messages):
    """(ids, spans): the whole conversation's tokens, and (start, end) of each assistant reply in them, the
    tokens a model is trained to produce (module docstring). A template that renders no reply is a UserError."""
    ids = encode_rendered(tok, render(tok, messages, add_generation_prompt=False))
    ends = set(tok.end_ids)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or i == 0:
            continue
        start = _agreeing(prompt_ids(tok, messages[:i]), ids)
        through = ids if i == len(messages) - 1 else encode_rendered(tok, render(tok, messages[:i + 1], False))
        end = _agreeing(through, ids)
        end = next((k + 1 for k in range(start, end) if ids[k] in ends), end)
        if end > start:
            spans.append((start, end))
    if not spans:
        raise UserError("the model's chat template renders no assistant reply of this conversation")
    return ids, spans
