"""Corpus fetchers: data/gutenberg.txt, data/web.txt, data/alpaca.json and data/preferences.jsonl, the real
corpora of the pipeline.

Run through the scripts in data/ (they cd to the repo root, so relative paths below are from there):

    sh data/get_gutenberg.sh [--list F] [--out F] [--cache-dir D] [--mirror URL]
    sh data/get_web.sh       [--max-bytes N] [--shards URL ...] [--out F] [--cache-dir D]
    sh data/get_alpaca.sh    [--url URL] [--out F] [--cache-dir D]
    sh data/get_preferences.sh [--url URL] [--out F] [--cache-dir D]

which call `python -m nanoeuler.data.fetch gutenberg|web|alpaca ...`. Every download goes through download():
streamed to `<name>.part` in the cache dir, resumed with an HTTP Range request after a dropped connection,
retried with exponential backoff, size checked against Content-Length, then renamed. A finished file in the
cache is never fetched again, so a re-run costs no requests for what it already has. Outputs are written
to a temporary name and renamed only when complete: a failed or interrupted run leaves the old file alone.

Sources (defaults are the real ones): NANOEULER_GUTENBERG_MIRROR, NANOEULER_WEB_SHARDS (whitespace-separated
parquet URLs), NANOEULER_ALPACA_URL, NANOEULER_PREFERENCES_URL; NANOEULER_WEB_BYTES is the size of web.txt. Network behaviour:
NANOEULER_FETCH_TIMEOUT (seconds without a byte before giving up on an attempt), NANOEULER_FETCH_RETRIES
(attempts per file), NANOEULER_FETCH_BACKOFF (first wait between attempts; it doubles, capped at a minute).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
from tqdm import tqdm

from nanoeuler.data.instructions import read_alpaca
from nanoeuler.env import env_float, env_int
from nanoeuler.errors import ENDINGS, UserError, exit_status
from nanoeuler.io.files import atomic_output

GUTENBERG_MIRROR = "https://www.gutenberg.org"
GUTENBERG_BOOK_URL = "{mirror}/cache/epub/{id}/pg{id}.txt"
# FineWeb-Edu sample-10BT: 14 parquet files (000 ... 013), about 2.15 GB each (the last one 0.54 GB).
WEB_SHARDS = tuple(
    f"https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/{i:03d}_00000.parquet"
    for i in range(14)
)
WEB_BYTES = "1GB"
ALPACA_URL = "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"
# Anthropic HH-RLHF, helpful-base training split: 43,835 transcripts as chosen/rejected pairs (MIT licence).
PREFERENCES_URL = "https://huggingface.co/datasets/Anthropic/hh-rlhf/resolve/main/helpful-base/train.jsonl.gz"

CHUNK = 1 << 16  # bytes per read: small enough that a dropped connection loses little, large enough to be cheap
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}  # statuses that say "try again later"; other 4xx are final
MAX_WAIT = 60.0
DOC_SEPARATOR = b"\n\n"  # between books in gutenberg.txt and between documents in web.txt


@dataclass(frozen=True)
class NetSettings:
    timeout: float = 30.0  # seconds: connect timeout, and the longest silence tolerated mid-download
    attempts: int = 6
    backoff: float = 2.0


class HTTPStatusError(Exception):
    """A final (non-retryable) HTTP status, such as 404: the caller decides whether it is fatal."""

    def __init__(self, url, status):
        super().__init__(f"HTTP {status}")
        self.url = url
        self.status = status


class _Retry(Exception):
    """One attempt failed in a way that another attempt may fix."""

    def __init__(self, message, wait=None):
        super().__init__(message)
        self.wait = wait  # a server's Retry-After, in seconds


# ---------------------------------------------------------------------------------------------------- settings


def net_settings():
    return NetSettings(
        timeout=env_float("NANOEULER_FETCH_TIMEOUT", NetSettings.timeout, minimum=0.01),
        attempts=env_int("NANOEULER_FETCH_RETRIES", NetSettings.attempts, minimum=1),
        backoff=env_float("NANOEULER_FETCH_BACKOFF", NetSettings.backoff, minimum=0.0),
    )


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text):
    """'1GB' -> 10**9, '500M' -> 5 * 10**8, '2GiB' -> 2 * 2**30, '12345' -> 12345."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"expected a size such as 1GB, 500MB or 1000000, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value


