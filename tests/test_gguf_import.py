"""`nanoeuler import --gguf FILE`: our own exports read back (f32, f16, q8_0, int8 and int4 checkpoints: the same
values and bits), files of llama.cpp's K-quant types written with the gguf package (Q4_K and Q6_K blocks packed
here, as the package quantizes neither) checked against the gguf package's dequantization and against
transformers' `from_pretrained(gguf_file=...)` on the same file, and bad files refused in one line with nothing
written. tests/test_gguf_llamacpp.py reads the tokenizer families back (ids equal to their tokenizer.json's)."""
import dataclasses
from unittest import mock

import gguf
import numpy as np
import pytest

from conftest import run_cli
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.io import gguf as export
from nanoeuler.io.gguf_import import load_gguf, q4_k_parts
from nanoeuler.model.config import Config, param_layout, quant_format, quantized_names, views
from nanoeuler.model.engine import make_engine
from nanoeuler.model.quantize import dequantize, quantize

T = gguf.GGMLQuantizationType
# rows of 256 (the K types' super-blocks): dim 256, hidden 512, heads of 64
CFG = dict(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, hidden=512, context=64, mtp_heads=1, rope_theta=10000.0,
           norm_eps=1e-5)


def pack_q4_k(x):
    """Q4_K blocks (n, 144) of x (n, 256): a plain quantizer (not llama.cpp's search), the bytes in its layout."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, minimum = (hi - lo) / 15, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (minimum.max(-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d.astype(np.float32))).clip(0, 63).astype(np.uint8)
        m = np.nan_to_num(np.round(minimum / dmin.astype(np.float32))).clip(0, 63).astype(np.uint8)
        s = d.astype(np.float32) * sc
        q = np.nan_to_num(np.round((sub + (dmin.astype(np.float32) * m)[..., None]) / s[..., None]))
    q = q.clip(0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # chunk j: sub-block 2j low, 2j + 1 high
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=-1)


def pack_q6_k(x):
    """Q6_K blocks (n, 210) of x (n, 256): ql, qh, 16 int8 scales, d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d.astype(np.float32))).clip(-128, 127).astype(np.int8)
        q = np.nan_to_num(np.round(sub / (d.astype(np.float32) * sc)[..., None]))
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    low, high = (q & 15).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=-1)


def random_q5_k(x):
    """Q5_K blocks (n, 176) of random bytes (any bytes are a block), d and dmin set to 2^-10: not x's values."""
    b = np.random.default_rng(x.shape[0]).integers(0, 256, (x.shape[0], 176), dtype=np.uint8)
    b[:, 0:4] = np.array([2.0 ** -10] * 2, np.float16).view(np.uint8)
    return b


PACKERS = {"Q4_K": pack_q4_k, "Q6_K": pack_q6_k, "Q5_K": random_q5_k}


def blocks(array, kind):
    """(data, raw dtype) of a float32 matrix stored as GGUF type `kind`."""
    if kind == "F16":
        return array.astype(np.float16), None
    if kind == "F32":
        return array, None
    if kind in PACKERS:
        O, I = array.shape
        return PACKERS[kind](array.reshape(-1, 256)).reshape(O, -1), getattr(T, kind)
    return gguf.quants.quantize(array, getattr(T, kind)), getattr(T, kind)


def write_typed(path, cfg, params, tok, type_of):
    """export --gguf's file of the float model, each matrix stored as type_of(gguf name) (None: f32)."""
    tensors = export.gguf_tensors(cfg, params)
    names = {id(a): n for n, a in tensors.items()}

    def stored(g, array, kind):
        t = type_of(names[id(array)]) if array.ndim == 2 else None
        return blocks(array, t) if t else (array, None)

    with mock.patch.object(export, "gguf_tensors", lambda *a: tensors), mock.patch.object(export, "_stored", stored):
        export.write_gguf(path, cfg, params, tok, "f32")


def q4_k_m(name):
    """llama.cpp's Q4_K_M mix: Q6_K for the output and (here) every attn_v and ffn_down, the rest Q4_K."""
    return "Q6_K" if name == "output.weight" or "attn_v" in name or "ffn_down" in name else "Q4_K"


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = Config(**CFG, vocab_size=tokenizer.vocab_size)
    flat = np.empty(param_layout(cfg)[1], np.float32)
    rng = np.random.default_rng(3)
    for name, view in views(flat, cfg).items():
        view[...] = rng.normal(1 if name.endswith("norm") else 0, 0.2, view.shape)
    return cfg, flat


