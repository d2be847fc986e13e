"""The `nanoeuler` command line: one subcommand per stage of the pipeline.

    nanoeuler check [--gpu]                 gradient check of the hand-written backward passes
    nanoeuler train [small|big|base|large]  pretrain (CPU or GPU engine; --gpus N: data parallel)
    nanoeuler infer "PROMPT" ...            sample from a checkpoint
    nanoeuler sft ...                       supervised fine-tuning on Alpaca
    nanoeuler dpo ...                       preference tuning (DPO) of a chat model
    nanoeuler chat ...                      interactive REPL
    nanoeuler serve ...                     OpenAI-compatible HTTP server and web chat page
    nanoeuler tokenizer train|encode|decode
    nanoeuler export --hf DIR | --gguf F    a Hugging Face LlamaForCausalLM folder, a GGUF file (llama.cpp)
    nanoeuler import --hf DIR|ID --out F    a Hugging Face Llama (a folder or a Hub id) into a checkpoint
    nanoeuler import --gguf FILE --out F    a GGUF file (llama.cpp's format) into a checkpoint
    nanoeuler quantize --out F --type T     a checkpoint's matrices to int8 or int4
    nanoeuler eval --task hellaswag|mc|bpb  scores: HellaSwag, multiple-choice items, bits per byte
    nanoeuler report [--ckpt F]             a checkpoint's run report

Each subcommand's work lives in its own module, imported only when it runs, so `nanoeuler tokenizer`
never pays for numba compilation and the CPU path never imports cupy; `nanoeuler tokenizer`'s own glue
(reading a tokenizer from a file or a checkpoint) is here, so that the tokenizer needs nothing of
the checkpoint module, and so is `nanoeuler report`'s line, so that io/report.py, which training writes its
reports with, is a library and no command's module. Bad input raises UserError, which is printed here as one line on stderr with a non-zero exit
and no traceback.

This module imports neither NumPy nor numba at its top, and main() calls configure_cpu_runtime() before
importing any subcommand: some of those settings are read only when OpenBLAS (through NumPy) or numba load.
"""
import argparse
import importlib
import os
import sys

from nanoeuler import __version__, configure_cpu_runtime
from nanoeuler.cli_help import document
from nanoeuler.errors import ENDINGS, UserError, exit_status


def _int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_positive_int, _nonneg_int = _int_at_least(1), _int_at_least(0)


def _float_at_least(minimum, inclusive):
    """A parser of finite numbers >= minimum (> minimum unless inclusive), whose error says which."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value
    return parse


_nonneg_float, _positive_float = _float_at_least(0, inclusive=True), _float_at_least(0, inclusive=False)


def _port(text):
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {value}")
    return value


def _probability(text):
    value = _nonneg_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """Bad flags get the same one-line error as every other bad input (the usage is one -h away);
    subparsers inherit this class."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} -h)\n")
        sys.exit(2)


def _device_flag(p, training=True):
    rule = ("the GPU when there is one, but models of at most 4M parameters (small) train on the CPU"
            if training else "the GPU when there is one")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto", help=f"engine: auto takes {rule}")


def _run_flags(p, out, unit):
    """The flags of a training run that train, sft and dpo share (defaults: the command's own, in the table
    that its -h prints: cli_help.py)."""
    p.add_argument("--out", default=out, help=f"checkpoint to write (default {out})")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint at --out exactly")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even though --out holds a checkpoint (replaced at the first checkpoint)")
    p.add_argument("--log", help="JSONL metrics log (default: --out with .jsonl); the PNG curve goes beside it")
    p.add_argument("--steps", type=_positive_int, help="total optimizer steps (default: the table below)")
    p.add_argument("--batch-size", type=_positive_int, help=f"{unit} per batch (default: the table below)")
    p.add_argument("--lr", type=_positive_float, help="peak learning rate (default: the table below)")
    p.add_argument("--seed", type=_nonneg_int, help="initialisation (train), data order and samples")
    p.add_argument("--eval-every", type=_positive_int, metavar="N",
                   help="steps between validation scores, which also redraw the loss curve (default: the table below)")
    p.add_argument("--sample-every", type=_positive_int, metavar="N",
                   help="steps between printed samples (default: the table below)")
    p.add_argument("--ckpt-every", type=_positive_int, metavar="N",
                   help="steps between checkpoints; one is also written at the end (default: the table below)")
    p.add_argument("--eval-task", metavar="TASK",
                   help="also score hellaswag or mc:FILE (JSON lines {context, choices, label}) during training")
    p.add_argument("--eval-task-every", type=_positive_int, metavar="N",
                   help="steps between those scores (default --eval-every's); always at the end")


