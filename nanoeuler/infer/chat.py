"""Interactive REPL: `nanoeuler chat [--ckpt F]`.

    nanoeuler chat --ckpt nanoeuler.bin
    > ROMEO:
    (the model continues the text, streamed, until a blank line or --max-new-tokens)

With a pretrained (base) checkpoint the session is one growing text: each line you type is appended to it
and the model continues it, so it answers in the voice of its corpus. The text is kept (up to the model's
context) until `/reset`. With a chat checkpoint (`nanoeuler sft` or `dpo`, `chat` = 1 in its metadata, or an
imported model with its own chat template) each line is one user message, and the reply runs until the
model emits an end token (`</s>`, or any of an imported model's end ids) or --max-new-tokens; the model sees
the conversation so far, every turn in its chat template (the model's own, else the Alpaca template it was
fine-tuned on: template.conversation_ids, as `nanoeuler serve` renders a chat request's messages), and when
the conversation no longer leaves room for a reply, its oldest turns are dropped. `/reset` starts a new conversation. `/quit` or Ctrl-D leaves; Ctrl-C
stops a reply that runs on. Line editing and history (up arrow, also across sessions in ~/.nanoeuler_history)
come from readline where Python has it.
"""
import os
import sys
import time

import numpy as np

from nanoeuler.infer.generate import TextStream, check_speculative, generate, stats_line
from nanoeuler.io.checkpoint import load_model
from nanoeuler.data.template import conversation_ids, own_template

HELP = "/reset clears the conversation so far, /quit (or Ctrl-D) leaves, Ctrl-C stops a reply"
HISTORY = os.path.expanduser("~/.nanoeuler_history")


def _readline():
    """Enable line editing and persistent history if this Python has readline."""
    try:
        import readline
    except ImportError:
        return None
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass  # first session, or no home directory
    readline.set_history_length(1000)
    return readline


def main(args):
    eng, tok, ck = load_model(args.ckpt, args.device, adapter=getattr(args, "adapter", None))
    if args.speculative:
        check_speculative(eng)
    rl = _readline() if sys.stdin.isatty() else None  # a pipe: answer each line, no history, exit at its end
    rng = np.random.default_rng(args.seed)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    kind = ("a base model: it continues your text" if not ck.chat else
            "a chat model in its own chat template: each line is a message" if own_template(tok) else
            "a chat model: each line is an instruction")
    print(f"nanoeuler chat: {args.ckpt} (step {ck.step}), {kind}. {HELP}.")
    text = []  # token ids of the whole session, prompt lines and replies
    turns = []  # a chat model's conversation: (instruction, reply)
    room = eng.cfg.context - min(args.max_new_tokens, eng.cfg.context // 2)  # what a prompt may fill
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                break
            except KeyboardInterrupt:
                print()
                continue
            command = line.strip()
            if command == "/quit":
                break
            if command == "/reset":
                text, turns = [], []
                print("(cleared)")
                continue
            if command.startswith("/"):
                print(f"unknown command {command}: {HELP}")
                continue
            if ck.chat:
                turns.append((line, None))
                text = conversation_ids(tok, turns)
                while len(turns) > 1 and len(text) > room:  # the oldest turns go first
                    turns.pop(0)
                    text = conversation_ids(tok, turns)
            else:
                text = text + tok.encode(line + "\n")
            reply, stream = [], TextStream(tok)
            try:
                stats, t0 = {}, time.perf_counter()
                for token in generate(eng, text, args.max_new_tokens, args.temperature, args.top_k,
                                      args.top_p, rng, stop_ids=tok.end_ids, speculative=args.speculative,
                                      stats=stats):
                    if token in tok.end_ids:
                        break
                    reply.append(token)
                    stream.write([token])
                    # a blank line ends a base model's passage; a chat model ends its reply with an end token
                    if not ck.chat and tok.decode(reply[-4:]).endswith(b"\n\n"):
                        break
            except KeyboardInterrupt:
                pass
            stream.close()
            if not tok.decode(reply).endswith(b"\n"):
                print()
            if args.stats:
                print(stats_line(len(reply), time.perf_counter() - t0, stats), file=sys.stderr)
            if ck.chat:
                turns[-1] = (line, tok.decode(reply).decode("utf-8", errors="replace"))
            text = (text + reply)[-eng.cfg.context:]
    finally:
        if rl is not None:
            try:
                rl.write_history_file(HISTORY)
            except OSError:
                pass
    return 0