def gguf_values(path, cfg):
    """{our name: float32} of a GGUF file as llama.cpp computes with it (the gguf package's dequantization), in our
    row order."""
    return views(export.read_params(str(path), cfg, np.zeros(param_layout(cfg)[1], np.float32)), cfg)


def engine_logits(cfg, params, quantized, tokens):
    eng = make_engine(cfg, training=False)
    eng.load_params(params, quantized)
    return eng.logits(tokens)


TOKENS = np.random.default_rng(0).integers(0, 250, (2, 16))


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_float_checkpoint_round_trip(model, tokenizer, tmp_path, kind):
    """export --gguf then import --gguf: f32 the same floats, f16 the float16-rounded ones, q8_0 the int8 checkpoint
    that `quantize --type int8` makes of the model, bit for bit (Q8_0 is our int8 in groups of 32)."""
    cfg, flat = model
    path = tmp_path / "m.gguf"
    export.write_gguf(path, cfg, flat, tokenizer, kind)
    got_cfg, params, tok, note, _ = load_gguf(path)
    assert note is None and tok.to_json() == tokenizer.to_json()
    v = views(flat, cfg)
    if kind == "q8_0":
        assert got_cfg == dataclasses.replace(cfg, quant="int8", quant_group=32, architecture="LlamaForCausalLM")
        floats, quantized = params
        for name in quantized_names(got_cfg):
            want = quantize(v[name], "int8", 32)
            assert np.array_equal(quantized[name].q, want.q) and np.array_equal(quantized[name].scales, want.scales)
        for name, view in views(floats, got_cfg, floats_only=True).items():  # Q8_0 embedding, f32 norms
            assert np.array_equal(view, v[name] if view.ndim == 1 else dequantize(quantize(v[name], "int8"))), name
    else:
        assert got_cfg == dataclasses.replace(cfg, architecture="LlamaForCausalLM")
        for name, view in views(params, cfg).items():
            expect = v[name] if kind == "f32" or view.ndim == 1 else v[name].astype(np.float16).astype(np.float32)
            assert np.array_equal(view, expect), name