def _training_flags(p):
    p.add_argument("--precision", choices=("bf16", "tf32", "fp32"),
                   help="GPU arithmetic: bf16 (default on the GPU; float32 master weights), tf32 or fp32; the CPU "
                        "computes in fp32")
    p.add_argument("--grad-accum", type=_positive_int,
                   help="forward/backward passes of --batch-size per optimizer step (less memory, same result)")
    p.add_argument("--recompute", nargs="?", const="auto", default=False, choices=RECOMPUTE_CHOICES,
                   metavar="MODE",
                   help="recompute activations in the backward pass instead of keeping them (less memory for long "
                        "contexts; the same gradients bit for bit): 'layer' keeps each layer's input only and runs "
                        "the layer's forward again; 'products' also keeps the attention's output and recomputes "
                        "the norms and products around it; 'mlp' also keeps the attention's results and "
                        "recomputes the norms and gate|up with SwiGLU alone (faster, more memory); 'auto' (the "
                        "flag alone) takes mlp, else products, where it fits the device's free memory, else layer")


def _lora_flags(p, adapter=False):
    p.add_argument("--lora", type=int, metavar="R",
                   help="train LoRA adapters of rank R on the frozen model instead of every weight; --out is then a "
                        "small checkpoint of the adapters naming their base (docs/lora.md)")
    p.add_argument("--lora-alpha", type=_positive_float, metavar="A",
                   help="the adapters' scale is A / R (default A = 2R)")
    p.add_argument("--lora-dropout", type=_probability, metavar="P",
                   help="dropout on the adapters' inputs while training (default 0)")
    p.add_argument("--lora-targets", metavar="LIST",
                   help="the products that get adapters, among q,k,v,o,gate,up,down (default all seven)")
    if adapter:
        p.add_argument("--adapter", metavar="DIR",
                       help="start the adapters from this PEFT LoRA folder (its rank, alpha and targets)")


def _adapter_flag(p):
    p.add_argument("--adapter", metavar="DIR",
                   help="a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) made for --ckpt's "
                        "model, merged into its weights")


def _launch_flags(p):
    p.add_argument("--gpus", type=_positive_int,
                   help="data parallel over N ranks on this host, one process each, started by this command (the "
                        "CPU engine: N CPU processes); --batch-size is per rank. Under torchrun, srun or mpirun, "
                        "start one process per GPU instead (docs/multi-gpu.md)")
    p.add_argument("--nnodes", type=_positive_int,
                   help="hosts in the run, one `--gpus N` launcher on each (default 1)")
    p.add_argument("--node-rank", type=_nonneg_int, help="this host's place among --nnodes (0 holds rank 0)")
    p.add_argument("--master-addr", help="rank 0's host, reachable from every host (with --nnodes)")
    p.add_argument("--master-port", type=_positive_int, help="a free port there for the rendezvous (default 29500 "
                   "with --nnodes)")


def _parallel_flags(p):
    _launch_flags(p)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="how much of the training state the ranks shard (less memory per GPU): 1 the AdamW moments "
                        "(the default of full training), 2 also the gradients, 3 also the weights (each layer "
                        "gathered as the passes reach it); 0 none (docs/multi-gpu.md)")


