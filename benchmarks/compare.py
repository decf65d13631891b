#!/usr/bin/env python
"""cpullm side by side with llama.cpp and transformers: same checkpoint, prompt and threads.

    python benchmarks/compare.py smollm2-135m-instruct [--threads 2] [--prompt-tokens 512]
        [--gen-tokens 128] [--repeat 3] [--rounds 1] [--paired 0] [--out DIR]
        [--skip llama.cpp,transformers] [--four-bit [--kl-prompts 1] [--kl-tokens 16] [--gguf-q4 FILE]]
        [--llama-convert]

Runs, one after another, each in its own child process (so no two thread pools ever compete):

* **cpullm**: ``cpullm.load(MODEL, quant="int8")`` (INT8 weights, one scale per block of 32).
* **llama.cpp** through llama-cpp-python on a **Q8_0** GGUF (INT8 weights, one fp16 scale per
  block of 32: the closest llama.cpp format to cpullm's INT8), ``n_threads = n_threads_batch =
  --threads``, ``n_batch = n_ubatch = 512``, ``n_ctx`` = the longest sequence rounded up to 256,
  other settings at llama-cpp-python's defaults.
* **transformers** in float32 (``AutoModelForCausalLM``, ``torch.set_num_threads(--threads)``,
  ``torch.inference_mode``, KV cache, logits of the last position only).

All three are driven by the same harness, ``cpullm.bench.measure_speed``, with the same prompt
token ids (``cpullm.bench.prompt_ids``: a fixed passage tokenized by the checkpoint's tokenizer,
repeated to exactly --prompt-tokens; ids are fed directly, no runtime tokenizes text) and the
same greedy pick, so the definitions are identical: prefill tokens/s, decode tokens/s after a
one-token prompt, decode tokens/s after a 512-token prefill, time to first token; medians over
--repeat runs after one untimed warm-up (see ``cpullm.bench``). ``--rounds R`` runs the whole
sequence R times (cpullm, llama.cpp, transformers, cpullm, ...), so that every runtime is measured
at several moments of a shared machine whose memory bandwidth drifts: the table then holds the
median over rounds, and a second table each round's ratios with their min and max.

**4-bit** (``--four-bit``) adds four runtimes, run the same way after those three:

* **cpullm-q4**: ``cpullm.load(MODEL, quant="q4")``, cpullm's own 4-bit mix (Q4_K, Q6_K for the
  lm_head and llama.cpp's Q4_K_M choice of v / down layers, Q5_0 / Q8_0 for rows that are not
  whole 256-weight super-blocks; kernels/q4.py).
* **cpullm-gguf**: cpullm running llama.cpp's **Q4_K_M** GGUF of the checkpoint as it is
  (``cpullm.load(FILE.gguf)``, quant "gguf": its blocks executed directly).
* **llama.cpp-Q4_K_M** and **llama.cpp-Q4_0**: llama-cpp-python, set up as above, on llama.cpp's
  Q4_K_M and Q4_0 of the checkpoint (the F32 GGUF below quantized by ``llama_model_quantize``).

Every row also gives the **weight bytes one decode token reads** (cpullm: the decode spans of
its program, ``cpullm.bench.memory_bound``; llama.cpp: the GGUF's tensors but a separate token
embedding, ``fidelity.gguf_decode_bytes``; transformers: its parameters but a separate input
embedding) and, when the **KL pass** runs (by default with --four-bit: ``--kl-prompts 1``,
``--kl-tokens 16``; ``--kl-prompts 0`` turns it off, ``--kl-prompts N`` turns it on without
--four-bit), the **mean KL(reference || runtime) in nats** over every position of teacher-forced
sequences: benchmarks/fidelity.py's first N prompts, each followed by the reference's greedy
continuation of --kl-tokens tokens, every runtime running each whole sequence in one pass
(fidelity.py's ``greedy_sequences``, ``cpullm_logits``, ``llama_cpp_logits``,
``transformers_logits``, ``mean_kl``). The **reference** is cpullm ``quant="f32"`` on the
checkpoint, in its own process: float32 on the checkpoint's weights, which is what transformers
f32 computes; the transformers row's KL shows it (3.8e-10 nats on ``python benchmarks/synth.py
qwen2.5-1.5b --out /tmp/cmp4-tiny --scale 16`` with ``compare.py /tmp/cmp4-tiny --four-bit
--threads 2 --prompt-tokens 64 --gen-tokens 16 --repeat 1``: float32 rounding). The pass runs in
the first round only (logits do not drift with the machine) and is kept short since it runs
every model once more (llama.cpp loads its file again with ``logits_all``). The ratios printed
besides cpullm / llama.cpp and cpullm / transformers: **cpullm-q4 / llama.cpp-Q4_K_M** (each
runtime's own 4-bit quantization of the same weights, about the same bytes per token) and
**cpullm-gguf / llama.cpp-Q4_K_M** (the very same file), for prefill, decode and decode at
context (``RATIO_PAIRS``).

``--paired N`` then measures decode the way a drifting machine cannot skew: every runtime is
loaded at once, each in its own child process (``--serve``), and they take N turns, each timing
one decode run (gen_tokens greedy steps after a one-token prompt, then after the context prefill)
per runtime, in the order A B, then B A, ..., nothing else running. Every ratio of
``RATIO_PAIRS`` whose two runtimes ran (with --four-bit: the 4-bit pairs too) is taken within a
turn, from runs seconds apart; the report gives its median, min and max, each turn's numbers,
and the plain read rate of the first cpullm runtime's decode bytes measured right after its run
in that turn, so the reader sees how the ratio moves with the machine's memory bandwidth. All
runtimes are loaded at once: with --four-bit that is seven models (``--skip`` some for large
checkpoints).

**Same weights.** Every runtime starts from the same Hugging Face checkpoint directory (the one
``cpullm pull`` produced, or any safetensors directory). For llama.cpp this script writes that
checkpoint as an **F32 GGUF** with ``cpullm.convert.gguf_writer`` (the ``gguf`` package's writer;
tensor names, Q/K row permutation and ``1 + w`` norms from the installed plugin's GGUF table of
the architecture, the one ``cpullm convert`` reads, as llama.cpp's ``convert_hf_to_gguf.py`` lays
them out; the vocabulary and merges from tokenizer.json) and quantizes it to Q8_0 with ``llama_cpp.llama_model_quantize`` (llama.cpp's C
quantizer; ``llama-quantize`` itself is not on PyPI). bf16 checkpoints are exact in F32, so
llama.cpp's Q8_0 and cpullm's INT8 quantize the very same values. Re-quantizing a store
model's original Q4 GGUF to Q8_0 was rejected: that would start from different numbers than the
safetensors checkpoint cpullm runs. The Q8_0 file (and with --four-bit the Q4_K_M and Q4_0
files, all made from one F32 GGUF written once) is kept under --work-dir (default
``~/.cache/cpullm/bench``), keyed by the checkpoint's identity, and reused. ``--gguf FILE``
benchmarks a GGUF of your own instead (``--gguf-q4 FILE`` for the Q4_K_M one; cpullm-gguf then
needs no llama-cpp-python). The writer supports the model types whose plugins declare
a GGUF architecture (``cpullm.gguf_file.supported_architectures()``).

**llama.cpp's own converter** makes the full-precision GGUF instead for the other architectures
(Gemma 2, Qwen3.5: llama.cpp knows ``gemma2`` and ``qwen35``, the plugins have no GGUF table for
them), and for any model with ``--llama-convert``: ``convert_hf_to_gguf.py`` with its
``conversion`` package and ``gguf-py``, of the installed llama-cpp-python's version (the libllama
that runs the file), taken from that version's source distribution (``pip download
llama-cpp-python==X --no-binary :all:``, ~77 MB, once; only those parts kept, in
``--work-dir/llama.cpp-convert-X``), run as it is in a subprocess with its own gguf-py. It writes
BF16 when every matrix of the checkpoint is bf16 (exact), else F32, and the text model of a
multimodal checkpoint (Gemma 3 4B-IT, Qwen3.5). One fallback: when its vocabulary step rejects the
tokenizer (its BPE pre-tokenizer check hashes the token ids of a fixed text, which no synthetic
vocabulary of ``benchmarks/synth.py`` reproduces; Gemma's path needs a SentencePiece
``tokenizer.model`` and the sentencepiece package), the vocabulary is written from tokenizer.json
as cpullm's writer writes it, which changes nothing here since the benchmark feeds token ids. Its
files are kept apart from the writer's (``-hfconv`` in the name); the report names which made
them. Without pip access to PyPI, or when the converter fails, the error says so in one line and
the llama.cpp runtimes are reported as failed. Where both know the architecture, the two ways
give bit-identical Q8_0 tensors (tested on a Llama 3.2 shape; also seen on ``synth.py --scale 16``
copies of Gemma 3 4B-IT and Llama 3.2 3B). As a check that the weights really are the same, the report gives each
runtime's fidelity on the prompt's last-position logits against transformers f32 (cosine of
mean-centred logits, same top-1).

Outputs in --out (default ``bench-results/<model>``): ``compare.md`` (also printed),
``compare.png`` (prefill and decode tokens/s with the ratios; needs matplotlib) and
``compare.json`` (a row per runtime: ``prefill_tps``, ``decode_tps``, ``decode_tps_at_512``,
``decode_weight_bytes``, ``kl`` (nats, with the pass), ``weights``, ...; ``ratios`` keyed "A / B";
``kl``: the pass's reference, prompts and positions; ``paired``). The report records the machine,
versions and the load average before and after,
since a busy machine makes every number noisy.

llama-cpp-python, torch and transformers are optional (``pip install 'cpullm[bench]'``); a
runtime whose package is missing is skipped with a note.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RUNTIMES = ("cpullm", "llama.cpp", "transformers")
FOUR_BIT = ("cpullm-q4", "cpullm-gguf", "llama.cpp-Q4_K_M", "llama.cpp-Q4_0")
"""The runtimes --four-bit adds (see the module docstring)."""
ALL_RUNTIMES = RUNTIMES + FOUR_BIT
GGUF_OF = {"llama.cpp": "Q8_0", "llama.cpp-Q4_K_M": "Q4_K_M", "llama.cpp-Q4_0": "Q4_0", "cpullm-gguf": "Q4_K_M"}
"""The llama.cpp file type of the GGUF a runtime runs (made from the checkpoint by llama_quantize)."""
RATIO_PAIRS = (("cpullm", "llama.cpp"), ("cpullm", "transformers"),
               ("cpullm-q4", "llama.cpp-Q4_K_M"), ("cpullm-gguf", "llama.cpp-Q4_K_M"))
"""The tokens/s ratios reported, numerator / denominator, where both runtimes ran."""
KL_REFERENCE = "kl-reference"
"""The worker that makes the KL pass's token sequences and reference logits (cpullm f32)."""
RESULT_TAG = "CPULLM_COMPARE_RESULT "
CONTEXT_TOKENS = 512


