"""Qwen3.5 GGUFs made by llama.cpp's own converter, read by cpullm (benchmarks/results/2026-12-06-qwen35-gguf.md).

    python -m benchmarks.qwen35_gguf --work /tmp/qwen35-gguf

Tiny random checkpoints of ``qwen3_5_text`` and ``qwen3_5_moe_text`` (cpullm_qwen.tiny_configs,
bf16, ``cpullm.testing.make_random_checkpoint``) go through llama-cpp-python's vendored
``convert_hf_to_gguf.py`` (the installed version's, benchmarks/compare/llama_convert.py) as F32,
F16 and Q8_0 (with ``--no-mtp``), plus one F32 file of a copy carrying an MTP block converted with
the converter's default (MTP exported). For each file and cpullm mode (f32: every tensor
dequantized; gguf: quantized tensors run as stored), against transformers on the checkpoint:
max |logit error| / max |ref logit| over 32 positions, mean KL(ref || ours), top-1 agreement, and
the first of 24 greedy steps (after 8 prompt tokens, KV cache) where the tokens part from
transformers' and from the file's own f32 run ("none": identical). Then two checks of where the
Q8_0 error comes from and of ``cpullm convert``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))          # hf_reference

IDS = [256] + [int(x) for x in np.random.default_rng(5).integers(0, 255, 31)]
PROMPT = IDS[:8]
OUTTYPES = ("f32", "f16", "q8_0")


def make_checkpoints(work: Path) -> dict:
    from cpullm.testing import make_random_checkpoint
    from cpullm_qwen import tiny_configs as t
    dirs = {"dense": work / "ck_dense", "moe": work / "ck_moe", "dense_mtp": work / "ck_dense_mtp"}
    make_random_checkpoint(t.QWEN3_5_TEXT, dirs["dense"], seed=1)
    make_random_checkpoint(t.QWEN3_5_MOE_TEXT, dirs["moe"], seed=2)
    make_random_checkpoint(t.QWEN3_5_TEXT, dirs["dense_mtp"], seed=1)
    add_mtp_block(dirs["dense_mtp"])
    return dirs


def add_mtp_block(d: Path) -> None:
    """What real Qwen3.5 checkpoints carry beside the decoder: ``mtp.*`` (one full-attention layer,
    the fc projection and its norms); transformers ignores them."""
    import torch
    from safetensors.torch import load_file, save_file
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    H, I, nh, nkv, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], cfg["head_dim"])
    L = "mtp.layers.0."
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,),
              L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,),
              L + "self_attn.q_proj.weight": (2 * nh * hd, H), L + "self_attn.k_proj.weight": (nkv * hd, H),
              L + "self_attn.v_proj.weight": (nkv * hd, H), L + "self_attn.o_proj.weight": (H, nh * hd),
              L + "self_attn.q_norm.weight": (hd,), L + "self_attn.k_norm.weight": (hd,),
              L + "mlp.gate_proj.weight": (I, H), L + "mlp.up_proj.weight": (I, H), L + "mlp.down_proj.weight": (H, I)}
    tensors = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        tensors[name] = (0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def llama_convert(src: Path, model: Path, out: Path, outtype: str, keep_mtp: bool = False) -> Path:
    """llama.cpp's convert_hf_to_gguf.py as benchmarks.compare runs it (its vocabulary fallback
    for the synthetic tokenizer; ``--no-mtp`` unless ``keep_mtp``)."""
    from benchmarks.compare.llama_convert import _CONVERT_DRIVER, GGUF_PY
    driver = _CONVERT_DRIVER
    if keep_mtp:
        driver = driver.replace('extra = {"no_mtp": True} if getattr(cls, "supports_mtp_export", False) else {}',
                                "extra = {}")
        assert driver != _CONVERT_DRIVER, "benchmarks.compare's converter driver changed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src / "gguf-py")]), NO_LOCAL_GGUF="1")
    proc = subprocess.run([sys.executable, "-c", driver, str(src), GGUF_PY, str(model), "--outfile", str(out),
                           "--outtype", outtype], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {model.name} ({outtype}): {proc.stderr[-2000:]}")
    return out


def _greedy(m) -> list[int]:
    return [int(t) for t in m.generate_ids(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True)]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), "none")


def measure(files: dict, dirs: dict) -> None:
    import cpullm
    from cpullm import testing
    from hf_reference import hf_greedy, hf_logits, hf_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    classes = {"dense": Qwen3_5ForCausalLM, "moe": Qwen3_5MoeForCausalLM}
    print("| file | cpullm mode | weight formats (values) | max err / max\\|ref\\| | mean KL | top-1 | "
          "greedy parts from transformers at | from the file's f32 run at |")
    print("|---|---|---|---:|---:|---:|---|---|")
    for kind, cls in classes.items():
        ref = hf_model(dirs[kind], cls)
        ref_logits, ref_tokens = hf_logits(ref, IDS), [int(t) for t in hf_greedy(ref, PROMPT, 24)]
        for path in [p for k, p in files.items() if k[0] == kind]:
            f32 = cpullm.load(path, quant="f32", use_cache=False)
            own = _greedy(f32)
            runs = [f32] + ([cpullm.load(path, use_cache=False)] if "q8_0" in path.name else [])
            for m in runs:
                got = m.logits(IDS)
                f = testing.fidelity(got, ref_logits)
                g = own if m is f32 else _greedy(m)
                formats = ", ".join(f"{k} {v}" for k, v in m.info()["weight_formats"].items())
                print(f"| {path.name} | {m.quant} | {formats} | {np.abs(got - ref_logits).max() / np.abs(ref_logits).max():.2e}"
                      f" | {f['kl']:.2e} | {f['top1']:.3f} | {_first_diff(g, ref_tokens)} | {_first_diff(g, own)} |")


def q8_values_in_transformers(files: dict, dirs: dict) -> None:
    """transformers run on the Q8_0 file's own values (each tensor as cpullm's GGUF store reads
    it: dequantized, V heads put back, A_log recovered) against cpullm's f32 run of that file."""
    import torch

    import cpullm
    from cpullm.loading.gguf_model import GGUFStore
    from hf_reference import hf_logits, hf_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    for kind, cls in (("dense", Qwen3_5ForCausalLM), ("moe", Qwen3_5MoeForCausalLM)):
        path = files[(kind, "q8_0")]
        ref, store = hf_model(dirs[kind], cls), GGUFStore(path)
        sd = ref.state_dict()
        with torch.no_grad():
            for n in store.names():
                w = torch.from_numpy(store.get(n))
                if n in sd:
                    sd[n].copy_(w.reshape(sd[n].shape))
                    continue
                base, e, which = expert.match(n).groups()       # transformers 5 stacks the experts
                e, rows = int(e), w.shape[0]
                if which == "down":
                    sd[base + ".down_proj"][e].copy_(w)
                else:
                    sd[base + ".gate_up_proj"][e, (0 if which == "gate" else rows):][:rows].copy_(w)
        theirs = hf_logits(ref, IDS)
        ours = cpullm.load(path, quant="f32", use_cache=False).logits(IDS)
        print(f"{path.name}: cpullm f32 run vs transformers on the same values: max err / max|ref| = "
              f"{np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")


