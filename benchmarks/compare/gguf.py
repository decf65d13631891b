"""The checkpoint as a GGUF of cpullm's own writer (F32, or any ggml type ``qtype``) and llama.cpp's
quantizer (``llama_model_quantize``) from that file to Q8_0 / Q4_K_M / Q4_0.

Standalone on purpose (no import of the rest of the package): benchmarks/fidelity.py imports it,
and llama.cpp's converter driver (llama_convert.py) loads it by path for its vocabulary fallback."""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

def _text_config_defaults(config: dict) -> dict:
    """transformers' defaults of a multimodal config's text part, for the keys a Hub config leaves
    out (Gemma 3 4B-IT's states no vocab_size, head counts or RoPE base); {} without transformers."""
    try:
        from transformers import CONFIG_MAPPING

        full = CONFIG_MAPPING[config["model_type"]].from_dict({k: v for k, v in config.items() if k != "model_type"})
    except Exception:      # noqa: BLE001 - transformers absent or too old: the stated keys only
        return {}
    text = getattr(full, "text_config", None)
    return text.to_dict() if text is not None else {}


def _text_config(config: dict) -> dict:
    """The text model's config: a multimodal checkpoint's ``text_config`` (Gemma 3 4B-IT, Qwen3.5)."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and (config.get("model_type") in ("gemma3",) or "vocab_size" not in config):
        merged = {**_text_config_defaults(config), **tc}
        if config.get("model_type") == "gemma3":
            merged.setdefault("model_type", "gemma3_text")
        return merged
    return config


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:      # per layer type (gemma3, v5)
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _llama3_rope_factors(cfg: dict, scaling: dict, theta: float) -> np.ndarray:
    n_head = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _vocab(model_dir: Path, n_vocab: int, special_ids: set[int]):
    """(tokenizer model, tokens, token types, scores | None) from tokenizer.json, padded to n_vocab."""
    import gguf

    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    m = tj.get("model") or {}
    kind = m.get("type")
    tokens: list[str | None] = [None] * n_vocab
    scores = None
    if kind == "Unigram":
        scores = [0.0] * n_vocab
        for i, (piece, score) in enumerate(m.get("vocab") or []):
            if i < n_vocab:
                tokens[i], scores[i] = piece, float(score)
    else:
        for piece, i in (m.get("vocab") or {}).items():
            if 0 <= i < n_vocab:
                tokens[i] = piece
    types = [gguf.TokenType.NORMAL] * n_vocab
    for t in tj.get("added_tokens") or []:
        i = int(t["id"])
        if 0 <= i < n_vocab:
            tokens[i] = t["content"]
            types[i] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.UNUSED
        elif i in special_ids:
            types[i] = gguf.TokenType.CONTROL
    if kind == "BPE" and not m.get("byte_fallback"):
        return "gpt2", tokens, types, None
    # SentencePiece-style vocabularies (byte-fallback BPE, Unigram): llama.cpp's "llama" model
    if scores is None:
        scores = [-float(i) for i in range(n_vocab)]
    for i, tok in enumerate(tokens):
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            types[i] = gguf.TokenType.BYTE
    return "llama", tokens, types, scores


def checkpoint_identity(model_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.suffix in (".json", ".safetensors") and p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(b"compare-gguf-v1")
    return h.hexdigest()[:16]


def _header_fields(model_dir: Path, cfg: dict, layout) -> tuple[dict, dict]:
    """(GGUFWriter fields of the model's shape and RoPE, extra tensors such as rope_freqs)."""
    import gguf

    mt = cfg.get("model_type")
    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    theta, scaling = _rope(cfg)
    fields = {
        "name": model_dir.name,
        "context_length": int(cfg.get("max_position_embeddings") or 4096),
        "embedding_length": hidden,
        "block_count": int(cfg["num_hidden_layers"]),
        "feed_forward_length": int(cfg["intermediate_size"]),
        "head_count": n_head,
        "head_count_kv": int(cfg.get("num_key_value_heads") or n_head),
        "layer_norm_rms_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_freq_base": theta,
        "key_length": head_dim,
        "value_length": head_dim,
    }
    if "rope.dimension_count" in layout.head_dim_keys:
        fields["rope_dimension_count"] = head_dim
    fields.update(vocab_size=int(cfg["vocab_size"]), file_type=gguf.LlamaFileType.ALL_F32)
    extra: dict[str, np.ndarray] = {}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            fields.update(rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=float(scaling["factor"]))
        elif kind == "llama3" and mt == "llama":
            extra["rope_freqs.weight"] = _llama3_rope_factors(cfg, scaling, theta)
        elif kind == "yarn":
            fields.update(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=float(scaling["factor"]),
                          rope_scaling_orig_ctx_len=int(scaling["original_max_position_embeddings"]))
        else:
            raise SystemExit(f"compare: rope scaling {kind!r} is not supported by the GGUF writer; "
                             "use --gguf FILE")
    if mt == "gemma3_text":
        if cfg.get("sliding_window"):
            fields["sliding_window"] = int(cfg["sliding_window"])
        local = cfg.get("rope_local_base_freq")
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("sliding_attention"), dict):
            local = rp["sliding_attention"].get("rope_theta", local)
        if local:
            fields["rope_freq_base_swa"] = float(local)
        if cfg.get("final_logit_softcapping"):
            fields["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    return fields, extra


def _inert_merge(tokens: list[str], types: list) -> str:
    """"a b" for the first vocabulary entry ab that splits into two entries a and b; in a vocabulary
    of single characters (the tests' byte-level one) the first unused padding slot becomes the
    entry a + b of its first two tokens (``tokens`` is changed in place)."""
    import gguf

    have = set(tokens)
    for t in tokens:
        for cut in range(1, len(t)):
            if t[:cut] in have and t[cut:] in have:
                return f"{t[:cut]} {t[cut:]}"
    pad = next((i for i, k in enumerate(types) if k == gguf.TokenType.UNUSED), None)
    if pad is not None and len(tokens) > 2 and tokens[0] + tokens[1] not in have:
        tokens[pad] = tokens[0] + tokens[1]
        return f"{tokens[0]} {tokens[1]}"
    raise SystemExit("compare: the byte-level vocabulary has no merges and no two-part entry "
                     "to make the one merge llama.cpp requires; pass a GGUF with --gguf FILE")


def _vocab_fields(model_dir: Path, config: dict, cfg: dict):
    """(GGUFWriter fields of the vocabulary, gguf.SpecialVocab with merges and special ids)."""
    import gguf

    n_vocab = int(cfg["vocab_size"])
    special_ids = set()
    for src in (config, cfg):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = src.get(key)
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, int):
                    special_ids.add(x)
    tok_model, tokens, types, scores = _vocab(model_dir, n_vocab, special_ids)
    fields = {"tokenizer_model": tok_model, "token_list": tokens, "token_types": types}
    if scores is not None:
        fields["token_scores"] = scores
    sv = gguf.SpecialVocab(model_dir, load_merges=tok_model == "gpt2", n_vocab=n_vocab)
    if tok_model == "gpt2" and not sv.merges:
        # llama.cpp requires the merges key; a merge-free byte-level BPE gets one inert merge
        # (the benchmark feeds token ids, llama.cpp never tokenizes text here) whose parts and
        # result are all in the vocabulary, as a BPE tokenizer (cpullm's, HF's) requires.
        sv.merges = [_inert_merge(tokens, types)]
    for key in ("bos", "eos", "pad"):
        v = cfg.get(f"{key}_token_id", config.get(f"{key}_token_id"))
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int) and key not in sv.special_token_ids:
            sv.special_token_ids[key] = v
    return fields, sv


