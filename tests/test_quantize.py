"""Quantized weights (model/quantize.py, docs/quantization.md): the formats against GGUF's own quantizers, exact
dequantization on both paths, the checkpoint's quantized tensors read back bit for bit, the CPU engine on them,
`quantize`, `import --quantize`, `export --gguf`'s copied blocks, and the one-line refusals."""
import dataclasses

import gguf
import numpy as np
import pytest

from conftest import run_cli, sharp_params
from nanoeuler.io import checkpoint
from nanoeuler.model.config import Config, float_params, param_layout, quant_format, quantized_names, views
from nanoeuler.model.cpu.layers import Layers, dequantize_rows
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.engine import make_engine
from nanoeuler.model.quantize import concat_rows, dequantize, integers, pack_int4, quantize, unpack_int4

CFG = dict(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, hidden=96, context=48, mtp_heads=2)
FORMATS = [("int8", 32), ("int8", 0), ("int8", 64), ("int4", 32), ("int4", 64)]


def matrix(rows=48, cols=128, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[3] = 0  # an all-zero row: d = 0
    w[5, :40] = 7.5  # an outlier group
    return w


def gguf_fields(w, qtype, sizes):
    """gguf.quants' blocks of w, split into their fields: (rows, blocks, field bytes) each."""
    blocks = gguf.quants.quantize(w, qtype).reshape(w.shape[0], -1, sum(sizes))
    return np.split(blocks, np.cumsum(sizes)[:-1], axis=-1)


def test_int8_in_groups_of_32_is_q8_0_bit_for_bit():
    w = matrix()
    qt = quantize(w, "int8", 32)
    d, qs = gguf_fields(w, gguf.GGMLQuantizationType.Q8_0, (2, 32))
    assert np.array_equal(np.ascontiguousarray(d).view(np.float16)[..., 0], qt.scales)
    assert np.array_equal(np.ascontiguousarray(qs).view(np.int8).reshape(w.shape), qt.q)
    assert np.array_equal(dequantize(qt), gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                                                 gguf.GGMLQuantizationType.Q8_0))


def test_int4_in_groups_of_32_is_q4_1_bit_for_bit():
    w = matrix()
    qt = quantize(w, "int4", 32)
    d, m, qs = gguf_fields(w, gguf.GGMLQuantizationType.Q4_1, (2, 2, 16))
    assert np.array_equal(np.ascontiguousarray(d).view(np.float16)[..., 0], qt.scales)
    assert np.array_equal(np.ascontiguousarray(m).view(np.float16)[..., 0], qt.mins)
    assert np.array_equal(qs.reshape(w.shape[0], -1), qt.q)  # GGUF's nibble order, byte for byte
    assert np.array_equal(dequantize(qt), gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                                                                 gguf.GGMLQuantizationType.Q4_1))


@pytest.mark.parametrize("kind, group", FORMATS)
def test_quantization_error_and_exact_dequantization(kind, group):
    """Every element within half a step of its group (plus the float16 rounding of the minimum); the numba
    dequantization the CPU products read gives quantize.dequantize's values bit for bit."""
    w = matrix()
    qt = quantize(w, kind, group)
    g = group or w.shape[1]
    blocks = w.reshape(w.shape[0], -1, g)
    step = (np.abs(blocks).max(-1) / 127 if kind == "int8" else (blocks.max(-1) - blocks.min(-1)) / 15)
    err = np.abs(dequantize(qt) - w).reshape(blocks.shape).max(-1)
    assert (err <= 0.5 * step * 1.01 + 1e-3 * np.abs(blocks).max(-1) + 1e-7).all()
    assert np.array_equal(dequantize_rows(qt, 0, w.shape[0]), dequantize(qt))
    assert np.array_equal(dequantize_rows(qt, 7, 20), dequantize(qt)[7:20])