def _sampling_flags(p):
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")
    _adapter_flag(p)
    p.add_argument("--max-new-tokens", type=_nonneg_int, default=200,
                   help="tokens to generate at most; generation also stops at </s> (default 200)")
    p.add_argument("--temperature", type=_nonneg_float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=_nonneg_int, default=0, help="sample among the K likeliest (0: all)")
    p.add_argument("--top-p", type=_probability, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=_nonneg_int, default=None, help="for reproducible samples")
    p.add_argument("--speculative", action="store_true",
                   help="self-speculative decoding: heads 1..K-1 draft, one forward verifies (same output "
                        "distribution; greedy output identical)")
    p.add_argument("--stats", action="store_true", help="print tokens/s (and accepted drafts) on stderr")
    _device_flag(p, training=False)


def _invariance_flag(p):
    p.add_argument("--no-batch-invariance", action="store_true",
                   help="products of a few rows on cuBLAS / BLAS: faster batches, but a sequence's tokens may then "
                        "change with what else is decoded beside it, and --speculative's greedy output may differ "
                        "from plain greedy's (docs/decoding.md)")


def build_parser():
    parser = _Parser(prog="nanoeuler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"nanoeuler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="verify every backward pass against finite differences")
    p.add_argument("--gpu", action="store_true", help="check the GPU kernels against the CPU engine")
    p.add_argument("--seed", type=_nonneg_int, default=0, help="the random problems' seed (default 0)")
    p.add_argument("--samples", type=_positive_int, default=8, help="entries sampled per tensor")

    p = sub.add_parser("train", help="pretrain a model on a text corpus")
    p.add_argument("preset", nargs="?", choices=("small", "big", "base", "large"), default=None,
                   help="model size (default small; on --resume, the checkpoint's)")
    _device_flag(p)
    _training_flags(p)
    _parallel_flags(p)
    p.add_argument("--data", help="text corpus (default: shakespeare.txt; base, large: data/pretrain.txt)")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: learn one on the corpus)")
    p.add_argument("--ckpt", help="continue pretraining this checkpoint's weights (an import, a finished run) with "
                   "its model and tokenizer and a fresh optimizer; the preset gives the hyperparameters (default base)")
    _run_flags(p, "nanoeuler.bin", "sequences")

    p = sub.add_parser("infer", help="continue a prompt with a trained model")
    p.add_argument("prompt", help="text to continue (may be empty)")
    _sampling_flags(p)
    p.add_argument("--num-samples", type=_positive_int, default=1, metavar="N",
                   help="N samples of the prompt, decoded as one batch and printed one after the other; "
                        "sample i draws with --seed + i - 1, as choice i - 1 of a server request (default 1)")
    _invariance_flag(p)

    p = sub.add_parser("sft", help="fine-tune a pretrained model on instruction data (Alpaca)")
    _device_flag(p)
    _training_flags(p)
    _parallel_flags(p)
    p.add_argument("--data", help="Alpaca-style JSON list of {instruction, input, output} (default "
                   "data/alpaca.json)")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="pretrained checkpoint (default nanoeuler.bin)")
    _run_flags(p, "nanoeuler_chat.bin", "examples")
    p.add_argument("--val-examples", type=_positive_int,
                   help="examples held out for the validation loss (default a twentieth, at most 500)")
    p.add_argument("--long", choices=("truncate", "skip"),
                   help="examples longer than context + K tokens: cut to the window (default) or skip them")
    p.add_argument("--show", type=_positive_int, metavar="N",
                   help="print the first N examples as trained, supervised tokens marked, and exit")
    _lora_flags(p, adapter=True)

    p = sub.add_parser("dpo", help="preference-tune a chat model on chosen/rejected pairs (DPO)")
    _device_flag(p)
    _training_flags(p)
    p.add_argument("--data", help="JSONL of {prompt, chosen, rejected} (default data/preferences.jsonl)")
    p.add_argument("--ckpt", default="nanoeuler_chat.bin",
                   help="chat checkpoint to start from, also the reference model (default nanoeuler_chat.bin)")
    p.add_argument("--beta", type=_positive_float, help="DPO's beta: how far from the reference (default 0.1)")
    p.add_argument("--rpo-alpha", type=_nonneg_float,
                   help="weight of the chosen replies' NLL per token added to DPO (RPO; default 1; 0: plain DPO)")
    _run_flags(p, "nanoeuler_dpo.bin", "pairs")
    p.add_argument("--val-pairs", type=_positive_int,
                   help="pairs held out for the validation metrics (default a twentieth, at most 500)")
    _parallel_flags(p)
    _lora_flags(p)

    p = sub.add_parser("chat", help="interactive session with a trained model")
    _sampling_flags(p)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server and web chat page (pip install '.[serve]')")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--slots", type=_positive_int, default=None,
                   help="sequences decoded together in one batch, each a row of the KV cache (1 to 64; default 64, "
                        "fewer where 64 x 2048 positions do not fit the memory)")
    p.add_argument("--context", type=_positive_int, default=None,
                   help="positions a slot of the KV cache holds: a request's prompt and new tokens (default the "
                        "model's context, or the largest power of two, at least 2048, with which --slots fit the "
                        "free memory)")
    p.add_argument("--queue", type=_nonneg_int, default=256,
                   help="requests that may wait for a row; beyond that the server answers 429 (default 256)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on the API (401 otherwise)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let web pages from ORIGIN (or * for any) call the API; repeat for several")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default the checkpoint file's name without .bin)")
    p.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                   help="GPU memory the server may hold in all, weights included (e.g. 12GiB): the KV cache is sized "
                        "to it rather than to all the free memory")
    _adapter_flag(p)
    _invariance_flag(p)
    _device_flag(p, training=False)

    p = sub.add_parser("tokenizer", help="byte-level BPE: train one, encode, decode")
    tok = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = tok.add_parser("train", help="learn a tokenizer on a text file; writes a Hugging Face tokenizer.json")
    t.add_argument("file", help="text corpus")
    t.add_argument("--vocab-size", type=_positive_int, default=4096, help="tokens in all (default 4096)")
    t.add_argument("--out", default="tokenizer.json", help="output (default tokenizer.json)")
    t.add_argument("--sample-mb", type=_positive_int, default=128,
                   help="a larger corpus is sampled down to this many MiB (default 128)")
    for action, what in (("encode", "print the token ids of TEXT, --file or stdin"),
                         ("decode", "write the bytes of token ids (arguments or stdin) to stdout")):
        t = tok.add_parser(action, help=what)
        source = t.add_mutually_exclusive_group()
        source.add_argument("--ckpt", help="take the tokenizer from this checkpoint (default nanoeuler.bin)")
        source.add_argument("--tokenizer", help="take the tokenizer from this tokenizer.json")
        if action == "encode":
            t.add_argument("text", nargs="?", help="text to encode")
            t.add_argument("--file", help="encode this file's bytes instead")
            t.add_argument("--allow-special", action="store_true", help="turn special tokens like </s> into their ids")
        else:
            t.add_argument("ids", nargs="*", help="token ids")

    p = sub.add_parser("export", help="write a Hugging Face LlamaForCausalLM folder or a GGUF file (llama.cpp)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hf", metavar="DIR", help="output folder")
    where.add_argument("--gguf", metavar="FILE", help="output GGUF file, for llama.cpp, Ollama, LM Studio")
    where.add_argument("--peft", metavar="DIR", help="an adapter checkpoint's adapters as a PEFT LoRA folder, for the "
                       "base that --hf writes")
    p.add_argument("--merge", action="store_true",
                   help="an adapter checkpoint (sft/dpo --lora) is written merged into its base: implied, accepted")
    p.add_argument("--type", default="f16", choices=("f32", "f16", "bf16", "q8_0"),
                   help="GGUF weight type of the matrices (default f16; norms stay f32)")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")

    p = sub.add_parser("import", help="turn a Hugging Face LlamaForCausalLM (a folder or a Hub id) or a GGUF file into "
                       "a checkpoint")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR|ID", help="the folder (config.json, safetensors, tokenizer.json) "
                        "or a Hub id owner/name[@revision] (pip install 'nanoeuler[hub]'; HF_HUB_CACHE, HF_HUB_OFFLINE)")
    source.add_argument("--gguf", metavar="FILE", help="a llama.cpp GGUF file (llama or qwen2; F32/F16/BF16, Q8_0, "
                        "Q4_0/Q4_1, Q4_K, Q5_0/Q5_1/Q5_K, Q6_K tensors; pip install 'nanoeuler[gguf]')")
    p.add_argument("--out", required=True, help="checkpoint to write")
    p.add_argument("--context", type=_positive_int, help="context length (default: max_position_embeddings; GGUF: "
                   "context_length)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    _quantize_flags(p, "--quantize", required=False)

    p = sub.add_parser("quantize", help="a checkpoint's matrices to int8 or int4 (infer, chat, serve, eval, export)")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")
    p.add_argument("--out", required=True, help="quantized checkpoint to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    _quantize_flags(p, "--type", required=True)

    p = sub.add_parser("eval", help="score a checkpoint: HellaSwag, your own multiple-choice items, bits per byte")
    p.add_argument("--task", required=True, choices=("hellaswag", "mc", "bpb"),
                   help="hellaswag (data/hellaswag_val.jsonl), mc (--data: JSON lines {context, choices, label}) or "
                        "bpb (--data: any text file)")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")
    p.add_argument("--data", help="the items (hellaswag: default data/hellaswag_val.jsonl) or the text file (bpb)")
    p.add_argument("--limit", type=_positive_int, help="the first N items only (bpb: N batches)")
    p.add_argument("--batch-size", type=_positive_int, help="sequences per forward (default 32 on the CPU, 128 on "
                   "the GPU; bpb: a quarter)")
    p.add_argument("--json", metavar="FILE", help="write {task, n, acc, acc_norm, ...} here")
    p.add_argument("--predictions", metavar="FILE",
                   help="write one JSON line per item: {index, pred, pred_norm, logprobs}")
    p.add_argument("--chat", action="store_true",
                   help="a chat checkpoint: each context is an instruction in the chat template, each choice a reply")
    p.add_argument("--precision", choices=("bf16", "tf32", "fp32"), help="GPU arithmetic (default bf16)")
    _adapter_flag(p)
    _device_flag(p, training=False)
    _launch_flags(p)

    p = sub.add_parser("report", help="print the run report (<ckpt>.md) of a checkpoint")
    p.add_argument("--ckpt", default="nanoeuler.bin", help="checkpoint (default nanoeuler.bin)")

    document(parser, sub)  # descriptions, examples, the pipeline map (cli_help.py)
    return parser, sub


def _size(text):
    from nanoeuler.model.memory import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _quantize_flags(p, flag, required):
    """--type / --quantize int8|int4, --group and --head-type (docs/quantization.md)."""
    p.add_argument(flag, choices=("int8", "int4"), required=required, dest="quantize" if flag == "--quantize" else "type",
                   help="quantized weights: int8 (GGUF Q8_0 in groups of 32) or int4 (GGUF Q4_1 in groups of 32)")
    p.add_argument("--group", type=int, help="elements a scale along a row: a multiple of 32 (default 32; int8: 0 "
                   "for a scale per output channel)")
    p.add_argument("--head-type", choices=("int8", "int4"), help="the untied prediction heads' type (default int8: "
                   "the head carries most of int4's loss); of the layers' type it takes --group, else groups of 32 "
                   "(int8: GGUF Q8_0); a tied head stays float")


def _tokenizer_for(args):
    from nanoeuler.tokenizer.bpe import Tokenizer

    if args.tokenizer:
        return Tokenizer.load(args.tokenizer)
    from nanoeuler.io.checkpoint import read_tokenizer
    return read_tokenizer(args.ckpt or "nanoeuler.bin")


def tokenizer_command(args):
    """`nanoeuler tokenizer train|encode|decode`."""
    from nanoeuler.tokenizer.bpe import Tokenizer

    if args.action == "train":
        tok = Tokenizer.train(args.file, args.vocab_size, max_bytes=args.sample_mb << 20)
        tok.save_hf(args.out)
        print(f"wrote {args.out} (vocab {tok.vocab_size}, eos {tok.eos_id})", file=sys.stderr)
    elif args.action == "encode":
        if args.text is not None and args.file is not None:
            raise UserError("give TEXT or --file, not both")
        tok = _tokenizer_for(args)
        if args.text is not None:
            data = args.text.encode("utf-8", "surrogateescape")  # the argument's bytes, as the shell gave them
        elif args.file is not None:
            try:
                with open(args.file, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise UserError(f"cannot read {args.file}: {e.strerror or e}") from None
        else:
            data = sys.stdin.buffer.read()
        print(" ".join(map(str, tok.encode(data, allow_special=args.allow_special))))
    else:
        tok = _tokenizer_for(args)
        words = " ".join(args.ids).split() if args.ids else sys.stdin.read().split()
        try:
            ids = [int(w) for w in words]
        except ValueError:
            raise UserError("token ids must be integers") from None
        sys.stdout.buffer.write(tok.decode(ids, text_start=True))
        sys.stdout.buffer.flush()
    return 0


def report_command(args):
    """`nanoeuler report [--ckpt F]`: the checkpoint's run report (io/report.py)."""
    from nanoeuler.io.report import report_text

    print(report_text(args.ckpt))
    return 0


# the module whose main(args) runs each command, imported only when it runs
COMMANDS = {"check": "nanoeuler.check.gradients", "train": "nanoeuler.train.pretrain",
            "infer": "nanoeuler.infer.main", "sft": "nanoeuler.train.sft", "dpo": "nanoeuler.train.dpo",
            "chat": "nanoeuler.infer.chat", "serve": "nanoeuler.infer.serve", "export": "nanoeuler.io.export",
            "import": "nanoeuler.io.hf_import", "quantize": "nanoeuler.io.quantize",
            "eval": "nanoeuler.eval.main"}
OWN_COMMANDS = {"tokenizer": tokenizer_command, "report": report_command}  # the commands whose glue is here


def launch_nodes(args):
    """launch.Nodes when this command should start its own ranks (--gpus N > 1 or --nnodes, and no launcher's
    variables say this process is already one rank of a run); else None."""
    gpus, count = getattr(args, "gpus", None) or 1, getattr(args, "nnodes", None) or 1
    if gpus == 1 and count == 1:
        return None
    from nanoeuler.parallel.world import World
    if World.from_env().world_size > 1:
        return None  # a worker (of this launcher, torchrun, srun or mpirun): world.world_of checks --gpus against it
    from nanoeuler.parallel.launch import Nodes
    if count == 1:
        if args.node_rank:
            raise UserError("--node-rank needs --nnodes")
        return Nodes(master_port=args.master_port)
    if args.node_rank is None or args.node_rank >= count:
        raise UserError(f"--nnodes {count} needs --node-rank 0..{count - 1} (this host's place)")
    if not args.master_addr:
        raise UserError(f"--nnodes {count} needs --master-addr: the address of node rank 0's host, which every "
                        "host reaches")
    return Nodes(count, args.node_rank, args.master_addr, args.master_port or 29500)


RECOMPUTE_CHOICES = ("auto", "mlp", "products", "layer")


def bare_recompute(argv):
    """argv with a bare `--recompute` followed by a word that is not a mode (`train --recompute small`) written
    `--recompute=auto`: the flag alone means auto whatever word follows it (a preset is not a mode)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--recompute" and not out[i + 1].startswith("-") and out[i + 1] not in RECOMPUTE_CHOICES:
            out[i] = "--recompute=auto"
    return out


def main(argv=None):
    # Before any subcommand imports NumPy or numba (see nanoeuler/__init__.py for what and why).
    configure_cpu_runtime()
    parser, sub = build_parser()
    args = parser.parse_args(bare_recompute(sys.argv[1:] if argv is None else argv))
    try:
        nodes = launch_nodes(args)
        if nodes is not None:
            from nanoeuler.parallel.launch import launch_self  # the launcher; each worker it starts runs the command
            sys.exit(launch_self(args.gpus or 1, sys.argv[1:] if argv is None else list(argv), nodes))
        if args.command in OWN_COMMANDS:
            run = OWN_COMMANDS[args.command]
        else:
            run = importlib.import_module(COMMANDS[args.command]).main
        status = run(args)
    except ENDINGS as e:  # one line and exit 2, 130 on Ctrl-C, 141 on a closed pipe (errors.exit_status)
        sys.exit(exit_status(e))
    sys.exit(status or 0)
