"""Bytes that are not UTF-8 on the command line and typed into a chat, and a chat template that
never finishes: one-line errors (exit 2), never a traceback, and the chat session goes on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

from test_chat_cli import PROMPT, spawn, with_template  # noqa: E402
from test_server_support import chat_model_dir, cli_env  # noqa: E402


def _cli(*args, timeout=180):
    cmd = [sys.executable.encode(), b"-m", b"cpullm.cli",
           *(a if isinstance(a, bytes) else str(a).encode() for a in args)]
    return subprocess.run(cmd, capture_output=True, env=cli_env(), timeout=timeout)


@pytest.mark.parametrize("args", [
    ("-p", b"caf\xe9 au lait"),                            # Latin-1, not UTF-8
    ("-p", b"hello", "--chat", "--system", b"\xff\xfe"),
])
def test_run_refuses_arguments_that_are_not_utf8(args):
    r = _cli("run", chat_model_dir(), "--threads", 1, "-n", 2, *args)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "not valid UTF-8 text (byte 0x" in err and "give UTF-8 text" in err


def test_chat_ignores_a_line_that_is_not_utf8_and_goes_on():
    child = spawn(chat_model_dir(), "-n", 3, "--no-stats")
    try:
        os.write(child.child_fd, b"caf\xe9\xff\r")
        child.expect("not valid (UTF-8 )?text")
        child.expect_exact(PROMPT)
        child.sendline("hello")                             # the session still answers
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")


def test_a_template_that_never_finishes_is_a_one_line_error(tmp_path):
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    d = with_template(tmp_path, spin)
    r = _cli("run", d, "--threads", 1, "-n", 2, "-p", "hi", "--chat", timeout=170)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "exceeded 10 s" in err and "without --chat" in err
    r = _cli("run", d, "--threads", 1, "-n", 2, "-p", "hi")        # plain completion still works
    assert r.returncode == 0, r.stderr.decode()
