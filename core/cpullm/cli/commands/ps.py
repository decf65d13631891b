"""``cpullm ps``: the running ``cpullm serve`` processes and their models (as Ollama's ``ps``),
from the state file each server writes (:mod:`cpullm.serve.running`) and its ``/health``."""
from __future__ import annotations

import json

from .models import ago, print_table


def add_parser(sub):
    p = sub.add_parser("ps", help="list the running servers and their models",
                       description="The running `cpullm serve` processes: pid, address, model, "
                                   "requests running and waiting (from each server's /health).")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def run(args) -> int:
    from cpullm.serve.running import running_servers

    servers = running_servers()
    if args.json:
        print(json.dumps(servers, indent=2, default=str))
        return 0
    if not servers:
        print("no cpullm server is running (start one with `cpullm serve MODEL`)")
        return 0
    rows = []
    for s in servers:
        host = s.get("host", "?")
        addr = f"{'[' + host + ']' if ':' in str(host) else host}:{s.get('port', '?')}"
        h = s.get("health")
        if h is None:
            status = "not answering /health"
        else:
            status = f"{h.get('status', '?')}, ctx {h.get('n_ctx', '?')}"
            for key, label in (("active", "running"), ("queued", "waiting")):
                if isinstance(h.get(key), int):
                    status += f", {h[key]} {label}"
        rows.append((s["pid"], addr, s.get("model", "?"), ago(s.get("started")), status))
    print_table([("PID", -7), ("ADDRESS", 22, 2), ("MODEL", 32), ("STARTED", 16), ("STATUS", 0)], rows)
    return 0
