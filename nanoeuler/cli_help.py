"""What `nanoeuler -h` and `nanoeuler COMMAND -h` print: the pipeline's map, each command's description and
examples, and the training commands' defaults.

    document(parser, sub)      # the last step of cli.build_parser

The map is derived from the parser itself: every subcommand appears, in FLOW's order (then any other in the
order it was added), with its one-line help and, from FLOW, what it reads and writes. A command's page adds
its GUIDE entry: what it does, then examples. The training commands' defaults are read from the tables their
runs use (pretrain.PRESET_HYPER, sft.SFT_HYPER, dpo.DPO_HYPER), rendered only when the page is shown: building
the parser imports neither NumPy nor numba (cli.py's rule).
"""
import argparse
import textwrap

WIDTH = 100  # the descriptions' line length (argparse keeps them as written)

# what each command reads -> what it writes, in the order a run of the pipeline goes
FLOW = {
    "tokenizer": "a text file -> tokenizer.json (optional: train learns one on its corpus)",
    "train": "shakespeare.txt (small, big) or data/pretrain.txt (base, large) -> nanoeuler.bin, nanoeuler.jsonl",
    "sft": "nanoeuler.bin + data/alpaca.json -> nanoeuler_chat.bin",
    "dpo": "nanoeuler_chat.bin + data/preferences.jsonl -> nanoeuler_dpo.bin",
    "infer": "any checkpoint + a prompt -> its continuation",
    "chat": "nanoeuler_chat.bin or nanoeuler_dpo.bin -> a conversation (from a pipe: one reply a line)",
    "serve": "a checkpoint -> an OpenAI-compatible HTTP API and a web chat page",
    "eval": "a checkpoint + data/hellaswag_val.jsonl or --data -> accuracy, or bits per byte",
    "report": "a checkpoint -> its run report",
    "export": "a checkpoint -> a Hugging Face folder (--hf) or a GGUF file (--gguf)",
    "import": "a Hugging Face Llama (folder or Hub id) or a GGUF file -> a checkpoint",
    "quantize": "a checkpoint -> a checkpoint of int8 or int4 matrices",
    "check": "no files: every hand-written backward pass against finite differences",
}

