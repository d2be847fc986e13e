"""`nanoeuler serve` under load: aggregate tokens/s, time to the first token and per-token latency at 1, 4,
16, 64 and 256 concurrent streaming clients.

Starts `nanoeuler serve` on a free port of 127.0.0.1 and runs, for each concurrency level, that many clients
(threads, 8 a process in processes of their own: --client-processes), each sending --requests streamed
completions back to back (its own prompt, --max-tokens new tokens,
temperature 0.8 with a per-request seed, no stop: every request generates all its tokens). Printed per
level: tokens/s over the level's wall time (the first request sent to the last answer; tokens are the
server's `usage.completion_tokens`), requests/s, and over the requests the p50 and p99 of the time to the
first token (TTFT) and of the per-token latency after it ((last token's time - first token's) / (tokens - 1),
vLLM's TPOT). The peer, measured first in this process without HTTP: `generate()` on a batch of
min(64, clients) of the same requests (the engine's own rate at that batch, which the server approaches).
Before the levels, a check of batch invariance through the server: 64 different requests at once (--check),
each compared token for token with `generate()` on it alone in this process.

    PYTHONPATH=. python3 benchmarks/bench_serve.py --ckpt nanoeuler.bin --device cpu --clients 16
    PYTHONPATH=. python3 benchmarks/bench_serve.py --preset base --device gpu    # random weights, no checkpoint
    PYTHONPATH=. python3 benchmarks/bench_serve.py --shape llama3.2-1b --device gpu --clients 1 16 64

--preset writes a checkpoint of the preset with random weights (and a BPE of its vocabulary learned on
shakespeare.txt) to a temporary folder: the speed of serving does not depend on what the weights learned.
--shape a published model's shape (benchmarks/shapes.py) likewise (served in bf16): its BPE has 4,096 tokens, and
the ids past them are the checkpoint's padding rows (tokenizer_vocab, as an import's), never generated.
A client reads the server-sent events off its socket as they come and parses only the usage chunk, and the
clients run in processes of their own, so that their work weighs little beside the server's on the same
machine (on the 2-core VM, at 64 clients of 128 tokens: 5.5-7.5 us of CPU a token for http.client's
readers in the benchmark's own process, 4.6-5.0 for these; 8 processes of them share that out over 8 cores).
"""
import argparse
import http.client
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = [1, 4, 16, 64, 256]


def random_checkpoint(preset, folder, shape=None):
    """A checkpoint of random weights: a preset, or a published model's shape (shape_checkpoint.py's, with a
    BPE of 4,096 tokens: the ids past them padding)."""
    from nanoeuler.io import checkpoint
    from nanoeuler.model.config import PRESETS, init_params
    from nanoeuler.tokenizer.bpe import Tokenizer

    path = os.path.join(folder, f"{shape or preset}.bin")
    text = os.path.join(ROOT, "shakespeare.txt")
    if shape is not None:
        from shape_checkpoint import save_shape_checkpoint
        save_shape_checkpoint(path, shape, Tokenizer.train(text, 4096, progress=False).to_json())
        return path
    cfg = PRESETS[preset]
    tok = Tokenizer.train(text, cfg.vocab_size, progress=False)
    checkpoint.save(path, cfg, init_params(cfg, seed=0), tok.to_json(), step=0)
    return path


def prompt(client, request):
    return f"Client {client}, request {request}:\n"


def in_process(eng, tok, batch, max_tokens):
    """tokens/s of generate() on `batch` of the benchmark's requests decoded together, in this process."""
    from nanoeuler.infer.generate import generate

    prompts = [tok.encode(prompt(c, 0)) for c in range(batch)]
    generate(eng, prompts, 4, 0.8, 0, 0.95, seed=1)  # warm-up: compile or load the kernels of this batch
    t0 = time.perf_counter()
    tokens = sum(map(len, generate(eng, prompts, max_tokens, 0.8, 0, 0.95, seed=1)))
    return tokens / (time.perf_counter() - t0)


def post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {answer}")
    return answer


