"""The speculative bench: a copying workload decoded plain and with speculation, in one process.

Here, in the shell, because it drives whole generations (``generate_ids``) that the generate stage's
speculation module sits below."""
from __future__ import annotations

from ..generate.generate import generate_ids
from ..generate.sampling import SamplingParams
from ..generate.sequence import GenerationStats
from ..generate.speculative import SpecConfig


def copy_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A copying workload of about ``n_tokens`` tokens: the start of a module of Python's own
    standard library (``textwrap``, text written by someone else) and the request to repeat it."""
    import inspect
    import textwrap
    src = inspect.getsource(textwrap)
    ids = tokenizer.encode(src)[:max(16, int(n_tokens) - 24)]
    return tokenizer.encode("Here is a Python file:\n\n") + ids + tokenizer.encode(
        "\n\nRepeat the file above exactly, from its first line:\n\n") + ids[:8]


def measure(model, prompt_ids: list[int], gen_tokens: int, spec: SpecConfig) -> dict:
    """Greedy decode of ``prompt_ids`` plain and with ``spec``: tokens/s from the first token to the
    last (prefill excluded), the speedup, tokens accepted per verify pass; the outputs must agree."""
    out = {}
    for name, cfg in (("plain", None), ("speculative", spec)):
        for _ in range(2):                       # the first run warms every kernel path
            st = GenerationStats()
            toks = list(generate_ids(model.forward, model.slot, prompt_ids, gen_tokens, SamplingParams(), (),
                                     st, speculative=cfg))
        out[name] = {"tokens": toks, "decode_tps": (len(toks) - 1) / st.decode_s if st.decode_s else 0.0,
                     "stats": st}
    st = out["speculative"]["stats"]
    return {"mode": spec.mode, "draft_max": spec.draft_max, "gen_tokens": len(out["plain"]["tokens"]),
            "plain_decode_tps": out["plain"]["decode_tps"], "speculative_decode_tps": out["speculative"]["decode_tps"],
            "speedup": out["speculative"]["decode_tps"] / max(out["plain"]["decode_tps"], 1e-9),
            "verify_passes": st.spec_passes, "accepted_tokens": st.spec_accepted,
            "accepted_per_pass": st.spec_accepted / st.spec_passes if st.spec_passes else 0.0,
            "identical": out["plain"]["tokens"] == out["speculative"]["tokens"]}