# command -> (what it does, examples); examples are `command  # comment` lines
GUIDE = {
    "tokenizer": (
        "Byte-level BPE, written here: 256 byte tokens, merges learned on a corpus, special tokens such as </s>. "
        "`train` learns one on its corpus by itself; this command is for learning one to reuse (train "
        "--tokenizer), and for looking at how text is cut into tokens.",
        ["nanoeuler tokenizer train shakespeare.txt --vocab-size 4096 --out tokenizer.json",
         "nanoeuler tokenizer encode 'To be, or not to be'      # the ids, with the tokenizer of nanoeuler.bin",
         "nanoeuler tokenizer encode --tokenizer tokenizer.json --file notes.txt",
         "nanoeuler tokenizer decode 84 111 32 98 101           # the bytes of those ids: ids 0-255 are bytes"]),
    "train": (
        "Pretrain a model from scratch on a text corpus: a tokenizer is learned on the corpus (or --tokenizer), "
        "the model trains on random windows of its first nine tenths and is scored on the last tenth "
        "(validation loss, bits per byte). `</s>` written in the corpus is the end-of-text token (an imported "
        "model's own, such as Llama 3's <|end_of_text|>, where its tokenizer has no </s>): the fetched "
        "corpora close every document with it, so the model learns where a text ends. "
        "Checkpoints are written atomically every --ckpt-every steps and at "
        "the end; --resume continues one exactly. The metrics log (JSONL, a line per step; the first names "
        "the corpus, its sha256 and its sources) and the loss curve (PNG) go beside --out. A missing default "
        "corpus: `python -m nanoeuler.data.fetch shakespeare|pretrain` downloads it.",
        ["nanoeuler train                                # small on shakespeare.txt, on the CPU",
         "nanoeuler train big --steps 1000               # the GPU when there is one",
         "nanoeuler train base --data data/pretrain.txt --gpus 8",
         "nanoeuler train --resume                       # continue nanoeuler.bin where it stopped",
         "nanoeuler train small --seed 1 --out seed1.bin # a second run beside the first"]),
    "sft": (
        "Supervised fine-tuning: a pretrained checkpoint learns to answer instructions (Alpaca-style JSON: "
        "instruction, input, output), rendered in the chat template, the loss on the reply's tokens only. "
        "Writes a chat checkpoint for `chat`, `serve` and `dpo`. Missing data/alpaca.json: `python -m "
        "nanoeuler.data.fetch alpaca`.",
        ["nanoeuler sft                                  # nanoeuler.bin + data/alpaca.json -> nanoeuler_chat.bin",
         "nanoeuler sft --show 3                         # the first 3 examples as trained, then exit",
         "nanoeuler sft --ckpt base.bin --data mine.json --out mine_chat.bin --steps 300",
         "nanoeuler sft --ckpt llama.bin --lora 16 --out chat_lora.bin   # LoRA adapters alone (docs/lora.md)"]),
    "dpo": (
        "Preference tuning of a chat checkpoint on {prompt, chosen, rejected} pairs: DPO against the starting "
        "model as the reference, with the chosen replies' likelihood kept up by RPO's NLL term (--rpo-alpha; "
        "0 is plain DPO, which can win its margins while its replies drift onto unrelated tokens: docs/dpo.md). "
        "Writes a chat checkpoint. The defaults follow the "
        "preset nearest to the checkpoint's size. Missing data/preferences.jsonl: `python -m "
        "nanoeuler.data.fetch preferences`.",
        ["nanoeuler dpo                                  # nanoeuler_chat.bin + data/preferences.jsonl -> nanoeuler_dpo.bin",
         "nanoeuler dpo --data pairs.jsonl --beta 0.2 --steps 300",
         "nanoeuler dpo --ckpt chat_lora.bin --lora 16 --out dpo_lora.bin   # adapters; the reference is the base",
         "nanoeuler chat --ckpt nanoeuler_dpo.bin        # then talk to the result"]),
    "infer": (
        "Continue a prompt with a trained model (head 0; --speculative drafts with the other heads and gives "
        "the same distribution; --num-samples N decodes N samples as one batch). An empty prompt starts from a "
        "newline; a prompt longer than the context keeps its last tokens.",
        ["nanoeuler infer 'ROMEO:'                        # sample from nanoeuler.bin",
         "nanoeuler infer 'ROMEO:' --temperature 0 --max-new-tokens 50   # greedy",
         "nanoeuler infer '' --seed 1 --top-k 40 --stats # reproducible, with tokens/s on stderr"]),
    "chat": (
        "An interactive conversation with a chat checkpoint (after `sft` or `dpo`, or an imported model with its "
        "own chat template), in its chat template. With its input from a pipe it answers each line and exits at "
        "the end of the input.",
        ["nanoeuler chat --ckpt nanoeuler_chat.bin",
         "echo 'Name three fruits.' | nanoeuler chat --ckpt nanoeuler_dpo.bin --temperature 0"]),
    "serve": (
        "An OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions, streaming too) "
        "and a web chat page at /. Needs the serve extra: pip install 'nanoeuler[serve]'.",
        ["nanoeuler serve --ckpt nanoeuler_chat.bin      # then open http://127.0.0.1:8000/",
         "nanoeuler serve --host 0.0.0.0 --port 8080 --slots 32"]),
    "eval": (
        "Score a checkpoint: HellaSwag (accuracy over the four endings), your own multiple-choice items, or "
        "bits per byte of a text file.",
        ["nanoeuler eval --task hellaswag --ckpt nanoeuler.bin --limit 500",
         "nanoeuler eval --task mc --data items.jsonl --json scores.json",
         "nanoeuler eval --task bpb --data held_out.txt"]),
    "report": (
        "Print the run report a training command wrote beside its checkpoint.",
        ["nanoeuler report --ckpt nanoeuler_chat.bin"]),
    "export": (
        "Write a checkpoint in another program's format: a Hugging Face LlamaForCausalLM folder (transformers "
        "loads it and gives the same logits) or a GGUF file for llama.cpp.",
        ["nanoeuler export --hf hf_model                 # nanoeuler.bin -> hf_model/",
         "nanoeuler export --gguf model.gguf --ckpt nanoeuler_chat.bin --type q8_0"]),
    "import": (
        "Turn a Hugging Face LlamaForCausalLM folder (config.json, safetensors, tokenizer.json), or a Hub id "
        "owner/name[@revision] (fetched into the Hugging Face cache; needs pip install 'nanoeuler[hub]'), into a "
        "checkpoint that every command here takes; an -Instruct model's chat template and end ids come with it "
        "(chat, serve, sft and dpo then use its template). --gguf FILE reads a llama.cpp GGUF file of the same "
        "families instead, its tokenizer and chat template from the metadata (pip install 'nanoeuler[gguf]').",
        ["nanoeuler import --hf hf_model --out imported.bin",
         "nanoeuler import --hf HuggingFaceTB/SmolLM2-135M-Instruct --out smol_chat.bin",
         "nanoeuler import --gguf Llama-3.2-1B-Instruct-Q4_K_M.gguf --out llama.bin   # a llama.cpp file",
         "nanoeuler infer 'Hello' --ckpt imported.bin"]),
    "quantize": (
        "Quantize a checkpoint's matrices (every layer's and the output heads') to int8 or int4 in groups along "
        "their rows, with a float16 scale (and for int4 a minimum) a group: GGUF's Q8_0 and Q4_1 for groups of "
        "32. The output heads default to int8 in groups of 32 (Q8_0) for either type: in int4 the head carries most "
        "of the loss (--head-type int4 quantizes it with the layers). The embedding and norms stay float. infer, "
        "chat, serve, eval and export take the result, and sft|dpo "
        "--lora R train adapters on it (QLoRA); full training needs the float checkpoint. docs/quantization.md has "
        "the formats and their measurements.",
        ["nanoeuler quantize --ckpt imported.bin --out imported_int4.bin --type int4",
         "nanoeuler quantize --ckpt nanoeuler.bin --out int8.bin --type int8 --group 0   # a scale a row",
         "nanoeuler quantize --ckpt nanoeuler.bin --out int4.bin --type int4 --head-type int4   # the head int4 too",
         "nanoeuler import --hf meta-llama/Meta-Llama-3-8B-Instruct --out llama3_int4.bin --quantize int4"]),
    "check": (
        "Verify every hand-written backward pass against finite differences in float64 (the CPU engine), or "
        "with --gpu every GPU kernel against the CPU engine.",
        ["nanoeuler check", "nanoeuler check --gpu"]),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and epilogs as written (a map, a table, examples) and renders a callable one only when
    the help is shown."""

    def add_text(self, text):
        super().add_text(text() if callable(text) else text)


def document(parser, sub):
    """Give the top-level parser the pipeline map and every subcommand its description and examples."""
    for name, p in sub.choices.items():
        p.formatter_class = HelpFormatter
        description, examples = GUIDE.get(name, (None, []))
        # a description or epilog given in cli.py stays, after this module's
        p.description = "\n\n".join(text for text in (description and textwrap.fill(description, WIDTH),
                                                       p.description) if text) or None
        pages = ([examples_text(examples)] if examples else []) + ([p.epilog] if p.epilog else [])
        defaults = TRAINING_DEFAULTS.get(name)
        p.epilog = (lambda pages=pages, defaults=defaults: "\n\n".join(([defaults()] if defaults else []) + pages))
        for summary, q in actions(p):  # `tokenizer train|encode|decode`: their help line, their own examples
            q.formatter_class = HelpFormatter
            q.description = q.description or f"{summary[:1].upper()}{summary[1:]}."
            own = [line for line in examples if line.startswith(f"{q.prog} ")]
            q.epilog = examples_text(own) if own else None
    parser.formatter_class = HelpFormatter
    parser.usage = "%(prog)s [-h] [--version] COMMAND ..."
    parser.description = lambda: pipeline_map(parser, sub)
    sub.help = argparse.SUPPRESS  # the map lists the commands


def actions(p):
    """(one-line help, parser) of a command's own subcommands (`tokenizer train`, ...)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            yield from ((helps.get(name, ""), q) for name, q in action.choices.items())


def commands(sub):
    """(name, one-line help) of every subcommand: FLOW's order, then the others as they were added."""
    helps = {action.dest: action.help for action in sub._choices_actions}
    names = [n for n in FLOW if n in sub.choices] + [n for n in sub.choices if n not in FLOW]
    return [(name, helps.get(name) or "") for name in names]


def pipeline_map(parser, sub):
    from nanoeuler.data.corpus import FETCH_COMMANDS

    rows = commands(sub)
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{parser.prog}: a GPT-2-class language model written from scratch, trained and run here.", "",
             "The pipeline, in the order a run goes (each command reads what an earlier one wrote):", ""]
    for name, summary in rows:
        lines.append(f"  {name:<{width}}{summary}")
        if name in FLOW:
            lines.append(f"  {'':<{width}}  {FLOW[name]}")
    path_width = max(map(len, FETCH_COMMANDS)) + 2
    lines += ["", "Data: each default data file is downloaded into the working directory by its command:"]
    lines += [f"  {path:<{path_width}}{command}" for path, command in FETCH_COMMANDS.items()]
    lines += ["",
              f"`{parser.prog} COMMAND -h`: what a command does, its flags and defaults, and examples."]
    return "\n".join(lines)


