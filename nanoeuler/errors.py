"""The one exception type for bad user input, and how a command that ends early reports it: one line on
stderr and an exit status, never a traceback (nanoeuler.cli.main and nanoeuler.data.fetch.main both use it).

    try:
        status = command(args)
    except ENDINGS as e:
        status = exit_status(e)
"""
import os
import sys


class UserError(Exception):
    pass


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
