"""Synthetic checkpoints with the exact shapes of cpullm's seed models, random weights.

Real 2-4B checkpoints cannot be downloaded everywhere, yet their sizes are what loading, memory
and speed must be measured on. This script writes, for each seed model, a directory that looks
like the Hub's: the model's exact ``config.json``, sharded bf16 safetensors with
``model.safetensors.index.json`` (tensor names, shapes and shard split as the Hub's), a
tokenizers-library ``tokenizer.json`` of the config's vocab_size with the family's special
tokens, ``tokenizer_config.json`` with a chat template, and ``generation_config.json``.

    python benchmarks/synth.py --list
    python benchmarks/synth.py llama-3.2-3b --out /data/synth/llama-3.2-3b
    python benchmarks/synth.py qwen3.5-4b --out /tmp/q35-tiny --scale 16     # same structure, tiny dims

Data (``benchmarks/seed_configs/<model>/``): ``config.json`` as the Hub serves it and
``layout.json`` (Hub repository, transformers class, Hub renames, shard size, tokenizer family,
what the scaled copy keeps); ``tokenizers.json`` and ``templates/`` hold the families' special
tokens and chat templates. ``seed_configs/README.md`` says where each value comes from and
which are not confirmed.

Tensor names and shapes. transformers' own model class is built from the config on the ``meta``
device (no memory) and its ``state_dict()`` gives every tensor; ``layout.json`` renames map
transformers 5's names back to the Hub's (Gemma 3's ``language_model.model.*``), tied lm_heads
are dropped unless the Hub stores one, and the Qwen3.5 multi-token-prediction layer (``mtp.*``,
which transformers does not build) is added as the Hub stores it.

Weight statistics (so that quantization and the greedy lm_head screen meet what trained weights
give them; each draw seeded by (seed, tensor name), so a checkpoint is reproducible):

* matrices: entries a Gaussian scale mixture, z * exp(0.35 z') (kurtosis ~4.9: trained LLM
  weights are heavier-tailed than Gaussian, kurtosis ~4-6 for most matrices; the mixture draws
  twice as fast as a Student-t of that tail), scaled to std 1/sqrt(fan_in), so activations keep
  unit scale through every projection as in a trained network;
* outlier channels: ``max(2, hidden // 512)`` hidden dimensions (the same in every layer, as the
  "massive activation" dimensions of trained LLMs) carry a 5-20x gain (log-uniform) in every norm
  that feeds a projection (input / pre-MLP / final norms): the inputs of q/k/v/gate/up and of
  the lm_head have a few channels 5-20x larger than the rest, which is what per-block int8
  activation quantization and the screen's choice of 8-bit columns must cope with;
* norm weights around their trained values: Llama/Qwen store the multiplier w (drawn near 1,
  std 0.1), Gemma and Qwen3.5 store w with multiplier 1 + w (drawn near 0); Qwen3.5's gated
  DeltaNet norm is a plain w near 1;
* embeddings: rows of the same mixture with a log-normal per-row scale (sigma 0.4: rare tokens have small
  rows, frequent ones large), entry std 2.5 / sqrt(hidden), so the tied lm_head gives logits of
  std ~2.5 on normalized hidden states and a top-1 logit several std above the rest with a
  top-1/top-2 gap of ~0.5 std (median), the heavy right tail trained heads have; with Gaussian
  rows of one scale the gap would be ~0.2 std;
* Qwen2 q/k/v biases: the same mixture, scale 0.1 (k: 0.5, trained k biases are large);
* Gated DeltaNet: A_log = log(U(1, 16)), dt_bias = softplus^-1 of a log-uniform dt in
  [1e-3, 1e-1] (decays exp(-A dt) in [0.2, 1)), conv1d std 1/sqrt(kernel); these barely move
  the scaled copy's INT8 fidelity (logit cosine 0.9978; dt_bias = 1 as transformers initialises
  it: 0.9971; A = 1: 0.9983), its head dims do (see scaled_config);
* vision towers and the MTP layer: the same rules (they are stored, not run).

Writing streams: the safetensors header is computed from the plan, then each tensor is drawn and
written in row chunks of at most CHUNK_ELEMENTS values, so peak memory is one chunk (plus the
imported libraries), never a tensor or the model. Everything goes to a hidden sibling directory
that is renamed into place (``os.replace``) when complete; an existing output is never touched.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np

SEED_DIR = Path(__file__).resolve().parent / "seed_configs"
CHUNK_ELEMENTS = 1 << 23          # 8M values a chunk: 32 MB as float32, a few of them live at once
TAIL_SIGMA = 0.35                 # log-normal sigma of the per-entry scale: kurtosis 3 exp(4 sigma^2) = 4.9
EMBED_LOGIT_STD = 2.5             # target logit std of the tied head on unit-RMS hidden states
ROW_SCALE_SIGMA = 0.4             # log-normal sigma of embedding row norms
OUTLIER_GAIN = (5.0, 20.0)        # gain range of the outlier channels in norms feeding projections
DTYPE_BYTES = {"BF16": 2, "F32": 4}


class SynthError(Exception):
    """A request synth cannot carry out; the message says what to change."""


# ---- seed data -------------------------------------------------------------------------------------

def model_names() -> list[str]:
    return sorted(p.name for p in SEED_DIR.iterdir() if (p / "config.json").is_file())


def load_seed(name: str) -> tuple[dict, dict]:
    """(config, layout) of one seed model, as stored in seed_configs/<name>/."""
    d = SEED_DIR / name
    if not (d / "config.json").is_file():
        raise SynthError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return (json.loads((d / "config.json").read_text()), json.loads((d / "layout.json").read_text()))


def tokenizer_spec(layout: dict) -> dict:
    specs = json.loads((SEED_DIR / "tokenizers.json").read_text())
    return specs[layout["tokenizer"]]


def text_value(config: dict, key: str):
    """A text-model setting: from the config, else transformers' default for it (Gemma 3's
    text_config lists only what differs from Gemma3TextConfig)."""
    t = text_section(config)
    if key in t:
        return t[key]
    tc = _transformers_config(config)
    return getattr(getattr(tc, "text_config", None) or tc, key)


def text_section(config: dict) -> dict:
    """The dict holding the text model's keys (text_config of a multimodal wrapper, else config)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


