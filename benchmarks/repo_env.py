"""The environment a benchmark's `python -m nanoeuler ...` subprocesses run in: this checkout's package first on
PYTHONPATH, the caller's path after it (where packages installed beside the interpreter's, e.g. into a
--target folder, are found)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repo_env(**extra):
    """os.environ with ROOT ahead of PYTHONPATH, and the given variables set."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