def _text_tensors(model_dir: Path, n_vocab: int):
    """(transformers name of the text model, float32 array), multimodal prefixes removed, the
    embedding cut to the vocabulary."""
    from cpullm.loading.tensors import TensorStore

    store = TensorStore(model_dir)
    for name in store.names():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        hf = name
        for pre in ("model.language_model.", "language_model.model.", "language_model."):
            if hf.startswith(pre):
                hf = "model." + hf[len(pre):] if not hf.startswith("language_model.lm_head") else hf[len(pre):]
                break
        if hf.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector.")):
            continue
        arr = np.asarray(store.get(name), dtype=np.float32)
        if hf == "model.embed_tokens.weight" and arr.shape[0] > n_vocab:
            arr = arr[:n_vocab]
        yield hf, arr


def write_f32_gguf(model_dir, out_path, qtype: str = "F32") -> Path:
    """The checkpoint as an F32 GGUF that llama.cpp loads (benchmarks/README.md, "compare: the
    method"), written by cpullm's GGUF writer with the installed plugins' table of the architecture. ``qtype`` other
    than F32 quantizes the 2-D tensors with the ``gguf`` package's numpy quantizer (Q8_0, Q4_0,
    ...; no llama.cpp needed: the tests make a 4-bit file this way where llama.cpp is absent)."""
    import gguf

    from cpullm.errors import ConversionError
    from cpullm.convert.gguf_writer import gguf_arch_for_model_type, write_gguf

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    cfg = _text_config(config)
    try:
        layout = gguf_arch_for_model_type(cfg.get("model_type"))
        fields, extra = _header_fields(model_dir, cfg, layout)
        if qtype != "F32":
            fields["file_type"] = gguf.LlamaFileType[f"MOSTLY_{qtype}"]
        vocab, special = _vocab_fields(model_dir, config, cfg)
        return write_gguf(out_path, layout.name, {**fields, **vocab},
                          _text_tensors(model_dir, int(cfg["vocab_size"])), layout=layout, qtype=qtype,
                          extra_tensors=extra, add_metadata=lambda w: special.add_to_gguf(w, quiet=True))
    except ConversionError as exc:
        raise SystemExit(f"compare: {exc}; or pass a GGUF of the same weights with --gguf FILE") from None