@pytest.mark.parametrize("kind, group", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_quantized_checkpoint_round_trip(model, tokenizer, tmp_path, kind, group):
    """A quantized checkpoint exported (int8 / int4 in groups of 32: Q8_0 / Q4_1, copied) and imported is the same
    checkpoint bit for bit, and the CPU engine's logits are equal; int4 in groups of 64 goes out as f32 (exact
    values) and comes back as int4 in groups of 32 (--quantize int4), within int4's error."""
    cfg, flat = model
    v = views(flat, cfg)
    qcfg = dataclasses.replace(cfg, quant=kind, quant_group=group, architecture="LlamaForCausalLM")
    quantized = {name: quantize(v[name], kind, group) for name in quantized_names(qcfg)}
    floats = np.concatenate([v[name].reshape(-1) for name in param_layout(qcfg, floats_only=True)[0]])
    ckpt, path = tmp_path / "q.bin", tmp_path / "q.gguf"
    checkpoint.save(ckpt, qcfg, floats, tokenizer.to_json(), step=0, quantized=quantized)
    r = run_cli("export", "--gguf", path, "--ckpt", ckpt, "--type", "f32")
    assert r.returncode == 0, r.stderr
    if group != 32:
        got_cfg, (got_floats, got), _, _, _ = load_gguf(path, quant="int4")
        assert got_cfg == dataclasses.replace(qcfg, quant_group=32, quant_head="int8", quant_head_group=32)
        for name, qt in got.items():
            error = np.abs(dequantize(qt) - dequantize(quantized[name])).max()
            assert error <= 0.6 * qt.scales.astype(np.float32).max()
        return
    out = tmp_path / "back.bin"
    r = run_cli("import", "--gguf", path, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "GGUF tensors" in r.stdout and f"quantized to {kind}" in r.stdout
    ck = checkpoint.load(out)
    assert ck.cfg == qcfg and np.array_equal(ck.params, floats)
    for name, qt in quantized.items():
        for a, b in zip(qt.arrays().values(), ck.quantized[name].arrays().values()):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert np.array_equal(engine_logits(ck.cfg, ck.params, ck.quantized, TOKENS),
                          engine_logits(qcfg, floats, quantized, TOKENS))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_exact_types_are_llama_cpps_values_bit_for_bit(model, tokenizer, tmp_path, kind):
    """Q8_0 -> int8, Q4_0 and Q4_1 -> int4 (groups of 32): every dequantized weight equals the gguf package's
    (llama.cpp's) float32 value bit for bit, F16 embedding and F32 norms as they are."""
    cfg, flat = model
    path = tmp_path / "m.gguf"
    write_typed(path, cfg, flat, tokenizer, lambda name: "F16" if name == "token_embd.weight" else kind)
    got_cfg, (floats, quantized), _, note, _ = load_gguf(path)
    assert note is None and got_cfg.quant == ("int8" if kind == "Q8_0" else "int4")
    want = gguf_values(path, cfg)
    for name, qt in quantized.items():
        assert np.array_equal(dequantize(qt), want[name]), name
    for name, view in views(floats, got_cfg, floats_only=True).items():
        assert np.array_equal(view, want[name]), name


@pytest.mark.parametrize("kind, quant", [("Q5_0", None), ("Q5_1", "int4"), ("Q5_K", None), ("F16", "int4"),
                                         ("BF16", "int8")])
def test_other_types_are_their_values_quantized(model, tokenizer, tmp_path, kind, quant):
    """Q5_0, Q5_1 and Q5_K (as Q6_K) become int8 in groups of 32 (or --quantize's type): exactly what quantizing
    llama.cpp's float32 values gives; F16 and BF16 matrices with --quantize are quantized as `import --hf
    --quantize` does."""
    cfg, flat = model
    path = tmp_path / "m.gguf"
    write_typed(path, cfg, flat, tokenizer, lambda name: kind)
    got_cfg, (floats, quantized), _, _, _ = load_gguf(path, quant=quant)
    assert got_cfg.quant == (quant or "int8") and got_cfg.quant_group == 32
    want = gguf_values(path, cfg)
    for name, qt in quantized.items():
        expect = quantize(want[name], *quant_format(got_cfg, name))  # --quantize int4: the head int8
        for a, b in zip(qt.arrays().values(), expect.arrays().values()):
            assert np.array_equal(a, b), name
    assert np.array_equal(views(floats, got_cfg, floats_only=True)["tok_emb"], want["tok_emb"])


def test_q4_k_keeps_its_q_and_rounds_its_scales(model, tokenizer, tmp_path):
    """Q4_K -> int4 in groups of 32: the q are Q4_K's, each sub-block's scale and minimum llama.cpp's float32 ones
    rounded to float16, so a weight moves by at most 15 half-steps of its scale's float16 plus one of its
    minimum's; the packer above and the import's reading agree with the gguf package's dequantization."""
    cfg, flat = model
    path = tmp_path / "m.gguf"
    write_typed(path, cfg, flat, tokenizer, lambda name: "Q4_K")
    f = gguf.GGUFReader(path)
    t = next(t for t in f.tensors if t.name == "blk.0.ffn_up.weight")
    q, scales, mins = q4_k_parts(np.asarray(t.data).reshape(t.data.shape[0], -1, 144))
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.array_equal((q.reshape(q.shape[0], -1, 32) * scales[..., None] + mins[..., None]).reshape(values.shape),
                          values)
    assert np.abs(values - views(flat, cfg)["layers.0.w_up"]).max() < 0.1  # the packer quantizes the model
    got_cfg, (_, quantized), _, note, _ = load_gguf(path)
    assert got_cfg.quant == "int4" and "Q4_K" in note
    want = gguf_values(path, cfg)
    for name, qt in quantized.items():
        # a float16 step (at most 2^-10 of the value, the subnormal step below 6.1e-5) each, and the two float32
        # roundings of the sums
        ulp = lambda a: np.abs(np.spacing(a.astype(np.float16)).astype(np.float32))[..., None]
        values = want[name].reshape(*qt.scales.shape, 32)
        bound = 15 * ulp(qt.scales) + ulp(qt.mins) + 2 * np.spacing(np.abs(values))
        assert (np.abs(dequantize(qt).reshape(values.shape) - values) <= bound).all(), name


def test_q4_k_m_file_against_transformers(model, tokenizer, tmp_path, torch, transformers):
    """A Q4_K_M-shaped file (Q4_K, Q6_K for the output, attn_v and ffn_down, a Q4_K embedding, F32 norms):
    imported as one int8 checkpoint by default and as int4 with --quantize int4; transformers' model of the same
    file (which dequantizes it) gives logits within the requantization's error of ours, and those of the exact
    dequantized weights (float_params of a float import of the values) equal to its own."""
    cfg, flat = model
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = folder / "m.gguf"
    write_typed(path, cfg, flat, tokenizer, q4_k_m)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.numpy()
    exact = gguf_values(path, cfg)
    exact_flat = np.concatenate([exact[name].reshape(-1) for name in param_layout(cfg)[0]])
    ref = engine_logits(cfg, exact_flat, None, TOKENS)
    assert np.abs(ref - theirs).max() < 1e-4 * np.abs(theirs).max()
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))
    file_error = rms(theirs - engine_logits(cfg, flat, None, TOKENS))  # what the file's quantization costs
    for quant, share in ((None, 0.15), ("int4", 0.6)):
        got_cfg, (floats, quantized), _, note, kinds = load_gguf(path, quant=quant)
        assert got_cfg.quant == (quant or "int8") and "Q4_K" in kinds and "Q6_K" in kinds
        assert np.array_equal(views(floats, got_cfg, floats_only=True)["tok_emb"], exact["tok_emb"])
        # int8: Q6_K's and Q4_K's values requantized (measured: 8% of the file's own deviation from the float
        # model); int4: Q4_K's q kept, the Q6_K tensors down to 4 bits (40%)
        assert rms(engine_logits(got_cfg, floats, quantized, TOKENS) - theirs) < share * file_error, quant


