"""Files in and out: checkpoints (checkpoint), Hugging Face import and export (hf_import, export), GGUF (gguf)
and training reports (report). The atomic writes every file nanoeuler writes goes through are a floor module
below every package, nanoeuler/files.py."""
