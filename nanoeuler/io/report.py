"""Run reports: the page a person reads about a trained checkpoint. `nanoeuler train|sft|dpo` write `<out>.md`
beside the checkpoint at each checkpoint and at the end; `nanoeuler report [--ckpt F]` prints it (cli.py); `nanoeuler
export --hf` makes the model card (README.md) from it.

    write_report("nanoeuler.bin")          # after checkpoint.save: nanoeuler.md, atomically
    print(report_text("nanoeuler.bin"))    # the .md when it is there, else built now

Everything in it comes from the checkpoint (its config, step and training state: the stage, preset, data,
hyperparameters, precision, device, command line and the last sample) and from its metrics log up to the
checkpoint's step (tokens, wall time, tokens/s, MFU, validation loss and bits per byte, eval-task scores), so
a report can always be rebuilt from those two files.
"""
import json
import os
import platform
import shlex

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.io import checkpoint
from nanoeuler.model.config import Config, param_count

COMMANDS = {"pretrain": "nanoeuler train", "sft": "nanoeuler sft", "dpo": "nanoeuler dpo"}


def report_path(ckpt):
    return os.path.splitext(os.fspath(ckpt))[0] + ".md"


def machine(device):
    """The device in words, for the report: the GPU's name, or the CPU's model and core count."""
    if device == "gpu":
        import cupy
        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def read_log(path, last_step):
    """The metrics records of steps up to last_step (a later run may have gone on); [] without a log."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if isinstance(record, dict) and record.get("step", last_step + 1) <= last_step:
                    records.append(record)
    except OSError:
        pass
    return records


def _file_facts(path):
    """'path (N bytes)' where the file is still there."""
    if path and os.path.isfile(path):
        return f"`{path}` ({os.path.getsize(path):,} bytes)"
    return f"`{path}` (not found now)" if path else "unknown"


def _corpus_tokens(path, tok):
    """(all tokens, training tokens) of a pretraining corpus from its token cache when it is current, else None."""
    from nanoeuler.data.corpus import Corpus, cached_tokens
    tokens = cached_tokens(path, tok)
    if tokens is None:
        return None
    byte_len = np.array([len(tok.decode([i])) for i in range(tok.vocab_size)], dtype=np.int64)
    return len(tokens), len(Corpus(tokens, byte_len, os.path.getsize(path)).train)


def _duration(seconds):
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h} h {rest // 60} min" if h else f"{rest // 60} min {rest % 60} s" if rest >= 60 else f"{seconds:.1f} s"


def loss_curve(ckpt, state):
    """The PNG beside the checkpoint's metrics log, when it is there."""
    log_path = state.get("log") or os.path.splitext(ckpt)[0] + ".jsonl"
    png = os.path.splitext(log_path)[0] + ".png"
    return png if state and os.path.isfile(png) else None


