"""The environment a benchmark's `python -m nanoeuler ...` subprocesses run in: this checkout's package first on
PYTHONPATH, the caller's path after it (where packages installed beside the interpreter's, e.g. into a
--target folder, are found); and how a benchmark runs such a command and logs its progress."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repo_env(**extra):
    """os.environ with ROOT ahead of PYTHONPATH, and the given variables set."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def log(message, t0=[time.perf_counter()]):
    """A line with the seconds since the script started."""
    print(f"[{time.perf_counter() - t0[0]:7.1f} s] {message}", flush=True)


def nanoeuler(args, env, stdin=None, check=True):
    """Run a nanoeuler command in ROOT (its output passing through, or returned when stdin is given); a failure
    stops the script, or with check=False returns None."""
    log("nanoeuler " + " ".join(args))
    done = subprocess.run([sys.executable, "-m", "nanoeuler", *args], cwd=ROOT, env=env, input=stdin,
                          stdout=subprocess.PIPE if stdin is not None else None, text=True)
    if done.returncode != 0:
        if not check:
            log(f"nanoeuler {args[0]} failed (exit status {done.returncode}): left out")
            return None
        sys.exit(f"nanoeuler {args[0]} failed (exit status {done.returncode})")
    return done.stdout if stdin is not None else ""