def human(n):
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


# ---------------------------------------------------------------------------------------------------- files


def output_file(path):
    """atomic_output (nanoeuler/io/files.py) for a corpus file, creating its directory first: the block writes
    a temporary sibling (web.txt -> web.tmp<pid>.txt, so the corpus ignore rules cover it too) that is
    renamed over `path` only if the block succeeds."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return atomic_output(path)


def cache_name(url):
    """A cache file name for a URL: readable, and distinct for same-named files at different URLs."""
    base = os.path.basename(urlsplit(url).path) or "download"
    return f"{hashlib.sha1(url.encode()).hexdigest()[:10]}_{base}"


# ---------------------------------------------------------------------------------------------------- download


def new_session():
    s = requests.Session()
    s.headers["User-Agent"] = "nanoeuler-fetch/0.1 (python-requests)"
    # Byte offsets for Range and Content-Length only mean something for the bytes as stored.
    s.headers["Accept-Encoding"] = "identity"
    return s


def download(session, url, dest, net, progress=True, desc=None):
    """Fetch `url` into `dest` unless `dest` already exists (a finished download); return its size.

    Bytes go to `dest + ".part"`; a later attempt (or run) continues it with a Range request. Raises
    HTTPStatusError for a final HTTP status (404, 403, ...) and UserError once `net.attempts` attempts in
    a row failed without progress (timeouts, refused or dropped connections, 5xx).
    """
    if os.path.exists(dest):
        return os.path.getsize(dest)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    desc = desc or os.path.basename(dest)
    failures = 0
    while True:
        have = os.path.getsize(part) if os.path.exists(part) else 0
        try:
            _attempt(session, url, part, have, net, progress, desc)
            os.replace(part, dest)
            return os.path.getsize(dest)
        except _Retry as e:
            problem, wait = str(e), e.wait
        except (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                requests.exceptions.InvalidSchema) as e:
            raise UserError(f"bad URL {url!r}: {e}") from None
        except requests.exceptions.RequestException as e:
            problem, wait = _describe(e, url, net), None
        grew = os.path.exists(part) and os.path.getsize(part) > have
        failures = 1 if grew else failures + 1  # an attempt that made progress restarts the count
        if failures >= net.attempts:
            hint = " (offline?)" if "cannot reach" in problem else ""
            raise UserError(f"cannot download {url}: {problem}{hint}; gave up after {failures} failed "
                            f"attempt{'s' if failures > 1 else ''} in a row; re-run to resume")
        delay = min(net.backoff * 2 ** (failures - 1), MAX_WAIT)
        if wait is not None:
            delay = max(delay, min(wait, MAX_WAIT))
        tqdm.write(f"{desc}: {problem}; retrying in {delay:.1f} s "
                   f"(attempt {failures + 1} of {net.attempts})", file=sys.stderr)
        time.sleep(delay)


def _attempt(session, url, part, have, net, progress, desc):
    headers = {"Range": f"bytes={have}-"} if have else {}
    with session.get(url, headers=headers, stream=True, timeout=(net.timeout, net.timeout)) as r:
        if r.status_code == 416 and have:
            # The partial file does not fit what the server has now (it is longer, or the file changed).
            os.remove(part)
            raise _Retry("partial download does not match the server's file; starting over", wait=0)
        if r.status_code in RETRY_STATUS:
            raise _Retry(f"HTTP {r.status_code} from {_host(url)}", wait=_retry_after(r))
        if r.status_code >= 400:
            raise HTTPStatusError(url, r.status_code)
        if r.status_code == 206:
            start, total = _content_range(r.headers.get("Content-Range", ""))
            if start != have:
                os.remove(part)
                raise _Retry(f"server resumed at byte {start}, not {have}; starting over", wait=0)
        elif r.status_code == 200:
            start = 0  # no Range asked, or the server ignores Range: take the whole file again
            length = r.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        else:
            raise _Retry(f"unexpected HTTP {r.status_code} from {_host(url)}")
        with open(part, "ab" if start else "wb") as f, \
                tqdm(total=total, initial=start, unit="B", unit_scale=True, desc=desc,
                     disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
            for chunk in r.iter_content(CHUNK):
                f.write(chunk)
                bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    size = os.path.getsize(part)
    if total is not None and size != total:
        if size > total:
            os.remove(part)
        raise _Retry(f"got {size} of {total} bytes")


def _content_range(text):
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", text)
    if not m:
        raise _Retry(f"unusable Content-Range {text!r}")
    return int(m.group(1)), None if m.group(3) == "*" else int(m.group(3))


def _retry_after(r):
    text = r.headers.get("Retry-After", "")
    return float(text) if text.isdigit() else None


def _host(url):
    return urlsplit(url).netloc or url


def _describe(e, url, net):
    """requests' exception text is a long repr chain; reduce it to what a user can act on."""
    host = _host(url)
    text = str(e)
    if isinstance(e, requests.exceptions.ConnectTimeout):
        return f"cannot reach {host}: connection timed out after {net.timeout:g} s"
    if isinstance(e, requests.exceptions.ReadTimeout) or "timed out" in text.lower():
        return f"{host} sent nothing for {net.timeout:g} s"
    if isinstance(e, requests.exceptions.ChunkedEncodingError):
        return f"connection to {host} dropped mid-transfer"
    if isinstance(e, requests.exceptions.SSLError):
        return f"TLS error talking to {host}"
    if isinstance(e, requests.exceptions.ConnectionError):
        m = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
        if m:
            return f"cannot reach {host}: {m.group(1).strip()}"
        if "RemoteDisconnected" in text or "aborted" in text:
            return f"connection to {host} closed without a response"
        return f"cannot reach {host}"
    return f"{type(e).__name__} from {host}"