# ---- scaled-down copy ------------------------------------------------------------------------------

def _div(value: int, scale: int, floor: int) -> int:
    return max(floor, int(value) // scale)


def scaled_config(config: dict, layout: dict, scale: int) -> dict:
    """The same model with every width divided by ``scale`` and a few layers.

    Kept: head counts (so the GQA ratio and MQA), vocabulary and special ids, tying, biases, rope
    settings, layer kinds in their order (the first ``scaled_layers`` of the real pattern, which
    covers one whole period: Gemma 3's 5 sliding + 1 global, Qwen3.5's 3 linear + 1 full),
    softcaps. Sliding windows shrink to ``scaled_sliding_window`` so a short test crosses them.

    Also kept: the Gated DeltaNet head dims (``linear_key_head_dim``, ``linear_value_head_dim``,
    128 in Qwen3.5). Each linear-attention head L2-normalises its query and key and RMS-normalises
    its output per head; over 8 values (128 / 16) a head vector's norm varies widely, so the
    normalisations scale small, error-dominated vectors up to unit size. Measured with q8 weights
    (transformers, layer 0 of the copy): relative error 0.0097 in the raw query -> 0.0116 after
    the L2 norm -> 0.019 out of the recurrence -> 0.032 after the gated RMSNorm, and 2.5-5x
    growth per Gated DeltaNet layer (the same with a 6-token prompt: not the 8-dim state filling
    up). INT8 vs f32 logits of the copy then had cosine 0.97 (0.92 on another prompt) whichever
    single tensor kind stayed f32 (only the embedding quantized: 0.96): a property of the shrunk
    copy, not of the model or of the INT8 path. With the real 128 the same stages read 0.0095 ->
    0.0096 -> 0.0115 and the cosine is 0.998 (with 32: 0.995). Cost: the four scaled
    linear-attention layers hold 10.7M parameters instead of 0.7M (the 248k x 160 embedding alone
    is 40M).
    """
    if scale <= 1:
        return copy.deepcopy(config)
    cfg = copy.deepcopy(config)
    t = text_section(cfg)
    defaults = _text_defaults(cfg)
    get = lambda k: t.get(k, defaults.get(k))                      # noqa: E731
    n_heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim") or int(get("hidden_size")) // n_heads)
    new_hd = _div(head_dim, scale, 8)
    if "head_dim" in t or "head_dim" in defaults:
        t["head_dim"] = new_hd
        t["hidden_size"] = _div(int(get("hidden_size")), scale, 32)
    else:                                                           # head_dim = hidden / heads
        t["hidden_size"] = new_hd * n_heads
    t["intermediate_size"] = _div(int(get("intermediate_size")), scale, 32)
    # linear_key_head_dim / linear_value_head_dim are not divided (see the docstring)
    if get("query_pre_attn_scalar") is not None:
        t["query_pre_attn_scalar"] = new_hd
    n_layers = int(layout["scaled_layers"])
    t["num_hidden_layers"] = n_layers
    if isinstance(t.get("layer_types"), list):
        t["layer_types"] = t["layer_types"][:n_layers]
    if t.get("max_window_layers") is not None:
        t["max_window_layers"] = n_layers
    if layout.get("scaled_sliding_window") and get("sliding_window"):
        t["sliding_window"] = int(layout["scaled_sliding_window"])
    rope = t.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        prf = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
        rope["mrope_section"] = _split_sections(rope["mrope_section"], int(new_hd * prf) // 2)
    if isinstance(cfg.get("vision_config"), dict):
        _scale_vision(cfg["vision_config"], t["hidden_size"])
    return cfg


def with_layers(config: dict, n_layers: int) -> dict:
    """The same model cut to its first ``n_layers`` layers (widths kept): a full-width checkpoint
    of a chosen size, e.g. Qwen3-1.7B's shapes at 8 layers is 0.7B parameters."""
    cfg = copy.deepcopy(config)
    t = text_section(cfg)
    if not 0 < n_layers <= int(t["num_hidden_layers"]):
        raise SynthError(f"--layers must be 1..{t['num_hidden_layers']}, not {n_layers}")
    t["num_hidden_layers"] = n_layers
    if isinstance(t.get("layer_types"), list):
        t["layer_types"] = t["layer_types"][:n_layers]
    if t.get("max_window_layers") is not None:
        t["max_window_layers"] = min(int(t["max_window_layers"]), n_layers)
    return cfg


def _text_defaults(config: dict) -> dict:
    """transformers' defaults of the text config class, for keys a Hub config leaves out."""
    tc = _transformers_config(config)
    sub = getattr(tc, "text_config", None) or tc
    keys = ("num_attention_heads", "head_dim", "hidden_size", "intermediate_size",
            "query_pre_attn_scalar", "sliding_window")
    return {k: getattr(sub, k, None) for k in keys}


def _split_sections(sections: list, total: int) -> list:
    """Integers proportional to ``sections`` summing to ``total`` (M-RoPE's split of rotary pairs)."""
    raw = [s * total / sum(sections) for s in sections]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:total - sum(out)]:
        out[i] += 1
    return out


def _scale_vision(v: dict, text_hidden: int) -> None:
    """A one-block vision tower of width 32: stored, never run by cpullm, built by transformers."""
    heads = 2
    if "depth" in v:                                                # Qwen3.5 ViT
        v.update(depth=1, hidden_size=32, intermediate_size=64, num_heads=heads,
                 out_hidden_size=text_hidden)
    else:                                                           # SigLIP (Gemma 3)
        v.update(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=heads)


# ---- tensor plan -----------------------------------------------------------------------------------

def _transformers_config(config: dict):
    from transformers import CONFIG_MAPPING

    cfg = {k: v for k, v in config.items() if k != "model_type"}
    return CONFIG_MAPPING[config["model_type"]].from_dict(cfg)


def tensor_plan(config: dict, layout: dict) -> list[tuple[str, tuple]]:
    """Every stored tensor as (Hub name, shape), in transformers' state_dict order."""
    import torch
    import transformers

    cls = getattr(transformers, layout["hf_class"])
    with torch.device("meta"):
        model = cls(_transformers_config(config))
    state = model.state_dict()
    tied = set((getattr(model, "_tied_weights_keys", None) or {}))
    plan = []
    for name, t in state.items():
        if name in tied and not layout.get("store_tied_lm_head"):
            continue
        plan.append((_rename(name, layout["renames"]), tuple(int(s) for s in t.shape)))
    if layout.get("split_experts"):
        plan = _split_experts(plan)
    for extra in layout.get("extras", []):
        plan += EXTRAS[extra](plan, config)
    names = [n for n, _ in plan]
    if len(set(names)) != len(names):
        raise SynthError(f"the plan of {layout['hub_repo']} names a tensor twice")
    return plan


def _split_experts(plan: list) -> list:
    """transformers 5 builds a MoE layer's experts as two stacked tensors, ``experts.gate_up_proj``
    (E, 2I, H) and ``experts.down_proj`` (E, H, I); Qwen3-MoE Hub checkpoints store one tensor per
    expert and projection (``experts.{e}.{gate,up,down}_proj.weight``), which transformers joins at
    load: the plan lists them as the Hub does."""
    out = []
    for name, shape in plan:
        if name.endswith("experts.gate_up_proj") and len(shape) == 3:
            E, I2, H = shape
            base = name[: -len("gate_up_proj")]
            for e in range(E):
                out += [(f"{base}{e}.gate_proj.weight", (I2 // 2, H)), (f"{base}{e}.up_proj.weight", (I2 // 2, H))]
        elif name.endswith("experts.down_proj") and len(shape) == 3:
            E, H, I = shape
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", (H, I)) for e in range(E)]
        else:
            out.append((name, shape))
    return out


def _rename(name: str, renames: list) -> str:
    for pattern, repl in renames:
        new = re.sub(pattern, repl, name)
        if new != name:
            return new
    return name


def _qwen3_5_mtp(plan: list, config: dict) -> list:
    """Qwen3.5's multi-token-prediction head as the Hub stores it: ``mtp.fc`` (H, 2H), three norms
    and ``mtp_num_hidden_layers`` decoder layers shaped as a full-attention text layer."""
    t = text_section(config)
    H = int(t["hidden_size"])
    first_full = t["layer_types"].index("full_attention")
    prefix = f"model.language_model.layers.{first_full}."
    out = [("mtp.fc.weight", (H, 2 * H))]
    for k in range(int(t.get("mtp_num_hidden_layers", 1))):
        out += [(f"mtp.layers.{k}." + n[len(prefix):], s) for n, s in plan if n.startswith(prefix)]
    out += [(f"mtp.{n}.weight", (H,)) for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")]
    return out


EXTRAS = {"qwen3_5_mtp": _qwen3_5_mtp}


def shard_plan(plan: list, dtype: str, max_shard_bytes: int) -> list[list]:
    """Tensors split into shards in order, a new shard when the next tensor would pass the limit
    (transformers' save_pretrained rule)."""
    shards, cur, size = [], [], 0
    for name, shape in plan:
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


# ---- weight statistics -----------------------------------------------------------------------------

def _family_norm_offset(config: dict) -> float:
    """0 where norms store w and multiply by 1 + w (Gemma, Qwen3.5), else 1 (store the multiplier)."""
    mt = text_section(config).get("model_type", config["model_type"])
    return 0.0 if mt.startswith("gemma") or mt.startswith("qwen3_5") else 1.0


class WeightStats:
    """Draws every tensor of one checkpoint by name (see the module docstring for the choices)."""

    def __init__(self, config: dict, seed: int):
        t = text_section(config)
        self.seed = seed
        self.hidden = int(text_value(config, "hidden_size"))
        self.norm_offset = _family_norm_offset(config)
        rng = np.random.default_rng([seed, 0x5EED])
        n_out = max(2, self.hidden // 512)
        self.outlier_channels = np.sort(rng.choice(self.hidden, size=n_out, replace=False))
        lo, hi = np.log(OUTLIER_GAIN[0]), np.log(OUTLIER_GAIN[1])
        self.outlier_gain = np.exp(rng.uniform(lo, hi, size=n_out))
        # the norms whose output feeds a projection (attention, MLP, lm_head)
        self.input_norm = re.compile(r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
                                     r"|language_model\.model\.norm|language_model\.norm"
                                     r"|^model\.norm)\.weight$")
        self.sandwich = bool(t.get("model_type", config["model_type"]).startswith(("gemma2", "gemma3")))

        self.alias: dict[str, str] = {}    # tensor -> tensor it equals (a stored tied lm_head)

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(self.alias.get(name, name).encode())])

    def chunks(self, name: str, shape: tuple):
        """Yield float32 arrays whose concatenation (row-major) is the tensor ``name``."""
        rng = self.rng(name)
        n = math.prod(shape)
        if len(shape) == 1:
            yield self._vector(name, shape[0], rng)
            return
        rows, row_len = shape[0], n // shape[0]
        step = max(1, CHUNK_ELEMENTS // row_len)
        kind = self._matrix_kind(name)
        for r0 in range(0, rows, step):
            r = min(step, rows - r0)
            yield self._matrix_rows(kind, shape, r, row_len, rng)

    def _matrix_kind(self, name: str) -> str:
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            return "embed"
        if name.endswith("conv1d.weight"):
            return "conv"
        if "position_embedding" in name:
            return "position"
        return "linear"

    def _matrix_rows(self, kind: str, shape: tuple, r: int, row_len: int, rng) -> np.ndarray:
        x = _heavy_tailed(rng, (r, row_len))
        if kind == "embed":
            std = EMBED_LOGIT_STD / math.sqrt(self.hidden) / math.exp(ROW_SCALE_SIGMA ** 2 / 2)
            scale = np.exp(rng.standard_normal((r, 1)) * ROW_SCALE_SIGMA).astype(np.float32)
            return x * (scale * np.float32(std))
        if kind == "position":
            return x * np.float32(0.02)
        fan_in = row_len
        return x * np.float32(1.0 / math.sqrt(fan_in))

    def _vector(self, name: str, n: int, rng) -> np.ndarray:
        if name.endswith("A_log"):
            return np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
        if name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), n))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)          # softplus^-1(dt)
        if name.endswith(".bias"):
            scale = 0.5 if "k_proj" in name else 0.1
            if "vision" in name or "visual" in name:
                scale = 0.02
            return _heavy_tailed(rng, (n,)) * np.float32(scale)
        if "norm" in name or "layer_norm" in name or "layernorm" in name:
            return self._norm(name, n, rng)
        return _heavy_tailed(rng, (n,)) * np.float32(0.02)

    def _norm(self, name: str, n: int, rng) -> np.ndarray:
        if "vision" in name or "visual" in name or name.endswith("linear_attn.norm.weight") \
                or "mm_soft_emb_norm" in name:
            offset = 1.0 if "mm_soft_emb_norm" not in name else self.norm_offset
            return (offset + 0.1 * rng.standard_normal(n)).astype(np.float32)
        multiplier = 1.0 + 0.1 * rng.standard_normal(n)                   # (n,) the effective gain
        feeds_projection = self.input_norm.search(name) and not (
            self.sandwich and "post_attention_layernorm" in name)     # Gemma 2/3: an output norm
        if n == self.hidden and feeds_projection:
            multiplier[self.outlier_channels] *= self.outlier_gain
        return (multiplier - (1.0 - self.norm_offset)).astype(np.float32)


def _heavy_tailed(rng, shape) -> np.ndarray:
    """Unit-variance float32 entries z * exp(TAIL_SIGMA z') / exp(TAIL_SIGMA^2), z, z' ~ N(0, 1)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    s = rng.standard_normal(shape, dtype=np.float32)
    s *= np.float32(TAIL_SIGMA)
    np.exp(s, out=s)
    x *= s
    x *= np.float32(math.exp(-TAIL_SIGMA ** 2))
    return x


def to_bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even) as little-endian bytes."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16).tobytes()


# ---- tokenizer -------------------------------------------------------------------------------------

def write_tokenizer(out: Path, config: dict, layout: dict) -> None:
    """tokenizer.json with exactly vocab_size entries (byte-level: the 256 byte symbols, the family's
    special tokens at their real ids, filler words elsewhere so every id decodes to text),
    tokenizer_config.json with the chat template, generation_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    spec = tokenizer_spec(layout)
    V = int(text_value(config, "vocab_size"))
    specials = dict(spec["specials"])
    res = spec.get("reserved")
    if res:
        taken = set(specials.values())
        free = [i for i in range(res["from"], res["to"]) if i not in taken]
        specials.update({res["name"].format(k=k): i for k, i in enumerate(free)})
    special_ids = {i: t for t, i in specials.items() if i < V}
    alphabet = sorted(ByteLevel.alphabet())
    words = _filler_words()
    vocab, a = {}, 0
    for i in range(V):
        if i in special_ids:
            vocab[special_ids[i]] = i           # in the model's vocab at its id, marked special below
        elif a < len(alphabet):
            vocab[alphabet[a]] = i
            a += 1
        else:
            vocab[next(words)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    added = sorted(special_ids.items())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in added])
    if spec["add_bos"] and spec["bos"]:
        bos_id = specials[spec["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A {spec['bos']} $B",
            special_tokens=[(spec["bos"], bos_id)])
    for i, t in added:                                  # the added tokens landed on their ids
        if tok.token_to_id(t) != i:
            raise SynthError(f"special token {t} got id {tok.token_to_id(t)}, not {i}")
    tok.save(str(out / "tokenizer.json"))
    template = (SEED_DIR / "templates" / spec["template"]).read_text()
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(spec["add_bos"]),
            "bos_token": spec["bos"], "eos_token": spec["eos"], "pad_token": spec["pad"],
            "unk_token": spec["unk"], "model_max_length": int(text_value(config, "max_position_embeddings")),
            "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    eos = _as_list(config.get("eos_token_id", text_section(config).get("eos_token_id")))
    eot = specials[spec["end_of_turn"]]
    gen = {"bos_token_id": specials.get(spec["bos"]) if spec["bos"] else None,
           "eos_token_id": eos + ([eot] if eot not in eos else []),
           "pad_token_id": specials.get(spec["pad"]) if spec["pad"] else None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _as_list(v) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [int(v)]


def _filler_words():
    """'Ġab', 'Ġac', ... then three letters, ...: space-prefixed lowercase words."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    n = 2
    while True:
        for k in range(len(letters) ** n):
            s = ""
            for _ in range(n):
                k, r = divmod(k, len(letters))
                s = letters[r] + s
            yield "\u0120" + s
        n += 1


# ---- writing ---------------------------------------------------------------------------------------

class Progress:
    """One line on stderr, rewritten at most twice a second: bytes written, share, rate."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done, self.t0, self.last = 0, time.monotonic(), 0.0

    def add(self, n: int, where: str) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done == self.total):
            self.last = now
            el = now - self.t0
            sys.stderr.write(f"\r{self.label}: {self.done / 1e9:6.2f} / {self.total / 1e9:.2f} GB "
                             f"({100 * self.done / max(1, self.total):3.0f}%) {el:5.0f} s  {where:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def write_checkpoint(name: str, out_dir, *, scale: int = 1, seed: int = 0, dtype: str = "BF16",
                     progress: bool = True, max_shard_bytes: int | None = None,
                     layers: int | None = None) -> dict:
    """Write the synthetic checkpoint of seed model ``name`` to ``out_dir`` (which must not exist).
    ``layers``: keep only the first so many layers (after ``scale``).

    Returns a summary: files and their sizes, parameter count, seconds taken."""
    dtype = dtype.upper()
    if dtype == "HUB":
        dtype = load_seed(name)[1]["hub_dtype"]
    if dtype not in DTYPE_BYTES:
        raise SynthError(f"--dtype {dtype!r} is not supported (use bf16, f32 or hub)")
    out = Path(out_dir)
    if out.exists():
        raise SynthError(f"{out} exists; synth never overwrites: choose another --out or remove it")
    config, layout = load_seed(name)
    config = scaled_config(config, layout, scale)
    if layers:
        config = with_layers(config, layers)
    plan = tensor_plan(config, layout)
    limit = max_shard_bytes or layout["max_shard_bytes"]
    if scale > 1 and max_shard_bytes is None:
        limit = max(1, sum(math.prod(s) for _, s in plan) * DTYPE_BYTES[dtype] // 2)   # still two shards
    shards = shard_plan(plan, dtype, limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.synth-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        total = sum(math.prod(s) for _, s in plan) * DTYPE_BYTES[dtype]
        prog = Progress(f"synth {name}" + (f" /{scale}" if scale > 1 else ""), total, progress)
        stats = WeightStats(config, seed)
        if layout.get("store_tied_lm_head"):             # the Hub stores a copy of the embedding
            names = [n for n, _ in plan]
            head = [n for n in names if n.endswith("lm_head.weight")]
            embed = [n for n in names if n.endswith("embed_tokens.weight")]
            stats.alias.update({h: embed[0] for h in head})
        files = _shard_names(len(shards))
        weight_map = {}
        for fname, shard in zip(files, shards):
            _write_shard(tmp / fname, shard, dtype, stats, prog)
            weight_map.update({n: fname for n, _ in shard})
        prog.close()
        if len(files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(tmp, config, layout)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"model": name, "dir": str(out), "scale": scale, "dtype": dtype,
            "params": sum(math.prod(s) for _, s in plan), "tensors": len(plan),
            "files": {f: (out / f).stat().st_size for f in files}, "seconds": time.monotonic() - t0}


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _write_shard(path: Path, shard: list, dtype: str, stats: WeightStats, prog: Progress) -> None:
    header, off = {}, 0
    for name, shape in shard:
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape in shard:
            for chunk in stats.chunks(name, shape):
                b = to_bf16_bytes(chunk) if dtype == "BF16" else np.ascontiguousarray(chunk, "<f4").tobytes()
                fh.write(b)
                prog.add(len(b), f"{path.name}")
        fh.flush()
        os.fsync(fh.fileno())


# ---- command line ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="seed model names (see --list)")
    p.add_argument("--out", help="output directory (one model) or parent directory (several)")
    p.add_argument("--scale", type=int, default=1, help="divide every width by this (tiny copy), default 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N layers (full widths unless --scale): a checkpoint of chosen size")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), f32, or hub (the Hub's own dtype)")
    p.add_argument("--list", action="store_true", help="list the seed models and their sizes")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # so the temporary directory is removed
    try:
        if a.list or not a.models:
            for n in model_names():
                cfg, lay = load_seed(n)
                print(f"{n:16s} {lay['hub_repo']:28s} {lay['hf_class']}")
            return 0
        if not a.out:
            raise SynthError("--out is required")
        for n in a.models:
            out = Path(a.out) if len(a.models) == 1 else Path(a.out) / n
            s = write_checkpoint(n, out, scale=a.scale, seed=a.seed, dtype=a.dtype, progress=not a.quiet,
                                 layers=a.layers)
            size = sum(s["files"].values())
            print(f"{n}: {s['params'] / 1e9:.3f} B params, {s['tensors']} tensors, {len(s['files'])} "
                  f"shard(s), {size / 1e9:.2f} GB, {s['seconds']:.0f} s -> {s['dir']}")
    except SynthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
