"""`nanoeuler import --gguf` on a ~125M-parameter model: the time and peak memory of the import of an F16, a Q8_0
and a Q4_K_M-shaped file, and what each GGUF type's mapping onto our int8 / int4 costs, measured on the weights.

    python benchmarks/gguf_import.py            # docs/import.md, Measurements

The model is random (weights N(0, 0.02), as a trained model's are in scale; a trained model's outliers are not
reproduced), Llama 2's layout at 125M: dim 768, 12 layers, 12/4 heads, SwiGLU 2048, vocabulary 32,000, untied
(the output Q6_K, as Q4_K_M has it). Its files are written as tests/test_gguf_import.py writes them: `export
--gguf` for F16 and Q8_0; Q4_K (and Q6_K for the output, every attn_v and ffn_down) packed there, for the
Q4_K_M mix. Each import runs in a fresh process; its peak resident set is VmHWM. The errors: RMS over every
matrix of one type of (the file's values - the float weights), what the file's own quantization costs, and of
(our checkpoint's values - the file's), what the import adds; and the head-0 logits of 64 tokens likewise.
"""
import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from nanoeuler.io import gguf as export  # noqa: E402
from nanoeuler.io.gguf_import import load_gguf  # noqa: E402
from nanoeuler.model.config import Config, param_count, param_layout, views  # noqa: E402
from nanoeuler.model.quantize import dequantize, quantize  # noqa: E402
from nanoeuler.tokenizer.bpe import Tokenizer  # noqa: E402
from repo_env import repo_env  # noqa: E402
from test_gguf_import import engine_logits, gguf_values, q4_k_m, write_typed  # noqa: E402

CFG = Config(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden=2048, vocab_size=32000, context=2048,
             mtp_heads=1, rope_theta=10000.0, norm_eps=1e-5)
# the peak resident set of the process since its exec (VmHWM: ru_maxrss would count this big parent's pages at fork)
HWM = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024"
PEAK = f"""import atexit, sys
atexit.register(lambda: print("peak", {HWM}))
from nanoeuler.cli import main
main(["import", "--gguf", sys.argv[1], "--out", sys.argv[2], "--overwrite"] + sys.argv[3:])
"""
BARE = (f"import numpy, numba, gguf, nanoeuler.io.hf_import, nanoeuler.io.gguf_import, nanoeuler.io.checkpoint\n"
        f"print({HWM})")


def run_import(path, out, *flags):
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK, str(path), str(out), *flags], capture_output=True, text=True,
                       cwd=ROOT, env=repo_env())
    assert r.returncode == 0, r.stderr
    return time.perf_counter() - start, int(r.stdout.split()[-1])


def rms(a):
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where the files go (default: a temporary folder)")
    args = parser.parse_args()
    folder = pathlib.Path(args.dir or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.train(str(ROOT / "shakespeare.txt"), 512, progress=False, max_bytes=1 << 20)
    rng = np.random.default_rng(0)
    flat = np.empty(param_layout(CFG)[1], np.float32)
    for name, view in views(flat, CFG).items():
        view[...] = 1 if name.endswith("norm") else rng.normal(0, 0.02, view.shape)
    files = {"F16": folder / "m-f16.gguf", "Q8_0": folder / "m-q8_0.gguf", "Q4_K_M": folder / "m-q4_k_m.gguf"}
    export.write_gguf(files["F16"], CFG, flat, tok, "f16")
    export.write_gguf(files["Q8_0"], CFG, flat, tok, "q8_0")
    write_typed(files["Q4_K_M"], CFG, flat, tok, q4_k_m)
    bare = int(subprocess.run([sys.executable, "-c", BARE], capture_output=True, text=True, check=True, cwd=ROOT,
                              env=repo_env()).stdout)
    fp32 = 4 * param_count(CFG)
    print(f"{param_count(CFG) / 1e6:.1f}M parameters ({fp32 / 2**20:.0f} MiB in float32); a bare interpreter with "
          f"the import's modules: {bare / 2**20:.0f} MiB")
    print("| file | size | flags | import time | peak RSS (above the bare interpreter) | checkpoint |")
    for kind, path in files.items():
        for flags in ([], ["--quantize", "int4"]) if kind == "Q4_K_M" else ([],):
            out = folder / f"{path.stem}{''.join(flags[1:])}.bin"
            seconds, peak = run_import(path, out, *flags)
            print(f"| {kind} | {path.stat().st_size / 2**20:.0f} MiB | {' '.join(flags) or '-'} | {seconds:.1f} s | "
                  f"{peak / 2**20:.0f} MiB ({(peak - bare) / 2**20:.0f} MiB, {(peak - bare) / fp32:.2f}x float32) | "
                  f"{out.stat().st_size / 2**20:.0f} MiB |")

    # errors: by GGUF type, what the file costs and what the import adds
    exact = gguf_values(files["Q4_K_M"], CFG)
    float_views = views(flat, CFG)
    tokens = np.random.default_rng(1).integers(0, tok.vocab_size, (1, 64))
    exact_flat = np.concatenate([exact[n].reshape(-1) for n in param_layout(CFG)[0]])
    reference = engine_logits(CFG, flat, None, tokens)
    file_logits = engine_logits(CFG, exact_flat, None, tokens)
    print(f"Q4_K_M file: logits RMS against the float model {rms(file_logits - reference):.4g}")
    print("| GGUF type | ours | RMS (file - float) | RMS (ours - file) | ratio | "
          "logits RMS (ours - file) / (file - float) |")
    for quant in ("int8", "int4"):
        cfg, (floats, quantized), _, note, _ = load_gguf(files["Q4_K_M"], quant=quant)
        ours = engine_logits(cfg, floats, quantized, tokens)
        logit_ratio = rms(ours - file_logits) / rms(file_logits - reference)
        for kind in ("Q4_K", "Q6_K"):
            names = [n for n in quantized if q4_k_m(export_name(n)) == kind]
            file_err = rms(np.concatenate([(exact[n] - float_views[n]).reshape(-1) for n in names]))
            ours_err = rms(np.concatenate([(dequantize(quantized[n]) - exact[n]).reshape(-1) for n in names]))
            print(f"| {kind} | {quant} | {file_err:.4g} | {ours_err:.4g} | {ours_err / file_err:.3f} | "
                  f"{logit_ratio:.3f} (all types together) |")
        if note:
            print(f"note: {note}")
    # each type alone on the first layer's matrices: the file's error and what int8 (the default) adds
    from test_gguf_import import blocks
    import gguf
    print("| GGUF type | RMS (file - float) | int8 from it: RMS (ours - file) | ratio |")
    matrices = [float_views[f"layers.0.{m}"] for m in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    for kind in ("Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0"):
        file_err, ours_err = [], []
        for w in matrices:
            data, qtype = blocks(w, kind)
            values = gguf.quants.dequantize(data, qtype)
            file_err.append((values - w).reshape(-1))
            ours_err.append((dequantize(quantize(values, "int8", 32)) - values).reshape(-1))
        a, b = rms(np.concatenate(file_err)), rms(np.concatenate(ours_err))
        print(f"| {kind} | {a:.4g} | {b:.4g} | {b / a:.3f} |")


def export_name(ours):
    """The GGUF name of one of our matrices (q4_k_m decides by it)."""
    return {v: k for k, v in export.gguf_names(CFG).items()}[ours]


if __name__ == "__main__":
    main()
