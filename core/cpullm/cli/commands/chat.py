"""``cpullm chat [MODEL]``: an interactive conversation in the terminal, streamed.

The model's chat template renders the whole history each turn; when it would not leave room for
an answer (``-n`` tokens, at most half the context), the oldest turns are dropped with a notice.
Commands: ``/reset``, ``/system TEXT`` (``/system`` alone clears it), ``/help``, ``/exit``.
Ctrl-C stops the current answer (the part already shown stays in the history) and returns to
the prompt; Ctrl-D or ``/exit`` leaves. A model without a chat template is refused up front: it
is a base model, so use ``cpullm run`` for plain completion.
"""
from __future__ import annotations

import queue
import re
import sys
import threading

from .common import (add_model_options, add_sampling_options, add_speculative_options, compile_first,
                     load_model, positive_int)

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system message; "
        "/system alone clears it), /help, /exit (or Ctrl-D). Ctrl-C stops an answer.")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def add_parser(sub):
    p = sub.add_parser("chat", help="chat with a model interactively",
                       description="Chat with a model in the terminal; answers stream as they are "
                                   "generated. " + HELP + " A model without a chat template (a base "
                                   "model) is refused: use `cpullm run` for plain completion, or add "
                                   "a chat_template.jinja to its directory.")
    add_model_options(p)
    add_speculative_options(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=positive_int, default=512,
                   help="longest answer in tokens (default 512)")
    add_sampling_options(p)
    p.set_defaults(temperature=0.7)
    p.add_argument("--no-stats", action="store_true", help="do not print speed after each answer")
    return p


def terminal_safe(text: str) -> str:
    """Model output without terminal control sequences (a model's text must not drive the
    terminal); newlines and tabs stay."""
    return _CONTROL.sub(lambda m: "\ufffd" if m.group() != "\r" else "", text)


def not_utf8(text: str) -> str | None:
    """Why ``text`` (from argv or stdin, decoded with surrogateescape) is not UTF-8, or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        return f"it is not valid UTF-8 text ({what} at character {exc.start})"


def require_utf8(option: str, text: str | None) -> None:
    """A PromptError when an argument is not UTF-8 (a prompt in another encoding)."""
    from cpullm.errors import PromptError

    why = None if text is None else not_utf8(text)
    if why is not None:
        raise PromptError(f"{option}: {why}; give UTF-8 text (convert it with iconv -t UTF-8)")


def _say(msg: str) -> None:
    print(f"cpullm: {msg}", file=sys.stderr, flush=True)


class _Answer:
    """Generates in a background thread so Ctrl-C only ever lands in the main thread: the model
    stops cleanly at the next token instead of being interrupted mid-step."""

    def __init__(self, model, ids, max_tokens, sampling):
        from cpullm.generate.generate import GenerationStats

        self.stats = GenerationStats()
        self.cancel = threading.Event()
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(model, ids, max_tokens, sampling),
                                       daemon=True)
        self.thread.start()

    def _run(self, model, ids, max_tokens, sampling):
        try:
            pieces = model.generate(ids, max_new_tokens=max_tokens, stats=self.stats, **sampling)
            try:
                for piece in pieces:
                    self.q.put(("piece", piece))
                    if self.cancel.is_set():
                        break
            finally:
                pieces.close()
            self.q.put(("done", None))
        except BaseException as exc:  # handed to the main thread
            self.q.put(("error", exc))

    def __iter__(self):
        while True:
            kind, data = self.q.get()
            if kind == "piece":
                yield data
            elif kind == "error":
                raise data
            else:
                return

    def stop(self) -> None:
        self.cancel.set()
        while self.thread.is_alive():        # a prefill in flight finishes first
            try:
                self.thread.join()
            except KeyboardInterrupt:
                pass


def _probe(system: str) -> list[dict]:
    """A conversation that shows whether the template accepts a system message."""
    return [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):
        return False


def _readline():
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass


def run(args) -> int:
    from cpullm.generate.chat import Conversation, render_chat, render_template, require_template
    from cpullm.errors import CpullmError
    from cpullm.generate.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                   args.seed).validate()
    require_utf8("--system", args.system)
    if args.model is not None:                # refuse before loading: a base model, a template
        from cpullm.model import resolve_model_dir   # that rejects the system message
        tpl = require_template(resolve_model_dir(args.model))
        if args.system:
            render_template(tpl, _probe(args.system))
    model = compile_first(load_model(args))
    require_template(model)
    conv = Conversation(model)
    if args.system:
        render_chat(model, _probe(args.system))
        conv.system = args.system
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    _readline()
    name = getattr(model.model_dir, "name", str(model.model_dir))
    interactive = _stdin_is_terminal()      # piped lines are turns: no banner, no prompt shown
    if interactive:
        print(f"cpullm chat: {name} ({model.family.name}, {model.quant}, {model.n_ctx}-token context). "
              "Type /help for commands, Ctrl-C stops an answer, Ctrl-D or /exit leaves.", flush=True)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print("", flush=True)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit leaves)", flush=True)
            continue
        except UnicodeDecodeError as exc:        # a strict terminal encoding
            _say(f"error: that line is not valid text in the terminal's encoding ({exc.reason}); "
                 "type it again in UTF-8")
            continue
        why = not_utf8(line)
        if why is not None:
            _say(f"error: that line was ignored: {why}; type it again in UTF-8")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            cmd = cmd.lower()
            if cmd in ("/exit", "/quit", "/bye"):
                return 0
            if cmd == "/reset":
                conv.reset()
                print("(conversation cleared)", flush=True)
            elif cmd == "/system":
                rest = rest.strip()
                if rest:
                    try:
                        render_chat(model, _probe(rest))
                    except CpullmError as exc:
                        _say(f"error: {exc}")
                        continue
                conv.system = rest or None
                print(f"(system message {'set' if rest else 'cleared'})", flush=True)
            elif cmd == "/help":
                print(HELP, flush=True)
            else:
                print(f"unknown command {cmd}; {HELP}", flush=True)
            continue
        try:
            ids, dropped = conv.prompt(line, reserve=args.max_tokens)
        except CpullmError as exc:
            _say(f"error: {exc}")
            continue
        except KeyboardInterrupt:               # Ctrl-C during a slow template render
            print("\n[stopped]", flush=True)
            continue
        if dropped:
            _say(f"context full: dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} "
                 "of the conversation")
        max_tokens = min(args.max_tokens, model.n_ctx - len(ids))
        parts: list[str] = []
        stopped = False
        answer = None
        try:
            try:
                answer = _Answer(model, ids, max_tokens, sampling)
                for piece in answer:
                    parts.append(piece)
                    sys.stdout.write(terminal_safe(piece))
                    sys.stdout.flush()
            except KeyboardInterrupt:
                stopped = True
                if answer is not None:
                    answer.stop()
        except CpullmError as exc:
            print("", flush=True)
            _say(f"error: {exc}")
            continue
        sys.stdout.write("\n")
        if stopped:
            sys.stdout.write("[stopped]\n")
        sys.stdout.flush()
        conv.add(line, "".join(parts))
        if not args.no_stats and answer is not None:
            s = answer.stats
            used = len(ids) + s.generated_tokens
            print(f"[{s.generated_tokens} tokens, {s.decode_tps:.1f} tok/s, context {used}/{model.n_ctx}]",
                  file=sys.stderr, flush=True)
