"""Batch jobs (``cpullm batch``): OpenAI's batch file format in, answers out, resumable.

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url": "/v1/chat/completions"
| "/v1/completions", "body": {...}}``. Output: one JSON object per finished request, in the order
they finish, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error":
null}``; a request the server would refuse (a bad field, too long a prompt) has its 4xx status and
the server's error body in ``response``; a line that is no request at all (not JSON, no
``custom_id``, another method or URL, a body that is not an object) gets ``"response": null,
"error": {"code", "message"}``, keyed by its ``custom_id`` or, without one, ``"line-N"``.

Each request runs through the same ASGI application ``cpullm serve`` runs (:func:`call_app`), so
a batch line gets exactly the answer the HTTP server would give. Each finished line is appended
with one write, flushed and fsynced. Resuming: the same command skips the ``custom_id`` s
already in the output; a last line cut short by a crash is dropped first (the file is truncated
after its last complete line), so no finished line is lost and none is written twice. A
``custom_id`` used twice in the input is refused before anything runs.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass

from ..errors import ConfigError
from .openai import json_bytes, surrogate_path

URLS = ("/v1/chat/completions", "/v1/completions")
MAX_LINE_BYTES = 4 * 2**20          # as the server's default --max-request-bytes
MAX_CUSTOM_ID_CHARS = 512


@dataclass
class BatchLine:
    """One input line: its 1-based number, its key, and either a request or why it is none."""
    number: int
    custom_id: str
    url: str | None = None
    body: bytes | None = None       # the request body as sent to the server (JSON, UTF-8)
    error: str | None = None        # the line is malformed: why


def _malformed(number: int, custom_id, why: str) -> BatchLine:
    key = custom_id if isinstance(custom_id, str) and custom_id and len(custom_id) <= MAX_CUSTOM_ID_CHARS \
        else f"line-{number}"
    return BatchLine(number, key, error=f"line {number}: {why}")


def parse_line(number: int, raw: bytes) -> BatchLine:
    """One input line (without its newline) as a :class:`BatchLine`; never raises."""
    if len(raw) > MAX_LINE_BYTES:
        return _malformed(number, None, f"the line is {len(raw)} bytes; the limit is {MAX_LINE_BYTES}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _malformed(number, None, "the line is not UTF-8 text")
    except (ValueError, RecursionError) as exc:
        return _malformed(number, None, f"the line is not valid JSON ({str(exc)[:120]})")
    if not isinstance(obj, dict):
        return _malformed(number, None, f"the line must be a JSON object, not {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _malformed(number, None, "custom_id is required: a non-empty string")
    if len(cid) > MAX_CUSTOM_ID_CHARS or surrogate_path(cid) is not None:
        return _malformed(number, None, f"custom_id must be valid text of at most {MAX_CUSTOM_ID_CHARS} "
                                        "characters")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _malformed(number, cid, f"unknown field {unknown[0]!r}: a line has custom_id, method, "
                                       "url and body")
    if obj.get("method") != "POST":
        return _malformed(number, cid, f"method must be \"POST\", got {json.dumps(obj.get('method'))[:40]}")
    url = obj.get("url")
    if url not in URLS:
        return _malformed(number, cid, f"url must be one of {', '.join(URLS)}, got "
                                       f"{json.dumps(url)[:80]}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _malformed(number, cid, "body must be a JSON object (the request)")
    if body.get("stream") not in (None, False):
        return _malformed(number, cid, "stream is not supported in a batch (each answer is written "
                                       "whole); drop it")
    try:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return _malformed(number, cid, "body holds a lone UTF-16 surrogate, which is not text")
    return BatchLine(number, cid, url=url, body=data)


def read_input(path: str) -> list[BatchLine]:
    """Every non-blank line of the input file; refuses a ``custom_id`` used twice."""
    lines: list[BatchLine] = []
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"cannot read the batch input {path} ({exc.strerror}); give a JSONL file") from None
    with f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):          # skip the rest of the long line
                    raw = f.readline(MAX_LINE_BYTES)
                lines.append(_malformed(number, None, f"the line is over {MAX_LINE_BYTES} bytes"))
                continue
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                lines.append(parse_line(number, raw))
    seen: dict[str, int] = {}
    for ln in lines:
        if ln.custom_id in seen:
            raise ConfigError(f"{path}: custom_id {ln.custom_id[:80]!r} is on lines {seen[ln.custom_id]} "
                              f"and {ln.number}; give every request its own custom_id")
        seen[ln.custom_id] = ln.number
    return lines


def finished_ids(path: str) -> set[str]:
    """The custom_ids already in the output file (absent: none). A last line without its newline
    (a crash while writing it) is cut off, so the file ends with its last complete line."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise ConfigError(f"cannot open the batch output {path} ({exc.strerror})") from None
    with f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    done = set()
    for i, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            cid = json.loads(raw)["custom_id"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} line {i} is not a batch output line; give -o a new file or "
                              "the output of an earlier run of this job") from None
        done.add(cid)
    return done