# =================================================================================================
# Checkpoint -> F32 GGUF -> Q8_0 GGUF
# =================================================================================================
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
            raise SystemExit(f"compare.py: rope scaling {kind!r} is not supported by the GGUF writer; "
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
    raise SystemExit("compare.py: the byte-level vocabulary has no merges and no two-part entry "
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
    from cpullm.tensors import TensorStore

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
    """The checkpoint as an F32 GGUF that llama.cpp loads (see the module docstring), written by
    cpullm's GGUF writer with the installed plugins' table of the architecture. ``qtype`` other
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
        raise SystemExit(f"compare.py: {exc}; or pass a GGUF of the same weights with --gguf FILE") from None


# =================================================================================================
# Checkpoint -> llama.cpp's own convert_hf_to_gguf.py -> BF16 / F32 GGUF (--llama-convert)
# =================================================================================================
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
"""What of llama-cpp-python's source distribution (under vendor/llama.cpp/) the converter needs."""

_CONVERT_DRIVER = r'''
import importlib.util, runpy, sys
src, compare_py = sys.argv[1:3]
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion

real_get_model_class = conversion.get_model_class


def vocab_from_tokenizer_json(self, why):
    spec = importlib.util.spec_from_file_location("cpullm_compare_vocab", compare_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    print("compare.py: llama.cpp's converter does not take this tokenizer (%s: %s); its vocabulary is "
          "written from tokenizer.json instead" % (type(why).__name__, str(why).splitlines()[0][:160]),
          file=sys.stderr, flush=True)
    import json
    config = json.loads((self.dir_model / "config.json").read_text())
    fields, special = mod._vocab_fields(self.dir_model, config, mod._text_config(config))
    w = self.gguf_writer
    w.add_tokenizer_model(fields["tokenizer_model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(fields["token_list"])
    w.add_token_types(fields["token_types"])
    if "token_scores" in fields:
        w.add_token_scores(fields["token_scores"])
    special.add_to_gguf(w, quiet=True)


def get_model_class(*args, **kwargs):
    cls = real_get_model_class(*args, **kwargs)
    if not hasattr(cls, "set_vocab"):
        return cls

    def set_vocab(self):
        try:
            cls.set_vocab(self)
        except (NotImplementedError, FileNotFoundError, ModuleNotFoundError) as why:
            vocab_from_tokenizer_json(self, why)

    # --no-mtp where the class has it: no runtime here runs the multi-token-prediction layer
    extra = {"no_mtp": True} if getattr(cls, "supports_mtp_export", False) else {}
    return type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "set_vocab": set_vocab, **extra})


conversion.get_model_class = get_model_class
runpy.run_path(sys.argv[0], run_name="__main__")
'''
"""Runs llama.cpp's converter as it is, with one fallback: when its vocabulary step rejects the
checkpoint's tokenizer (a BPE tokenizer whose pre-tokenizer hash it does not list, or no
SentencePiece ``tokenizer.model``), the vocabulary is written from tokenizer.json by
``_vocab_fields``, as cpullm's own writer does. benchmarks/synth.py's tokenizers always take the
fallback: the hash is of the token ids of a fixed text, which no synthetic vocabulary reproduces;
the benchmark feeds token ids, so llama.cpp never tokenizes with it. And the converter's
``--no-mtp`` where the model has a multi-token-prediction layer (Qwen3.5): neither runtime runs it,
and the report counts every tensor of the GGUF but the embedding as read per decode token."""


def writer_has_table(model_dir: Path) -> bool:
    """Whether cpullm's GGUF writer knows the checkpoint's architecture (an installed plugin declares
    its GGUF table); llama.cpp's converter makes the GGUF of the others."""
    from cpullm.convert.gguf_writer import gguf_arch_for_model_type
    from cpullm.errors import ConversionError

    cfg = _text_config(json.loads((Path(model_dir) / "config.json").read_text()))
    try:
        gguf_arch_for_model_type(cfg.get("model_type"))
    except ConversionError:
        return False
    return True


def llama_cpp_converter(work_dir: Path, say=print) -> Path:
    """The directory holding llama.cpp's ``convert_hf_to_gguf.py`` (with its ``conversion`` package
    and ``gguf-py``) of the installed llama-cpp-python's version: unpacked once from that version's
    source distribution (``pip download``, ~77 MB, deleted after) into ``work_dir``, reused after."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("compare.py: llama.cpp's converter comes with llama-cpp-python's version; "
                         "install it (pip install 'cpullm[bench]')") from None
    version = llama_cpp.__version__
    dest = work_dir / f"llama.cpp-convert-{version}"
    if (dest / CONVERTER_PARTS[0]).is_file():
        return dest
    import shutil
    import tarfile

    work_dir.mkdir(parents=True, exist_ok=True)
    dl = Path(tempfile.mkdtemp(prefix="sdist-", dir=work_dir))
    try:
        say(f"fetching llama.cpp's converter: pip download llama-cpp-python=={version} (source distribution)")
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
               "--no-binary", ":all:", "--quiet", "-d", str(dl)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(dl.glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            last = (proc.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
            raise SystemExit(f"compare.py: could not fetch llama.cpp's converter (pip download "
                             f"llama-cpp-python=={version} --no-binary :all:: {last}); "
                             "give pip access to PyPI, or pass a GGUF of the checkpoint with --gguf FILE")
        tmp = dl / "unpacked"
        with tarfile.open(sdists[0]) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)          # llama_cpp_python-X/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and \
                        any(parts[3] == p or parts[3].startswith(p) for p in CONVERTER_PARTS):
                    m.name = parts[3]
                    members.append(m)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # Python >= 3.10.12
            tar.extractall(tmp, members=members, **safe)
        if not (tmp / CONVERTER_PARTS[0]).is_file():
            raise SystemExit(f"compare.py: llama-cpp-python {version}'s source distribution has no "
                             "vendor/llama.cpp/convert_hf_to_gguf.py; pass a GGUF with --gguf FILE")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return dest


def _converter_outtype(model_dir: Path) -> str:
    """"bf16" when every matrix of the checkpoint is bf16 (exact), else "f32" (exact for f32 and
    f16 checkpoints; vectors stay F32 either way)."""
    from cpullm.tensors import TensorStore

    store = TensorStore(model_dir)
    dtypes = {store.dtype(n) for n in store.names() if len(store.shape(n)) >= 2}
    return "bf16" if dtypes == {"BF16"} else "f32"


def llama_convert_gguf(model_dir, out_path, work_dir: Path, say=print) -> Path:
    """The checkpoint as a BF16 (or F32) GGUF made by llama.cpp's own ``convert_hf_to_gguf.py``
    of the installed libllama's version, run in a subprocess with its own gguf-py (see
    ``_CONVERT_DRIVER`` for its one fallback). Multimodal checkpoints (Gemma 3 4B-IT, Qwen3.5)
    give their text model: the converter drops the vision tower unless asked for ``--mmproj``."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    src = llama_cpp_converter(Path(work_dir), say)
    outtype = _converter_outtype(model_dir)
    say(f"converting the checkpoint with llama.cpp's convert_hf_to_gguf.py ({outtype})")
    cmd = [sys.executable, "-c", _CONVERT_DRIVER, str(src), str(Path(__file__).resolve()), str(model_dir),
           "--outfile", str(out_path), "--outtype", outtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src / "gguf-py")]), NO_LOCAL_GGUF="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stderr.splitlines():
        if line.startswith("compare.py: "):
            say(line[len("compare.py: "):])
    if proc.returncode != 0 or not out_path.is_file():
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        out_path.unlink(missing_ok=True)
        missing = re.search(r"No module named '([\w.]+)'", proc.stderr)
        fix = (f"install {missing.group(1).partition('.')[0]} (the converter needs torch and transformers)"
               if missing else "pass a GGUF of the checkpoint with --gguf FILE")
        raise SystemExit(f"compare.py: llama.cpp's convert_hf_to_gguf.py failed on {model_dir.name}: "
                         f"{last.strip()[:300]}; {fix}")
    return out_path


