"""nanoeuler: a GPT-2-class language model written from scratch (see README.md)."""
__version__ = "0.1.0"
