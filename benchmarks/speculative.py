"""Speculative decoding (cpullm.generate.speculative) against plain decode and llama.cpp's prompt lookup.

Parts (``--parts``, default all that their inputs allow):

* ``edit``: code editing. The prompt holds a module of this Python's standard library (default
  ``colorsys``, 166 lines, written by someone else) and asks for the whole file back with one small
  change; greedy, decode tokens/s from the first generated token to the last, plain decode vs
  ``--speculative lookup``.
* ``llama``: with ``--llama-gguf`` (the Q8_0 of the same weights), llama-cpp-python's plain
  decode and its ``LlamaPromptLookupDecoding`` on the same token ids.
* ``chat``: open-ended chat requests (answers not copied from the prompt), plain vs the default
  ``auto`` (what backing off costs).
* ``verify``: the cost of a verify pass of k = 1, 2, 4, 8 guesses (k + 1 rows) relative to one
  plain decode step (greedy, as decoding runs it), after a 256-token prompt, for the model and
  for each ``--synth`` checkpoint (benchmarks/synth.py writes random weights in published shapes).
* ``draft``: with ``--draft-model``: the measured cost of a draft step and, for each target of the
  ``verify`` part (the model and each ``--synth`` checkpoint), of a verify pass of k guesses, and
  the speedup they imply at acceptance 0.6 / 0.7 / 0.8.

    python benchmarks/speculative.py --model qwen2.5-coder-0.5b-instruct --threads 2 \\
        --llama-gguf /tmp/qwen2.5-coder-0.5b-instruct-q8_0.gguf --out result.json

The llama.cpp paths are arguments (nothing here assumes where llama.cpp lives). This is a
benchmark, never a test: the numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time

import numpy as np

EDIT_INSTRUCTION = ("Return the whole file with one change: rename the function `{old}` to `{new}` "
                    "everywhere. Write only the code, no explanation.")
CHAT_PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "In three short paragraphs and in your own words, explain why the sky is blue and sunsets are red.")
"""Open-ended requests: their answers are not copied from the prompt."""


def edit_prompt(model, module_name: str) -> tuple[list[int], str]:
    mod = importlib.import_module(module_name)
    src = inspect.getsource(mod)
    funcs = [n for n, f in inspect.getmembers(mod, inspect.isfunction) if f.__module__ == module_name
             and not n.startswith("_")]
    old = funcs[0]
    text = f"Here is the file {module_name}.py:\n\n```python\n{src}```\n\n" + EDIT_INSTRUCTION.format(
        old=old, new=old + "_v2")
    return chat_ids(model, text), f"{module_name}.py ({src.count(chr(10))} lines), rename {old}"


def chat_ids(model, text: str) -> list[int]:
    from cpullm.generate.chat import render_chat
    return model.tokenizer.encode(render_chat(model, [{"role": "user", "content": text}]))


def run_cpullm(model, ids, gen_tokens: int, mode: str, draft_max: int) -> dict:
    from cpullm.generate.generate import generate_ids
    from cpullm.generate.sampling import SamplingParams
    from cpullm.generate.sequence import GenerationStats
    from cpullm.generate.speculative import resolve
    cfg = resolve(mode, draft_max, model.speculative.draft if mode in ("draft", "auto") else None)
    st = GenerationStats()
    toks = list(generate_ids(model.forward, model.slot, ids, gen_tokens, SamplingParams(), model.eos_token_ids,
                             st, speculative=cfg))
    return {"tokens": toks, "n": len(toks), "decode_tps": (len(toks) - 1) / st.decode_s if st.decode_s else 0.0,
            "prefill_s": st.prefill_s, "verify_passes": st.spec_passes, "drafted": st.spec_drafted,
            "accepted": st.spec_accepted,
            "accepted_per_pass": st.spec_accepted / st.spec_passes if st.spec_passes else 0.0}


def run_llama(path: str, ids, gen_tokens: int, threads: int, lookup: bool, n_ctx: int) -> dict:
    from llama_cpp import Llama
    kw = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        kw["draft_model"] = LlamaPromptLookupDecoding()
        kw["logits_all"] = True     # llama-cpp-python 0.3.36 sizes its logits buffer from this argument
                                    # (not from the draft model), prompts over n_batch fail without it
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False, **kw)
    times, toks = [], []
    for chunk in llm.create_completion(prompt=list(ids), max_tokens=gen_tokens, temperature=0.0, top_k=1,
                                       stream=True):
        times.append(time.perf_counter())
        toks.append(chunk["choices"][0]["text"])
    n = len(times)
    return {"n": n, "decode_tps": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0, "text": "".join(toks)}


def verify_costs(model, ks=(1, 2, 4, 8), reps: int = 7, prompt_len: int = 256) -> dict:
    """Median seconds of a plain greedy decode step and of a verify pass of k guesses (k + 1 rows)
    at position ``prompt_len``, and their ratios (``verify_k{k}_x``: the median ratio of each
    pass to the step timed just before it): the greedy verify pass as speculative decoding
    runs it (``verify_argmax``: the lm_head through the multi-row head screen or whole, whichever
    its timings found faster), and with the lm_head forced through the screen and whole
    (``_screen`` / ``_full``, where the model has a screen), and the verify pass that returns
    every row's logits (``_logits``: sampling)."""
    fwd = model.forward
    slot = fwd.new_slot()
    fwd.prefill(slot, [(7 * i + 3) % 1000 + 10 for i in range(prompt_len)])
    pos = slot.position
    rs = fwd.decoder.rows_screen

    def timed(fn, warm=1):
        out = []
        for _ in range(reps + warm):
            slot.position = pos
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        slot.position = pos
        return statistics.median(out[warm:])
    def once(fn):
        slot.position = pos
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        slot.position = pos
        return dt

    timed(lambda: fwd.step([slot], [42], greedy=[True]), warm=6)     # (the screen's choice settles)
    steps = []
    out = {"rows_screen": rs is not None}
    for k in ks:
        # each k against plain steps timed in turn with its passes: the host's memory speed drifts
        # by a third over seconds on a shared VM (a 4B step: 115-163 ms in one minute), and a
        # pass of k + 1 rows, compute-bound where a step is memory-bound, does not follow it
        rows = [[42] * (k + 1)]
        timed(lambda: fwd.verify_argmax([slot], rows), warm=6)
        st, vt = [], []
        for _ in range(3 * reps):
            st.append(once(lambda: fwd.step([slot], [42], greedy=[True])))
            vt.append(once(lambda: fwd.verify_argmax([slot], rows)))
        step, t = statistics.median(st), statistics.median(vt)
        steps.append(step)
        out[f"verify_k{k}_s"] = t
        out[f"verify_k{k}_x"] = statistics.median([v / s for v, s in zip(vt, st)])
        if rs is not None:
            for name, forced in (("screen", True), ("full", False)):
                rs.choose = lambda m, forced=forced: forced
                out[f"verify_k{k}_{name}_x"] = timed(lambda: fwd.verify_argmax([slot], rows)) / step
            del rs.choose
        out[f"verify_k{k}_logits_x"] = timed(lambda: fwd.verify([slot], rows)) / step
    out["decode_step_s"] = statistics.median(steps)
    return out


