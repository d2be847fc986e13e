#!/bin/sh
# Builds data/gutenberg.txt: the public-domain Project Gutenberg classics listed in
# nanoeuler/data/gutenberg_books.tsv, each cut to the text between its "*** START OF" and "*** END OF" lines
# (a book without them is skipped) and closed by the end-of-text token </s>. Project Gutenberg keeps no
# revisions: data/gutenberg.txt.source.json records each book's URL and the sha256 it had.
#
#   sh data/get_gutenberg.sh [--out F] [--list F] [--mirror URL] [--cache-dir D]
#
# Books are cached in data/cache/gutenberg/, so a re-run downloads only what is missing. Paths are relative
# to the repo root. Env: NANOEULER_GUTENBERG_MIRROR (base URL), NANOEULER_FETCH_TIMEOUT/_RETRIES/_BACKOFF,
# PYTHON (interpreter; default .venv/bin/python if it exists, else python3).
set -e
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
exec "${PYTHON:-python3}" -m nanoeuler.data.fetch gutenberg "$@"