def solo_runs_agree(port, eng, tok, n=64):
    """How many of n different requests sent at once (prompts and new tokens each up to half the context,
    greedy and sampled with a seed) the server answers with exactly the tokens generate() gives each alone."""
    import concurrent.futures

    from nanoeuler.infer.generate import generate

    text = tok.encode(open(os.path.join(ROOT, "shakespeare.txt"), encoding="utf-8").read(20_000))
    half = eng.cfg.context // 2
    cases = [dict(prompt=text[i:i + 1 + (i * 37) % half], max_tokens=1 + (i * 13) % half,
                  temperature=0.0 if i % 2 else 0.8, top_p=1.0 if i % 2 else 0.95, seed=i, logprobs=0)
             for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda case: post(port, case), cases))
    agree = 0
    for case, answer in zip(cases, answers):
        alone = list(generate(eng, case["prompt"], case["max_tokens"], case["temperature"], 0, case["top_p"],
                              seed=case["seed"], stop_ids=(tok.eos_id,)))
        stopped = alone[-1] == tok.eos_id  # the served text leaves </s> out, its finish_reason says "stop"
        choice = answer["choices"][0]
        served = [t for t in choice["logprobs"]["tokens"] if t != "</s>"]
        agree += (len(served) == len(alone) - stopped and choice["finish_reason"] == ("stop" if stopped else "length")
                  and b"".join(map(token_bytes, served)) == tok.decode(alone[:len(alone) - stopped]))
    return agree