def test_int4_packing_round_trips():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (6, 128)).astype(np.uint8)
    for group in (32, 64, 128):
        packed = pack_int4(q, group)
        assert packed.shape == (6, 64) and np.array_equal(unpack_int4(packed, group), q)
    assert pack_int4(np.arange(32, dtype=np.uint8)[None] % 16, 32)[0, 0] == 0x00  # element 0 | element 16 << 4
    assert pack_int4(np.arange(32, dtype=np.uint8)[None] % 16, 32)[0, 1] == 0x11


def gpu_layout_values(w_tiles, scale_tiles, kind, group, I, first, rows):
    """The float32 values of rows first .. first + rows - 1 read from the GPU layout's arrays by the addresses
    kernels/quantized.cu computes (tiled_row, copy_record's piece, record_scales, quant_dequantize), in NumPy."""
    from nanoeuler.model.gpu.quantized_layout import group_shift, layout, scale_piece
    shift, pieces = group_shift(group, I), layout(kind, group, rows, I)[2]
    piece, int4 = scale_piece(kind, shift), kind == "int4"
    chunks, row_bytes = (4, I // 2) if int4 else (2, I)
    records = I // (32 * chunks)
    wb, sb = w_tiles.reshape(-1).view(np.uint8), scale_tiles.reshape(-1).view(np.uint8)
    r = np.arange(first, first + rows)[:, None, None, None]
    rec, t, byte = (np.arange(records)[None, :, None, None], np.arange(4)[None, None, :, None],
                    np.arange(16)[None, None, None, :])
    lanes = wb[(r >> 3) * 8 * row_bytes + (r & 7) * 64 + 512 * rec + 16 * t + byte]  # (rows, records, 4, 16)
    words = lanes.copy().view(np.uint32).astype(np.int64)  # (rows, records, 4 lanes, 4 words)
    srow = (r[..., 0] >> 3) * 8 * pieces * piece + (r[..., 0] & 7) * piece  # (rows, 1, 1)
    out = np.empty((rows, I), np.float32)
    for c in range(chunks):
        chunk = np.arange(records)[None, :, None] * chunks + c
        g = chunk >> shift
        b = (4 if int4 else 2) * g
        at = srow + (b // piece) * 8 * piece + b % piece  # the group's scale
        rec_ = np.arange(records)[None, :, None]  # the piece copy_record loads for the record holds it
        loaded = srow + (32 * (((2 * rec_) >> shift) >> 1) if not int4 else
                         128 * rec_ if shift == 0 else 64 * rec_ if shift == 1 else 32 * ((4 * rec_) >> shift))
        assert ((loaded <= at) & (at < loaded + piece)).all()
        d = (sb[at] | sb[at + 1].astype(np.uint16) << 8).view(np.float16).astype(np.float32)
        for e in range(8):
            cols = 32 * chunk + 8 * np.arange(4)[None, None, :] + e
            if int4:
                q = (words[..., c] >> (4 * (e >> 1) + 16 * (e & 1))) & 15
                m = (sb[at + 2] | sb[at + 3].astype(np.uint16) << 8).view(np.float16).astype(np.float32)
                v = (d * q.astype(np.float32)).astype(np.float32) + m  # d q exact: one rounding, as the fma
            else:
                byte_of = (e & 1) * 2 + ((e >> 1) & 1)  # elements 0, 2, 1, 3 in a word's bytes
                q = ((words[..., 2 * c + (e >> 2)] >> (8 * byte_of)) & 0xFF) - 128
                v = d * q.astype(np.float32)
            np.put_along_axis(out, np.broadcast_to(cols, v.shape).reshape(rows, -1), v.reshape(rows, -1), axis=1)
    return out


@pytest.mark.parametrize("kind, group", FORMATS + [("int4", 128)])
def test_gpu_layout_gives_every_value(kind, group):
    """The GPU's tiled layout (gpu/quantized_layout.py) read by the kernels' addresses gives the dequantized
    values bit for bit, of the whole matrix and of row slices that start inside a tile."""
    from nanoeuler.model.gpu.quantized_layout import pack, packed_scales
    w = matrix(rows=37, cols=256)
    qt = quantize(w, kind, group)
    tiles, scales = pack(qt), packed_scales(qt)
    assert tiles.shape[0] == scales.shape[0] == 5 and not tiles.reshape(5, -1, 8, 64)[4, :, 5:].any()  # 3 padded
    for first, rows in ((0, 37), (3, 17), (13, 24), (8, 1)):
        assert np.array_equal(gpu_layout_values(tiles, scales, kind, qt.group, 256, first, rows),
                              dequantize(qt)[first:first + rows]), (first, rows)


@pytest.mark.parametrize("kind, group", FORMATS)
def test_cpu_products_are_those_of_the_dequantized_matrix(kind, group):
    """A few rows: bit for bit the float kernel on the dequantized matrix, whatever the other rows; many rows
    (BLAS on dequantized pieces): within float32 rounding."""
    w = matrix()
    qt = quantize(w, kind, group)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((70, 128)).astype(np.float32)
    layers = Layers("fp32", True)
    few = np.zeros((5, 48), np.float32)
    layers.matmul_forward(few, x[:5], layers.quantized_matrix(qt))
    ref = np.zeros((5, 48), np.float32)
    layers.matmul_forward(ref, x[:5], dequantize(qt))
    assert np.array_equal(few, ref)
    one = np.zeros((1, 48), np.float32)
    layers.matmul_forward(one, x[3:4], qt)
    assert np.array_equal(one[0], few[3])
    many = np.ones((70, 48), np.float32)
    layers.matmul_forward(many, x, qt, accumulate=True)
    np.testing.assert_allclose(many, 1 + x @ dequantize(qt).T, rtol=1e-5, atol=1e-5)


def test_fused_rows_are_exact():
    a, b = quantize(matrix(seed=3), "int4", 32), quantize(matrix(seed=4)[:16], "int4", 32)
    both = concat_rows([a, b])
    assert np.array_equal(dequantize(both), np.concatenate([dequantize(a), dequantize(b)]))
    assert np.array_equal(integers(both.rows(48, 64)), integers(b))


def quantized_model(tokenizer, kind, group, tied=False, head=None):
    """(float cfg, its flat parameters, quantized cfg, its float tensors, its quantized tensors); head: the heads'
    own type (groups of 32)."""
    cfg = Config(**dict(CFG, hidden=128, mtp_heads=1 if tied else 2), vocab_size=tokenizer.vocab_size, tied=tied)
    flat = sharp_params(cfg, 1, 0.3)
    qcfg = dataclasses.replace(cfg, quant=kind, quant_group=group, quant_head=head,
                               quant_head_group=None if head is None else 32)
    v = views(flat, cfg)
    quantized = {name: quantize(v[name], *quant_format(qcfg, name)) for name in quantized_names(qcfg)}
    floats = np.concatenate([v[name].reshape(-1) for name in param_layout(qcfg, floats_only=True)[0]])
    return cfg, flat, qcfg, floats, quantized


@pytest.mark.parametrize("kind, group, tied, head", [("int8", 32, False, None), ("int4", 64, False, None),
                                                     ("int4", 32, True, None), ("int4", 32, False, "int8"),
                                                     ("int4", 64, False, "int8"), ("int8", 0, False, "int4")])
def test_checkpoint_round_trip_and_engine_logits(tokenizer, tmp_path, kind, group, tied, head):
    """The quantized tensors read back bit for bit, each in its own type (the heads' where they have one); the
    CPU engine on them gives the logits of the float model of the dequantized weights, exactly (full forward and
    decoding)."""
    cfg, flat, qcfg, floats, quantized = quantized_model(tokenizer, kind, group, tied, head)
    path = tmp_path / "q.bin"
    checkpoint.save(path, qcfg, floats, tokenizer.to_json(), step=4, quantized=quantized)
    ck = checkpoint.load(path)
    assert ck.cfg == qcfg and ck.step == 4 and np.array_equal(ck.params, floats)
    assert set(ck.quantized) == set(quantized) and ("heads.0" in quantized) != tied
    for name, qt in quantized.items():
        back = ck.quantized[name]
        assert (back.kind, back.group) == (qt.kind, qt.group)
        assert back.kind == (head or kind if name.startswith("heads.") else kind)
        for a, b in zip(qt.arrays().values(), back.arrays().values()):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    fcfg, deq = float_params(ck.cfg, ck.params, ck.quantized)
    assert fcfg == cfg
    eng, _, _ = checkpoint.load_model(path, "cpu")
    ref = make_engine(cfg, training=False)
    ref.load_params(deq)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    assert np.array_equal(eng.logits(tokens), ref.logits(tokens))
    steps = []
    for e in (eng, ref):  # KV-cache decoding: a prompt, then a token at a time (the few-row products)
        dec = decoder_of(e)
        cache = dec.new_cache(2)
        steps.append([dec.logits(cache, tokens[:, :12])] + [dec.logits(cache, tokens[:, 12 + i:13 + i])
                                                              for i in range(3)])
    for got, want in zip(*steps):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_old_checkpoints_and_their_json_are_unchanged(tokenizer, tiny_ckpt):
    ck = checkpoint.load(tiny_ckpt)
    assert ck.cfg.quant is None and ck.quantized is None and "quant" not in ck.cfg.to_json()


@pytest.fixture(scope="module")
def float_ckpt(tokenizer, tmp_path_factory):
    cfg = Config(**CFG, vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("quant") / "f.bin"
    checkpoint.save(path, cfg, sharp_params(cfg, 1, 0.3), tokenizer.to_json(), step=3)
    return path


def test_quantize_command_and_what_takes_its_output(float_ckpt, tmp_path):
    out = tmp_path / "q4.bin"
    r = run_cli("quantize", "--ckpt", float_ckpt, "--out", out, "--type", "int4")
    assert r.returncode == 0, r.stderr
    ck, ref = checkpoint.load(out), checkpoint.load(float_ckpt)
    v = views(ref.params, ref.cfg)
    assert ck.cfg.quant == "int4" and ck.cfg.quant_group == 32 and ck.step == 3
    for name, qt in ck.quantized.items():  # the heads int8 (the default: test_int4_keeps_its_heads_int8...)
        assert np.array_equal(qt.q, quantize(v[name], *quant_format(ck.cfg, name)).q)
    for command in (["infer", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"],
                    ["eval", "--task", "bpb", "--data", "shakespeare.txt", "--limit", "1"]):
        r = run_cli(*command, "--ckpt", out)
        assert r.returncode == 0, r.stderr
    r = run_cli("chat", "--ckpt", out, "--max-new-tokens", "4", input="To be\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_int4_keeps_its_heads_int8_unless_asked(float_ckpt, tmp_path):
    """quantize --type int4: the layers int4 in groups of 32 (or --group), the heads int8 in groups of 32 (Q8_0),
    recorded in the config; --head-type int4 writes what every int4 checkpoint was before (no quant_head in the
    JSON); the engine's memory estimate counts each tensor in its own type."""
    from nanoeuler.model.engine import quantized_bytes
    ref = checkpoint.load(float_ckpt)
    v = views(ref.params, ref.cfg)
    sizes = {}
    for label, extra in (("h8", []), ("h4", ["--head-type", "int4"]), ("g64", ["--group", "32", "--head-type",
                                                                                "int8"])):
        out = tmp_path / f"{label}.bin"
        r = run_cli("quantize", "--ckpt", float_ckpt, "--out", out, "--type", "int4", *extra)
        assert r.returncode == 0, r.stderr
        ck = checkpoint.load(out)
        head = "int4" if label == "h4" else "int8"
        assert (ck.cfg.quant, ck.cfg.quant_group) == ("int4", 32)
        assert (ck.cfg.quant_head, ck.cfg.quant_head_group) == ((None, None) if label == "h4" else ("int8", 32))
        assert ("quant_head" in ck.cfg.to_json()) == (label != "h4")
        assert (f"the heads int8 in groups of 32" in r.stdout) == (label != "h4"), r.stdout
        for name, qt in ck.quantized.items():
            kind = head if name.startswith("heads.") else "int4"
            assert qt.kind == kind and qt.group == 32
            assert np.array_equal(qt.q, quantize(v[name], kind, 32).q) and np.array_equal(qt.scales, quantize(
                v[name], kind, 32).scales)
        sizes[label] = quantized_bytes(ck.cfg)
        assert sizes[label] == sum(qt.nbytes for qt in ck.quantized.values())
    heads = ref.cfg.mtp_heads * ref.cfg.vocab_size * ref.cfg.dim  # int8 /32: 34 bytes a 32; int4 /32: 20
    assert sizes["h8"] - sizes["h4"] == heads // 32 * (34 - 20) and sizes["g64"] == sizes["h8"]


def test_old_int4_checkpoints_read_with_int4_heads(tokenizer, tmp_path):
    """A checkpoint written before the heads had a type of their own (config without quant_head) reads as before:
    its heads int4 in its group, and a head type given in JSON is read back."""
    import json
    cfg, flat, qcfg, floats, quantized = quantized_model(tokenizer, "int4", 64)
    path = tmp_path / "old.bin"
    checkpoint.save(path, qcfg, floats, tokenizer.to_json(), step=2, quantized=quantized)
    assert "quant_head" not in json.loads(checkpoint.read_metadata(path)["config"])
    ck = checkpoint.load(path)
    assert ck.cfg.quant_head is None and quant_format(ck.cfg, "heads.1") == ("int4", 64)
    assert ck.quantized["heads.0"].kind == "int4" and ck.quantized["heads.0"].group == 64
    assert np.array_equal(ck.quantized["heads.1"].mins, quantized["heads.1"].mins)
    with pytest.raises(ValueError, match="untied heads"):
        dataclasses.replace(cfg, quant_head="int8", quant_head_group=32)  # no quantized model


@pytest.mark.parametrize("args, message", [
    (["--type", "int4", "--group", "64"], "not a whole number of int4 groups of 64"),  # hidden 96
    (["--type", "int4", "--head-type", "int5"], "invalid choice: 'int5'"),
    (["--type", "int4", "--head-type"], "expected one argument"),
    (["--type", "int4", "--group", "0"], "multiple of 32"),
    (["--type", "int8", "--group", "48"], "multiple of 32"),
    (["--type", "int5"], "invalid choice"),
])
def test_quantize_bad_input_is_one_line(float_ckpt, tmp_path, args, message):
    out = tmp_path / "q.bin"
    r = run_cli("quantize", "--ckpt", float_ckpt, "--out", out, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_quantized_checkpoints_refuse_training_and_requantizing(float_ckpt, tmp_path):
    q = tmp_path / "q8.bin"
    assert run_cli("quantize", "--ckpt", float_ckpt, "--out", q, "--type", "int8").returncode == 0
    r = run_cli("quantize", "--ckpt", q, "--out", tmp_path / "again.bin", "--type", "int4")
    assert r.returncode == 2 and "quantized already" in r.stderr
    for command in (["train", "--steps", "1"], ["sft", "--data", "missing.json"], ["dpo", "--data", "missing.jsonl"]):
        r = run_cli(*command, "--ckpt", q, "--out", tmp_path / "t.bin")
        assert r.returncode == 2 and "full training needs float weights" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.bin").exists()


Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1


@pytest.mark.parametrize("kind, head, qtype, head_qtype", [("int8", None, Q8_0, Q8_0), ("int4", None, Q4_1, Q8_0),
                                                           ("int4", "int4", Q4_1, Q4_1)])
def test_export_gguf_copies_the_blocks(float_ckpt, tmp_path, kind, head, qtype, head_qtype):
    """The GGUF file's matrices are Q8_0 / Q4_1 whose fields are our stored arrays (rows in llama.cpp's RoPE
    order for q and k), and read back through gguf's own reader as our dequantized values; an int4 model's int8
    head (the default) is a Q8_0 output beside Q4_1 layers, the file type the layers' (MOSTLY_Q4_1); import
    --gguf gives the checkpoint back, every block copied."""
    from nanoeuler.io.gguf import rope_pairs_adjacent
    q = tmp_path / "q.bin"
    assert run_cli("quantize", "--ckpt", float_ckpt, "--out", q, "--type", kind,
                   *(["--head-type", head] if head else [])).returncode == 0
    r = run_cli("export", "--gguf", tmp_path / "q.gguf", "--ckpt", q)
    assert r.returncode == 0, r.stderr
    assert ("int8 head as q8_0 blocks (copied)" in r.stdout) == (kind == "int4" and head is None), r.stdout
    ck = checkpoint.load(q)
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    file_type = reader.fields["general.file_type"]
    assert int(file_type.parts[file_type.data[0]][0]) == (gguf.LlamaFileType.MOSTLY_Q8_0 if kind == "int8" else
                                                          gguf.LlamaFileType.MOSTLY_Q4_1)
    tensors = {t.name: t for t in reader.tensors}
    for ours, theirs, heads in (("layers.1.w_down", "blk.1.ffn_down.weight", None),
                                ("layers.0.wq", "blk.0.attn_q.weight", ck.cfg.n_heads),
                                ("heads.0", "output.weight", None)):
        t = tensors[theirs]
        assert t.tensor_type == (head_qtype if ours.startswith("heads.") else qtype)
        qt = ck.quantized[ours]
        order = (lambda a: a) if heads is None else (lambda a: rope_pairs_adjacent(a, heads))
        raw = np.asarray(t.data).reshape(qt.q.shape[0], -1, 34 if qt.kind == "int8" else 20)
        assert np.array_equal(raw[..., :2].copy().view(np.float16)[..., 0], order(qt.scales))
        assert np.array_equal(raw[..., -32 if qt.kind == "int8" else -16:].reshape(qt.q.shape[0], -1),
                              order(qt.q).view(np.uint8))
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(qt.shape)
        assert np.array_equal(values, order(dequantize(qt)))
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    r = run_cli("import", "--gguf", tmp_path / "q.gguf", "--out", tmp_path / "back.bin")
    assert r.returncode == 0, r.stderr
    back = checkpoint.load(tmp_path / "back.bin")
    one_head = dataclasses.replace(ck.cfg, mtp_heads=1, architecture=back.cfg.architecture)  # export writes head 0
    assert back.cfg == one_head, (back.cfg, one_head)
    for name, qt in back.quantized.items():
        assert qt.kind == ck.quantized[name].kind and np.array_equal(qt.q, ck.quantized[name].q)


def test_import_quantizes_while_streaming(tmp_path):
    """import --hf --quantize int8: every matrix is the quantization of the Hugging Face tensor; the embedding
    stays float32 as read."""
    from test_import_memory import write_random_llama
    from nanoeuler.io.hf_import import read_tensors
    write_random_llama(tmp_path / "hf", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, vocab=512,
                       tied=False)
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin", "--quantize", "int8")
    assert r.returncode == 0, r.stderr
    assert "quantized to int8" in r.stdout
    ck = checkpoint.load(tmp_path / "m.bin")
    theirs = read_tensors(tmp_path / "hf")
    assert np.array_equal(views(ck.params, ck.cfg, floats_only=True)["tok_emb"], theirs["model.embed_tokens.weight"])
    assert np.array_equal(ck.quantized["layers.1.w_up"].q, quantize(theirs["model.layers.1.mlp.up_proj.weight"], "int8").q)
    assert np.array_equal(ck.quantized["heads.0"].scales, quantize(theirs["lm_head.weight"], "int8").scales)
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "x.bin", "--quantize", "int4", "--group", "128")
    assert r.returncode == 2 and "not a whole number" in r.stderr and not (tmp_path / "x.bin").exists()
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m4.bin", "--quantize", "int4")
    assert r.returncode == 0 and "int4 in groups of 32, the heads int8 in groups of 32" in r.stdout, r.stderr
    ck = checkpoint.load(tmp_path / "m4.bin")
    assert ck.quantized["layers.0.wq"].kind == "int4" and ck.quantized["heads.0"].kind == "int8"
    assert np.array_equal(ck.quantized["heads.0"].q, quantize(theirs["lm_head.weight"], "int8").q)
    for args, message in ((["--head-type", "int8"], "--head-type goes with --quantize"),
                          (["--quantize", "int4", "--head-type", "fp8"], "invalid choice: 'fp8'")):
        r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "x.bin", *args)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "x.bin").exists()


needs_gpu = pytest.mark.skipif(not __import__("nanoeuler.model.gpu").model.gpu.available(),
                               reason="needs a CUDA GPU (compute capability 8.0+) and cupy")


@pytest.mark.gpu
@needs_gpu
def test_gpu_dequantize_is_exact():
    """The GPU's dequantized copy (the products of many rows multiply by it) is model/quantize.py's values bit for
    bit in float32 and those rounded to nearest even in bf16: int8 and int4 in groups of 32, 64, 128 and a whole
    row, the whole matrix and a slice of rows from the middle of a tile (an odd count)."""
    import cupy
    from nanoeuler.check.gpu import bf16_bits
    from nanoeuler.model.gpu import quantized
    from nanoeuler.model.gpu.runtime import BF16, F32
    for kind, group, I in (("int8", 32, 384), ("int8", 128, 256), ("int8", 256, 256), ("int4", 32, 384),
                           ("int4", 64, 1152), ("int4", 128, 256), ("int4", 256, 256)):
        w = matrix(43, I, seed=I + group)
        qt = quantize(w, kind, group)
        want = dequantize(qt)
        whole = quantized.QuantizedMatrix.of(qt)
        for m, rows in ((whole, slice(0, 43)), (whole.rows(3, 38), slice(3, 38)), (whole.rows(13, 14), slice(13, 14))):
            got32 = quantized.dequantize(m, F32).get()
            assert np.array_equal(got32.view(np.uint32), want[rows].view(np.uint32)), (kind, group, rows)
            out = cupy.full((rows.stop - rows.start, I), 0xFFFF, dtype=BF16)  # NaNs where nothing is written
            assert np.array_equal(quantized.dequantize(m, BF16, out).get(), bf16_bits(want[rows])), (kind, group, rows)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_quantized_products_match_the_cpu(precision):
    """check --gpu's quantized lines: the products of 1..100 rows within the precision's bound, the
    dequantization bit for bit, a row of 37 and of 64 (bf16) bit for bit that row alone."""
    from nanoeuler.check.gpu import _Case, check_quantized_matmul
    from nanoeuler.model.gpu.layers import Layers as GPULayers
    case = _Case(np.random.default_rng(0), precision)
    lines = check_quantized_matmul(case, GPULayers(precision, True), Layers("fp32", True))
    assert lines and all(err <= tol for _, err, tol in lines), [line for line in lines if line[1] > line[2]]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind, group, head", [("int8", 32, None), ("int4", 64, None), ("int4", 32, "int8")])
def test_gpu_quantized_model_matches_the_cpu_engine(kind, group, head):
    from nanoeuler.check.gpu import BF16_MODEL_TOL, quantized_model_check
    errors = quantized_model_check(0, kind, group, "bf16", report=lambda line: None, head=head)
    assert max(errors.values()) < BF16_MODEL_TOL, errors


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_quantized_products_in_row_slices(precision, monkeypatch):
    """A quantized matrix of more than SLICE_ELEMENTS weights (an untied head) in products of many rows goes a
    slice of rows at a time (the forward into out's columns, += and into float32; the normed product; the input
    gradient summed over the slices in float32): within the precision's bound of the float64 products and of
    the whole matrix's, the dequantized scratch never larger than a slice; a slice of a matrix (row 3 on) too."""
    from nanoeuler.check.gpu import _Case, rel_err
    from nanoeuler.model.gpu import quantized
    from nanoeuler.model.gpu.layers import Layers as GPULayers
    case = _Case(np.random.default_rng(0), precision)
    gpu = GPULayers(precision, True)
    N, O, I = 100, 211, 128
    for kind in ("int8", "int4"):
        qt = quantize(case.normal(O, I).astype(np.float32), kind, 32)
        whole = quantized.QuantizedMatrix.of(qt)
        for w, rows in ((whole, slice(0, O)), (whole.rows(3, 203), slice(3, 203))):
            W = dequantize(qt)[rows].astype(np.float64)
            x, gain = case.act(case.normal(N, I)), case.act(1.0 + 0.1 * case.normal(I))
            dout, base = case.act(case.normal(N, len(W))), case.act(case.normal(N, len(W)))
            xn = case.act(x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-5) * gain)
            got = {}
            for sliced in (False, True):
                monkeypatch.setattr(quantized, "SLICE_ELEMENTS", 48 * I if sliced else 1 << 27)
                monkeypatch.setattr(quantized, "_dequantized", {})
                assert len(quantized.row_slices(w)) == (5 if sliced else 1)
                out, acc, out32 = case.poisoned(N, len(W)), case.dev(base), case.poisoned32(N, len(W))
                gpu.matmul_forward(out, case.dev(x), w)
                gpu.matmul_forward(acc, case.dev(x), w, accumulate=True)
                gpu.matmul_forward(out32, case.dev(x), w)
                normed, rstd, dx = case.poisoned(N, len(W)), case.poisoned32(N), case.poisoned(N, I)
                gpu.rmsnorm_matmul_forward(normed, rstd, case.dev(x), case.dev(gain), w, 1e-5, None)
                gpu.matmul_backward(dx, None, case.dev(dout), case.dev(x), w)
                got[sliced] = [case.get(a) for a in (out, acc, out32, normed, dx)]
                assert all(s.size <= quantized.SLICE_ELEMENTS for s in quantized._dequantized.values())
            refs = (x @ W.T, base + x @ W.T, x @ W.T, xn @ W.T, dout @ W)
            for name, ref, one, part in zip(("out", "+=", "float32 out", "normed", "dx"), refs, got[False], got[True]):
                assert rel_err(part, ref) <= case.tol, (kind, rows, name, rel_err(part, ref))
                assert rel_err(part, one) <= case.tol, (kind, rows, name, rel_err(part, one))


def test_gpu_memory_sizes():
    from nanoeuler.model.memory import GiB, parse_size
    assert parse_size("12GiB") == parse_size("12G") == 12 * GiB and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("800MiB") == 800 << 20 and parse_size("4096") == 4096
    for bad in ("x", "12Q", "-1G", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    r = run_cli("serve", "--gpu-memory", "12Q")
    assert r.returncode == 2 and "not a size" in r.stderr


def test_q4_0_blocks_are_int4_groups_of_32():
    """docs/quantization.md: a Q4_0 block (d, q) is our int4 group (d, q, m = -8 d), m exact in float16: the same
    values as gguf's own dequantization, bit for bit."""
    from nanoeuler.model.quantize import QuantizedTensor
    w = matrix()
    d, qs = gguf_fields(w, gguf.GGMLQuantizationType.Q4_0, (2, 16))
    d = np.ascontiguousarray(d).view(np.float16)[..., 0]
    ours = QuantizedTensor("int4", 32, qs.reshape(w.shape[0], -1), d, (np.float16(-8) * d).astype(np.float16))
    assert np.array_equal((np.float16(-8) * d).astype(np.float32), -8 * d.astype(np.float32))
    theirs = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0),
                                    gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(dequantize(ours), theirs)
