"""The byte-level BPE tokenizer, written here: training, encoding, decoding and token files (bpe), its
compiled loops (kernels) and the Unicode character classes of GPT-2's pretokenizer (unicode_classes.txt)."""
