"""The command line as llama.cpp and Ollama users type it: llama.cpp's option spellings beside
ours, no prefix matching (a mistyped option names the nearest real one), a positional prompt,
piped stdin as the prompt, and `run` without a prompt opening the chat."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cpullm.cli import build_parser, main
from cpullm.cli.commands.common import settle_model_args

from test_server_support import chat_model_dir, cli_env  # noqa: E402


def _parse(*argv):
    args = build_parser().parse_args([str(a) for a in argv])
    settle_model_args(args, getattr(args, "model_spare", None))
    return args


def test_llama_cpp_spellings_mean_the_same_as_ours():
    ours = _parse("run", "M", "-p", "hi", "--threads", 3, "--ctx", 256, "--seed", 7, "--max-tokens", 9,
                  "--temperature", 0.5, "--repetition-penalty", 1.1)
    theirs = _parse("run", "-m", "M", "-p", "hi", "-t", 3, "-c", 256, "-s", 7, "--n-predict", 9,
                    "--temp", 0.5, "--repeat-penalty", 1.1)
    keys = ("model", "prompt", "threads", "ctx", "seed", "max_tokens", "temperature", "repetition_penalty")
    assert [getattr(ours, k) for k in keys] == [getattr(theirs, k) for k in keys] == \
        ["M", "hi", 3, 256, 7, 9, 0.5, 1.1]
    assert _parse("run", "M", "--ctx-size", 512).ctx == 512
    serve = _parse("serve", "-m", "M", "-np", 3, "--alias", "mine")
    assert (serve.model, serve.parallel, serve.model_name) == ("M", 3, "mine")


def test_gpu_layers_are_accepted_with_a_notice(capsys, monkeypatch):
    monkeypatch.delenv("CPULLM_QUIET", raising=False)
    args = _parse("run", "M", "-ngl", 0)            # once "-n gl": invalid int value: 'gl'
    assert args.model == "M" and args.max_tokens is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-ngl 0 ignored" in err and "CPU" in err
    _parse("serve", "M", "--n-gpu-layers", 99)
    assert "-ngl 99 ignored" in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["run", "M", "--top", "5"], "did you mean --top-k or --top-p?"),      # no prefix guessing
    (["run", "M", "--temperatur", "1"], "did you mean --temperature?"),
    (["run", "M", "--repeat_penalty", "1.1"], "did you mean --repeat-penalty?"),
    (["serve", "M", "--max-token-cap", "5"], "did you mean --max-tokens-cap?"),
    (["chat", "M", "--sytem", "x"], "did you mean --system?"),
])
def test_a_mistyped_option_names_the_nearest_one(capsys, argv, hint):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown option {argv[2]}; {hint}" in err


def test_options_may_come_between_the_positionals():
    args = _parse("run", "M", "-n", 5, "the prompt", "-t", 2)
    assert (args.model, args.prompt_text, args.max_tokens, args.threads) == ("M", "the prompt", 5, 2)


def test_a_stray_argument_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["run", "M", "prompt", "extra"])
    assert "unexpected argument(s): extra" in capsys.readouterr().err


def test_help_groups_the_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    order = [out.index(f"\n  {c} ") for c in ("run", "chat", "serve", "pull", "list", "show", "rm", "ps",
                                                "bench", "convert", "cache")]
    assert order == sorted(order)
    assert out.index("run a model:") < out.index("manage models:") < out.index("tools:")


def test_the_prompt_is_given_once(capsys):
    assert main(["run", "M", "positional", "-p", "and option"]) == 2
    assert "give the prompt once" in capsys.readouterr().err
    assert main(["run", "A", "-m", "B", "prompt"]) == 2          # -m with a model positional too
    assert "two models given ('A' and -m 'B')" in capsys.readouterr().err


def _cli(*args, stdin=b"", timeout=300):
    cmd = [sys.executable, "-m", "cpullm.cli", *map(str, args)]
    return subprocess.run(cmd, input=stdin, capture_output=True, env=cli_env(), timeout=timeout)


def test_positional_prompt_and_piped_stdin_give_the_same_text():
    model = chat_model_dir()
    common = ["-t", 1, "-c", 128, "-n", 5, "--no-stats"]
    a = _cli("run", model, "Once upon a time", *common)
    b = _cli("run", "-m", model, *common, stdin=b"Once upon a time")
    c = _cli("run", model, "-p", "Once upon a time", *common)
    for r in (a, b, c):
        assert r.returncode == 0, r.stderr.decode()
    assert a.stdout == b.stdout == c.stdout and a.stdout.strip()


def test_piped_chat_has_no_banner_or_prompt_marks():
    """Piped lines are turns and stdout holds exactly the answers, each ended by one newline
    (a random model's answer may itself hold newlines, so the answers are computed here)."""
    import cpullm
    from cpullm.cli.commands.chat import terminal_safe
    from cpullm.generate.chat import Conversation

    r = _cli("chat", chat_model_dir(), "-t", 1, "-c", 256, "-n", 3, "--no-stats",
             "--temperature", 0, stdin=b"hello\nand again\n")
    out = r.stdout.decode("utf-8", "surrogateescape")
    assert r.returncode == 0, r.stderr.decode()
    assert ">>>" not in out and "cpullm chat:" not in out and "/help" not in out
    model = cpullm.load(chat_model_dir(), threads=1, n_ctx=256)
    conv, expected = Conversation(model), ""
    for line in ("hello", "and again"):
        ids, _ = conv.prompt(line, reserve=3)
        answer = "".join(model.generate(ids, max_new_tokens=3, temperature=0.0))
        conv.add(line, answer)
        expected += terminal_safe(answer) + "\n"
    assert out == expected


def test_run_without_a_prompt_on_a_terminal_opens_the_chat():
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "cpullm.cli", "run", str(chat_model_dir()), "-t", "1",
                                           "-c", "256", "-n", "3"], env=cli_env(), timeout=300,
                          encoding="utf-8")
    try:
        child.expect_exact("cpullm chat:")
        child.expect_exact(">>> ")
        child.sendline("hello")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_run_options_that_need_a_prompt_refuse_the_chat(monkeypatch, capsys):
    monkeypatch.setattr("cpullm.cli.commands.run._stdin_is_terminal", lambda: True)
    assert main(["run", "M", "--json"]) == 2
    assert "--json needs a prompt" in capsys.readouterr().err
