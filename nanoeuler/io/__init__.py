"""Files in and out: checkpoints (checkpoint), Hugging Face export (export), and the atomic writes every file
nanoeuler writes goes through (files)."""