def examples_text(examples):
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


# ------------------------------------------------------------------------------------------ defaults tables
HYPER_ROWS = (("--steps", "steps"), ("--batch-size", "batch_size"), ("--grad-accum", "grad_accum"),
              ("--lr (peak)", "lr"), ("warmup steps", "warmup"), ("--eval-every", "eval_every"),
              ("--sample-every", "sample_every"), ("--ckpt-every", "ckpt_every"),
              ("eval batches", "eval_batches"), ("--seed", "seed"))


def hyper_table(title, hypers, extra_rows=()):
    """A table of Hyperparameters (name -> hp): a row per HYPER_ROWS field, then the decay (loop.lr_at) and
    extra_rows ((label, name -> text))."""
    names = list(hypers)
    rows = [(label, [f"{getattr(hypers[n], field):g}" for n in names]) for label, field in HYPER_ROWS]
    rows.append(("cosine decay over", [f"last {hypers[n].decay_frac:.0%}" for n in names]))
    rows.append(("lr at the end", [f"{hypers[n].lr * hypers[n].min_lr_ratio:g}" for n in names]))
    rows += [(label, [value(n) for n in names]) for label, value in extra_rows]
    label_width = max(len(label) for label, _ in rows) + 2
    widths = [max(len(n), *(len(values[i]) for _, values in rows)) + 2 for i, n in enumerate(names)]
    out = [title, "", "  " + " " * label_width + "".join(f"{n:<{w}}" for n, w in zip(names, widths)).rstrip()]
    out += ["  " + f"{label:<{label_width}}" + "".join(f"{v:<{w}}" for v, w in zip(values, widths)).rstrip()
            for label, values in rows]
    out.append("  (a --steps at or below the warmup shortens the warmup to a tenth of the steps)")
    return "\n".join(out)


