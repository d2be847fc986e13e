"""`nanoeuler serve` under load: requests/s and tokens/s at 1, 4 and 16 concurrent clients.

Starts `nanoeuler serve` on a free port of 127.0.0.1 and runs, for each concurrency level, that many client
threads, each sending --requests streamed completions back to back (its own prompt, --max-tokens new tokens,
temperature 0.8 with a per-request seed). requests/s and tokens/s are over the level's wall time (the first
request sent to the last answer); tokens are the server's `usage.completion_tokens`. Also the mean time to the
first token and the mean time of a whole request, which show the scheduler's fairness: every active request
advances one token per turn, so at N clients each runs about N times slower while the total stays level.
The peer, measured first in this process: the same requests through `sample.generate` one at a time, no
HTTP (the engine's own speed at batch 1, which the server cannot pass without batched decoding).

    PYTHONPATH=. python3 benchmarks/bench_serve.py --ckpt nanoeuler.bin --device cpu
    PYTHONPATH=. python3 benchmarks/bench_serve.py --preset base --device gpu    # random weights, no checkpoint

--preset writes a checkpoint of the preset with random weights (and a BPE of its vocabulary learned on
shakespeare.txt) to a temporary folder: the speed of serving does not depend on what the weights learned.
"""
import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_checkpoint(preset, folder):
    from nanoeuler.io import checkpoint
    from nanoeuler.model.config import PRESETS, init_params
    from nanoeuler.tokenizer.bpe import Tokenizer

    cfg = PRESETS[preset]
    tok = Tokenizer.train(os.path.join(ROOT, "shakespeare.txt"), cfg.vocab_size, progress=False)
    path = os.path.join(folder, f"{preset}.bin")
    checkpoint.save(path, cfg, init_params(cfg, seed=0), tok.to_json(), step=0)
    return path


def in_process(ckpt, device, requests, max_tokens):
    """tokens/s of `generate` on the bench's request shapes, one request at a time, in this process."""
    import numpy as np

    from nanoeuler.infer.generate import generate
    from nanoeuler.io.checkpoint import load_model

    eng, tok, _ = load_model(ckpt, device)
    run = lambda i, n: len(list(generate(eng, tok.encode(f"Client 0, request {i}:\n"), n, 0.8, 0, 0.95,
                                         np.random.default_rng(i), stop_ids=(tok.eos_id,))))
    run(0, 8)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(run(i, max_tokens) for i in range(requests))
    return tokens / (time.perf_counter() - t0)


def start_server(ckpt, device, slots, log):
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", ckpt, "--device", device,
                             "--port", "0", "--slots", str(slots)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        with open(log.name, errors="replace") as f:
            banner = f.read()
        if m := re.search(r"on http://127\.0\.0\.1:(\d+)/ ", banner):
            return proc, int(m.group(1)), banner.splitlines()[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start:\n{banner}")
        time.sleep(0.1)


def completion(port, prompt, max_tokens, seed):
    """One streamed completion: (seconds to the first token, seconds in all, completion tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first, usage = None, None
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
            first = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    conn.close()
    total = time.perf_counter() - t0
    return first if first is not None else total, total, usage["completion_tokens"]


def level(port, clients, requests, max_tokens):
    results, lock = [], threading.Lock()

    def client(c):
        for i in range(requests):
            out = completion(port, f"Client {c}, request {i}:\n", max_tokens, seed=1000 * c + i)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    n, tokens = len(results), sum(r[2] for r in results)
    return {"clients": clients, "requests": n, "tokens": tokens, "wall_s": wall, "requests_per_s": n / wall,
            "tokens_per_s": tokens / wall, "ttft_s": sum(r[0] for r in results) / n,
            "latency_s": sum(r[1] for r in results) / n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="checkpoint to serve")
    source.add_argument("--preset", choices=("small", "big", "base", "large"), help="serve random weights")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or random_checkpoint(args.preset, tmp)
        peer = in_process(ckpt, args.device, args.requests, args.max_tokens)
        with open(os.path.join(tmp, "serve.log"), "wb") as log:
            proc, port, banner = start_server(ckpt, args.device, max(args.clients), log)
            try:
                print(banner)
                completion(port, "warm-up", 8, 0)
                print(f"{args.requests} streamed requests per client, {args.max_tokens} new tokens each, "
                      "temperature 0.8")
                print(f"peer: generate() in this process, one request at a time, no HTTP: {peer:.1f} tokens/s")
                print(f"{'clients':>7} {'requests':>8} {'wall s':>7} {'requests/s':>10} {'tokens/s':>9} "
                      f"{'first token s':>13} {'request s':>9}")
                for clients in args.clients:
                    r = level(port, clients, args.requests, args.max_tokens)
                    print(f"{r['clients']:>7} {r['requests']:>8} {r['wall_s']:>7.2f} {r['requests_per_s']:>10.2f} "
                          f"{r['tokens_per_s']:>9.1f} {r['ttft_s']:>13.3f} {r['latency_s']:>9.3f}", flush=True)
            finally:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
