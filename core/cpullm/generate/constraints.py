"""Constrained decoding: a per-sequence :class:`Constraint` that says which tokens may come next, so
the output is guaranteed to match a JSON schema, a regular expression, a grammar or a choice.

Built on llguidance (the optional extra ``cpullm[structured]``): it compiles a grammar into a lexer
and an Earley parser over the tokenizer's token bytes and computes each step's mask in well under a
millisecond for a 152k-token vocabulary, releasing the GIL while it does (so the scheduler computes
the next step's masks while the forward pass runs). One spec kind per constraint::

    {"json_schema": {...}}     JSON Schema (OpenAI's strict structured-outputs subset and more:
                               llguidance's JSON compiler; unsupported keywords are refused)
    {"json_object": True}      any JSON object
    {"regex": "[0-9]+"}        a regular expression (Rust regex syntax, matched whole)
    {"lark": "start: ..."}     llguidance's Lark dialect, which can embed %json{...} schemas and
                               lazy (triggered) lexemes, see docs/structured.md
    {"gbnf": "root ::= ..."}   llama.cpp's GBNF, translated to Lark (Lark text is passed through)
    {"choice": ["yes", "no"]}  exactly one of these strings

What a request may send is bounded before anything is compiled (cpullm.limits: size, nesting,
enum size, regex size) and while compiling (llguidance's parser limits: lexer fuel, lexer states,
grammar size), so a hostile schema is refused, never a hang.
"""
from __future__ import annotations

import json
import re
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConstraintError, MissingDependencyError
from ..toolcalls import JSON_OPTIONS  # the one JSON layout of constrained output and tool calls
from ..limits import (MAX_CHOICE_BYTES, MAX_CONSTRAINT_BYTES, MAX_ENUM_VALUES, MAX_REGEX_BYTES, MAX_REGEX_EXPANSION,
                     MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, one_line)

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")

INSTALL_HINT = "pip install 'cpullm[structured]'"

"""How constrained JSON is laid out: one line, ``", "`` and ``": "`` between items (what models
write by habit). No free whitespace: a small model can otherwise emit newlines until max_tokens.
A schema's own ``"x-guidance"`` object overrides these (llguidance's JSON options)."""

PARSER_LIMITS = dict(
    initial_lexer_fuel=1_000_000,    # building the lexer's regexes: ~20 ms of work at most
    step_lexer_fuel=200_000,         # one mask: ~15 ms at most
    step_max_items=50_000,           # Earley items per mask
    max_lexer_states=50_000,         # ~100 MB at most of lexer states
    max_grammar_size=200_000,        # symbols in the compiled grammar
)
"""llguidance's own bounds on compiling and on each step (its defaults, with fewer lexer states
and a smaller grammar: the lexer's memory is the one unbounded-looking cost)."""


def load_llguidance():
    try:
        import llguidance
        import llguidance.gbnf_to_lark  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            f"constrained decoding (JSON schema, regex, grammar, choice) needs llguidance: {INSTALL_HINT}"
        ) from None
    return llguidance


def available() -> bool:
    """True when llguidance is installed (constrained requests can run)."""
    try:
        load_llguidance()
        return True
    except MissingDependencyError:
        return False


# ---- the token table: each token's bytes, built once per tokenizer -------------------------------
_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_table(tokenizer, vocab_size: int | None = None, eos_ids=None):
    """llguidance's view of ``tokenizer`` (a cpullm Tokenizer, from tokenizer.json or a GGUF
    vocabulary: both wrap a ``tokenizers.Tokenizer``, whose serialized form llguidance reads for
    every token's bytes: byte-level BPE, SentencePiece with byte fallback, WordPiece).
    ``vocab_size``: rows of the model's logits (may exceed the tokenizer's tokens; the extra ids
    are never allowed). ``eos_ids``: the tokens that end the sequence, allowed once the
    constraint accepts. Costs a few seconds for a 152k vocabulary; cached per tokenizer."""
    llg = load_llguidance()
    n = int(vocab_size or tokenizer.vocab_size)
    known = min(n, int(tokenizer.vocab_size))        # ids the tokenizer has (llguidance's bound)
    eos = sorted({int(i) for i in (eos_ids or ()) if 0 <= int(i) < known})
    if not eos and tokenizer.eos_token_id is not None and tokenizer.eos_token_id < known:
        eos = [int(tokenizer.eos_token_id)]
    key = (n, tuple(eos))
    with _tables_lock:
        per = _tables.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=n, eos_token=eos or None)
            except Exception as exc:        # llguidance's tokenizer import raises plain errors
                raise ConstraintError(f"this model's tokenizer cannot be used for constrained decoding: "
                                      f"{one_line(exc)}") from None
        return per[key]


