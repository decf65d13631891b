"""llama.cpp's own q8_0 KV cache on the same text, for comparison with benchmarks/kv_cache.py:
KL(f16 cache || q8_0 cache) of the next-token distributions at the last ``--eval`` + 1 positions
after ``--ctx`` tokens of real text (teacher forced), through llama-cpp-python (pip install
'cpullm[bench]').

    python benchmarks/kv_cache_llamacpp.py MODEL.gguf --ctx 4096 16384 --eval 32 [--threads 2]

llama.cpp's reference is its default f16 cache (it has no f32 cache with flash attention, which its
quantized V cache needs); the text is benchmarks/kv_cache.py's, tokenized by the GGUF's tokenizer.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from kv_cache import compare, text_ids


class _Tok:
    def __init__(self, llm):
        self.llm = llm

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)


def logits(path: str, ids: list[int], n_eval: int, type_kv: int, threads: int) -> np.ndarray:
    """Logits (n_eval + 1, vocab) at the last n_eval + 1 positions: a prefill of all but the last
    n_eval tokens, then one-token decode steps (as benchmarks/kv_cache.py runs cpullm; only the
    last row of each call is kept, so a 16k context does not hold 16k rows of logits)."""
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, logits_all=False,
                type_k=type_kv, type_v=type_kv, flash_attn=True, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(ids[: len(ids) - n_eval])
    rows = [np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy()]
    for t in ids[len(ids) - n_eval:]:
        llm.eval([t])
        rows.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy())
    return np.stack(rows).astype(np.float32)


def main(argv=None) -> int:
    import llama_cpp
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--ctx", type=int, nargs="+", default=[4096])
    p.add_argument("--eval", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    from llama_cpp import Llama
    tok = Llama(model_path=a.gguf, vocab_only=True, verbose=False)
    for n in a.ctx:
        ids = text_ids(_Tok(tok), n + a.eval)
        ref = logits(a.gguf, ids, a.eval, llama_cpp.GGML_TYPE_F16, a.threads)
        got = logits(a.gguf, ids, a.eval, llama_cpp.GGML_TYPE_Q8_0, a.threads)
        r = compare(ref, got)
        print(f"llama.cpp {os.path.basename(a.gguf)}, context {n}, {a.eval} teacher-forced positions, load average "
              f"{os.getloadavg()[0]:.1f}: q8_0 vs f16 cache KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e} "
              f"top-1 {r['top1']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
