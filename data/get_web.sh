#!/bin/sh
# Builds data/web.txt (1 GB by default): FineWeb-Edu documents, each closed by </s>, from its Hugging Face
# parquet shards (each about 2.15 GB, downloaded only as far as the target size needs), pinned to a commit
# of the dataset and checked against their sha256s; data/web.txt.source.json records them.
#
#   sh data/get_web.sh [--max-bytes 1GB] [--shards URL ...] [--out F] [--cache-dir D]
#
# Shards are cached in data/cache/web/; an interrupted download resumes where it stopped. Paths are relative
# to the repo root. Env: NANOEULER_WEB_BYTES (size), NANOEULER_WEB_SHARDS (whitespace-separated parquet URLs),
# NANOEULER_FETCH_TIMEOUT/_RETRIES/_BACKOFF, PYTHON (default .venv/bin/python if it exists, else python3).
set -e
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
exec "${PYTHON:-python3}" -m nanoeuler.data.fetch web "$@"