class OutputWriter:
    """Appends finished lines: one write each, flushed and fsynced before the next."""

    def __init__(self, path: str):
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot write the batch output {path} ({exc.strerror})") from None

    def write(self, obj: dict) -> None:
        data = json_bytes(obj) + b"\n"
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def output_line(line: BatchLine, status: int | None = None, body=None) -> dict:
    """OpenAI's batch output object for ``line``: its answer (status and body) or its error."""
    out = {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": line.custom_id}
    if line.error is not None:
        out["response"] = None
        out["error"] = {"code": "invalid_request", "message": line.error}
    else:
        out["response"] = {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
        out["error"] = None
    return out


JSON_HEADERS = ((b"host", b"localhost"), (b"content-type", b"application/json"))


async def call_app(app, path: str, body: bytes, headers=JSON_HEADERS, cancel: asyncio.Event | None = None,
                   method: str = "POST", query: bytes = b""):
    """Send one HTTP request (``method``, ``path``, ``headers`` as (bytes, bytes) pairs, whole
    ``body``) to an ASGI app in this process. Yields the ASGI messages it sends
    (``http.response.start``, then ``http.response.body`` ones). ``cancel`` set (or this
    generator closed) is the client leaving: the app sees ``http.disconnect``."""
    headers = [(bytes(k).lower(), bytes(v)) for k, v in headers if bytes(k).lower() != b"content-length"]
    if body or method not in ("GET", "HEAD"):
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query, "root_path": "", "client": None, "server": None,
             "headers": headers}
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        waits = [asyncio.ensure_future(e.wait()) for e in (gone, cancel) if e is not None]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return {"type": "http.disconnect"}

    out: asyncio.Queue = asyncio.Queue()

    async def send(message):
        await out.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            msg = await out.get()
            if msg is None:
                break
            yield msg
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 30)
            except (asyncio.TimeoutError, Exception):
                task.cancel()


async def answer_line(app, line: BatchLine, cancel: asyncio.Event | None = None) -> dict:
    """The output object for one line, answered by ``app`` (the server's ASGI application)."""
    if line.error is not None:
        return output_line(line)
    status, chunks = 500, []
    async for msg in call_app(app, line.url, line.body, cancel=cancel):
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))
    raw = b"".join(chunks)
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = {"error": {"message": raw.decode("utf-8", "replace")[:500], "type": "server_error",
                          "param": None, "code": None}}
    return output_line(line, status, body)


def completion_tokens(obj: dict) -> int:
    r = obj.get("response") or {}
    usage = (r.get("body") or {}).get("usage") if isinstance(r.get("body"), dict) else None
    return int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0


class Progress:
    """``done/total, tokens/s, ETA`` on stderr: redrawn in place on a terminal, a line every few
    seconds otherwise."""

    def __init__(self, total: int, already: int, stream=None, every_s: float = 5.0):
        import sys
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.done, self.start_done = total, already, already
        self.errors = self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.every_s = every_s if not self.tty else 0.2
        self.shown = -1

    def update(self, obj: dict) -> None:
        self.done += 1
        r = obj.get("response")
        if obj.get("error") is not None or (r and r.get("status_code") != 200):
            self.errors += 1
        self.tokens += completion_tokens(obj)
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.show()

    def line(self) -> str:
        dt = max(1e-9, time.monotonic() - self.t0)
        ran = self.done - self.start_done
        left = self.total - self.done
        eta = f"{left * dt / ran:.0f} s" if ran and left else ("0 s" if not left else "?")
        return (f"batch: {self.done}/{self.total} done ({self.errors} errors), "
                f"{self.tokens / dt:.1f} tok/s, ETA {eta}")

    def show(self, final: bool = False) -> None:
        if final and not self.tty and self.shown == self.done:
            return
        self.shown = self.done
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


async def run_local(app, lines: list[BatchLine], writer: OutputWriter, progress: Progress,
                    in_flight: int, stop: asyncio.Event) -> int:
    """Answer ``lines`` with at most ``in_flight`` at once, writing each as it finishes. When
    ``stop`` is set, nothing new starts and the running ones are cancelled (not written: a rerun
    does them). Returns the lines written."""
    queue = list(reversed(lines))
    written = 0
    running: set = set()

    async def one(line):
        return await answer_line(app, line, cancel=stop)

    while (queue or running) and not stop.is_set():
        while queue and len(running) < in_flight:
            running.add(asyncio.ensure_future(one(queue.pop())))
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait(running | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        for t in done - {stopper}:
            running.discard(t)
            if stop.is_set():
                continue
            obj = t.result()
            writer.write(obj)
            written += 1
            progress.update(obj)
    for t in running:
        t.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)
    return written


def build_app(options: dict, **app_options):
    """Load the model ``options`` names (see ``cpullm.cli.commands.batch.load_options``) and
    build the server's ASGI application over it (``app.engine`` is its engine). ``app_options``
    go to :func:`cpullm.serve.http.create_app` (an API key, body limits)."""
    import cpullm

    from .http import create_app

    if options.get("template_timeout"):
        from ..generate import chat
        chat.RENDER_TIMEOUT_S = float(options["template_timeout"])
    name = options.get("model")
    if name is None:
        from ..store import ensure_default_model
        name = ensure_default_model()
    model = cpullm.load(name, quant=options.get("quant"), threads=options.get("threads"),
                        n_ctx=options.get("n_ctx"), cache_dir=options.get("cache_dir"),
                        use_cache=options.get("use_cache", True), kv_dtype=options.get("kv_dtype"))
    return create_app(model, model_id=options.get("model_id"), parallel=options.get("parallel"),
                      prefix_cache_bytes=options.get("prefix_cache_bytes"),
                      max_tokens_cap=options.get("max_tokens_cap", 1024),
                      request_timeout=options.get("request_timeout"),
                      prefill_chunk=options.get("prefill_chunk"), **app_options)