def implied_speedup(step_s: float, draft_s: float, verify_s: dict, k: int, alpha: float) -> float:
    """Tokens per round (1 - a^(k+1)) / (1 - a) over the round's time (k draft steps + a verify
    pass of k guesses), relative to plain decode (one token per step_s)."""
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens * step_s / (k * draft_s + verify_s[k])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--module", default="colorsys", help="standard-library module the edit prompt holds")
    ap.add_argument("--gen-tokens", type=int, default=1200)
    ap.add_argument("--chat-tokens", type=int, default=256)
    ap.add_argument("--chat-rounds", type=int, default=3,
                    help="plain / auto runs alternated per chat prompt (the ratio: their median)")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--llama-gguf", default=None, help="the Q8_0 GGUF of the same weights (llama-cpp-python)")
    ap.add_argument("--synth", nargs="*", default=[], help="synthetic checkpoint dirs for the verify cost")
    ap.add_argument("--draft-model", default=None, help="a draft model: draft-step cost and implied speedup")
    ap.add_argument("--parts", default="edit,llama,chat,verify,draft")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))

    import cpullm
    model = cpullm.load(a.model, quant=a.quant, threads=a.threads, n_ctx=4096)
    res = {"model": a.model, "quant": a.quant, "threads": a.threads, "argv": sys.argv}

    def save(r):
        if a.out:
            import os
            tmp = a.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(r, f, indent=1, default=float)
            os.replace(tmp, a.out)

    def say(*x):
        print(*x, file=sys.stderr, flush=True)

    if "edit" in parts or "llama" in parts:
        ids, what = edit_prompt(model, a.module)
        say(f"edit: {what}, {len(ids)} prompt tokens")
        r = res["edit"] = {"workload": what, "prompt_tokens": len(ids)}
    if "edit" in parts:
        # warm every path: a verify pass's first run in a process loads the batched step and
        # touches its rows' arena pages (5 rows: 104 ms against 21 after), decode time otherwise
        run_cpullm(model, ids[:64], 8, "off", a.draft_max)
        run_cpullm(model, ids, 48, "lookup", a.draft_max)
        plain = run_cpullm(model, ids, a.gen_tokens, "off", a.draft_max)
        spec = run_cpullm(model, ids, a.gen_tokens, "lookup", a.draft_max)
        r.update({"plain": _short(plain), "lookup": _short(spec),
                  "speedup_vs_plain": spec["decode_tps"] / plain["decode_tps"],
                  "identical": plain["tokens"] == spec["tokens"]})
        say(json.dumps(r, default=float))
        save(res)
    if "llama" in parts and a.llama_gguf:     # (its lookup drafts past the last token: room in n_ctx)
        lp = run_llama(a.llama_gguf, ids, a.gen_tokens, a.threads, False, len(ids) + a.gen_tokens + 256)
        ll = run_llama(a.llama_gguf, ids, a.gen_tokens, a.threads, True, len(ids) + a.gen_tokens + 256)
        r["llama_plain"] = {k: v for k, v in lp.items() if k != "text"}
        r["llama_lookup"] = {k: v for k, v in ll.items() if k != "text"}
        if "lookup" in r:
            r["speedup_vs_llama_lookup"] = r["lookup"]["decode_tps"] / ll["decode_tps"]
        say(json.dumps(r, default=float))
        save(res)
    if "chat" in parts:                     # plain vs the default mode (auto: lookup, backing off)
        res["chat"] = []
        ids, _ = edit_prompt(model, a.module)   # warm the verify path (see "edit")
        run_cpullm(model, ids, 48, "lookup", a.draft_max)
        for text in CHAT_PROMPTS:
            ids = chat_ids(model, text)
            run_cpullm(model, ids[:32], 8, "auto", a.draft_max)             # warm the paths
            # alternated, each ratio from a plain run and the auto run right after it: this VM's
            # memory rate moves 10-20 % between minutes, more than the speculation's effect
            rounds = []
            for _ in range(max(1, a.chat_rounds)):
                plain = run_cpullm(model, ids, a.chat_tokens, "off", a.draft_max)
                spec = run_cpullm(model, ids, a.chat_tokens, "auto", a.draft_max)
                rounds.append((plain, spec))
            ratios = [s["decode_tps"] / p["decode_tps"] for p, s in rounds]
            res["chat"].append({"prompt": text, "plain": _short(plain), "auto": _short(spec),
                                "plain_tps": [p["decode_tps"] for p, _ in rounds],
                                "auto_tps": [s["decode_tps"] for _, s in rounds],
                                "ratios": ratios, "ratio": float(np.median(ratios)),
                                "identical": all(p["tokens"] == s["tokens"] for p, s in rounds)})
            say(json.dumps(res["chat"][-1], default=float))
            save(res)
    if "verify" in parts:
        res["verify"] = {a.model: verify_costs(model)}
        say(json.dumps(res["verify"], default=float))
        for d in a.synth:
            m = cpullm.load(d, quant=a.quant, threads=a.threads, n_ctx=1024)
            res["verify"][d] = verify_costs(m)
            say(d, json.dumps(res["verify"][d], default=float))
            save(res)
            del m
    if "draft" in parts and a.draft_model:     # against every target measured above (the model, --synth)
        dm = cpullm.load(a.draft_model, quant=a.quant, threads=a.threads, n_ctx=1024)
        dc = verify_costs(dm, ks=())
        targets = res.get("verify") or {a.model: verify_costs(model)}
        res["draft"] = {"draft_model": a.draft_model, "draft_step_s": dc["decode_step_s"], "targets": {}}
        for name, tc in targets.items():
            ver = {k: tc[f"verify_k{k}_s"] for k in (1, 2, 4, 8)}
            res["draft"]["targets"][name] = {
                "target_step_s": tc["decode_step_s"], "verify_s": ver,
                "implied_speedup": {f"k{k}_a{al}": implied_speedup(tc["decode_step_s"], dc["decode_step_s"], ver, k, al)
                                    for k in (2, 4, 8) for al in (0.6, 0.7, 0.8)}}
        say(json.dumps(res["draft"], default=float))
    save(res)
    print(json.dumps(res, default=float))
    return 0


def _short(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "tokens"}


if __name__ == "__main__":
    sys.exit(main())
