"""File output: atomic writes and the early writability check, for every file nanoeuler writes (checkpoints,
token files, metrics logs and loss curves, exports, tokenizer.json, the fetched corpora).

    with atomic_output("data/web.txt") as f:         # a block that writes f; renamed into place at its end
        f.write(...)
    atomic_write("nanoeuler.bin", lambda f: f.write(data))   # the same for one callback; OSError -> UserError
    check_writable("nanoeuler.bin")                  # before hours of training, not after
    output_folder("hf_out", "--hf", "config.json")   # a folder made (or kept) and found writable, for exports

A file is written under a temporary name in the same directory (`<root>.tmp<pid><ext>`: it keeps the
extension, so the ignore rules that cover the file cover its temporary too, and two processes writing the
same file never share one), flushed and fsynced, renamed over `path` only when the whole write succeeded,
and the directory is fsynced so that the rename itself is durable. A crash, a kill or Ctrl-C at any moment
leaves either the old file or the new one, never a mixture; on any exception the temporary is removed.
"""
import contextlib
import os

from nanoeuler.errors import UserError


def _tmp_name(path):
    root, ext = os.path.splitext(path)
    return f"{root}.tmp{os.getpid()}{ext}"


def remove_stale_temporaries(path):
    """Remove the temporaries of `path` (`<root>.tmp<pid><ext>`) left by processes that no longer exist (a kill
    between the write and the rename); a live process's are its own business. Returns the names removed."""
    path = os.fspath(path)
    root, ext = os.path.splitext(os.path.basename(path))
    directory = os.path.dirname(os.path.abspath(path))
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(root) + 4:len(name) - len(ext)] if ext else name[len(root) + 4:]
            if not (name.startswith(root + ".tmp") and name.endswith(ext) and pid.isdigit()):
                continue
            try:
                os.kill(int(pid), 0)
                continue  # alive (or not ours to signal): leave it
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
                removed.append(name)
    return removed


def _fsync_dir(directory):
    # Makes the rename durable; not every platform or file system lets a directory be opened and fsynced,
    # and by now the file is complete under its name, so a failure here is not an error.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path, mode="wb"):
    """Open a temporary sibling of `path` with `mode` for the block; when the block ends without an
    exception, fsync it and rename it over `path`. On any exception (KeyboardInterrupt included) the
    temporary is removed, `path` is untouched and the exception propagates as it is (an OSError stays one).
    The directory must exist."""
    path = os.fspath(path)
    tmp = _tmp_name(path)
    f = open(tmp, mode)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path, write, mode="wb"):
    """Atomically write `path` by calling write(f) on the temporary file (atomic_output). Any OSError (a
    missing directory, no permission, a full disk) becomes the one-line UserError "cannot write PATH: why"."""
    try:
        with atomic_output(path, mode) as f:
            write(f)
    except OSError as e:
        raise UserError(f"cannot write {os.fspath(path)}: {e.strerror or e}") from None


def check_writable(path):
    """Fail early (before hours of training) if `path` cannot be written: create and remove the temporary
    file that atomic_write would use. A UserError if it cannot."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UserError(f"cannot write {path}: it is a directory")
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb"):
            pass
        os.remove(tmp)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def output_folder(folder, flag, first_file):
    """Make `folder` (the value of `flag`) for an export, or keep it, and check that `first_file` in it can be
    written: a one-line error before any work."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"{flag} {folder} exists and is not a directory")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {folder}: {e.strerror or e}") from None
    check_writable(os.path.join(folder, first_file))