# ---- checking a spec before compiling it -----------------------------------------------------------
def _check_text(kind: str, text, limit: int) -> str:
    if not isinstance(text, str):
        raise ConstraintError(f"{kind} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ConstraintError(f"{kind} is empty: give a {kind.replace('_', ' ')}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ConstraintError(f"{kind} is {size} bytes, more than the {limit} allowed; simplify it")
    return text


_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def regex_expansion(regex: str) -> int:
    """An upper estimate of how long ``regex`` is with its counted repetitions written out
    (``(a{1000}){1000}`` is a million): a group's size is the sum of its parts, a count multiplies
    what it follows. llguidance's fuel limits bound the lexer's work per step, but not the
    expansion of counts when the regex is first parsed."""
    stack = [0]                 # sizes of the open groups
    last = 0                    # size of the atom or group just before the current position
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            last = 1
            stack[-1] += 1
            i += 2
            continue
        if ch == "[":
            j = i + 1
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            last = 1
            stack[-1] += 1
            i = j + 1
            continue
        if ch == "(":
            stack.append(0)
        elif ch == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] += last
        elif ch in "|^$":
            pass
        elif ch == "{" and (m := _COUNT.match(regex, i)):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            stack[-1] += last * (count - 1)
            last *= count
            i = m.end()
            continue
        else:
            last = 1
            stack[-1] += 1
        i += 1
    return sum(stack)