def token_bytes(token):
    """The bytes of a token as the API names it (its text, or "bytes:\\xNN..." for part of a character)."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def start_server(ckpt, device, log, *flags):
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", ckpt, "--device", device,
                             "--port", "0", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        with open(log.name, errors="replace") as f:
            banner = f.read()
        if m := re.search(r"on http://127\.0\.0\.1:(\d+)/ ", banner):
            return proc, int(m.group(1)), banner.splitlines()[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start:\n{banner}")
        time.sleep(0.1)


def completion(port, text, max_tokens, seed):
    """One streamed completion: (seconds to the first token, seconds per token after it, completion tokens).
    HTTP/1.1 over a socket of its own, read as it comes: the server's events are split at their blank lines
    (a chunk's framing stays at the start of the next piece: JSON strings hold no raw newline), only the usage
    chunk parsed, so that a client's own work weighs little beside the server's."""
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": seed,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    first = last = usage = None
    received, status = b"", None
    with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(head + body)
        while data := s.recv(1 << 16):
            now = time.perf_counter()
            received += data
            if status is None and b"\r\n" in received:
                status = received[:received.index(b"\r\n")]
                if not status.startswith(b"HTTP/1.1 200 "):
                    raise RuntimeError(f"{received[:300]!r}")
            *events, received = received.split(b"\n\n")
            for event in events:
                payload = event[event.find(b"data: ") + 6:]
                if payload.startswith(b"{") and b'"usage"' in payload:
                    usage = json.loads(payload)["usage"]
                elif payload.startswith(b"{") and b'"text": ""' not in payload:
                    last = now
                    first = first or now
    tokens = usage["completion_tokens"]
    return first - t0, (last - first) / max(tokens - 1, 1), tokens


def client_process(port, clients, requests, max_tokens, ready, go, results):
    """Some of a level's clients, a thread each, in a process of their own (clients in one process would share
    its interpreter lock: on a machine of many cores the processes keep the clients' work off the measure)."""
    out, lock = [], threading.Lock()

    def client(c):
        for i in range(requests):
            answer = completion(port, prompt(c, i), max_tokens, seed=1000 * c + i)
            with lock:
                out.append(answer)

    threads = [threading.Thread(target=client, args=(c,)) for c in clients]
    ready.put(True)
    go.wait()
    cpu = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # CLOCK_MONOTONIC: one clock for every process of the machine
    results.put((out, time.monotonic(), time.process_time() - cpu))


def level(port, clients, requests, max_tokens, processes):
    """One concurrency level: `clients` clients spread over `processes` processes, started together."""
    processes = max(1, min(processes, clients))
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds the GPU
    ready, results, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    workers = [spawn.Process(target=client_process, args=(port, range(p, clients, processes), requests,
                                                           max_tokens, ready, go, results))
               for p in range(processes)]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get()
    t0 = time.monotonic()
    go.set()
    parts = [results.get() for _ in workers]
    for w in workers:
        w.join()
    wall = max(end for _, end, _ in parts) - t0
    ttft, per_token, tokens = (np.array(x) for x in zip(*[r for out, _, _ in parts for r in out]))
    p = lambda x, q: float(np.percentile(x, q))
    return {"clients": clients, "requests": len(ttft), "tokens": int(tokens.sum()), "wall_s": wall,
            "requests_per_s": len(ttft) / wall, "tokens_per_s": tokens.sum() / wall,
            "ttft_p50_s": p(ttft, 50), "ttft_p99_s": p(ttft, 99),
            "token_p50_ms": 1e3 * p(per_token, 50), "token_p99_ms": 1e3 * p(per_token, 99),
            "client_cpu_us_per_token": 1e6 * sum(cpu for _, _, cpu in parts) / tokens.sum()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="checkpoint to serve")
    source.add_argument("--preset", choices=("small", "big", "base", "large"), help="serve random weights")
    source.add_argument("--shape", help="serve random weights of a published model's shape (benchmarks/shapes.py)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--clients", type=int, nargs="+", default=LEVELS, help=f"levels (default {LEVELS})")
    ap.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    ap.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="processes a level's clients are spread over, as many as give each 8 clients, at most "
                         "this (default half the cores, at most 8)")
    ap.add_argument("--check", type=int, default=64,
                    help="requests of the batch-invariance check before the levels (default 64; 0: none)")
    ap.add_argument("--json", help="also write the levels' results to this file, one JSON object a line")
    ap.add_argument("--no-batch-invariance", action="store_true",
                    help="serve (and run the peer) with BLAS's products: faster, not batch-invariant")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or random_checkpoint(args.preset, tmp, args.shape)
        from nanoeuler.io.checkpoint import load_model
        eng, tok, _ = load_model(ckpt, args.device, not args.no_batch_invariance)
        batch = min(64, max(args.clients))
        peer = in_process(eng, tok, batch, args.max_tokens)
        with open(os.path.join(tmp, "serve.log"), "wb") as log:
            # a queue for every client beyond the batch's rows: none gets a 429
            proc, port, banner = start_server(ckpt, args.device, log, "--queue", str(max(args.clients)),
                                              *["--no-batch-invariance"] * args.no_batch_invariance)
            try:
                print(banner)
                completion(port, "warm-up", 8, 0)
                if args.check:
                    print(f"{args.check} different requests at once, each equal token for token to generate() on "
                          f"it alone: {solo_runs_agree(port, eng, tok, args.check)} of {args.check}")
                print(f"{args.requests} streamed requests per client, {args.max_tokens} new tokens each, "
                      "temperature 0.8, top_p 0.95")
                print(f"peer: generate() in this process on a batch of {batch} of them, no HTTP: "
                      f"{peer:,.0f} tokens/s")
                print(f"{'clients':>7} {'requests':>8} {'wall s':>7} {'tokens/s':>9} {'TTFT p50 s':>10} "
                      f"{'TTFT p99 s':>10} {'token p50 ms':>12} {'token p99 ms':>12} {'client us/token':>15}")
                for clients in args.clients:
                    processes = min(args.client_processes, -(-clients // 8))
                    r = level(port, clients, args.requests, args.max_tokens, processes)
                    print(f"{r['clients']:>7} {r['requests']:>8} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9,.0f} "
                          f"{r['ttft_p50_s']:>10.3f} {r['ttft_p99_s']:>10.3f} {r['token_p50_ms']:>12.2f} "
                          f"{r['token_p99_ms']:>12.2f} {r['client_cpu_us_per_token']:>15.1f}", flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(r) + "\n")
            finally:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