# ---------------------------------------------------------------------------------------------------- gutenberg

_START = re.compile(rb"^\*\*\*\s*START OF\b[^\n]*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(rb"^\*\*\*\s*END OF\b[^\n]*$", re.MULTILINE | re.IGNORECASE)
# Older transcriptions repeat the end as a plain line just above the marker: a credit line, not the book.
_END_CREDIT = re.compile(rb"\n[ \t]*End of (the )?Project Gutenberg[^\n]*\s*$", re.IGNORECASE)


def gutenberg_text(raw):
    """The book between the `*** START OF ...` and `*** END OF ...` lines, LF line ends, or None without them."""
    start = _START.search(raw)
    if not start:
        return None
    end = _END.search(raw, start.end())
    if not end:
        return None  # without the END line the licence that follows it would come along
    body = raw[start.end():end.start()].replace(b"\r\n", b"\n")
    body = _END_CREDIT.sub(b"", body).strip()
    if not body:
        return None
    # Valid UTF-8 whatever the source: a stray byte becomes U+FFFD instead of poisoning the corpus.
    return body.decode("utf-8", errors="replace").encode("utf-8")


def read_book_list(path):
    """[(id, title)] from a TSV of `id<TAB>title[<TAB>author]`; blank lines and # comments are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"book list {path} not found") from None
    books, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if not fields[0].strip().isdigit():
            raise UserError(f"{path}:{n}: expected a Project Gutenberg id, got {fields[0]!r}")
        book_id = int(fields[0])
        if book_id in seen:
            raise UserError(f"{path}:{n}: book {book_id} is listed twice")
        seen.add(book_id)
        title = " by ".join(x.strip() for x in fields[1:3] if x.strip()) or f"pg{book_id}"
        books.append((book_id, title))
    if not books:
        raise UserError(f"book list {path} has no books")
    return books


def fetch_gutenberg(out, book_list, cache_dir, mirror, net):
    books = read_book_list(book_list)
    mirror = mirror.rstrip("/")
    book_dir = os.path.join(cache_dir, "gutenberg")
    session = new_session()
    skipped, written, kept = [], 0, 0
    with output_file(out) as f, \
            tqdm(total=len(books), unit="book", desc="gutenberg", file=sys.stderr, dynamic_ncols=True) as bar:
        for book_id, title in books:
            raw_path = os.path.join(book_dir, f"pg{book_id}.txt")
            url = GUTENBERG_BOOK_URL.format(mirror=mirror, id=book_id)
            text, reason = None, "no *** START OF / *** END OF *** markers"
            try:
                download(session, url, raw_path, net, progress=False, desc=f"pg{book_id}")
                with open(raw_path, "rb") as raw:
                    text = gutenberg_text(raw.read())
                if text is None:
                    # Drop the cached copy: it may be an error page, and the next run should ask again.
                    os.remove(raw_path)
            except HTTPStatusError as e:
                reason = f"{e} for {url}"
            if text is None:
                skipped.append(f"pg{book_id} ({title}): {reason}")
                tqdm.write(f"skipped pg{book_id} ({title}): {reason}", file=sys.stderr)
            else:
                f.write(text + DOC_SEPARATOR)
                written += len(text) + len(DOC_SEPARATOR)
                kept += 1
            bar.update(1)
            bar.set_postfix_str(human(written), refresh=False)
        if not kept:
            raise UserError(f"none of the {len(books)} books could be used; {out} left as it was")
    print(f"wrote {out}: {kept} books, {human(written)}", file=sys.stderr)
    if skipped:
        print(f"skipped {len(skipped)} of {len(books)} books: " + "; ".join(skipped), file=sys.stderr)


# ---------------------------------------------------------------------------------------------------- web


def parquet_texts(path, batch_rows=4096):
    """Yield the `text` column of a parquet file, in file order, one record batch at a time.

    DuckDB reads the file and hands back a pyarrow RecordBatchReader, so memory holds one batch of
    documents, never the whole shard.
    """
    import duckdb  # only the web fetcher needs it
    import pyarrow

    con = duckdb.connect()
    try:
        # Each DuckDB thread holds row groups in flight: memory grows with threads, speed hardly does
        # (the Python loop that writes the text is the slow part).
        con.execute("SET threads TO 2")
        try:
            rel = con.read_parquet(path).select("text")
            # to_arrow_reader is DuckDB 2's name for 1.x's fetch_record_batch.
            reader = (rel.to_arrow_reader(batch_rows) if hasattr(rel, "to_arrow_reader")
                      else rel.fetch_record_batch(batch_rows))
        except duckdb.Error as e:
            raise UserError(_duckdb_message(path, e)) from None
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (duckdb.Error, pyarrow.ArrowException) as e:  # surfacing mid-stream: a damaged file
                raise UserError(_duckdb_message(path, e)) from None
            for text in batch.column(0).to_pylist():
                if text:
                    yield text
    finally:
        con.close()


def _duckdb_message(path, e):
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"cannot read the text column of {path}: {first}"


def fetch_web(out, shards, max_bytes, cache_dir, net):
    if not shards:
        raise UserError("no FineWeb-Edu shard URLs given")
    shard_dir = os.path.join(cache_dir, "web")
    session = new_session()
    written = docs = 0
    with output_file(out) as f:
        for i, url in enumerate(shards, 1):
            if written >= max_bytes:
                break
            path = os.path.join(shard_dir, cache_name(url))
            try:
                download(session, url, path, net, desc=f"shard {i}/{len(shards)}")
            except HTTPStatusError as e:
                raise UserError(f"cannot download shard {url}: {e}") from None
            with tqdm(total=max_bytes, initial=written, unit="B", unit_scale=True,
                      desc=f"{os.path.basename(out)} from shard {i}", file=sys.stderr, dynamic_ncols=True) as bar:
                try:
                    for text in parquet_texts(path):
                        doc = text.encode("utf-8", errors="replace") + DOC_SEPARATOR
                        f.write(doc)
                        written += len(doc)
                        docs += 1
                        bar.update(len(doc))
                        if written >= max_bytes:
                            break
                except UserError as e:
                    # A shard that passed the size check but does not parse is not worth keeping.
                    os.remove(path)
                    raise UserError(f"{e} (removed it from the cache; re-run to download it again)") from None
        if not docs:
            raise UserError(f"the shards hold no text; {out} left as it was")
    print(f"wrote {out}: {docs} documents, {human(written)}", file=sys.stderr)
    if written < max_bytes:
        print(f"warning: the shards ran out: all {len(shards)} gave {human(written)} of the {human(max_bytes)} "
              f"asked for", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------- alpaca


def download_to_cache(url, cache_dir, kind, net):
    """One file at url into cache_dir/kind/ (resumable, retried); its path. An HTTP error is one line."""
    path = os.path.join(cache_dir, kind, cache_name(url))
    try:
        download(new_session(), url, path, net, desc=kind)
    except HTTPStatusError as e:
        raise UserError(f"cannot download {url}: {e}") from None
    return path


def fetch_alpaca(out, url, cache_dir, net):
    path = download_to_cache(url, cache_dir, "alpaca", net)
    try:
        n = len(read_alpaca(path))
    except UserError as e:
        os.remove(path)  # a bad download must not satisfy the next run
        raise UserError(f"{url} is not Alpaca data: {e}; {out} left as it was") from None
    with output_file(out) as f, open(path, "rb") as src:
        shutil.copyfileobj(src, f)
    print(f"wrote {out}: {n} examples, {human(os.path.getsize(out))}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------- preferences
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def hh_pair(record):
    """An HH-RLHF record {chosen, rejected} (two transcripts of "\n\nHuman: ..." / "\n\nAssistant: ..." turns
    that differ only in the last assistant reply) -> {prompt, chosen, rejected}: the prompt is the last human
    turn alone, the responses the two final assistant replies, stripped. None when the record does not have
    that shape or a part is empty."""
    if not isinstance(record, dict):
        return None
    parts = []
    for key in ("chosen", "rejected"):
        text = record.get(key)
        if not isinstance(text, str) or ASSISTANT not in text:
            return None
        cut = text.rindex(ASSISTANT)
        parts.append((text[:cut], text[cut + len(ASSISTANT):].strip()))
    (context, chosen), (other_context, rejected) = parts
    if context != other_context or HUMAN not in context:
        return None
    prompt = context[context.rindex(HUMAN) + len(HUMAN):].strip()
    if not prompt or not chosen or not rejected or chosen == rejected:
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def fetch_preferences(out, url, cache_dir, net):
    import gzip
    import zlib

    path = download_to_cache(url, cache_dir, "preferences", net)
    kept = dropped = 0
    try:
        opener = gzip.open if url.split("?")[0].endswith(".gz") else open
        with output_file(out) as f, opener(path, "rt", encoding="utf-8") as src:
            for n, line in enumerate(tqdm(src, desc="pairs", unit=" lines", file=sys.stderr,
                                          dynamic_ncols=True), 1):
                if not line.strip():
                    continue
                try:
                    pair = hh_pair(json.loads(line))
                except ValueError:
                    raise UserError(f"line {n} is not JSON") from None
                if pair is None:
                    dropped += 1
                    continue
                f.write((json.dumps(pair, ensure_ascii=False) + "\n").encode("utf-8"))
                kept += 1
            if not kept:
                raise UserError("no record has the HH-RLHF shape (chosen/rejected transcripts with a final "
                                "assistant reply)")
    except (UserError, gzip.BadGzipFile, EOFError, zlib.error, UnicodeDecodeError) as e:
        os.remove(path)  # a bad download must not satisfy the next run
        reason = e if isinstance(e, UserError) else f"not gzip'd JSONL ({type(e).__name__}: {e})"
        raise UserError(f"{url} is not HH-RLHF preference data: {reason}; {out} left as it was") from None
    print(f"wrote {out}: {kept} pairs ({dropped} records of another shape skipped), "
          f"{human(os.path.getsize(out))}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------- CLI


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m nanoeuler.data.fetch",
                                     description="Download and build the corpora of the nanoeuler pipeline.")
    sub = parser.add_subparsers(dest="corpus", required=True, metavar="CORPUS")
    cache_help = "where downloads are kept between runs (default data/cache)"

    p = sub.add_parser("gutenberg", help="Project Gutenberg classics -> data/gutenberg.txt")
    p.add_argument("--out", default="data/gutenberg.txt")
    p.add_argument("--list", default="data/gutenberg_books.tsv", help="TSV of book ids and titles")
    p.add_argument("--mirror", default=None,
                   help=f"base URL (env NANOEULER_GUTENBERG_MIRROR, default {GUTENBERG_MIRROR})")
    p.add_argument("--cache-dir", default="data/cache", help=cache_help)

    p = sub.add_parser("web", help="a slice of FineWeb-Edu -> data/web.txt")
    p.add_argument("--out", default="data/web.txt")
    p.add_argument("--max-bytes", default=None, type=_size_arg,
                   help=f"size of the output, e.g. 1GB, 200MB (env NANOEULER_WEB_BYTES, default {WEB_BYTES})")
    p.add_argument("--shards", nargs="+", default=None, metavar="URL",
                   help="parquet URLs (env NANOEULER_WEB_SHARDS, default FineWeb-Edu sample/10BT)")
    p.add_argument("--cache-dir", default="data/cache", help=cache_help)

    p = sub.add_parser("alpaca", help="Stanford Alpaca instructions -> data/alpaca.json")
    p.add_argument("--out", default="data/alpaca.json")
    p.add_argument("--url", default=None, help=f"(env NANOEULER_ALPACA_URL, default {ALPACA_URL})")
    p.add_argument("--cache-dir", default="data/cache", help=cache_help)

    p = sub.add_parser("preferences", help="Anthropic HH-RLHF helpful-base pairs -> data/preferences.jsonl")
    p.add_argument("--out", default="data/preferences.jsonl")
    p.add_argument("--url", default=None, help=f"(env NANOEULER_PREFERENCES_URL, default {PREFERENCES_URL})")
    p.add_argument("--cache-dir", default="data/cache", help=cache_help)
    return parser


def _size_arg(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        net = net_settings()
        if args.corpus == "gutenberg":
            mirror = args.mirror or os.environ.get("NANOEULER_GUTENBERG_MIRROR", "").strip() or GUTENBERG_MIRROR
            fetch_gutenberg(args.out, args.list, args.cache_dir, mirror, net)
        elif args.corpus == "web":
            shards = args.shards or os.environ.get("NANOEULER_WEB_SHARDS", "").split() or list(WEB_SHARDS)
            max_bytes = args.max_bytes
            if max_bytes is None:
                text = os.environ.get("NANOEULER_WEB_BYTES", "").strip() or WEB_BYTES
                try:
                    max_bytes = parse_size(text)
                except ValueError as e:
                    raise UserError(f"NANOEULER_WEB_BYTES: {e}") from None
            fetch_web(args.out, shards, max_bytes, args.cache_dir, net)
        elif args.corpus == "alpaca":
            url = args.url or os.environ.get("NANOEULER_ALPACA_URL", "").strip() or ALPACA_URL
            fetch_alpaca(args.out, url, args.cache_dir, net)
        else:
            url = args.url or os.environ.get("NANOEULER_PREFERENCES_URL", "").strip() or PREFERENCES_URL
            fetch_preferences(args.out, url, args.cache_dir, net)
    except ENDINGS as e:  # as the command line ends: one line, and 2, 130 or 141 (errors.exit_status)
        return exit_status(e, interrupted="; re-run to resume the downloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
