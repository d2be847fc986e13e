"""The one exception type for bad user input, and how a command that ends early reports it: one line on
stderr and an exit status, never a traceback (nanoeuler.cli.main and nanoeuler.data.fetch.main both use it).
A missing optional dependency is such an error too: `require` names the package and the extra that brings it.

    try:
        status = command(args)
    except ENDINGS as e:
        status = exit_status(e)

    uvicorn, = require("uvicorn", what="nanoeuler serve")   # UserError: ... needs uvicorn: pip install -e '.[serve]'
"""
import importlib
import importlib.util
import os
import sys


class UserError(Exception):
    pass


# The optional dependencies: the module, the package that brings it, and pyproject.toml's extra that installs it.
OPTIONAL = {"cupy": ("CuPy", "gpu"), "cuda.bindings": ("cuda-bindings", "gpu"), "nvmath": ("nvmath-python", "gpu"),
            "starlette": ("Starlette", "serve"), "uvicorn": ("uvicorn", "serve"), "gguf": ("gguf", "gguf"),
            "huggingface_hub": ("huggingface_hub", "hub")}


def missing(module, what, error=None):
    """The one-line UserError for an optional dependency (a module of OPTIONAL, or one inside it) that does not
    import: what needs it, the package, and the pip command of the extra that brings it (with the reason where
    the package is there but fails to import)."""
    root = next(name for name in OPTIONAL if module == name or module.startswith(name + "."))
    package, extra = OPTIONAL[root]
    broken = "" if error is None or isinstance(error, ModuleNotFoundError) else f", which does not import ({error})"
    return UserError(f"{what} needs {package}{broken}: pip install -e '.[{extra}]'")


def require(*modules, what):
    """The modules, imported (a list in the same order); the first that does not import ends the command with
    `missing`'s one line."""
    found = []
    for module in modules:
        try:
            found.append(importlib.import_module(module))
        except ImportError as e:
            raise missing(module, what, e) from None
    return found


def installed(*modules, what):
    """Check that the modules are installed without importing them (importlib.util.find_spec: a library that
    must be loaded after another keeps its order); `missing`'s one line for the first that is not."""
    for module in modules:
        if sys.modules.get(module) is not None:
            continue  # imported already
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package that is missing or not a package
            found = False
        if not found:
            raise missing(module, what)


# What ends a command with a one-line report instead of a traceback (BrokenPipeError is an OSError).
ENDINGS = (UserError, OSError, KeyboardInterrupt)


def exit_status(e, interrupted=""):
    """Report e, one of ENDINGS, and return the exit status it ends the command with:
    - UserError, or an OSError (a full disk, an unwritable file): `nanoeuler: error: ...`, 2;
    - Ctrl-C: `nanoeuler: interrupted` plus the `interrupted` hint, 130;
    - a reader that closed our stdout (`nanoeuler ... | head`): nothing, 141, as a Unix tool does."""
    if isinstance(e, KeyboardInterrupt):
        print(f"\nnanoeuler: interrupted{interrupted}", file=sys.stderr)  # below the terminal's ^C
        return 130
    if isinstance(e, BrokenPipeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the final flush cannot fail
        return 141
    if isinstance(e, UserError):
        print(f"nanoeuler: error: {e}", file=sys.stderr)
    else:
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"nanoeuler: error: {getattr(e, 'strerror', None) or e}{where}", file=sys.stderr)
    return 2