def test_cli_mixed_file_and_its_note(model, tokenizer, tmp_path):
    cfg, flat = model
    path, out = tmp_path / "m.gguf", tmp_path / "m.bin"
    write_typed(path, cfg, flat, tokenizer, q4_k_m)
    r = run_cli("import", "--gguf", path, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "mix Q4_K, Q6_K" in r.stderr and "int8" in r.stderr
    ck = checkpoint.load(out)
    assert ck.cfg.quant == "int8" and ck.tokenizer().to_json() == tokenizer.to_json()
    r = run_cli("infer", "ROMEO:", "--ckpt", out, "--temperature", "0", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


def _write_raw(path, arch, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_files_one_line_nothing_written(model, tokenizer, tmp_path):
    cfg, flat = model
    good = tmp_path / "good.gguf"
    export.write_gguf(good, cfg, flat, tokenizer, "f16")
    data = good.read_bytes()
    truncated, header_only, gemma, iq = (tmp_path / n for n in ("cut.gguf", "head.gguf", "gemma.gguf", "iq.gguf"))
    truncated.write_bytes(data[:len(data) * 2 // 3])
    header_only.write_bytes(data[:200])
    _write_raw(gemma, "gemma", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    size = gguf.GGML_QUANT_SIZES[T.IQ2_XS]
    write_typed(iq, cfg, flat, tokenizer, lambda name: "Q8_0")
    zeros = lambda a: np.zeros((a.shape[0], a.shape[1] // size[0] * size[1]), np.uint8)
    with mock.patch.object(export, "_stored", lambda g, a, k: (zeros(a), T.IQ2_XS) if a.ndim == 2 else (a, None)):
        export.write_gguf(iq, cfg, flat, tokenizer, "f32")
    tekken = tmp_path / "tekken.gguf"  # a pre-tokenizer whose split nanoeuler does not have (Mistral Nemo's)
    with mock.patch.dict(export.GGUF_PRE, {tokenizer.rule: "tekken"}):
        export.write_gguf(tekken, cfg, flat, tokenizer, "f16")
    cases = {truncated: "truncated or corrupt", header_only: "truncated or corrupt", tekken: "pre-tokenizer 'tekken'",
             gemma: "architecture 'gemma'", iq: "tensor type IQ2_XS", tmp_path / "none.gguf": "not found"}
    for path, message in cases.items():
        out = tmp_path / "out.bin"
        r = run_cli("import", "--gguf", path, "--out", out)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (path, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    r = run_cli("import", "--gguf", good, "--hf", tmp_path, "--out", tmp_path / "x.bin")
    assert r.returncode == 2 and "not allowed with" in r.stderr
    with pytest.raises(UserError, match="--group goes with --quantize"):
        load_gguf(good, group=64)


def test_q8_0_file_comes_back_byte_for_byte(model, tokenizer, tmp_path):
    """A Q8_0 file imported and exported again (--type q8_0) has the same tensors, byte for byte: the matrices'
    blocks are copied both ways, and the embedding, dequantized to float32 on import, quantizes back to its
    own blocks (its scale is its largest value / 127, which that value's q of 127 gives back)."""
    cfg, flat = model
    first, ckpt, second = tmp_path / "a.gguf", tmp_path / "a.bin", tmp_path / "b.gguf"
    export.write_gguf(first, cfg, flat, tokenizer, "q8_0")
    r = run_cli("import", "--gguf", first, "--out", ckpt)
    assert r.returncode == 0, r.stderr
    r = run_cli("export", "--gguf", second, "--ckpt", ckpt, "--type", "q8_0")
    assert r.returncode == 0, r.stderr
    a, b = ({t.name: (t.tensor_type, bytes(t.data)) for t in gguf.GGUFReader(p).tensors} for p in (first, second))
    assert a == b
