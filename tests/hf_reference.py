"""Tiny random-weight checkpoints built with transformers, and transformers' own outputs on them.

torch and transformers are test dependencies only. Checkpoints are saved in bf16 like real ones,
in transformers 5's layout (``rope_parameters``, ``dtype``) or rewritten into the Hub's legacy
layout (``rope_theta``/``rope_scaling``, ``torch_dtype``, some tensors stored as F32).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_VOCAB = 384          # byte-level tokenizer: 256 byte tokens + specials, the rest unused


def write_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB, bos_id: int = 256, eos_id: int = 257,
                    chat_template: str | None = None) -> None:
    """A byte-level BPE tokenizer.json (no merges) with <s>=bos_id and </s>=eos_id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = {bos_id: "<s>", eos_id: "</s>"}
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


def randomize(model, seed: int, std: float = 0.15) -> None:
    """Weights large enough that logits are far from ties (tiny models at default init are flat);
    norm weights spread around their identity value so a wrong norm convention shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                base = 1.0 if p.abs().mean() > 0.5 else 0.0       # (w) vs zero-centred (1 + w)
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def save_tiny(config, out_dir: Path, seed: int = 0, legacy: bool = False, f32_tensors=(),
              model_class=None, chat_template: str | None = None) -> Path:
    """Build a random model from a transformers config, save it in bf16, write a tokenizer.

    legacy=True rewrites config.json the way pre-5 Hub checkpoints look (rope_theta /
    rope_scaling, torch_dtype, no layer_types) and stores the tensors named in f32_tensors as F32.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cls = model_class or AutoModelForCausalLM
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    randomize(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    if legacy:
        _legacyfy(out_dir, f32_tensors)
    write_tokenizer(out_dir, chat_template=chat_template)
    return out_dir


def _legacy_config(cfg: dict) -> dict:
    cfg = dict(cfg)
    rp = cfg.pop("rope_parameters", None)
    if isinstance(rp, dict):
        if all(isinstance(v, dict) for v in rp.values()):        # per layer type (gemma3)
            full = rp.get("full_attention", {})
            local = rp.get("sliding_attention", {})
            cfg["rope_theta"] = full.get("rope_theta")
            if "rope_theta" in local:
                cfg["rope_local_base_freq"] = local["rope_theta"]
            scaling = {k: v for k, v in full.items() if k != "rope_theta"}
            cfg["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
        else:
            cfg["rope_theta"] = rp.get("rope_theta")
            scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
            cfg["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
            if "partial_rotary_factor" in rp:
                cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    for sub in ("text_config",):
        if isinstance(cfg.get(sub), dict):
            cfg[sub] = _legacy_config(cfg[sub])
    return cfg


def _legacyfy(out_dir: Path, f32_tensors) -> None:
    from safetensors.numpy import load_file, save_file

    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(_legacy_config(cfg), indent=2))
    if f32_tensors:
        import torch
        from safetensors.torch import load_file as tload, save_file as tsave
        for f in out_dir.glob("*.safetensors"):
            tensors = tload(str(f))
            for name in list(tensors):
                if any(s in name for s in f32_tensors):
                    tensors[name] = tensors[name].to(torch.float32)
            tsave(tensors, str(f), metadata={"format": "pt"})


def hf_model(model_dir: Path, model_class=None):
    import torch
    from transformers import AutoModelForCausalLM

    cls = model_class or AutoModelForCausalLM
    m = cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    m.eval()
    return m


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    import torch

    gen = model.generation_config
    gen.eos_token_id = None
    gen.repetition_penalty = None
    gen.do_sample = False
    gen.temperature = None
    gen.top_k = None
    gen.top_p = None
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, use_cache=True)
    return out[0, len(ids):].tolist()
