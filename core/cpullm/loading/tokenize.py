"""Tokenizer from tokenizer.json (the ``tokenizers`` library) and incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import TokenizerError


class Tokenizer:
    """``encode(text) -> list[int]`` and ``decode(ids) -> str``, as transformers would.

    BOS is added when the tokenizer's post-processor adds it, or when tokenizer_config.json says
    ``add_bos_token: true`` and the post-processor does not.
    """

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} is missing: cpullm needs the checkpoint's tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerError(f"{path} cannot be read ({exc}); restore it from the checkpoint") from None
        cfg_path = model_dir / "tokenizer_config.json"
        config: dict = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                config = {}
        self._setup(config)

    @classmethod
    def from_objects(cls, tok, config: dict) -> "Tokenizer":
        """From a built ``tokenizers.Tokenizer`` and its tokenizer_config dict (a GGUF's metadata,
        cpullm.loading.gguf_vocab.build_tokenizer), with no files."""
        self = cls.__new__(cls)
        self._tok = tok
        self._setup(dict(config))
        return self

    def _setup(self, config: dict) -> None:
        self.config = config if isinstance(config, dict) else {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        probe = self._tok.encode("a", add_special_tokens=True).ids
        post_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self._prepend_bos = bool(self.config.get("add_bos_token")) and not post_adds_bos \
            and self.bos_token_id is not None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int):
        return self._tok.id_to_token(i)

    def special_ids(self) -> set[int]:
        added = self._tok.get_added_tokens_decoder()
        return {i for i, t in added.items() if t.special}


def _token_str(t):
    if isinstance(t, dict):
        return t.get("content")
    return t


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    Decodes a short window of recent ids and emits only the new, complete suffix, so byte-level
    BPE tokens that carry half a character wait for the rest.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tok.decode(self.ids[self.prefix_offset: self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset: self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
