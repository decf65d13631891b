"""The tokenizer of a GGUF file, rebuilt from its ``tokenizer.ggml.*`` metadata with the
``tokenizers`` library alone (transformers is not needed), giving the same token ids as
transformers' GGUF tokenizer; plus the generation config the metadata implies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import limits
from ..errors import ConversionError
from .family import GGUFArch
from .gguf_file import arch_spec, meta_int, token_id
from .plugins import discover

# ---------------------------------------------------------------------------------------------
# Tokenizer (tokenizers library only)
# ---------------------------------------------------------------------------------------------

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass
class TokenizerSpec:
    """What the GGUF says about its tokenizer (``tokenizer.ggml.*`` and ``tokenizer.chat_template``)."""

    model: str                          # "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE)
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    extra_eos_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_metadata(cls, meta: dict) -> "TokenizerSpec":
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not model or not tokens:
            raise ConversionError("this GGUF has no tokenizer (tokenizer.ggml.model/tokens missing); "
                                  "cpullm needs a GGUF that embeds its vocabulary")
        _check_tokenizer_metadata(meta)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            # older SentencePiece files carry no flag; llama.cpp then adds BOS
            add_bos = model == "llama"
        extra = [token_id(meta, k) for k in ("eot_token_id", "eom_token_id")]
        return cls(
            model=model, pre=meta.get("tokenizer.ggml.pre"), tokens=tokens,
            token_types=meta.get("tokenizer.ggml.token_type") or [],
            scores=meta.get("tokenizer.ggml.scores"), merges=meta.get("tokenizer.ggml.merges"),
            bos_id=token_id(meta, "bos_token_id"), eos_id=token_id(meta, "eos_token_id"),
            unk_id=token_id(meta, "unknown_token_id"), pad_id=token_id(meta, "padding_token_id"),
            add_bos=bool(add_bos), add_eos=bool(meta.get("tokenizer.ggml.add_eos_token") or False),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_eos_ids=[int(x) for x in extra if x is not None],
        )

    def token(self, idx: int | None) -> str | None:
        return self.tokens[idx] if idx is not None and 0 <= idx < len(self.tokens) else None


MAX_TOKEN_CHARS = 4096   # one vocabulary entry; real ones are < 300 (rebuilding merges is quadratic in it)

# tokenizer.ggml.* key -> (what each element must be, a description for the error)
_TOKENIZER_LISTS = {
    "tokens": (lambda t: isinstance(t, str) and len(t) <= MAX_TOKEN_CHARS, f"strings of at most {MAX_TOKEN_CHARS} characters"),
    "token_type": (limits.is_int, "integers"),
    "scores": (limits.is_number, "finite numbers"),
    "merges": (lambda m: isinstance(m, str) and len(m) <= 2 * MAX_TOKEN_CHARS + 1, "strings"),
}


def _check_tokenizer_metadata(meta: dict) -> None:
    """Types and sizes of every tokenizer field, before a vocabulary or a merge table is built."""
    for key in ("model", "pre"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not isinstance(value, str):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} = {limits.shown(value)} is not a string; the file is damaged")
    for key, (ok, what) in _TOKENIZER_LISTS.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > limits.MAX_VOCAB or not all(map(ok, value)):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} must be a list of at most {limits.MAX_VOCAB} "
                                  f"{what}; this file's is not: the file is damaged")
    for key in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not isinstance(value, (bool, int)):
            raise ConversionError(f"GGUF tokenizer.ggml.{key} = {limits.shown(value)} is not a boolean; the file is damaged")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ConversionError(f"GGUF tokenizer.chat_template is a {type(template).__name__}, not a string; "
                              "the file is damaged (remove the key to convert without a chat template)")


MAX_SPLIT_CHARS = 1 << 27
"""Bound on the work of rebuilding merges: the sum over tokens of len(token) * (len(token) - 1),
which bounds both the splits tried and the characters the candidate merges hold. Real
SentencePiece vocabularies need a few tens of millions (262k tokens of a few characters);
a hostile one of tokens 'a' * k, k = 1..2045, would need 2.8 G (cubic in the token length)."""


def merges_from_vocab(vocab: dict[str, int], order: dict[str, float]) -> list[tuple[str, str]]:
    """Rebuild BPE merges from a SentencePiece vocabulary that lists none.

    Every split of a token into two vocabulary pieces is a merge; merges are ranked by ``order``
    (higher first: the token's score, or minus its position), then longer left piece first.
    The work (and so the memory of the candidates) is checked against MAX_SPLIT_CHARS before
    anything is built: a vocabulary over it is a ConversionError.
    """
    work = sum(len(t) * (len(t) - 1) for t in order)
    if work > MAX_SPLIT_CHARS:
        raise ConversionError(f"this GGUF's SentencePiece vocabulary lists no merges, and rebuilding them "
                              f"would split {work} characters of tokens (at most {MAX_SPLIT_CHARS}; real "
                              "vocabularies need far fewer): the vocabulary is damaged or hostile")
    ranked = []
    for token, score in order.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, cut, len(right), left, right))
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep insertion order
    return [(r[3], r[4]) for r in ranked]


def _bpe_model(vocab, merges, **kw):
    from tokenizers.models import BPE
    return BPE(vocab=vocab, merges=merges, dropout=None, **kw)


def _byte_level_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """Byte-level BPE (GPT-2 / Llama 3 / Qwen / SmolLM): vocabulary spelled in the byte alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ")) for m in (spec.merges or [])]
    tok = Tokenizer(_bpe_model(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    split = splits.get(spec.pre or "")   # an unlisted pre type gets the GPT-2 regex (ByteLevel use_regex)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _replace_spaces_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """SentencePiece BPE whose spaces become "▁" in a normalizer (Gemma's); merges rebuilt from token order."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    # Tokens made only of spaces are stored with real spaces; the normalized text has "▁" instead.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    order = {t: -i for i, t in enumerate(tokens)}  # these scores do not follow merge order; position does
    merges = merges_from_vocab(vocab, order)
    unk = spec.token(spec.unk_id) or "<unk>"
    tok = Tokenizer(_bpe_model(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, None


def _metaspace_backend(spec: TokenizerSpec, splits: dict[str, str]):
    """Llama-style SentencePiece BPE (Llama 2, TinyLlama, Mistral v1): Metaspace, byte fallback."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    vocab = {t: i for i, t in enumerate(spec.tokens)}
    if spec.merges:
        merges = [tuple(m.split(" ")) for m in spec.merges]
    else:
        scores = spec.scores or [0.0] * len(spec.tokens)
        merges = merges_from_vocab(vocab, dict(zip(spec.tokens, scores)))
    tok = Tokenizer(_bpe_model(vocab, merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    return tok, None


_SENTENCEPIECE_BACKENDS = {"metaspace": _metaspace_backend, "replace_spaces": _replace_spaces_backend}


def _select_backend(spec: TokenizerSpec, arch: GGUFArch):
    if spec.model == "gpt2":
        return _byte_level_backend
    if spec.model == "llama":
        return _SENTENCEPIECE_BACKENDS[arch.sentencepiece]
    raise ConversionError(f"GGUF tokenizer model {spec.model!r} is not supported; "
                          "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)")


def _add_gguf_tokens(tok, spec: TokenizerSpec, alphabet: set[str] | None) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole)."""
    from tokenizers import AddedToken

    types = spec.token_types or []
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(spec.tokens, types)
               if ty == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(spec.tokens, types) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    # bos/eos/unk/pad are special even when the file does not mark them as control
    named = [spec.token(i) for i in (spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id)]
    extra = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)
             if t is not None and t in vocab and (alphabet is None or set(t) <= alphabet)]
    if extra:
        tok.add_special_tokens(extra)


def _post_processor(spec: TokenizerSpec):
    """TemplateProcessing that adds BOS / EOS as the GGUF flags say (transformers' layout)."""
    from tokenizers.processors import TemplateProcessing

    bos = spec.token(spec.bos_id) if spec.add_bos else None
    eos = spec.token(spec.eos_id) if spec.add_eos else None
    single = " ".join(x for x in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "") if x)
    pair = " ".join(x for x in (single, f"{bos}:1" if bos else "", "$B:1", f"{eos}:1" if eos else "") if x)
    special = []
    if bos:
        special.append((bos, spec.bos_id))
    if eos and eos != bos:
        special.append((eos, spec.eos_id))
    return TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(meta: dict, arch_spec_: GGUFArch | None = None):
    """(tokenizers.Tokenizer, tokenizer_config dict, TokenizerSpec) from the GGUF metadata.
    ``arch_spec_`` defaults to the installed plugins' GGUFArch of the file's architecture."""
    spec = TokenizerSpec.from_metadata(meta)
    arch = meta.get("general.architecture", "")
    backend = _select_backend(spec, arch_spec_ or arch_spec(arch))
    try:
        tok, alphabet = backend(spec, discover().pre_tokenizer_splits())
        _add_gguf_tokens(tok, spec, alphabet)
        tok.post_processor = _post_processor(spec)
    except Exception as exc:   # the tokenizers library rejects the vocabulary or merges
        raise ConversionError(f"cannot build a tokenizer from this GGUF's vocabulary "
                              f"({type(exc).__name__}: {limits.one_line(exc, 120)}); the file is damaged") from None
    tok_config = {
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "bos_token": spec.token(spec.bos_id),
        "eos_token": spec.token(spec.eos_id),
        "unk_token": spec.token(spec.unk_id),
        "pad_token": spec.token(spec.pad_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta_int(meta, arch, "context_length", 1, limits.MAX_CONTEXT, default=2048),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if spec.chat_template:
        tok_config["chat_template"] = spec.chat_template
    return tok, tok_config, spec


def generation_config(spec: TokenizerSpec, end_of_turn_tokens: tuple[str, ...] | None = None) -> dict:
    """generation_config.json: bos, pad and every end-of-generation id the chat template uses
    (``end_of_turn_tokens`` defaults to the installed plugins' GGUFArch.end_of_turn_tokens)."""
    if end_of_turn_tokens is None:
        end_of_turn_tokens = discover().end_of_turn_tokens()
    eos = [spec.eos_id] if spec.eos_id is not None else []
    eos += spec.extra_eos_ids
    if spec.chat_template:
        index = {t: i for i, t in enumerate(spec.tokens) if t in end_of_turn_tokens}
        eos += [index[t] for t in end_of_turn_tokens if t in index and t in spec.chat_template]
    eos = list(dict.fromkeys(eos))
    out = {"_from_model_config": True, "bos_token_id": spec.bos_id,
           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if spec.pad_id is not None:
        out["pad_token_id"] = spec.pad_id
    return out