def llama_quantize(src, dst, threads: int, ftype: str = "Q8_0") -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, the C API behind llama-quantize) to
    ``LLAMA_FTYPE_MOSTLY_<ftype>`` (Q8_0, Q4_K_M, Q4_0, ...)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = int(threads)
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
        raise SystemExit(f"compare.py: llama_model_quantize to {ftype} failed with code {rc}: " + " / ".join(tail))
    os.replace(tmp, dst)
    return Path(dst)


def ensure_ggufs(model_dir: Path, work_dir: Path, threads: int, ftypes, say=print,
                 llama_convert: bool | None = None) -> dict:
    """{ftype: path} of llama.cpp's quantization of the checkpoint to each of ``ftypes`` (Q8_0,
    Q4_K_M, Q4_0), kept in ``work_dir`` under the checkpoint's identity and reused. They are made
    from one full-precision GGUF, written once and deleted after: by cpullm's writer (F32) when an
    installed plugin has the architecture's GGUF table, else (or with ``llama_convert=True``) by
    llama.cpp's own convert_hf_to_gguf.py (BF16 or F32, ``llama_convert_gguf``)."""
    model_dir = Path(model_dir)
    if llama_convert is None:
        llama_convert = not writer_has_table(model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{model_dir.name}-{checkpoint_identity(model_dir)}" + ("-hfconv" if llama_convert else "")
    out = {ft: work_dir / f"{stem}.{ft}.gguf" for ft in ftypes}
    for ft, path in out.items():
        if path.is_file():
            say(f"using the {ft} GGUF {path}")
    missing = [ft for ft, path in out.items() if not path.is_file()]
    if not missing:
        return out
    full = work_dir / f"{stem}.full.gguf.partial"
    try:
        if llama_convert:
            llama_convert_gguf(model_dir, full, work_dir, say)
        else:
            say(f"writing the checkpoint as an F32 GGUF ({full.name})")
            write_f32_gguf(model_dir, full)
        for ft in missing:
            say(f"quantizing it to {ft} with llama_cpp.llama_model_quantize")
            llama_quantize(full, out[ft], threads, ft)
    finally:
        full.unlink(missing_ok=True)
    return out


def gguf_source(model_dir: Path, llama_convert: bool | None = None) -> str:
    """Which converter made llama.cpp's files of the checkpoint (ensure_ggufs' choice), for the report."""
    if llama_convert is None:
        llama_convert = not writer_has_table(model_dir)
    if not llama_convert:
        return "cpullm's GGUF writer (F32), quantized by llama_model_quantize"
    import llama_cpp

    return (f"llama.cpp's convert_hf_to_gguf.py of llama-cpp-python {llama_cpp.__version__}, quantized by "
            "llama_model_quantize")


def ensure_q8_gguf(model_dir: Path, work_dir: Path, threads: int, say=print,
                   llama_convert: bool | None = None) -> Path:
    """llama.cpp's Q8_0 of the checkpoint (benchmarks/batched.py's llama.cpp file)."""
    return ensure_ggufs(model_dir, work_dir, threads, ["Q8_0"], say, llama_convert)["Q8_0"]


def gguf_label(path) -> str:
    """The file type a GGUF declares ("Q4_K_M", "Q8_0", ...), "GGUF" if it declares none."""
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        return gguf.LlamaFileType(int(field.contents())).name.replace("MOSTLY_", "").replace("ALL_", "")
    except Exception:      # noqa: BLE001 - a label only
        return "GGUF"


# =================================================================================================
# Workers (each runs in its own process)
# =================================================================================================
class LlamaCppRunner:
    """llama-cpp-python's ``Llama.eval`` (its usual decode path); the last position's logits are
    read from the context with ``llama_get_logits_ith(ctx, -1)`` (a view, no copy): recent
    llama-cpp-python no longer copies them into ``Llama.scores`` unless ``logits_all``."""

    name = "llama.cpp"

    def __init__(self, llm):
        import llama_cpp

        self.llm = llm
        self.n_ctx = llm.n_ctx()
        self.n_vocab = llm.n_vocab()
        self._get = llama_cpp.llama_get_logits_ith

    def reset(self):
        self.llm.reset()

    def _last_logits(self):
        ptr = self._get(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, ids):
        self.llm.eval(list(ids))
        return self._last_logits()

    def decode(self, tok):
        self.llm.eval([int(tok)])
        return self._last_logits()


class TransformersRunner:
    name = "transformers"

    def __init__(self, model, torch, n_ctx: int):
        self.model, self.torch, self.n_ctx = model, torch, n_ctx
        self.past = None
        self._keep = True

    def reset(self):
        self.past = None

    def _forward(self, ids):
        torch = self.torch
        kw = dict(input_ids=torch.tensor([list(ids)], dtype=torch.long), past_key_values=self.past,
                  use_cache=True)
        with torch.inference_mode():
            if self._keep:
                try:
                    out = self.model(**kw, logits_to_keep=1)
                except TypeError:
                    self._keep = False
                    out = self.model(**kw)
            else:
                out = self.model(**kw)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def prefill(self, ids):
        return self._forward(ids)

    def decode(self, tok):
        return self._forward([int(tok)])


def _n_ctx_needed(spec) -> int:
    need = max(len(spec["ids"]), spec["context_tokens"]) + spec["gen_tokens"] + 8
    return int(-(-need // 256) * 256)


def is_cpullm(name: str) -> bool:
    return name == "cpullm" or name.startswith("cpullm-")


def is_llama_cpp(name: str) -> bool:
    return name == "llama.cpp" or name.startswith("llama.cpp-")


def gguf_path(name: str, spec: dict) -> str:
    """The GGUF file runtime ``name`` runs (llama.cpp's Q8_0 in ``spec["gguf"]``, the 4-bit
    files in ``spec["gguf_files"]`` by file type)."""
    if name == "llama.cpp":
        return spec["gguf"]
    return spec["gguf_files"][GGUF_OF[name]]


def load_runner(name: str, spec: dict):
    """(runner, info): the runtime ``name`` loaded as ``spec`` says, and what the report states
    about it (weights, version, threads, ``load_s``)."""
    from cpullm.bench import CpullmRunner

    threads = spec["threads"]
    info: dict = {"runtime": name}
    t0 = time.perf_counter()
    if is_cpullm(name):
        import cpullm
        if name == "cpullm-gguf":
            source, quant = gguf_path(name, spec), "gguf"
        else:
            source, quant = spec["model_dir"], "q4" if name == "cpullm-q4" else spec["quant"]
        model = cpullm.load(source, quant=quant, threads=threads, mmap=not spec.get("no_mmap", False))
        runner = CpullmRunner(model)
        no_mmap = ", --no-mmap" if spec.get("no_mmap") else ""
        weights = f"{gguf_label(source)} GGUF as it is" if quant == "gguf" else model.quant
        info.update(weights=f"{weights} (cpullm{no_mmap})", version=cpullm.__version__,
                    cache=str(model.cache_status).split()[0], threads=model.threads,
                    head_screen=model.executor.screen is not None)
        if quant == "gguf":
            info["gguf"] = source
    elif is_llama_cpp(name):
        import llama_cpp
        path = gguf_path(name, spec)
        llm = llama_cpp.Llama(model_path=path, n_ctx=_n_ctx_needed(spec), n_threads=threads,
                              n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
        runner = LlamaCppRunner(llm)
        info.update(weights=f"{gguf_label(path)} (GGUF)", version=f"llama-cpp-python {llama_cpp.__version__}",
                    threads=threads, gguf=path, n_ctx=runner.n_ctx)
    elif name == "transformers":
        import torch
        import transformers
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
        except TypeError:
            model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)
        model.eval()
        runner = TransformersRunner(model, torch, _n_ctx_needed(spec))
        info.update(weights="f32 (torch)", version=f"{transformers.__version__} (torch {torch.__version__})",
                    threads=torch.get_num_threads())
    else:
        raise SystemExit(f"unknown runtime {name!r}")
    info["load_s"] = time.perf_counter() - t0
    return runner, info


def _fidelity_module():
    """benchmarks/fidelity.py (KL, teacher-forced logits, GGUF decode bytes), imported from
    this script's directory."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import fidelity
    return fidelity


def worker(name: str, spec: dict) -> dict:
    from cpullm.bench import measure_speed

    if name == KL_REFERENCE:
        return kl_reference(spec)
    ids, gen = spec["ids"], spec["gen_tokens"]
    runner, info = load_runner(name, spec)
    if not is_cpullm(name):     # cpullm's comes with its memory-bound pass below
        info["decode_weight_bytes"] = _decode_weight_bytes(name, runner, spec)
    ctx_n = spec["context_tokens"]
    ctx_ids = spec.get("context_ids") or (ids if len(ids) == ctx_n else None)
    speed = measure_speed(runner, ids, gen, repeat=spec["repeat"], context_tokens=ctx_n,
                          context_ids=ctx_ids)
    if is_cpullm(name):     # this machine's streaming read rate, over cpullm's decode bytes
        from cpullm.bench import memory_bound
        mb = memory_bound(runner.model, steps=min(32, gen), token=ids[0])
        info.update(decode_weight_bytes=mb["decode_weight_bytes"], read_gbps=mb["read_gbps"],
                    decode_bound_share=mb["decode_bound_share"])
    runner.reset()
    last = np.asarray(runner.prefill(ids), np.float32).copy()
    np.save(spec["logits_out"], last)
    info.update({k: v for k, v in speed.items()})
    if spec.get("kl_sequences"):
        np.savez(spec["kl_logits_out"], *teacher_forced_logits(name, runner, spec))
    return info


def kl_reference(spec: dict) -> dict:
    """The KL pass's reference, in its own process: cpullm ``quant="f32"`` on the checkpoint
    makes the token sequences (``kl_prompts`` of fidelity.py's prompts, each followed by its
    ``kl_tokens`` greedy tokens) and their teacher-forced logits (saved to ``kl_logits_out``)."""
    import cpullm

    fid = _fidelity_module()
    t0 = time.perf_counter()
    model = cpullm.load(spec["model_dir"], quant="f32", threads=spec["threads"])
    sequences = fid.greedy_sequences(model, list(fid.PROMPTS[: spec["kl_prompts"]]), spec["kl_tokens"])
    np.savez(spec["kl_logits_out"], *fid.cpullm_logits(model, sequences))
    return {"runtime": KL_REFERENCE, "sequences": sequences, "load_s": time.perf_counter() - t0}


def teacher_forced_logits(name: str, runner, spec: dict) -> list:
    """Logits (T, vocab) at every position of each of ``spec["kl_sequences"]``, each run from a
    fresh context in one pass (fidelity.py's functions; llama.cpp loads the file again with
    ``logits_all``)."""
    fid = _fidelity_module()
    seqs = spec["kl_sequences"]
    if is_cpullm(name):
        return fid.cpullm_logits(runner.model, seqs)
    if is_llama_cpp(name):
        return fid.llama_cpp_logits(gguf_path(name, spec), seqs, spec["threads"])
    return fid.transformers_logits(runner.model, seqs)


def _decode_weight_bytes(name: str, runner, spec: dict) -> int | None:
    """Weight bytes one decode token reads in llama.cpp and transformers (cpullm's:
    ``cpullm.bench.memory_bound``): every GGUF tensor but a token embedding that has a separate
    output matrix (llama.cpp reads one row of it: fidelity.gguf_decode_bytes); every torch
    parameter, counted once, but an input embedding that is not also the lm_head."""
    try:
        if is_llama_cpp(name):
            return _fidelity_module().gguf_decode_bytes(gguf_path(name, spec))
        model = runner.model
        sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        if head is None or head.weight.data_ptr() != emb.data_ptr():
            sizes.pop(emb.data_ptr(), None)
        return sum(sizes.values())
    except Exception:          # an optional figure: never fail the run for it
        return None


def run_worker(name: str, spec: dict, workdir: Path, timeout: float) -> dict:
    """Runs ``worker(name, spec)`` in a child process: its result, with the last-position logits
    under "_logits" and, when the spec asks for the KL pass, the teacher-forced logits of each
    sequence under "_kl_logits"; {"runtime", "error"} when the child failed."""
    spec = dict(spec, logits_out=str(workdir / f"{name}.logits.npy"),
                kl_logits_out=str(workdir / f"{name}.kl.npz"))
    env = dict(os.environ, CPULLM_QUIET="1", OMP_NUM_THREADS=str(spec["threads"]))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name,
                           "--spec", str(spec_path)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        return {"runtime": name, "error": f"exit {proc.returncode}: {tail}"}
    res = json.loads(line[len(RESULT_TAG):])
    try:
        res["_logits"] = np.load(spec["logits_out"])
    except OSError:
        pass
    try:
        with np.load(spec["kl_logits_out"]) as z:
            res["_kl_logits"] = [z[f"arr_{i}"] for i in range(len(z.files))]
        os.unlink(spec["kl_logits_out"])
    except OSError:
        pass
    return res


# =================================================================================================
# Paired decode: the runtimes alive side by side, taking turns
# =================================================================================================
READY_TAG = "CPULLM_COMPARE_READY "
PAIR_KINDS = ("decode", "decode_at_512")
"""What one turn of the paired phase times: ``decode`` (gen_tokens steps after a one-token prompt)
or ``decode_at_512`` (the same after the context_ids prefill), as measure_speed defines them."""


def serve(name: str, spec: dict, stdin=None, stdout=None) -> None:
    """A runtime kept loaded for the paired phase: warms up, prints READY_TAG, then times one
    decode run per command read from ``stdin`` (a PAIR_KINDS name; ``quit`` or end of input
    stops) and prints its tokens/s after RESULT_TAG. One cpullm runtime (``spec["read_probe"]``,
    default "cpullm") also times, right after each run, a plain parallel read of the bytes its
    decode reads (``read_gbps``: the machine's memory bandwidth at that moment, as
    ``cpullm.bench.memory_bound`` measures it)."""
    from cpullm.bench import greedy, next_token

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    runner, info = load_runner(name, spec)
    ids, gen = spec["ids"], spec["gen_tokens"]
    ctx_n = spec["context_tokens"]
    ctx_ids = spec.get("context_ids") or (list(ids) * -(-ctx_n // len(ids)))[:ctx_n]

    def timed(prompt) -> float:
        runner.reset()
        tok = greedy(runner.prefill(prompt))
        t0 = time.perf_counter()
        for _ in range(gen):
            tok = next_token(runner, tok)
        return gen / (time.perf_counter() - t0)

    read = _read_rate_probe(runner) if name == spec.get("read_probe", "cpullm") else None
    timed(ids[:1])                                    # untimed warm-up of both paths
    print(READY_TAG + json.dumps(info, default=float), file=stdout, flush=True)
    for line in stdin:
        cmd = line.strip()
        if cmd not in PAIR_KINDS:
            break
        out = {"kind": cmd, "tps": timed(ids[:1] if cmd == "decode" else ctx_ids)}
        if read is not None:
            out["read_gbps"] = read()
        print(RESULT_TAG + json.dumps(out), file=stdout, flush=True)


def _read_rate_probe(runner):
    """A function timing 3 plain parallel reads of the weight bytes one cpullm decode token reads;
    returns their median GB/s."""
    import numba

    from cpullm.bench import decode_weight_spans
    from cpullm.kernels.bandwidth import as_words, read_sum_u32

    words = [as_words(v) for v in decode_weight_spans(runner.model.program)]
    nbytes, nth = sum(w.nbytes for w in words), numba.get_num_threads()

    def read() -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w in words:
                read_sum_u32(w, nth)
            times.append(time.perf_counter() - t0)
        return nbytes / float(np.median(times)) / 1e9
    read()                                            # compiles (or loads) the read kernel
    return read


class ServedRuntime:
    """One runtime in its own child process (``compare.py --serve NAME``), asked for timed runs."""

    def __init__(self, name: str, spec: dict, workdir: Path):
        self.name = name
        spec_path = workdir / f"{name}.serve.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, CPULLM_QUIET="1", OMP_NUM_THREADS=str(spec["threads"]))
        # stderr to a file: a pipe nobody reads while the runs go on could fill and stall the child
        self.err_path = workdir / f"{name}.serve.err"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", name,
                                          "--spec", str(spec_path)], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        self.info = json.loads(self._line(READY_TAG))

    def _line(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):]
        self.proc.wait()
        tail = "\n".join(self.err_path.read_text(errors="replace").strip().splitlines()[-8:])
        raise RuntimeError(f"{self.name} stopped (exit {self.proc.returncode}): {tail}")

    def run(self, kind: str) -> dict:
        """{"tps": tokens/s of one timed run of ``kind``, "read_gbps" (cpullm only)}."""
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(RESULT_TAG))

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def turn_order(names: list, i: int) -> list:
    """The order of turn ``i``: as given on even turns, reversed on odd ones (A B, B A, A B, ...),
    so that a drift of the machine's speed during a pair favours neither runtime."""
    return list(names) if i % 2 == 0 else list(reversed(names))


def ratio_pairs(names) -> list:
    """The RATIO_PAIRS (numerator, denominator) whose two runtimes are both in ``names``."""
    return [(a, b) for a, b in RATIO_PAIRS if a in names and b in names]


def paired_decode(names: list, spec: dict, workdir: Path, pairs: int, timeout: float, say=print,
                  start=ServedRuntime) -> dict:
    """Every runtime in ``names`` loaded at once in its own process; ``pairs`` turns in which each
    times one decode run of every PAIR_KINDS kind in turn_order, with nothing else running. Each
    ratio of RATIO_PAIRS present (cpullm / llama.cpp, cpullm-q4 / llama.cpp-Q4_K_M, ...) is taken
    within each turn (runs seconds apart), then its median, min and max over the turns. Returns
    {"pairs", "tps": {name: {kind: [...]}}, "ratios": {"A / B": {kind: [...]}}, "read_gbps":
    {kind: [...]}} (one value per turn; the read rate measured by the first cpullm runtime right
    after its run) or {"error": ...}."""
    served, killer = [], None
    spec = dict(spec, read_probe=next((n for n in names if is_cpullm(n)), None))
    try:
        for name in names:
            say(f"paired decode: loading {name}")
            served.append(start(name, spec, workdir))
        if timeout:
            import threading
            killer = threading.Timer(timeout, lambda: [s.proc.kill() for s in served if hasattr(s, "proc")])
            killer.daemon = True
            killer.start()
        tps = {s.name: {k: [] for k in PAIR_KINDS} for s in served}
        read = {k: [] for k in PAIR_KINDS}
        for i in range(pairs):
            for kind in PAIR_KINDS:
                for s in turn_order(served, i):
                    res = s.run(kind)
                    tps[s.name][kind].append(float(res["tps"]))
                    if res.get("read_gbps") is not None:
                        read[kind].append(float(res["read_gbps"]))
            say(f"paired decode: turn {i + 1} of {pairs}: " + ", ".join(
                f"{n} {v['decode'][-1]:.1f} / {v['decode_at_512'][-1]:.1f}" for n, v in tps.items()) + " tok/s")
    except (RuntimeError, OSError, ValueError) as exc:
        return {"error": str(exc)}
    finally:
        if killer is not None:
            killer.cancel()
        for s in served:
            s.close()
    ratios = {f"{a} / {b}": {k: [x / y for x, y in zip(tps[a][k], tps[b][k])] for k in PAIR_KINDS}
              for a, b in ratio_pairs(tps)}
    return {"pairs": pairs, "tps": tps, "ratios": ratios, "read_gbps": read}


# =================================================================================================
# Report
# =================================================================================================
ROUND_KEYS = ("prefill_tps", "decode_tps", "decode_tps_at_512", "decode_logits_tps", "ttft_s", "load_s",
              "read_gbps", "decode_bound_share")
"""Numbers a runtime's row takes as the median over rounds (the rest come from its first good round)."""


def merge_rounds(runs: list) -> dict:
    """One runtime's row from its rounds: the first successful round, with each of ROUND_KEYS
    replaced by its median over the successful rounds and the per-round values under "rounds";
    the first error when no round succeeded."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    row = dict(good[0])
    if len(runs) > 1:
        row["rounds"] = {k: [r.get(k) for r in good] for k in ROUND_KEYS if good[0].get(k) is not None}
        for k, vals in row["rounds"].items():
            vals = [v for v in vals if v is not None]
            row[k] = float(np.median(vals)) if vals else None
        row["rounds_ok"] = len(good)
        row["rounds_failed"] = len(runs) - len(good)
    return row


def _ratios(by: dict) -> dict:
    """{"A / B": prefill / decode / decode-at-context tokens/s of A over B's} for each of
    RATIO_PAIRS where both ran."""
    out = {}
    for a, b in RATIO_PAIRS:
        x, y = by.get(a), by.get(b)
        if x and y and "error" not in x and "error" not in y:
            out[f"{a} / {b}"] = {"prefill": _ratio(x["prefill_tps"], y["prefill_tps"]),
                                 "decode": _ratio(x["decode_tps"], y["decode_tps"]),
                                 "decode_at_512": _ratio(x["decode_tps_at_512"], y["decode_tps_at_512"])}
    return out


def _fidelity(a: np.ndarray, ref: np.ndarray) -> dict:
    n = min(a.size, ref.size)
    a, ref = a[:n].astype(np.float64), ref[:n].astype(np.float64)
    x, y = a - a.mean(), ref - ref.mean()
    cos = float((x * y).sum() / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30))
    return {"cosine": cos, "same_top1": bool(int(a.argmax()) == int(ref.argmax()))}


def _ratio(a, b):
    return (a / b) if (a and b) else None


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from cpullm.kernels import q8_panels
        prefill = {"vnni": "W8A16 q8 panels (AVX-512 VNNI)", "avx2": "W8A16 q8 panels (AVX2)"}.get(
            q8_panels.ISA, "W8A16 q8 panels (portable IR)")
    except Exception:  # noqa: BLE001 - the report still says what it can
        prefill = "unknown"
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "cpullm_prefill": prefill}


def _busy(report: dict) -> bool:
    """Other work was running when the benchmark started (> a quarter of the CPU time used in
    the seconds before it; the load average where that could not be measured)."""
    busy = report.get("cpu_busy_before")
    if busy is not None:
        return busy > 0.25
    return report["loadavg_before"] > 0.25 * (report["machine"]["logical_cpus"] or 1)


def _pct(x):
    return None if x is None else 100.0 * x


def _fmt(x, f="{:.1f}"):
    return "n/a" if x is None else f.format(x)


def markdown(report: dict) -> str:
    s = report["settings"]
    rows = report["results"]
    m = report["machine"]
    lines = [
        f"# cpullm vs llama.cpp vs transformers: {report['model_name']}",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs; {s['threads']} thread(s) for every runtime; "
        f"cpullm prefill path: {m.get('cpullm_prefill', 'unknown')}",
        f"- CPU used by other work in the 2 s before the run: {_fmt(_pct(report.get('cpu_busy_before')), '{:.0f} %')}; "
        f"load average (1 min) before / after (after includes this run): {report['loadavg_before']:.2f} / "
        f"{report['loadavg_after']:.2f}" + ("  **(machine busy before the run: numbers are noisy)**"
                                             if _busy(report) else ""),
        f"- prompt {s['prompt_tokens']} tokens, {s['gen_tokens']} decode steps, decode-at-context after "
        f"{s['context_tokens']} tokens, medians of {s['repeat']} run(s)"
        + (f", then the median over {s['rounds']} rounds (every runtime once per round, in turn)"
           if s.get("rounds", 1) > 1 else "") + f"; {report['date']}",
    ]
    if report.get("gguf_source"):
        lines.append(f"- llama.cpp's GGUFs made from the checkpoint by {report['gguf_source']}")
    lines += [
        "",
        "| runtime | weights | prefill tok/s | decode tok/s | decode @%d tok/s | TTFT s | load s "
        "| weight MB / decode token | KL vs f32 (nats) | fidelity vs transformers f32 |" % s["context_tokens"],
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['runtime']} | {r.get('skipped') or 'failed: ' + r['error'].splitlines()[-1][:80]} "
                         "| | | | | | | | |")
            continue
        fid, agree = r.get("fidelity"), r.get("agreement_with_cpullm")
        if fid:
            fid_s = f"cosine {fid['cosine']:.4f}, top-1 {'same' if fid['same_top1'] else 'differs'}"
        elif r["runtime"] == "transformers":
            fid_s = "reference"
        elif agree:
            fid_s = (f"(vs cpullm) cosine {agree['cosine']:.4f}, top-1 "
                     f"{'same' if agree['same_top1'] else 'differs'}")
        else:
            fid_s = "n/a"
        lines.append(f"| {r['runtime']} | {r.get('weights', '')} | {_fmt(r.get('prefill_tps'))} | "
                     f"{_fmt(r.get('decode_tps'))} | {_fmt(r.get('decode_tps_at_512'))} | "
                     f"{_fmt(r.get('ttft_s'), '{:.3f}')} | {_fmt(r.get('load_s'), '{:.2f}')} | "
                     f"{_fmt(_mb(r.get('decode_weight_bytes')), '{:.2f}')} | {_kl(r.get('kl'))} | {fid_s} |")
    ours = next((r for r in rows if r["runtime"] == "cpullm" and r.get("decode_logits_tps")), None)
    if ours:
        how = ("cpullm's may read the lm_head through its screen (the same tokens; the faster of the two "
               "heads, timed as it goes)" if ours.get("head_screen") else "cpullm's model has no lm_head screen "
               "(its lm_head is below the size for one, or an op follows it, as Gemma 2's logit soft-capping)")
        lines += ["", f"Decode steps pick the argmax (greedy) in every runtime; {how}. Through the full logits, "
                      f"as sampling decodes, cpullm ran {_fmt(ours['decode_logits_tps'])} tok/s."]
    lines += _kl_lines(report)
    lines += ["", "| ratio | prefill | decode | decode @%d |" % s["context_tokens"], "|---|---:|---:|---:|"]
    for label, rat in report["ratios"].items():
        lines.append(f"| {label} | {_fmt(rat['prefill'], '{:.2f}x')} | {_fmt(rat['decode'], '{:.2f}x')} "
                     f"| {_fmt(rat['decode_at_512'], '{:.2f}x')} |")
    lines += _round_lines(report)
    lines += _paired_lines(report)
    lines += _bandwidth_lines(rows)
    lines += ["", "Versions: " + "; ".join(f"{r['runtime']} {r.get('version', '?')}" for r in rows
                                             if "version" in r)]
    return "\n".join(lines) + "\n"


def _mb(n):
    return None if not n else n / 1e6


def _kl(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.5f}" if x >= 1e-3 else f"{x:.2e}"


def _kl_lines(report: dict) -> list:
    """What the KL column measured (or why it is empty)."""
    kl = report.get("kl")
    if not kl:
        return []
    if "error" in kl:
        return ["", f"KL pass: not run ({kl['error'].splitlines()[-1][:160]})."]
    return ["", f"KL: mean KL(reference || runtime) in nats over all {kl['positions']} positions of "
                f"{len(kl['sequence_lengths'])} teacher-forced sequence(s) (a fixed prompt followed by the "
                f"reference's {kl['gen_tokens']} greedy tokens; lengths {kl['sequence_lengths']}); reference: "
                f"{kl['reference']}. Weight MB / decode token: what one decode step reads (cpullm: its program's "
                "decode spans; llama.cpp: the GGUF's tensors but a separate token embedding; transformers: "
                "its parameters but a separate input embedding)."]


def _round_lines(report: dict) -> list:
    """Each round's ratios (measured minutes apart on a possibly shared machine), and their range."""
    per = report.get("round_ratios") or []
    others = [f"{a} / {b}" for a, b in RATIO_PAIRS if any(f"{a} / {b}" in r for r in per)]
    if not per or not others:
        return []
    head = " | ".join(f"{key} {o}" for o in others for key in ("prefill", "decode", "decode @ctx"))
    lines = ["", "The ratios in every round (the runtimes one after another within a round):",
             "", f"| round | {head} |", "|---|" + "---:|" * (3 * len(others))]
    for i, r in enumerate(per, 1):
        cells = [_fmt((r.get(o) or {}).get(k), "{:.2f}x") for o in others for k in ("prefill", "decode", "decode_at_512")]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    for label, pick in (("min", min), ("max", max)):
        cells = []
        for o in others:
            for k in ("prefill", "decode", "decode_at_512"):
                vals = [r[o][k] for r in per if r.get(o) and r[o].get(k) is not None]
                cells.append(_fmt(pick(vals) if vals else None, "{:.2f}x"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _paired_lines(report: dict) -> list:
    """The paired phase (``--paired N``): each runtime's median tokens/s and the per-turn ratios."""
    pd = report.get("paired")
    if not pd:
        return []
    if "error" in pd:
        return ["", f"Paired decode: not run ({pd['error'].splitlines()[-1][:160]})."]
    s = report["settings"]
    lines = ["", f"Paired decode ({pd['pairs']} turns): every runtime loaded at once, each in its own process, "
                 "taking turns (A B, then B A, ...) with nothing else running; a turn times one run of "
             f"{s['gen_tokens']} greedy steps per runtime after a one-token prompt, then one after the "
             f"{s['context_tokens']}-token prefill. Ratios are taken within a turn, runs seconds apart, so a "
             "drift of the machine's memory bandwidth moves both sides of each ratio.", "",
             f"| runtime | decode tok/s | decode @{s['context_tokens']} tok/s |", "|---|---:|---:|"]
    for name, v in pd["tps"].items():
        lines.append(f"| {name} | {_fmt(float(np.median(v['decode'])))} | {_fmt(float(np.median(v['decode_at_512'])))} |")
    lines += ["", "| ratio per turn | decode: median | min | max | decode @ctx: median | min | max |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, rat in pd["ratios"].items():
        cells = []
        for k in PAIR_KINDS:
            v = rat[k]
            cells += [_fmt(float(np.median(v)) if v else None, "{:.2f}x"), _fmt(min(v) if v else None, "{:.2f}x"),
                      _fmt(max(v) if v else None, "{:.2f}x")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    names, others = list(pd["tps"]), list(pd["ratios"])
    read = pd.get("read_gbps") or {}
    probe = next((n for n in names if is_cpullm(n)), "cpullm")
    lines += ["", f"Each turn (tokens/s and ratios as decode / decode @ctx; read: the plain read rate of {probe}'s "
                  "decode bytes measured right after its runs, GB/s):", "",
              "| turn | read GB/s | " + " | ".join(names) + " | " + " | ".join(others) + " |",
              "|---|---:|" + "---:|" * (len(names) + len(others))]
    for i in range(pd["pairs"]):
        def pair(vals, f):
            return " / ".join(_fmt(v[i] if i < len(v) else None, f) for v in vals)
        cells = [pair([read.get(k, []) for k in PAIR_KINDS], "{:.1f}")]
        cells += [pair([pd["tps"][n][k] for k in PAIR_KINDS], "{:.1f}") for n in names]
        cells += [pair([pd["ratios"][o][k] for k in PAIR_KINDS], "{:.2f}x") for o in others]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def _bandwidth_lines(rows: list) -> list:
    """The memory-bound view of decode: each runtime's weight bytes per token times its decode
    tokens/s, against the read rate measured in the cpullm process (a plain parallel read of
    cpullm's decode bytes after its timed runs, alternating with decode steps)."""
    probe = next((r for r in rows if is_cpullm(r["runtime"]) and r.get("read_gbps")), None)
    read = probe["read_gbps"] if probe else None
    done = [r for r in rows if r.get("decode_weight_bytes") and r.get("decode_tps")]
    if not done:
        return []
    lines = ["", "| runtime | weight bytes read per decode token | decode GB/s | share of the read rate |",
             "|---|---:|---:|---:|"]
    for r in done:
        gbps = r["decode_weight_bytes"] * r["decode_tps"] / 1e9
        share = f"{100 * gbps / read:.0f} %" if read else "n/a"
        lines.append(f"| {r['runtime']} | {r['decode_weight_bytes'] / 1e6:.1f} MB | {gbps:.1f} | {share} |")
    if read:
        who, ours = probe["runtime"], probe.get("decode_bound_share")
        lines += ["", f"Read rate: {read:.1f} GB/s, a plain parallel read of the bytes {who}'s decode reads, "
                      f"in the {who} process after its timed runs, alternating with decode steps (median); "
                      "decode is bound by memory bandwidth as its share nears 100 %."
                      + (f" In those alternating steps {who}'s decode read at {100 * ours:.0f} % of it."
                         if ours else "")]
    return lines


def chart(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["results"] if "prefill_tps" in r]
    if not rows:
        return None
    s = report["settings"]
    metrics = (("prefill_tps", f"prefill ({s['prompt_tokens']} tokens)"),
               ("decode_tps", "decode (short context)"),
               ("decode_tps_at_512", f"decode @{s['context_tokens']} context"))
    def color(name):
        return "#3b75af" if is_cpullm(name) else "#e1812c" if is_llama_cpp(name) else "#6aa84f"
    by = {r["runtime"]: r for r in rows}
    pairs = ratio_pairs(by)
    if len(rows) > 3:           # --four-bit: one panel per row, or the 7 bars' labels collide
        fig, axes = plt.subplots(3, 1, figsize=(max(10.0, 1.6 * len(rows)), 13))
    else:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    for ax, (key, title) in zip(axes, metrics):
        names = [r["runtime"] for r in rows]
        vals = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(names, vals, color=[color(n) for n in names])
        for b, r, v in zip(bars, rows, vals):
            txt = f"{v:.1f}"
            for num, den in pairs:              # the ratios this bar is the denominator of
                if den == r["runtime"] and v:
                    txt += f"\n{num} = {(by[num].get(key) or 0) / v:.2f}x"
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), txt, ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(0, max(vals + [1]) * (1.3 + 0.1 * max(1, len(pairs))))
    busy = " (machine busy: noisy)" if _busy(report) else ""
    fig.suptitle(f"{report['model_name']}: {s['threads']} thread(s), medians of {s['repeat']}{busy}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# =================================================================================================
# Main
# =================================================================================================
def _available(runtime: str) -> str | None:
    """None if the runtime's package imports, else why it is skipped. cpullm-gguf needs
    llama_cpp for llama.cpp's quantizer (main does not ask when --gguf-q4 gives the file)."""
    import importlib.util
    need = ["llama_cpp"] if is_llama_cpp(runtime) else ["torch", "transformers"] if runtime == "transformers" else []
    if runtime == "cpullm-gguf" and importlib.util.find_spec("llama_cpp") is None:
        return ("skipped: llama_cpp not installed, whose quantizer makes the Q4_K_M GGUF "
                "(pip install 'cpullm[bench]', or give one with --gguf-q4 FILE)")
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        return f"skipped: {', '.join(missing)} not installed (pip install 'cpullm[bench]')"
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cpullm vs llama.cpp (Q8_0) vs transformers (f32) on one "
                                            "checkpoint; writes compare.md / compare.png / compare.json")
    p.add_argument("model", nargs="?", help="model directory or cpullm store name")
    p.add_argument("--threads", type=int, default=None, help="threads for every runtime (default: physical cores)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS,
                   help="prefill length before the decode-at-context measurement (default 512)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every runtime this many times in turn (each with --repeat runs); the "
                        "report takes medians over rounds and gives each round's ratios (default 1)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="after the rounds, load every runtime at once and let them take N turns of one "
                        "decode run each (A B, B A, ...); reports each turn's ratio (default 0: off)")
    p.add_argument("--quant", default="int8", help="cpullm weight format (default int8)")
    p.add_argument("--no-mmap", action="store_true",
                   help="cpullm reads its cached program into memory instead of mapping it (cpullm --no-mmap)")
    p.add_argument("--four-bit", action="store_true",
                   help="also run the 4-bit runtimes: " + ", ".join(FOUR_BIT) + " (and the KL pass)")
    p.add_argument("--skip", default="", help="comma-separated runtimes to skip: " + ",".join(ALL_RUNTIMES))
    p.add_argument("--gguf", default=None, help="use this GGUF for llama.cpp instead of converting the checkpoint")
    p.add_argument("--llama-convert", action="store_true",
                   help="make llama.cpp's GGUFs with llama.cpp's own convert_hf_to_gguf.py (fetched once with pip "
                        "from llama-cpp-python's source distribution into --work-dir) even where cpullm's GGUF "
                        "writer knows the architecture; architectures it does not know always take this way")
    p.add_argument("--gguf-q4", default=None, metavar="FILE",
                   help="use this 4-bit GGUF of the same weights for cpullm-gguf and llama.cpp-Q4_K_M instead "
                        "of llama.cpp's Q4_K_M of the checkpoint")
    p.add_argument("--kl-prompts", type=int, default=None, metavar="N",
                   help="KL pass over N prompts (mean KL vs cpullm f32 at every position); default 1 with "
                        "--four-bit, else 0 (off)")
    p.add_argument("--kl-tokens", type=int, default=16, metavar="N",
                   help="greedy tokens of the reference after each KL prompt (default 16)")
    p.add_argument("--work-dir", default=None,
                   help="where the Q8_0 / Q4_K_M / Q4_0 GGUFs are kept (default ~/.cache/cpullm/bench)")
    p.add_argument("--out", default=None, help="output directory (default bench-results/<model>)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per runtime")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        res = worker(args.worker, spec)
        print(RESULT_TAG + json.dumps(res, default=float), flush=True)
        return 0
    if args.serve:
        serve(args.serve, json.loads(Path(args.spec).read_text()))
        return 0
    if not args.model:
        print("compare.py: give a model directory or store name", file=sys.stderr)
        return 2
    kl_prompts = args.kl_prompts if args.kl_prompts is not None else (1 if args.four_bit else 0)
    n_prompts = len(_fidelity_module().PROMPTS)
    if args.rounds < 1 or args.repeat < 1 or args.paired < 0 or not 0 <= kl_prompts <= n_prompts \
            or args.kl_tokens < 0:
        print(f"compare.py: --rounds and --repeat must be at least 1, --paired and --kl-tokens at least 0, "
              f"--kl-prompts from 0 to {n_prompts}", file=sys.stderr)
        return 2

    def say(msg):
        print(f"compare: {msg}", file=sys.stderr, flush=True)

    from cpullm.bench import cpu_busy as bench_cpu_busy, prompt_ids
    from cpullm.kernels.numba_setup import physical_cores
    from cpullm.model import resolve_model_dir
    from cpullm.tokenize import Tokenizer

    model_dir = resolve_model_dir(args.model).resolve()
    if not (model_dir / "config.json").is_file():      # a GGUF file, or a store entry kept as GGUF
        sys.exit(f"compare: {model_dir} is not a checkpoint directory; compare runs safetensors "
                 f"checkpoints (store models: `cpullm pull NAME --convert`)")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(_text_config(config).get("vocab_size") or 0) or None
    threads = int(args.threads or physical_cores())
    tok = Tokenizer(model_dir)
    ids = prompt_ids(tok, args.prompt_tokens, vocab)
    ctx_ids = ids if args.context_tokens == len(ids) else prompt_ids(tok, args.context_tokens, vocab)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(ALL_RUNTIMES)
    if unknown:
        print(f"compare.py: unknown runtime(s) in --skip: {sorted(unknown)}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("bench-results") / model_dir.name)
    out.mkdir(parents=True, exist_ok=True)
    work_dir = Path(os.path.expanduser(args.work_dir or "~/.cache/cpullm/bench"))
    spec = {"model_dir": str(model_dir), "ids": ids, "context_ids": ctx_ids, "gen_tokens": args.gen_tokens,
            "context_tokens": args.context_tokens, "repeat": args.repeat, "threads": threads,
            "quant": args.quant, "gguf": args.gguf, "no_mmap": bool(args.no_mmap)}
    report = {"model_name": model_dir.name, "model_dir": str(model_dir),
              "command": "python benchmarks/compare.py " + " ".join(
                  shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(),
              "cpu_busy_before": bench_cpu_busy(), "loadavg_before": os.getloadavg()[0],
              "settings": {k: spec[k] for k in ("gen_tokens", "context_tokens", "repeat", "threads", "quant", "no_mmap")}
              | {"prompt_tokens": len(ids), "rounds": args.rounds, "paired": args.paired, "four_bit": args.four_bit,
                 "kl_prompts": kl_prompts, "kl_tokens": args.kl_tokens},
              "results": [], "ratios": {}}
    names = list(RUNTIMES) + (list(FOUR_BIT) if args.four_bit else [])
    with tempfile.TemporaryDirectory(prefix="cpullm-compare-") as td:
        td = Path(td)
        rows: dict[str, dict] = {}
        runnable = []
        for name in names:
            if name in skip:
                rows[name] = {"runtime": name, "skipped": "skipped (--skip)"}
                continue
            why = None if name == "cpullm-gguf" and args.gguf_q4 else _available(name)
            if why:
                say(f"{name}: {why}")
                rows[name] = {"runtime": name, "skipped": why}
                continue
            runnable.append(name)
        gguf_files = {ft: f for ft, f in (("Q8_0", args.gguf), ("Q4_K_M", args.gguf_q4)) if f}
        need = sorted({GGUF_OF[n] for n in runnable if n in GGUF_OF} - set(gguf_files), key=list(GGUF_OF.values()).index)
        if need:
            try:
                llama_convert = True if args.llama_convert else None
                gguf_files.update({ft: str(f) for ft, f in ensure_ggufs(model_dir, work_dir, threads, need, say,
                                                                        llama_convert).items()})
                report["gguf_source"] = gguf_source(model_dir, llama_convert)
            except SystemExit as exc:
                for name in [n for n in runnable if GGUF_OF.get(n) in need]:
                    rows[name] = {"runtime": name, "error": str(exc)}
                    runnable.remove(name)
        spec.update(gguf=gguf_files.get("Q8_0"), gguf_files=gguf_files)
        ref = None
        if kl_prompts and runnable:
            say(f"KL pass: reference cpullm f32, {kl_prompts} prompt(s) + {args.kl_tokens} greedy tokens")
            res = run_worker(KL_REFERENCE, dict(spec, kl_prompts=kl_prompts, kl_tokens=args.kl_tokens), td,
                             args.timeout)
            if "error" in res or not res.get("_kl_logits"):
                report["kl"] = {"error": res.get("error", "the reference wrote no logits")}
                say(f"KL pass: {report['kl']['error']}")
            else:
                ref = res["_kl_logits"]
                report["kl"] = {"reference": "cpullm quant=f32 on the checkpoint (float32 on its weights, as "
                                             "transformers f32)",
                                "prompts": kl_prompts, "gen_tokens": args.kl_tokens,
                                "sequence_lengths": [len(q) for q in res["sequences"]],
                                "positions": sum(len(q) for q in res["sequences"])}
                kl_spec = dict(spec, kl_sequences=res["sequences"])
        runs: dict[str, list] = {name: [] for name in runnable}
        for rnd in range(args.rounds):
            for name in runnable:
                say(f"running {name} ({threads} thread(s))"
                    + (f", round {rnd + 1} of {args.rounds}" if args.rounds > 1 else ""))
                res = run_worker(name, kl_spec if ref is not None and rnd == 0 else spec, td, args.timeout)
                outs = res.pop("_kl_logits", None)
                if outs is not None:
                    res["kl"] = _fidelity_module().mean_kl(ref, outs)
                if "error" in res:
                    say(f"{name} failed: {res['error']}")
                else:
                    say(f"{name}: prefill {res['prefill_tps']:.1f} tok/s, decode {res['decode_tps']:.1f} tok/s, "
                        f"decode@{res['decode_context_tokens']} {res['decode_tps_at_512']:.1f} tok/s"
                        + (f", KL {res['kl']:.3g}" if res.get("kl") is not None else ""))
                runs[name].append(res)
        for name in runnable:
            rows[name] = merge_rounds(runs[name])
        report["results"] = [rows[name] for name in names if name in rows]
        report["round_ratios"] = [_ratios({name: runs[name][i] for name in runnable})
                                  for i in range(args.rounds)] if args.rounds > 1 else []
        if args.paired:
            if ratio_pairs(runnable):
                report["paired"] = paired_decode(runnable, spec, td, args.paired, args.timeout, say)
            else:
                report["paired"] = {"error": "it needs both runtimes of a ratio: " + ", ".join(
                    f"{a} and {b}" for a, b in RATIO_PAIRS)}
            if "error" in report["paired"]:
                say(f"paired decode: {report['paired']['error']}")
    report["loadavg_after"] = os.getloadavg()[0]
    by = {r["runtime"]: r for r in report["results"] if "prefill_tps" in r}
    ref = by.get("transformers", {}).get("_logits")
    ours = by.get("cpullm", {}).get("_logits")
    for r in report["results"]:
        lg = r.pop("_logits", None)
        if lg is not None and ref is not None and r["runtime"] != "transformers":
            r["fidelity"] = _fidelity(lg, ref)
        if lg is not None and ours is not None and r["runtime"] != "cpullm":
            r["agreement_with_cpullm"] = _fidelity(lg, ours)
    report["ratios"] = _ratios(by)
    md = markdown(report)
    png = chart(report, out / "compare.png")
    (out / "compare.md").write_text(md)
    report["outputs"] = {"markdown": str(out / "compare.md"), "json": str(out / "compare.json"),
                         "chart": str(png) if png else None}
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=float))
    print(md)
    say(f"wrote {out / 'compare.md'}, {out / 'compare.json'}" + (f", {png}" if png else
                                                                  " (no chart: matplotlib not installed)"))
    return 0 if any("prefill_tps" in r for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
