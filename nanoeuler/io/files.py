"""The atomic writes' old address, kept while train/loop.py and train/run.py still import it from here: the
code is nanoeuler/files.py, a floor module that data/ and tokenizer/ use without importing io/."""
from nanoeuler.files import atomic_output, atomic_write, check_writable, remove_stale_temporaries  # noqa: F401
