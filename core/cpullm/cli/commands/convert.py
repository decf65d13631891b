"""``cpullm convert FILE.gguf OUT_DIR``: a GGUF file -> a Hugging Face-layout model directory."""
from __future__ import annotations

from .common import progress_printer


def add_parser(sub):
    p = sub.add_parser("convert", help="convert a GGUF file to a safetensors model directory")
    p.add_argument("gguf", help="input .gguf file")
    p.add_argument("out_dir", help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    return p


def run(args) -> int:
    from cpullm.convert import convert_gguf

    with progress_printer("convert") as progress:
        out = convert_gguf(args.gguf, args.out_dir, progress=progress, overwrite=args.overwrite)
    print(out)
    return 0