def build_report(ckpt):
    """The report's markdown for a checkpoint, from it and its metrics log."""
    ckpt = os.fspath(ckpt)
    meta = checkpoint.read_metadata(ckpt)
    try:
        cfg, step = Config.from_json(meta["config"]), int(meta["step"])
        state = json.loads(meta.get("train") or "{}")
    except (KeyError, ValueError, TypeError):
        raise UserError(f"checkpoint {ckpt} is corrupt (unreadable config or training state)") from None
    kind, hyper = state.get("kind"), state.get("hyper") or {}
    log_path = state.get("log") or os.path.splitext(ckpt)[0] + ".jsonl"
    records = read_log(log_path, step)
    name = os.path.basename(ckpt)
    what = {"pretrain": f"pretrained {state.get('preset', '')} model", "sft": "chat model (supervised fine-tuning)",
            "dpo": "chat model (DPO)"}.get(kind, "model (no training state: an import or an export)")
    lines = [f"# {name}: nanoeuler {what}", ""]

    lines += ["## Model", "",
              f"- {param_count(cfg):,} parameters: dim {cfg.dim}, {cfg.n_layers} layers, "
              f"{cfg.n_heads}/{cfg.n_kv_heads} query/key-value heads, SwiGLU hidden {cfg.hidden}, context "
              f"{cfg.context}, vocabulary {cfg.vocab_size}, {cfg.mtp_heads} prediction "
              f"head{'s' * (cfg.mtp_heads != 1)}{' (tied to the embedding)' if cfg.tied else ''}",
              f"- step {step}, {'chat template' if meta.get('chat') == '1' else 'plain text'}", ""]
    if not state:
        return "\n".join(lines)

    data = state.get("data")
    lines += ["## Data", "", f"- file: {_file_facts(data)}"]
    if state.get("base"):
        lines.append(f"- started from: {_file_facts(state['base'])}")
    seen = records[-1].get("tokens_seen") if records else None
    if kind == "pretrain" and data and os.path.isfile(data):
        counts = _corpus_tokens(data, checkpoint.read_tokenizer(ckpt))
        if counts:
            total, train = counts
            epochs = f", {seen / train:.2f} epochs of the training split" if seen else ""
            lines.append(f"- {total:,} tokens, {train:,} of them for training (the last tenth held out){epochs}")
    lines.append("")

    lines += ["## Training", ""]
    if state.get("argv"):
        lines.append(f"- command: `nanoeuler {shlex.join(state['argv'])}`")
    if hyper:
        batch = hyper.get("batch_size", 0) * hyper.get("grad_accum", 1) * state.get("world_size", 1)
        lines.append(f"- {step:,} of {hyper.get('steps', step):,} steps, {batch} sequences a step, peak lr "
                     f"{hyper.get('lr', 0):g}, warmup {hyper.get('warmup', 0)}, seed {hyper.get('seed', 0)}")
    if seen:
        lines.append(f"- {seen:,} tokens")
    if records and "time_s" in records[-1]:
        wall = records[-1]["time_s"]
        rate = f", {seen / wall:,.0f} tokens/s" if seen and wall else ""
        lines.append(f"- wall time {_duration(wall)}{rate}")
    mfus = [r["mfu"] for r in records if "mfu" in r]
    if mfus:
        lines.append(f"- MFU {sum(mfus) / len(mfus):.1%} (mean over steps)")
    lines.append(f"- {state.get('precision', 'fp32')} on {state.get('machine') or state.get('device', 'unknown')}"
                 + (f", {state['world_size']} ranks" if state.get("world_size", 1) > 1 else ""))
    lines.append("")

    lines += ["## Results", ""]
    final = next((r for r in reversed(records) if "val_loss" in r), None)
    if final is None:
        lines.append("- no validation record in the log" + ("" if records else f" (no log at `{log_path}`)"))
    elif "val_bpb" in final:
        lines.append(f"- validation loss {final['val_loss']:.4f} nats/token, {final['val_bpb']:.4f} bits/byte "
                     f"(step {final['step']})")
    else:
        lines.append(f"- validation DPO loss {final['val_loss']:.4f}, reward accuracy "
                     f"{final.get('val_reward_accuracy', float('nan')):.1%}, margin "
                     f"{final.get('val_reward_margin', float('nan')):.3f} (step {final['step']})")
    scored = next((r for r in reversed(records) if "eval_acc" in r), None)
    if scored:
        lines.append(f"- {scored['eval_task']} ({scored['eval_n']} items): acc {scored['eval_acc']:.4f}, acc_norm "
                     f"{scored['eval_acc_norm']:.4f}, chance {scored['eval_chance']:.4f} (step {scored['step']})")
    png = loss_curve(ckpt, state)
    if png:
        lines += ["", f"![loss curve]({os.path.relpath(png, os.path.dirname(os.path.abspath(ckpt)))})"]
    lines.append("")

    if state.get("sample") is not None:
        lines += ["## Sample", "", f"At step {state.get('sample_step', step)}:", "", "```text", state["sample"], "```",
                  ""]

    command = COMMANDS.get(kind)
    if command:
        out = shlex.quote(ckpt)
        log = f" --log {shlex.quote(log_path)}" if state.get("log") else ""  # set only when not beside the checkpoint
        total = hyper.get("steps", step)
        more = "" if step < total else f" --steps {2 * total}"
        lines += ["## Resume", "", "```sh", f"{command} --resume --out {out}{log}{more}", "```",
                  f"continues from step {step}" + (f" to step {total}" if step < total else
                                                   f" (it finished its {total} steps: --steps sets the new end)"), ""]
    return "\n".join(lines)


def write_report(ckpt):
    """Write `<ckpt without extension>.md` atomically."""
    text = build_report(ckpt)
    atomic_write(report_path(ckpt), lambda f: f.write(text), mode="w")
    return text


def model_card(ckpt, out_dir, chat):
    """README.md for `export --hf`: Hugging Face's front matter, how to load the folder, then the run report,
    its loss curve copied into the folder as loss_curve.png."""
    import shutil
    report = build_report(ckpt)
    meta = checkpoint.read_metadata(ckpt)
    png = loss_curve(ckpt, json.loads(meta.get("train") or "{}"))
    if png:
        shutil.copyfile(png, os.path.join(out_dir, "loss_curve.png"))
        report = "\n".join("![loss curve](loss_curve.png)" if line.startswith("![loss curve](") else line
                           for line in report.split("\n"))
    chat_use = ("\n\nA chat model: `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders the "
                "conversation in the template it was fine-tuned on." if chat else "")
    return ("---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [nanoeuler, llama]\n---\n\n"
            + report.replace("# ", "# Model card: ", 1).split("\n", 1)[0] + "\n\n"
            "A model trained from scratch with nanoeuler and exported as a Llama "
            "(`LlamaForCausalLM`, head 0 of its prediction heads as `lm_head`):\n\n```python\n"
            "from transformers import AutoTokenizer, LlamaForCausalLM\n"
            "model = LlamaForCausalLM.from_pretrained(\"DIR\")\ntokenizer = AutoTokenizer.from_pretrained(\"DIR\")\n```"
            + chat_use + "\n" + report.split("\n", 1)[1])


def report_text(ckpt):
    """The checkpoint's report: its .md when it is there and at least as new as the checkpoint, else built."""
    path = report_path(ckpt)
    if os.path.isfile(path) and os.path.isfile(ckpt) and os.path.getmtime(path) >= os.path.getmtime(ckpt):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return build_report(ckpt)
