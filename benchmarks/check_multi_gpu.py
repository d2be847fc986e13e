"""The launchers, the failures and the other commands of data-parallel runs, checked on 2 GPUs in one run.

Every run is the real command line. Launchers: `--gpus 2` is the reference; torchrun, mpirun (Open MPI),
Slurm's and MPICH/PMI's variables set by hand (srun is not installed here), and two hosts simulated on one
machine (two `--nnodes 2` launchers, one GPU each, NCCL on its socket transport over loopback) each train the
`small` preset in fp32 and must log the reference's losses. Then: the socket transport's tokens/s on `base`
with and without overlapped buckets; a rank hung with SIGSTOP and a rank killed while rank 0 writes a
checkpoint (one line, the previous checkpoint intact); Ctrl-C at step 50 and --resume (on 2 GPUs, and on 1);
dpo --gpus 2 and eval --gpus 2 against one GPU. Prints one line a check and a table at the end.

    PYTHONPATH=. python3 benchmarks/check_multi_gpu.py --tokenizer tok512.json --base-tokenizer tok4096.json
"""
import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

PY = [sys.executable, "-m", "nanoeuler"]
RESULTS = []


def report(name, ok, detail):
    RESULTS.append((name, "PASS" if ok else "FAIL", detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def log_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(path):
    return [r["loss"] for r in log_of(path) if "loss" in r and "step" in r]


def small(args, out, steps=30, batch=8, extra=()):
    return ["train", "small", "--device", args.device, "--precision", "fp32", "--data", args.data, "--tokenizer",
            args.tokenizer, "--steps", str(steps), "--batch-size", str(batch), "--eval-every", "10",
            "--sample-every", "1000", "--ckpt-every", "10", "--out", out, "--overwrite", *extra]


def run(command, env=None, timeout=600):
    done = subprocess.run(command, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    return done


def together(commands, envs, timeout=600):
    """Start every command at once (the ranks of a hand-made launch); their CompletedProcess-like results."""
    procs = [subprocess.Popen(c, env=dict(os.environ, **e), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c, e in zip(commands, envs)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def same_losses(name, path, ref, detail=""):
    got = losses(path)
    equal = len(got) == len(ref) and np.allclose(got, ref, rtol=1e-6, atol=0)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if len(got) == len(ref) else float("nan")
    report(name, equal, f"{len(got)} steps, largest relative difference to --gpus 2 {worst:.1e}{detail}")


def launchers(args, tmp):
    ref_path = f"{tmp}/ref.bin"
    done = run(PY + small(args, ref_path) + ["--gpus", "2"])
    assert done.returncode == 0, done.stderr[-2000:]
    ref = losses(f"{tmp}/ref.jsonl")
    report("--gpus 2", len(ref) == 30, f"30 steps, loss {ref[0]:.4f} -> {ref[-1]:.4f}")

    done = run(["torchrun", "--nproc-per-node", "2", "--master-port", "29611", "-m", "nanoeuler"]
               + small(args, f"{tmp}/torchrun.bin"))
    if done.returncode:
        report("torchrun", False, done.stderr[-1500:])
    else:
        same_losses("torchrun --nproc-per-node 2", f"{tmp}/torchrun.jsonl", ref)

    mpi_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = run(["mpirun", "-np", "2", "--oversubscribe", "-x", "PYTHONPATH", "-x", "NCCL_NVLS_ENABLE"]
               + [sys.executable, "-m", "nanoeuler"] + small(args, f"{tmp}/mpirun.bin"), mpi_env)
    if done.returncode:
        report("mpirun", False, done.stderr[-1500:])
    else:
        same_losses("mpirun -np 2 (Open MPI, mpi4py rendezvous)", f"{tmp}/mpirun.jsonl", ref)

    by_hand = (("srun-style (SLURM_PROCID/NTASKS/LOCALID, first node of SLURM_STEP_NODELIST)", "srun",
                lambda r: dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_JOB_ID="4242",
                               SLURM_STEP_NODELIST="localhost")),
               ("MPICH/PMI-style (PMI_RANK/PMI_SIZE, TCP rendezvous)", "pmi",
                lambda r: dict(PMI_RANK=str(r), PMI_SIZE="2", MPI_LOCALRANKID=str(r), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29612")))
    for name, run_name, variables in by_hand:  # the ranks started by hand with a launcher's variables
        outs = together([PY + small(args, f"{tmp}/{run_name}.bin")] * 2, [variables(r) for r in range(2)])
        if any(code for code, _, _ in outs):
            report(name, False, " | ".join(e[-800:] for _, _, e in outs))
        else:
            same_losses(name, f"{tmp}/{run_name}.jsonl", ref)

    sockets = dict(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo",
                   NCCL_DEBUG="INFO")
    nodes = [dict(sockets, CUDA_VISIBLE_DEVICES=str(node)) for node in range(2)]
    hosts = lambda out, extra=(), base=False: [
        PY + (base_args(args, out, extra) if base else small(args, out)) + [
            "--gpus", "1", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
            "--master-port", "29613"] for node in range(2)]
    outs = together(hosts(f"{tmp}/hosts.bin"), nodes)
    text = outs[0][1] + outs[0][2]  # NCCL_DEBUG writes to stdout
    transport = "NET/Socket" in text and "via P2P" not in text and "via SHM" not in text
    if any(code for code, _, _ in outs):
        report("two hosts", False, " | ".join(e[-800:] for _, _, e in outs))
    else:
        same_losses("two hosts simulated (--nnodes 2, NCCL sockets over loopback)", f"{tmp}/hosts.jsonl", ref,
                    f"; NCCL socket transport: {transport}")
    for name, env in (("16 MiB buckets overlapped (default across hosts)", {}),
                      ("one bucket after the backward pass", {"NANOEULER_BUCKET_MB": "1000000"})):
        outs = together(hosts(f"{tmp}/hosts_base.bin", base=True), [dict(n, NCCL_DEBUG="WARN", **env) for n in nodes])
        if any(code for code, _, _ in outs):
            report(f"two hosts, base: {name}", False, " | ".join(e[-800:] for _, _, e in outs))
            continue
        steps = [r for r in log_of(f"{tmp}/hosts_base.jsonl") if "tokens_per_s" in r][10:]
        tps = statistics.median(r["tokens_per_s"] for r in steps)
        report(f"two hosts over sockets, base bf16 2 x 16: {name}", True, f"{tps:,.0f} tokens/s")
    return ref_path


def base_args(args, out, extra=()):
    return ["train", "base" if args.device == "gpu" else "small", "--device", args.device, "--data", args.data, "--tokenizer", args.base_tokenizer if args.device == "gpu" else args.tokenizer,
            "--steps", "40", "--batch-size", "16", "--eval-every", "100000", "--sample-every", "100000",
            "--ckpt-every", "100000", "--out", out, "--overwrite", *extra]


def rank_pids(launcher_pid):
    """{rank: pid} of the workers a launcher started."""
    found = {}
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            env = open(path, "rb").read().split(b"\0")
            stat = open(path.replace("environ", "stat")).read().split()
        except OSError:
            continue
        if int(stat[3]) == launcher_pid:  # its children
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(path.split("/")[2])
    return found


def wait_for(condition, limit=300):
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > limit:
            raise TimeoutError
        time.sleep(0.05)


def signal_rank(proc, rank, sig):
    """Send sig to one rank of the launcher `proc`; (exit status, seconds until the run ended, its last line)."""
    os.kill(rank_pids(proc.pid)[rank], sig)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]
    return proc.returncode, time.monotonic() - t0, lines[-1:]


def failures(args, tmp):
    n = args.gpus
    gpus = ["--gpus", str(n)]
    # a hung rank: SIGSTOP the last rank after 15 steps; the launcher's step timeout ends the run
    out = f"{tmp}/hang.bin"
    proc = subprocess.Popen(PY + small(args, out, steps=100000) + gpus, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, NANOEULER_STEP_TIMEOUT="20"))
    wait_for(lambda: os.path.exists(f"{tmp}/hang.jsonl") and len(log_of(f"{tmp}/hang.jsonl")) >= 15)
    code, took, last = signal_rank(proc, n - 1, signal.SIGSTOP)
    intact = run(PY + ["report", "--ckpt", out]).returncode == 0
    said = bool(last) and last[0].startswith(f"nanoeuler: error: rank {n - 1} took no training step")
    report(f"a hung rank of {n} (SIGSTOP), NANOEULER_STEP_TIMEOUT=20", code == 2 and took < 80 and intact and said,
           f"exit {code} after {took:.0f} s, last line {last!r}, checkpoint readable {intact}")

    # a rank killed while rank 0 writes a checkpoint: base, whose checkpoint takes a while to write
    out = f"{tmp}/kill.bin"
    proc = subprocess.Popen(PY + base_args(args, out, ["--ckpt-every", "10", "--steps", "100000"]) + gpus,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(out), limit=600)  # the first checkpoint (step 10) is there
    wait_for(lambda: glob.glob(f"{tmp}/kill.tmp*"), limit=600)  # rank 0 is writing the next one
    code, took, last = signal_rank(proc, 0, signal.SIGKILL)
    from nanoeuler.io import checkpoint
    ck = checkpoint.load(out)
    # the write under way is lost, or had just been renamed into place: either way a whole checkpoint
    said = bool(last) and last[0].startswith("nanoeuler: error: rank 0 was killed by SIGKILL")
    report(f"rank 0 of {n} killed (SIGKILL) while writing a checkpoint", code == 2 and ck.step % 10 == 0 and said,
           f"exit {code} after {took:.1f} s, last line {last!r}, checkpoint at step {ck.step}")

    # Ctrl-C at step 50, --resume to 100, on N GPUs; the stopped checkpoint also resumes on 1 GPU
    full = f"{tmp}/full.bin"
    assert run(PY + small(args, full, steps=100) + gpus).returncode == 0
    ref = losses(f"{tmp}/full.jsonl")
    out = f"{tmp}/stop.bin"
    proc = subprocess.Popen(PY + small(args, out, steps=100) + gpus, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(f"{tmp}/stop.jsonl") and len(log_of(f"{tmp}/stop.jsonl")) >= 50)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    stopped = losses(f"{tmp}/stop.jsonl")
    subprocess.run(["cp", out, f"{tmp}/stop1.bin"], check=True)
    subprocess.run(["cp", f"{tmp}/stop.jsonl", f"{tmp}/stop1.jsonl"], check=True)
    resumed = run(PY + small(args, out, steps=100)[:-1] + ["--resume", *gpus])
    got = losses(f"{tmp}/stop.jsonl")
    ok = proc.returncode == 130 and resumed.returncode == 0 and np.allclose(got, ref, rtol=1e-6, atol=0)
    report(f"Ctrl-C at step 50, --resume on {n} GPUs", ok,
           f"stopped at step {len(stopped)} (exit {proc.returncode}), resumed to {len(got)}; largest relative "
           f"difference to the uninterrupted run {max(abs(a - b) / b for a, b in zip(got, ref)):.1e}")
    one = run(PY + small(args, f"{tmp}/stop1.bin", steps=100, batch=8 * n)[:-1] + ["--resume"])
    got = losses(f"{tmp}/stop1.jsonl")
    report(f"the stopped checkpoint resumed on 1 GPU (global batch kept: 1 x {8 * n})",
           one.returncode == 0 and np.allclose(got, ref, rtol=1e-5, atol=0),
           f"largest relative difference {max(abs(a - b) / b for a, b in zip(got, ref)):.1e}")


def commands(args, tmp, ckpt):
    lines = open(args.data, encoding="utf-8").read().splitlines()
    lines = [line.strip() for line in lines if len(line.strip()) > 20][:400]
    with open(f"{tmp}/pairs.jsonl", "w") as f:
        for i in range(0, 360, 3):
            f.write(json.dumps(dict(prompt=lines[i], chosen=lines[i + 1], rejected=lines[i + 2])) + "\n")
    dpo = lambda out, batch, extra=(): PY + [
        "dpo", "--ckpt", ckpt, "--data", f"{tmp}/pairs.jsonl", "--device", "gpu", "--precision", "fp32",
        "--steps", "20", "--batch-size", str(batch), "--eval-every", "10", "--sample-every", "1000",
        "--out", out, "--overwrite", *extra]
    one, two = run(dpo(f"{tmp}/dpo1.bin", 8)), run(dpo(f"{tmp}/dpo2.bin", 4, ["--gpus", "2"]))
    if one.returncode or two.returncode:
        report("dpo --gpus 2", False, (one.stderr + two.stderr)[-1500:])
    else:
        a, b = log_of(f"{tmp}/dpo1.jsonl"), log_of(f"{tmp}/dpo2.jsonl")
        la, lb = [r["loss"] for r in a if "step" in r], [r["loss"] for r in b if "step" in r]
        va, vb = [r["val_loss"] for r in a if "val_loss" in r], [r["val_loss"] for r in b if "val_loss" in r]
        worst = max(abs(x - y) / abs(y) for x, y in zip(la + va, lb + vb))
        report("dpo --gpus 2 x 4 pairs against 1 GPU x 8", len(la) == len(lb) == 20 and worst < 1e-4,
               f"losses {la[0]:.5f} -> {la[-1]:.5f} vs {lb[0]:.5f} -> {lb[-1]:.5f}, val {va} vs {vb}, "
               f"largest relative difference {worst:.1e}")
    fixture = "tests/data/hellaswag_fixture.jsonl"
    runs = {}
    for gpus in ("1", "2"):
        mc = run(PY + ["eval", "--task", "hellaswag", "--data", fixture, "--ckpt", ckpt, "--device", "gpu",
                       "--batch-size", "4", "--gpus", gpus, "--predictions", f"{tmp}/pred{gpus}.jsonl"])
        bpb = run(PY + ["eval", "--task", "bpb", "--data", args.data, "--ckpt", ckpt, "--device", "gpu",
                        "--limit", "40", "--gpus", gpus, "--json", f"{tmp}/bpb{gpus}.json"])
        if mc.returncode or bpb.returncode:
            report(f"eval --gpus {gpus}", False, (mc.stderr + bpb.stderr)[-1500:])
            return
        preds = [json.loads(line) for line in open(f"{tmp}/pred{gpus}.jsonl")]
        runs[gpus] = ([(p["pred"], p["pred_norm"]) for p in preds], [p["logprobs"] for p in preds],
                      json.load(open(f"{tmp}/bpb{gpus}.json"))["bpb"])
    report("eval --gpus 2 against 1 GPU (hellaswag fixture, bpb of 40 batches)",
           runs["1"][0] == runs["2"][0] and runs["1"][2] == runs["2"][2],
           f"same picks {runs['1'][0] == runs['2'][0]}, same log-probs {runs['1'][1] == runs['2'][1]}, "
           f"bpb {runs['1'][2]:.6f} vs {runs['2'][2]:.6f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="shakespeare.txt")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json of 512 tokens (the small preset's)")
    parser.add_argument("--base-tokenizer", required=True, help="a tokenizer.json of 4096 tokens (base's)")
    parser.add_argument("--only", nargs="+", default=["launchers", "failures", "commands"])
    parser.add_argument("--device", default="gpu", help="cpu: the same runs as CPU ranks (a dry run of this script)")
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the failure checks (the others take 2)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if "launchers" in args.only:
            ckpt = launchers(args, tmp)
        if "failures" in args.only:
            failures(args, tmp)
        if "commands" in args.only:
            if ckpt is None:
                ckpt = f"{tmp}/ref.bin"
                assert run(PY + small(args, ckpt) + ["--gpus", "2"]).returncode == 0
            commands(args, tmp, ckpt)
    print("\n| check | result | detail |\n|---|---|---|")
    for name, result, detail in RESULTS:
        print(f"| {name} | {result} | {detail[:300]} |")


if __name__ == "__main__":
    main()
