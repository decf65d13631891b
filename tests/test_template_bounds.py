"""Hostile chat templates: every render is bounded in time and memory, runs in a worker process
that holds no secrets, can be cancelled, and old or hook-less jinja2 is refused. Each test is
bounded by an alarm, so a render that is not bounded fails instead of hanging the run."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from cpullm.generate import chat
from cpullm.generate.chat import RenderCancelled, render_template
from cpullm.errors import ChatTemplateError, TemplateLimitError

HI = [{"role": "user", "content": "Hi"}]
TEST_BOUND_S = 90          # per test: far beyond the render limits below, only there to stop a hang


class Hung(Exception):
    pass


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    """Render limits small enough for quick tests, and an alarm for the test itself."""
    monkeypatch.setattr(chat, "RENDER_TIMEOUT_S", 3.0)
    monkeypatch.setattr(chat, "RENDER_MEMORY_MB", 256)

    def hung(signum, frame):
        raise Hung(f"the test ran past {TEST_BOUND_S} s: the render is not bounded")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(TEST_BOUND_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _worker_pid() -> int:
    w = chat._worker
    assert w is not None and w.alive(), "no render worker is running"
    return w.proc.pid


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


# ---- time -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ lipsum(1000000, min=1000, max=1001) }}",
    "{{ ('x' * 1000000)|wordwrap(1) }}",
    "{% set ns = namespace(s='') %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% set ns.s = ns.s ~ 'a' %}{% endfor %}{% endfor %}",
], ids=["nested-loops", "lipsum", "wordwrap", "namespace-append"])
def test_slow_templates_are_stopped_with_the_fix_named(template):
    with pytest.raises(TemplateLimitError, match=r"exceeded (3 s|256 MB).*/v1/completions.*without --chat"):
        render_template(template, HI)
    assert render_template("{{ messages[0].content }}", HI) == "Hi"       # a fresh worker serves on


# ---- memory -----------------------------------------------------------------------------------------
def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("template", [
    "{% set s = namespace(v='ab') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v|length }}",
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(2000) %}{% set ns.s = ns.s ~ ('a' * 1000000) %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}{{ d('ab', 40) }}",
], ids=["namespace-doubling", "namespace-append-1MB", "macro-doubling"])
def test_memory_bombs_are_stopped_in_the_worker(template):
    before = _rss()
    with pytest.raises(TemplateLimitError, match=r"exceeded (256 MB|3 s).*/v1/completions"):
        render_template(template, HI)
    assert _rss() - before < 200 * 2**20        # the caller's memory did not grow with the bomb
    assert render_template("{{ 'ok' }}", HI) == "ok"


# ---- format widths --------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{{ '{0:>{1}}'.format(1, '999999999') }}",                # a width from a nested field, as text
    "{{ '{0:{1}}'.format('x', '>999999999') }}",
    "{{ '{x:{w}}'.format_map({'x': 1, 'w': '99999999'}) }}",
    "{{ '%*d' % (999999999, 1) }}",                           # a * width from the arguments
    "{{ '%.*f' % (999999999, 1.5) }}",
    "{{ '%*d'|format(999999999, 1) }}",
])
def test_format_widths_from_arguments_are_bounded(template):
    with pytest.raises(ChatTemplateError, match="format width over a million"):
        render_template(template, HI)


def test_ordinary_formatting_still_works():
    assert render_template("{{ '{0:>{1}}'.format(1, '3') }}|{{ '%*d' % (3, 7) }}|{{ '%-*s|' % (4, 'a') }}"
                           "{{ '{:08.3f}'.format(3.14159) }}", HI) == "  1|  7|a   |0003.142"


# ---- the sandbox escape class ----------------------------------------------------------------------------
def test_old_jinja2_is_refused_with_the_fix(monkeypatch):
    import jinja2

    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    with pytest.raises(ChatTemplateError, match=r"CVE-2025-27516.*jinja2>=3\.1\.6.*without --chat"):
        render_template("{{ 'hi' }}", HI)


def test_jinja2_without_the_format_hook_is_refused(monkeypatch):
    from jinja2 import sandbox

    monkeypatch.delattr(sandbox.SandboxedEnvironment, "wrap_str_format")
    with pytest.raises(ChatTemplateError, match="wrap_str_format.*jinja2>=3.1.6"):
        render_template("{{ 'hi' }}", HI)


@pytest.mark.parametrize("template", [
    "{{ '{0.__class__.__mro__}'|attr('format')(1) }}",                      # CVE-2025-27516's shape
    "{{ ('{0.__class__}'|attr('format'))(messages) }}",
    "{% set f = '{0.__init__.__globals__}'.format %}{{ f(cycler) }}",      # CVE-2024-56326's shape
    "{{ '{0.__class__}'.format_map({'0': 1}) }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
])
def test_format_method_escapes_are_blocked(template):
    with pytest.raises(ChatTemplateError, match="unsafe|failed to render"):
        render_template(template, HI)


def test_the_worker_holds_no_secrets(monkeypatch):
    """Even a sandbox escape would find no API key or token: the worker has an empty
    environment and no arguments but its own script."""
    chat.stop_render_worker()
    monkeypatch.setenv("CPULLM_API_KEY", "sk-secret-in-env")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    assert render_template("{{ 'x' }}", HI) == "x"
    pid = _worker_pid()
    assert pid != os.getpid()
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"secret" not in environ and b"hf_" not in environ
    assert cmdline[-2].endswith(b"template_sandbox.py") and b"secret" not in b" ".join(cmdline)


# ---- cancelling and stopping ---------------------------------------------------------------------------
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_cancelled_render_stops_its_work(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_TIMEOUT_S", 60.0)
    render_template("{{ 'warm' }}", HI)
    pid = _worker_pid()
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    with pytest.raises(RenderCancelled):
        render_template(SPIN, HI, cancel=cancel)
    assert not _alive(pid)                   # the spinning worker is gone, not left to finish


def test_stop_render_worker_ends_a_render_in_flight(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_TIMEOUT_S", 60.0)
    render_template("{{ 'warm' }}", HI)
    threading.Timer(0.5, chat.stop_render_worker).start()
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_template(SPIN, HI)
    assert time.monotonic() - t0 < 45        # did not wait for the 60 s render limit
    assert render_template("{{ 'again' }}", HI) == "again"


def test_variables_must_be_json_values():
    with pytest.raises(ChatTemplateError, match="JSON values"):
        render_template("{{ x }}", HI, x=object())
