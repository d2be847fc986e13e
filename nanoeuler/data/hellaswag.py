"""The HellaSwag validation set (Zellers et al. 2019) for `nanoeuler eval --task hellaswag`: data/hellaswag_val.jsonl.

    sh data/get_hellaswag.sh [--url URL] [--sha256 HEX] [--out F] [--cache-dir D]
    python -m nanoeuler.data.hellaswag ...                 # the same, from any directory

The canonical source is the dataset's own repository, rowanz/hellaswag, at a pinned commit; the file there
is checked against the git blob id that commit's tree records for it (no sha256 is published for it). The
download goes through the fetch module (data/fetch.py: cached, resumed, retried, digest-checked), is checked
to hold the 10,042 rows of HellaSwag's shape, and is written with its `.source.json` sidecar. The file is
the original rows; read_hellaswag makes them into mc items (data/mc_items.py) as lm-eval's hellaswag task does
(lm_eval/tasks/hellaswag/utils.py): the context is preprocess(activity_label + ": " + ctx_a + " " +
ctx_b.capitalize()), each ending preprocess(ending), where preprocess strips, turns " [title]" into ". ",
drops any other [bracketed] text and collapses double spaces.
Env: NANOEULER_HELLASWAG_URL (another URL, taken as it is), NANOEULER_FETCH_TIMEOUT/_RETRIES/_BACKOFF.
"""
import argparse
import os
import re
import shutil
import sys

from nanoeuler.data.fetch import Source, fetch_source, human, net_settings, output_file, write_sidecar
from nanoeuler.data.mc_items import mc_item, read_jsonl
from nanoeuler.errors import ENDINGS, UserError, exit_status

COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"  # rowanz/hellaswag master, 2020-05-28; the file dates from 2019
HELLASWAG = Source(f"https://raw.githubusercontent.com/rowanz/hellaswag/{COMMIT}/data/hellaswag_val.jsonl",
                   revision=f"rowanz/hellaswag@{COMMIT}", git_blob="0f5ee25d72216f12317d5d8a7b92deafa423d81e")
VALIDATION_ROWS = 10042


def preprocess(text):
    """lm-eval's HellaSwag text cleaning (WikiHow's bracketed artefacts)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(record, where):
    """An mc item from a row of the original HellaSwag JSONL (ctx_a, ctx_b, activity_label, endings, label)."""
    try:
        context = preprocess(record["activity_label"] + ": " + record["ctx_a"] + " " + record["ctx_b"].capitalize())
        return mc_item({"context": context, "choices": [preprocess(e) for e in record["endings"]],
                        "label": int(record["label"])}, where)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"{where}: not a HellaSwag row (activity_label, ctx_a, ctx_b, endings, label)") from None


def read_hellaswag(path):
    return read_jsonl(path, hellaswag_item)


def fetch_hellaswag(out, source, cache_dir, net):
    """Download, check and write the validation set; returns the source records of its sidecar."""
    path, record = fetch_source(source, cache_dir, "hellaswag", net)
    try:
        n = len(read_hellaswag(path))
    except UserError as e:
        os.remove(path)  # a bad download must not satisfy the next run
        raise UserError(f"{source.url} is not HellaSwag data: {e}; {out} left as it was") from None
    if source.git_blob and n != VALIDATION_ROWS:  # only the pinned file promises the validation split
        raise UserError(f"{source.url} holds {n} rows, not HellaSwag's {VALIDATION_ROWS}; {out} left as it was")
    with output_file(out) as f, open(path, "rb") as src:
        shutil.copyfileobj(src, f)
    write_sidecar(out, [record], argv=sys.argv[1:])
    print(f"wrote {out}: {n} items, {human(os.path.getsize(out))}", file=sys.stderr)
    return [record]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m nanoeuler.data.hellaswag",
                                description="Download the HellaSwag validation set -> data/hellaswag_val.jsonl.")
    p.add_argument("--out", default="data/hellaswag_val.jsonl")
    p.add_argument("--url", default=None,
                   help=f"(env NANOEULER_HELLASWAG_URL; default {HELLASWAG.url}, checked against its git blob id)")
    p.add_argument("--sha256", default=None, help="the sha256 the download must have")
    p.add_argument("--cache-dir", default="data/cache", help="where downloads are kept between runs")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        url = args.url or os.environ.get("NANOEULER_HELLASWAG_URL", "").strip()
        source = Source(url, sha256=args.sha256) if url else Source(HELLASWAG.url, HELLASWAG.revision, args.sha256,
                                                                     HELLASWAG.git_blob)
        fetch_hellaswag(args.out, source, args.cache_dir, net_settings())
    except ENDINGS as e:
        return exit_status(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
