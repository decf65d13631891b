"""One module per ``cpullm`` command: ``add_parser(subparsers)`` and ``run(args) -> int``."""
