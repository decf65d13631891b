"""The chat page (``GET /``) in headless Chromium, driven over the DevTools protocol (on a pipe,
so no extra Python packages): type a message, read the streamed answer, check it against the API,
set temperature and max tokens in the page, keep history, stop an answer."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from test_server_support import shared_server  # noqa: E402

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="chromium is not installed "
                                "(apt-get install -y chromium) - the web page test needs it")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-pipe"]


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (replies out)."""

    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="cpullm-chromium-")
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        to_r, from_w = (self._high(fd) for fd in (to_r, from_w))   # never 3 or 4 themselves
        self.log = open(os.path.join(self.profile, "chromium.log"), "w")
        cmd = [BROWSER, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        # bash places the pipe ends on fds 3 and 4, where --remote-debugging-pipe looks for them
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-', "bash", *cmd],
            pass_fds=(to_r, from_w), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(to_r)
        os.close(from_w)
        self._next = 0
        self._replies: dict = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = None

    @staticmethod
    def _high(fd: int) -> int:
        import fcntl
        high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
        os.close(fd)
        return high

    def _read(self):
        buf = b""
        while True:
            data = os.read(self._from_r, 65536)
            if not data:
                with self._cond:
                    self._replies["eof"] = True
                    self._cond.notify_all()
                return
            buf += data
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()

    def call(self, method, params=None, session=True, timeout=60):
        with self._cond:
            self._next += 1
            mid = self._next
        msg = {"id": mid, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies:
                if self._replies.get("eof"):
                    raise RuntimeError(f"chromium exited: {open(self.log.name).read()[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply to {method} in {timeout}s")
                self._cond.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self, url):
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Page.navigate", {"url": url})

    def js(self, expression):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(expression)
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expression}; page state: "
                             f"{self.js('document.body && document.body.innerText')!r}")

    def type(self, selector, text, replace=True):
        """Focus an element and type into it (as keyboard input, not by setting .value)."""
        self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); "
                f"{'e.select();' if replace else ''} }})()")
        self.call("Input.insertText", {"text": text})

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13,
                                                 **({"text": "\r"} if kind == "keyDown" else {})})

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_w)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page():
    server = shared_server()
    b = Browser()
    try:
        b.open(server.url + "/")
        b.wait_for("document.body && document.body.dataset.state === 'idle'")
        yield b, server
    finally:
        b.close()


def _api_answer(server, messages, max_tokens):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tinychat", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["message"]["content"]


ANSWER_DONE = "document.querySelectorAll('.msg.assistant[data-done]').length"


def test_page_loads_with_the_model_and_headers(page):
    b, server = page
    assert b.js("document.getElementById('model').textContent").startswith("tinychat")
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(server.url + "/static/app.js").status_code == 200


def test_typed_message_streams_an_answer_with_speed(page):
    b, server = page
    b.type("#temperature", "0")
    b.type("#max-tokens", "24")
    # record every change of the answer as it streams in
    b.js("window.__updates = []; new MutationObserver(rs => { for (const r of rs) { const e = "
         "r.target.nodeType === 1 ? r.target : r.target.parentElement; const m = e && e.closest("
         "'.msg.assistant'); if (m) window.__updates.push(m.textContent); } }).observe("
         "document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); true")
    b.type("#prompt", "Hello there")
    b.press_enter()
    b.wait_for(f"{ANSWER_DONE} === 1")
    answer = b.js("document.querySelector('.msg.assistant').textContent")
    assert b.js("document.querySelector('.msg.user').textContent") == "Hello there"
    assert answer == _api_answer(server, [{"role": "user", "content": "Hello there"}], 24)
    updates = [u for u in b.js("window.__updates") if u]
    assert len(updates) > 1 and updates[-1] == answer          # it grew piece by piece
    assert all(answer.startswith(u) for u in updates)
    stats = b.js("document.getElementById('stats').textContent")
    assert re.match(r"^24 tokens · \d+(\.\d+)? tok/s", stats), stats
    assert float(b.js("document.getElementById('stats').dataset.tps")) > 0
    assert b.js("document.body.dataset.state") == "idle"
    assert b.js("document.getElementById('prompt').value") == ""

    # a second turn carries the conversation
    b.type("#max-tokens", "5")
    b.type("#prompt", "And again")
    b.press_enter()
    b.wait_for(f"{ANSWER_DONE} === 2")
    second = b.js("document.querySelectorAll('.msg.assistant')[1].textContent")
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "And again"}]
    assert second == _api_answer(server, history, 5)
    assert b.js("document.getElementById('stats').textContent").startswith("5 tokens")


