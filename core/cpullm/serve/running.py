"""The running servers, for ``cpullm ps``: each ``cpullm serve`` writes a small JSON state file
(pid, address, model) into :func:`cpullm.loading.locations.servers_dir` once it listens, atomically,
and removes it on exit. A file whose process is gone (a server that was killed) is stale: the
listing skips it and deletes it."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from ..loading.locations import servers_dir

MAX_STATE_BYTES = 64 * 1024


def write_state(info: dict, root: Path | None = None) -> Path:
    """Record this process's server (``info``: host, port, model, ...); returns the file."""
    root = root or servers_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"serve-{os.getpid()}.json"
    tmp = root / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    data = {**info, "pid": os.getpid(), "started": time.time()}
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_state(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process: alive
        return True
    except OSError:
        return False
    return True


def running_servers(root: Path | None = None, probe: bool = True) -> list[dict]:
    """The servers whose state files name a live process, oldest first; each with ``health``:
    its ``GET /health`` answer (``probe``), else None, and ``responding``."""
    from ..limits import read_json_file

    root = root or servers_dir()
    out = []
    for path in sorted(root.glob("serve-*.json")) if root.is_dir() else []:
        try:
            info = read_json_file(path, follow_symlinks=False, max_bytes=MAX_STATE_BYTES)
        except (OSError, ValueError, RuntimeError, TypeError):
            info = None
        pid = info.get("pid") if isinstance(info, dict) else None
        if not isinstance(pid, int) or pid <= 0 or not pid_alive(pid):
            remove_state(path)                  # killed without cleaning up
            continue
        info["health"] = _health(info) if probe else None
        info["responding"] = info["health"] is not None
        out.append(info)
    return sorted(out, key=lambda i: i.get("started") or 0)


def _health(info: dict, timeout: float = 1.0) -> dict | None:
    """The server's /health JSON, or None if it does not answer within ``timeout``."""
    import urllib.request

    host, port = info.get("host"), info.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{shown}:{port}/health", timeout=timeout) as r:
            data = json.loads(r.read(MAX_STATE_BYTES))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