def train_defaults():
    from nanoeuler.model.config import PRESETS, param_count
    from nanoeuler.train.pretrain import DEFAULT_DATA, PRESET_HYPER

    return hyper_table("defaults of each preset (a flag overrides its value; --resume keeps the run's own):",
                       PRESET_HYPER, (("parameters", lambda n: f"{param_count(PRESETS[n]) / 1e6:.1f}M"),
                                      ("context", lambda n: f"{PRESETS[n].context}"),
                                      ("--data", lambda n: DEFAULT_DATA[n])))


def sft_defaults():
    from nanoeuler.train.sft import SFT_HYPER

    return hyper_table("defaults (a flag overrides its value):", {"sft": SFT_HYPER})


def dpo_defaults():
    from nanoeuler.train.dpo import DEFAULT_BETA, DEFAULT_RPO_ALPHA, DPO_HYPER

    return hyper_table("defaults, by the preset nearest to the checkpoint's size (a flag overrides its value):",
                       DPO_HYPER, (("--beta", lambda n: f"{DEFAULT_BETA:g}"),
                                   ("--rpo-alpha", lambda n: f"{DEFAULT_RPO_ALPHA:g}")))


TRAINING_DEFAULTS = {"train": train_defaults, "sft": sft_defaults, "dpo": dpo_defaults}
