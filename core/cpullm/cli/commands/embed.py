"""``cpullm embed [MODEL] < texts``: one embedding per input line, one JSON line each
(``{"index": i, "embedding": [...]}``), in order; ``-p TEXT`` embeds one text instead."""
from __future__ import annotations

import json
import sys

from .common import add_model_options, load_model, positive_int

BATCH_LINES = 64          # lines embedded per model call (output streams batch by batch)
MAX_LINE_BYTES = 1 << 20


def add_parser(sub):
    p = sub.add_parser("embed", help="embed each line of stdin (one JSON line per input line)",
                       description="Embeddings of each line of standard input (or of -p TEXT): one "
                                   "JSON object per line, {\"index\", \"embedding\"}. Pooling is the "
                                   "checkpoint's (sentence-transformers modules.json, GGUF metadata), "
                                   "else the last token; vectors are L2-normalized.")
    add_model_options(p)
    p.add_argument("-p", "--prompt", default=None, help="embed this text instead of reading stdin")
    p.add_argument("--pooling", choices=["last", "mean", "cls"], default=None,
                   help="override the checkpoint's pooling")
    p.add_argument("--no-normalize", action="store_true", help="do not L2-normalize")
    p.add_argument("--dimensions", type=positive_int, default=None,
                   help="cut to N dimensions (Matryoshka models only)")
    return p


def _lines():
    """(line number, text) of stdin's lines, each UTF-8 and at most MAX_LINE_BYTES."""
    from cpullm.errors import PromptError

    from .chat import require_utf8
    for n, raw in enumerate(iter(lambda: sys.stdin.buffer.readline(MAX_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise PromptError(f"stdin line {n} is over {MAX_LINE_BYTES >> 20} MiB; split it")
        text = raw.decode("utf-8", errors="surrogateescape").rstrip("\r\n")
        require_utf8(f"stdin line {n}", text)
        if not text.strip():
            raise PromptError(f"stdin line {n} is empty; give one text per line")
        yield text


def run(args) -> int:
    from cpullm.errors import PromptError

    if args.prompt is not None:
        texts = iter([args.prompt])
    elif sys.stdin is None or sys.stdin.isatty():
        raise PromptError("give the texts on stdin, one per line (cpullm embed MODEL < texts.txt), "
                          "or one with -p")
    else:
        texts = _lines()
    model = load_model(args)
    index = 0
    while True:
        batch = [t for _, t in zip(range(BATCH_LINES), texts)]
        if not batch:
            return 0
        vecs = model.embed(batch, pooling=args.pooling, normalize=not args.no_normalize,
                           dimensions=args.dimensions)
        for v in vecs:
            sys.stdout.write(json.dumps({"index": index, "embedding": [float(x) for x in v]}) + "\n")
            index += 1
        sys.stdout.flush()
