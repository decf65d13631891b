"""cpullm on a Ray cluster: batch jobs on Ray Data (``data.py``) and replicas behind one
OpenAI-compatible endpoint on Ray Serve (``serve.py``). Ray is the optional extra ``cpullm[ray]``:
nothing outside this package imports it, and this package imports it only when a job starts.

Each Ray worker (a Ray Data actor, a Ray Serve replica) loads the model itself, so it compiles the
program for its own CPU or loads it from its node's execution cache: a cluster mixing AVX-512
and AVX2 nodes works. The model is named by a path every node sees or a store name each node
pulls into its own store.
"""
from __future__ import annotations

import os

from ..errors import ConfigError, MissingDependencyError

INSTALL = "pip install 'cpullm[ray]'"


def require_ray():
    """The ``ray`` module, or one line naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(f"--ray needs Ray (ray[serve,data]); install it with {INSTALL}") from None
    return ray


def connect(address: str | None, num_cpus: int | None = None):
    """Join the cluster at ``address`` (or ``$RAY_ADDRESS``), else start a local one with
    ``num_cpus`` CPUs. Ray's own logs stay out of the terminal."""
    import logging

    ray = require_ray()
    for name in ("ray.serve", "ray.data"):         # their progress chatter; warnings still show
        logging.getLogger(name).setLevel(logging.WARNING)
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = {"address": address} if address else {"num_cpus": num_cpus or os.cpu_count() or 1}
    if not address:
        # Ray starts its workers at nice 15 (background work); replicas and batch actors are the
        # node's main work and must not yield their cores to everything else on the machine
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(log_to_driver=False, include_dashboard=False, logging_level="ERROR",
                 configure_logging=True, **kwargs)
    except ConnectionError as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address} ({exc}); check --ray-address "
                          "(or $RAY_ADDRESS), or drop it to start a local cluster") from None
    return ray


def check_cores(replicas: int, threads: int) -> None:
    """Refuse ``replicas`` x ``threads`` that cannot fit the cluster's CPUs without sharing cores
    (each replica asks Ray for ``threads`` CPUs and Ray places it on one node that has them)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = sorted((int(n.get("Resources", {}).get("CPU", 0)) for n in nodes), reverse=True)
    if not per_node or threads > per_node[0]:
        raise ConfigError(f"--threads {threads} is more than any node's {per_node[0] if per_node else 0} "
                          "CPUs: a replica would oversubscribe its node; lower --threads")
    fit = sum(c // threads for c in per_node)
    if replicas > fit:
        raise ConfigError(f"--replicas {replicas} x --threads {threads} needs {replicas * threads} CPUs "
                          f"in blocks of {threads}, but the cluster's nodes have {per_node} CPUs "
                          f"({fit} replicas fit); lower --replicas or --threads, or add nodes")