def convert_roundtrip(files: dict, dirs: dict, work: Path) -> None:
    """``cpullm convert`` of the F32 files: transformers on the directory against the checkpoint."""
    from cpullm.convert.directory import convert_gguf
    from hf_reference import hf_logits, hf_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    for kind, cls in (("dense", Qwen3_5ForCausalLM), ("moe", Qwen3_5MoeForCausalLM)):
        out = work / f"converted_{kind}"
        convert_gguf(files[(kind, "f32")], out, overwrite=True)
        a, b = hf_logits(hf_model(out, cls), IDS), hf_logits(hf_model(dirs[kind], cls), IDS)
        print(f"cpullm convert {files[(kind, 'f32')].name}: transformers on the result vs on the checkpoint: "
              f"max err / max|ref| = {np.abs(a - b).max() / np.abs(b).max():.2e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="directory for the checkpoints and GGUFs")
    args = ap.parse_args(argv)
    from benchmarks.compare.llama_convert import llama_cpp_converter
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = llama_cpp_converter(work, say=lambda s: print(s, file=sys.stderr))
    dirs = make_checkpoints(work)
    files = {(kind, ot): llama_convert(src, dirs[kind], work / f"{kind}-{ot}.gguf", ot)
             for kind in ("dense", "moe") for ot in OUTTYPES}
    files[("dense", "mtp-f32")] = llama_convert(src, dirs["dense_mtp"], work / "dense-mtp-f32.gguf", "f32",
                                                keep_mtp=True)
    measure(files, dirs)
    print()
    q8_values_in_transformers(files, dirs)
    convert_roundtrip(files, dirs, work)


if __name__ == "__main__":
    main()
