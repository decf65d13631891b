"""``cpullm pull NAME``: fetch a known model (or an org/name repository) into the model store."""
from __future__ import annotations

from .common import progress_printer


def add_parser(sub):
    p = sub.add_parser("pull", help="fetch a known model into the model store")
    p.add_argument("name", help="smollm2-135m-instruct | gemma-3-270m | qwen2.5-coder-0.5b-instruct | org/name")
    p.add_argument("--dir", default=None, help="model store directory (default ~/.cache/cpullm/models)")
    p.add_argument("--convert", action="store_true",
                   help="store a bf16 safetensors directory instead of the GGUF as it is (4x larger)")
    return p


def run(args) -> int:
    from cpullm.store import pull

    with progress_printer(f"pull {args.name}") as progress:
        path = pull(args.name, dest_dir=args.dir, progress=progress, convert=args.convert)
    print(path)
    return 0
