"""``cpullm chat``, driven through a pseudo-terminal as a person would: streaming answers, history
within the context, /reset, /system, /exit, Ctrl-C stopping an answer, Ctrl-D leaving; and the
errors for models whose template refuses a system message or that have no template at all."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

from test_chat_templates import GEMMA2  # noqa: E402
from test_server_support import chat_model_dir, cli_env  # noqa: E402

PROMPT = ">>> "


def _as_at_a_terminal():
    """In the child: SIGINT back to its default. A test run started as a background job (``cmd &``
    in a script) ignores SIGINT, and the chat would inherit that: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(model_dir, *args):
    cmd = [sys.executable, "-m", "cpullm.cli", "chat", str(model_dir), "--threads", "1", *map(str, args)]
    child = pexpect.spawn(cmd[0], cmd[1:], env=cli_env(), encoding="utf-8", codec_errors="replace",
                          timeout=120, dimensions=(40, 200), preexec_fn=_as_at_a_terminal)
    child.expect(r"cpullm chat: \S+ \(llama, int8, \d+-token context\)")
    child.expect_exact(PROMPT)
    return child


def stats(child):
    child.expect(r"\[(\d+) tokens, [\d.]+ tok/s, context (\d+)/(\d+)\]")
    return tuple(int(g) for g in child.match.groups())


def with_template(tmp_path, template):
    """The shared tiny model's files with another tokenizer_config.json (hard links or copies:
    a symlink leading out of the model directory is refused)."""
    d = tmp_path / "model"
    d.mkdir()
    for f in chat_model_dir().iterdir():
        if f.name != "tokenizer_config.json":
            try:
                os.link(f, d / f.name)
            except OSError:
                shutil.copy2(f, d / f.name)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template} if template else {}))
    return d


def test_conversation_keeps_history_drops_oldest_turns_and_system_commands():
    child = spawn(chat_model_dir(), "--ctx", 320, "-n", 40, "--temperature", 0, "--system", "Be terse.")
    child.sendline("hello")
    n, used1, n_ctx = stats(child)
    assert (n, n_ctx) == (40, 320)
    child.expect_exact(PROMPT)
    child.sendline("and again")
    n, used2, _ = stats(child)
    assert used2 > used1 + 40                 # the first turn is part of the second prompt
    child.expect_exact(PROMPT)
    dropped = False
    for i in range(4):                        # the context fills up: the oldest turns go
        child.sendline(f"message {i}")
        k = child.expect([r"context full: dropped the oldest \d+ turns?", r"\[\d+ tokens"])
        if k == 0:
            dropped = True
            _, used, _ = stats(child)
            assert used <= 320
            child.expect_exact(PROMPT)
            break
        child.expect_exact(PROMPT)
    assert dropped

    def fresh_hello():
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(PROMPT)
        child.sendline("hello")
        used = stats(child)[1]
        child.expect_exact(PROMPT)
        return used

    assert fresh_hello() == used1             # a fresh conversation; the system message stays
    child.sendline("/system")                 # cleared: the template's default system prompt
    child.expect_exact("(system message cleared)")
    child.expect_exact(PROMPT)
    assert fresh_hello() != used1
    child.sendline("/system Be terse.")
    child.expect_exact("(system message set)")
    child.expect_exact(PROMPT)
    assert fresh_hello() == used1
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_and_commands(tmp_path):
    child = spawn(with_template(tmp_path, GEMMA2), "--ctx", 1024, "-n", 900)
    child.sendline("tell me a long story")
    child.expect(r"tell me a long story\r\n")  # the echo; then the answer streams
    child.expect(r"\S")                       # some of the answer has arrived
    child.sendintr()
    child.expect_exact("[stopped]")
    n, used, _ = stats(child)
    assert 0 < n < 900
    child.expect_exact(PROMPT)
    # Gemma 2's template refuses a system role: the error names it and the chat goes on
    child.sendline("/system You are terse.")
    child.expect("error: the model's chat template rejected the conversation: System role not supported")
    child.expect_exact(PROMPT)
    child.sendline("/bogus")
    child.expect_exact("unknown command /bogus")
    child.expect_exact(PROMPT)
    child.sendline("/help")
    child.expect_exact("/reset")
    child.expect_exact(PROMPT)
    child.sendintr()                          # Ctrl-C at the prompt does not leave
    child.expect_exact("(Ctrl-D or /exit leaves)")
    child.expect_exact(PROMPT)
    child.sendline("short one")               # the earlier (stopped) turn stays in the history
    child.expect(r"short one\r\n")
    child.expect(r"\S")
    child.sendintr()
    child.expect_exact("[stopped]")
    _, used2, _ = stats(child)
    assert used2 > used
    child.expect_exact(PROMPT)
    child.sendeof()                           # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cpullm.cli", *map(str, args)], capture_output=True,
                          text=True, env=cli_env(), timeout=180)


def test_template_errors_are_one_line(tmp_path):
    gemma = with_template(tmp_path, GEMMA2)
    r = _cli("chat", gemma, "--threads", 1, "--system", "Be brief.")
    assert r.returncode == 2
    assert r.stderr.strip() == ("cpullm: error: the model's chat template rejected the conversation: "
                                "System role not supported")
    shutil.rmtree(gemma)
    base = with_template(tmp_path, None)
    for args in (("chat", base), ("run", base, "-p", "hi", "--chat", "-n", 2)):
        r = _cli(*args, "--threads", 1)
        assert r.returncode == 2, r
        line = r.stderr.strip()
        assert "\n" not in line and re.match(r"cpullm: error: .* has no chat template", line)
        assert "without --chat" in line