def test_stop_button_and_new_chat(page):
    b, server = page
    b.type("#max-tokens", "300")
    # The tiny model writes 300 tokens in well under 0.1 s, faster than a round trip from this
    # process: the page itself clicks Stop the moment the first piece of the answer shows.
    click_on_first_text = (
        "window.__stopper = new MutationObserver(() => { const m = document.querySelectorAll("
        "'.msg.assistant'); const last = m[m.length - 1]; if (last && last.textContent && "
        "!last.dataset.done) { window.__stopper.disconnect(); document.getElementById('stop').click(); } });"
        " window.__stopper.observe(document.getElementById('messages'), {childList: true, subtree: true,"
        " characterData: true}); true")
    # A stop can still come too late: the model may end (EOS) before its first piece, or the
    # server may have written all 300 tokens before the page's abort reaches it. Each attempt
    # starts a new chat, so a finished answer never fills the context of the next one.
    for attempt in range(5):
        b.js("document.getElementById('reset').click(); true")
        cancelled = server.health()["cancelled"]
        b.js(click_on_first_text)
        b.type("#prompt", "Go on for a while")
        b.press_enter()
        b.wait_for("(document.querySelectorAll('.msg.assistant')[0] || {}).textContent")
        b.wait_for("document.body.dataset.state === 'idle'")
        stopped = b.js("document.getElementById('status').textContent") == "stopped"
        if stopped and server.wait_idle()["cancelled"] == cancelled + 1:
            break
    assert b.js("document.getElementById('status').textContent") == "stopped"
    h = server.wait_idle()                     # the server stopped generating for the page too
    assert h["cancelled"] == cancelled + 1
    b.js("document.getElementById('reset').click(); true")
    assert b.js("document.querySelectorAll('.msg').length") == 0


def test_thinking_is_collapsed_and_tool_calls_are_shown(page):
    """The page's rendering of a thinking model's reasoning deltas (a collapsed block above the
    answer) and of tool-call deltas (one line per call, kept in the history); a tools box with
    bad JSON is an error in the page, not a request."""
    b, server = page
    b.js("document.getElementById('reset').click(); true")
    shown = b.js("(() => { const el = addMessage('assistant', ''); const p = answerParts(el); "
                 "addThinking(p, 'Let me '); addThinking(p, 'see.'); p.content.textContent = 'Paris.'; "
                 "addToolCall(p, {id: 'c1', function: {name: 'get_weather', arguments: '{\"city\": \"Paris\"}'}}); "
                 "const d = el.querySelector('details.thinking'); return JSON.stringify({open: d.open, "
                 "thinking: d.textContent, content: el.querySelector('.content').textContent, "
                 "call: el.querySelector('.tool-call').textContent, calls: p.calls}); })()")
    got = json.loads(shown)
    assert got["open"] is False and got["thinking"] == "thinkingLet me see." and got["content"] == "Paris."
    assert got["call"] == '\u2192 get_weather({"city": "Paris"})'
    assert got["calls"] == [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    b.js("document.getElementById('reset').click(); true")
    b.js("document.getElementById('tools').value = '[not json'; true")
    before = server.health()["requests"]
    b.type("#prompt", "Hi")
    b.press_enter()
    b.wait_for("document.querySelectorAll('.msg.error').length === 1")
    assert b.js("document.querySelector('.msg.error').textContent").startswith("error: tools:")
    assert server.health()["requests"] == before
    b.js("document.getElementById('tools').value = ''; document.getElementById('reset').click(); true")
