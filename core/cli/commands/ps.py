"""``cpullm ps``: the running ``cpullm serve`` processes and their models (as Ollama's ``ps``),
from the state file each server writes (:mod:`cpullm.serve.running`) and its ``/health``."""
from __future__ import annotations

import json

from .models import ago, one_line


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
    print(f"{'PID':>7}  {'ADDRESS':<22} {'MODEL':<32} {'STARTED':<16} STATUS")
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
        print(f"{s['pid']:>7}  {one_line(addr, 22):<22} {one_line(str(s.get('model', '?')), 32):<32} "
              f"{ago(s.get('started')):<16} {status}")
    return 0