def llama_quantize(src, dst, threads: int, ftype: str = "Q8_0", allow_requantize: bool = False,
                   tool: str | None = None) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, the C API behind llama-quantize) to
    ``LLAMA_FTYPE_MOSTLY_<ftype>`` (Q8_0, Q4_K_M, Q4_0, ...); ``allow_requantize`` lets ``src`` be
    quantized already (llama-quantize's --allow-requantize). ``tool``: a ``llama-quantize``
    executable to run instead of the ``llama_cpp`` Python package (the one built beside the
    llama-bench being measured: no package to install)."""
    if tool is not None:
        return _quantize_with_tool(tool, src, dst, threads, ftype, allow_requantize)
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = int(threads)
    params.allow_requantize = bool(allow_requantize)
    tmp = Path(str(dst) + ".tmp")
    with tempfile.TemporaryFile() as log:          # the C quantizer logs every tensor to fd 2
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"compare: llama_model_quantize to {ftype} failed with code {rc}: " + " / ".join(tail))
    os.replace(tmp, dst)
    return Path(dst)


def _quantize_with_tool(tool: str, src, dst, threads: int, ftype: str, allow_requantize: bool) -> Path:
    import subprocess

    tmp = Path(str(dst) + ".tmp")
    cmd = [str(tool), *(["--allow-requantize"] if allow_requantize else []), str(src), str(tmp), ftype,
           str(int(threads))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"compare: {' '.join(cmd)} failed with code {r.returncode}: " + " / ".join(tail))
    os.replace(tmp, dst)
    return Path(dst)


def gguf_label(path) -> str:
    """The file type a GGUF declares ("Q4_K_M", "Q8_0", ...), "GGUF" if it declares none."""
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        return gguf.LlamaFileType(int(field.contents())).name.replace("MOSTLY_", "").replace("ALL_", "")
    except Exception:      # noqa: BLE001 - a label only
        return "GGUF"