def check_schema(schema) -> None:
    """Refuse a JSON schema that is not an object, or too large, deep or wide to compile safely
    (iterative: a schema may nest deeper than Python's recursion limit)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    nodes = 0
    stack = [(schema, "#", 0)]
    while stack:
        value, where, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ConstraintError(f"json_schema has more than {MAX_SCHEMA_NODES} values; simplify it")
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {where}; "
                                  "flatten it")
        if isinstance(value, dict):
            for k in ("enum", "required"):
                v = value.get(k)
                if isinstance(v, list) and len(v) > MAX_ENUM_VALUES:
                    raise ConstraintError(f"json_schema {k} at {where} has {len(v)} values, more than "
                                          f"the {MAX_ENUM_VALUES} allowed")
            stack.extend((v, f"{where}/{k}", depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}/{i}", depth + 1) for i, v in enumerate(value))
    try:
        size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"json_schema is not JSON: {one_line(exc)}") from None
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"json_schema is {size} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed")


def _grammar_text(spec) -> tuple[str, str]:
    """(kind, llguidance grammar text) for a spec dict, after the size checks."""
    llg = load_llguidance()
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        got = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ConstraintError(f"a constraint is one of {', '.join(KINDS)} (exactly one), got {got}")
    kind, value = next(iter(spec.items()))
    M = llg.LLMatcher
    if kind == "json_schema":
        check_schema(value)
        return kind, M.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        if value is not True:
            raise ConstraintError(f"json_object takes true, got {value!r}")
        return kind, M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        text = _check_text("regex", value, MAX_REGEX_BYTES)
        if regex_expansion(text) > MAX_REGEX_EXPANSION:
            raise ConstraintError(f"regex repeats too much: written out it is over {MAX_REGEX_EXPANSION} "
                                  "characters (lower its {n,m} counts)")
        return kind, M.grammar_from_regex(text)
    if kind == "lark":
        return kind, M.grammar_from_lark(_check_text("lark", value, MAX_CONSTRAINT_BYTES))
    if kind == "gbnf":
        text = _check_text("gbnf", value, MAX_CONSTRAINT_BYTES)
        try:
            lark = llg.gbnf_to_lark.any_to_lark(text)       # Lark text is returned as it is
        except Exception as exc:                             # GbnfToLarkError names line and text
            raise ConstraintError(f"invalid GBNF grammar: {one_line(exc, 300)}") from None
        return kind, M.grammar_from_lark(lark)
    # choice
    if not isinstance(value, list) or not value:
        raise ConstraintError("choice must be a non-empty list of strings")
    if len(value) > MAX_ENUM_VALUES:
        raise ConstraintError(f"choice has {len(value)} strings, more than the {MAX_ENUM_VALUES} allowed")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise ConstraintError(f"choice[{i}] must be a non-empty string, got {s!r:.60}")
        if len(s.encode("utf-8", "surrogatepass")) > MAX_CHOICE_BYTES:
            raise ConstraintError(f"choice[{i}] is longer than {MAX_CHOICE_BYTES} bytes")
    return kind, M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in value))


def build_constraint(spec: dict, tokenizer, *, vocab_size: int | None = None, eos_ids=None) -> "Constraint":
    """A fresh :class:`Constraint` for one sequence. ``spec``: exactly one of :data:`KINDS` (see
    the module docstring). ``tokenizer``: the model's cpullm Tokenizer; ``vocab_size`` and
    ``eos_ids``: the model's logits size and stop ids (``Model.constraint`` fills them in).
    Raises ConstraintError naming what is wrong and where, MissingDependencyError without
    llguidance."""
    llg = load_llguidance()
    kind, grammar = _grammar_text(spec)
    table = token_table(tokenizer, vocab_size, eos_ids)
    limits = llg.LLParserLimits(**PARSER_LIMITS)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, table, limits=limits)
    if is_error:
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {one_line(messages[0], 400)}")
    matcher = llg.LLMatcher(table, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {one_line(matcher.get_error(), 400)}")
    return Constraint(matcher, table.vocab_size, kind)


class Constraint:
    """One sequence's constraint state: the next step's allowed tokens (:meth:`compute_mask`,
    :meth:`apply`), the tokens taken (:meth:`consume`), and whether the output is complete
    (:attr:`finished`: nothing may follow; the sequence ends with stop reason "stop").

    Not thread-safe: one thread computes the mask (possibly the scheduler's mask thread while
    the forward pass runs), then the sequence's own step applies it and consumes the token."""

    def __init__(self, matcher, vocab_size: int, kind: str):
        self.kind = kind
        self.vocab_size = int(vocab_size)
        self._m = matcher
        self._bits = np.zeros((self.vocab_size + 31) // 32, np.int32)   # (words,) one bit per token
        self._ready = False
        self.mask_seconds: list[float] = []         # time of each mask computed (benchmarks read it)

    @property
    def ready(self) -> bool:
        """The next step's mask is computed."""
        return self._ready

    def compute_mask(self) -> None:
        """Compute the next step's mask (llguidance drops the GIL meanwhile)."""
        if self._ready:
            return
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self.mask_seconds.append(time.perf_counter() - t0)
        self._ready = True

    def allowed(self) -> np.ndarray:
        """bool (vocab_size,): the tokens the next step may take."""
        self.compute_mask()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def copy(self) -> "Constraint":
        """An independent constraint in the same state (another choice of the same request)."""
        return Constraint(self._m.deep_copy(), self.vocab_size, self.kind)

    def allows(self, token: int) -> bool:
        """Whether the next step may take ``token`` (one bit read: no full mask unpacked)."""
        self.compute_mask()
        t = int(token)
        return 0 <= t < self.vocab_size and bool((int(self._bits[t >> 5]) >> (t & 31)) & 1)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (vocab,) with every token the constraint forbids at -inf (a new array; rows
        past the tokenizer's vocabulary are forbidden too)."""
        ok = self.allowed()
        x = np.full(logits.shape, -np.inf, dtype=np.float64)
        n = min(ok.size, x.size)
        x[:n] = np.where(ok[:n], logits[:n], -np.inf)
        return x

    def consume(self, token: int) -> bool:
        """Advance past ``token`` (one the mask allowed); False if the constraint refused it."""
        self._ready = False
        return bool(self._m.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """Nothing may follow (the schema, regex or grammar is complete and cannot grow)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is complete (it may still grow: EOS is allowed)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


# ---- the next step's masks, while the forward pass runs ------------------------------------------------
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _mask_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpullm-masks")
        return _pool


class MaskJob:
    """The masks of some constraints being computed on the mask thread; :meth:`join` waits."""

    def __init__(self, future=None):
        self._future = future

    def join(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None


def start_masks(constraints) -> MaskJob:
    """Compute the next step's mask of every constraint not ready yet, on the mask thread
    (llguidance releases the GIL: this runs beside the forward pass). Returns the job to join."""
    todo = [c for c in constraints if c is not None and not c.ready]
    if not todo:
        return MaskJob()

    def run():
        for c in todo:
            c.compute_mask()
    return MaskJob(_mask_pool().submit(run))
