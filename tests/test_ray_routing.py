"""The Ray deployment's prefix-aware routing, without a cluster: the routing key of a request,
and the request router's ranking (rendezvous hashing: stable, spread, minimal movement)."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
from cpullm.ray.serve import ROUTE_PREFIX_CHARS, PrefixRouter, route_key  # noqa: E402


def _replica(name):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def _first(candidates, key):
    ranks = asyncio.run(PrefixRouter.choose_replicas(None, candidates, SimpleNamespace(args=[key])))
    assert sorted(r[0].replica_id.unique_id for r in ranks) == sorted(c.replica_id.unique_id for c in candidates)
    assert all(len(r) == 1 for r in ranks)             # one replica per rank: the next if it is full
    return ranks[0][0].replica_id.unique_id


def test_route_key_is_the_start_of_the_prompt_or_messages():
    system = {"role": "system", "content": "S" * ROUTE_PREFIX_CHARS}
    a = json.dumps({"messages": [system, {"role": "user", "content": "one"}], "max_tokens": 3}).encode()
    b = json.dumps({"messages": [system, {"role": "user", "content": "two"}], "temperature": 0}).encode()
    c = json.dumps({"messages": [{"role": "system", "content": "other"}, {"role": "user", "content": "one"}]}).encode()
    assert route_key("/v1/chat/completions", a) == route_key("/v1/chat/completions", b)
    assert route_key("/v1/chat/completions", a) != route_key("/v1/chat/completions", c)
    p = "P" * ROUTE_PREFIX_CHARS
    assert route_key("/v1/completions", json.dumps({"prompt": p + "x"}).encode()) == \
        route_key("/v1/completions", json.dumps({"prompt": p + "y"}).encode())
    assert route_key("/v1/completions", b"not json") == "/v1/completions"
    assert route_key("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()).endswith("[1,2,3]")


def test_the_router_is_stable_spreads_keys_and_moves_only_a_lost_replicas_keys():
    reps = [_replica(n) for n in ("r-a", "r-b", "r-c")]
    keys = [f"/v1/completions\nprompt {i}" for i in range(300)]
    owner = {k: _first(reps, k) for k in keys}
    assert owner == {k: _first(list(reversed(reps)), k) for k in keys}     # order does not matter
    counts = Counter(owner.values())
    assert len(counts) == 3 and min(counts.values()) > 50               # 100 each expected
    after = {k: _first(reps[:2], k) for k in keys}                      # r-c is lost
    assert all(after[k] == owner[k] for k in keys if owner[k] != "r-c")
    assert asyncio.run(PrefixRouter.choose_replicas(None, reps, None)) == [reps]
    assert asyncio.run(PrefixRouter.choose_replicas(None, [], SimpleNamespace(args=["k"]))) == []


def test_replicas_times_threads_are_checked_against_the_nodes_cores(monkeypatch):
    import ray

    from cpullm.errors import ConfigError
    from cpullm.ray import check_cores

    nodes = [{"Alive": True, "Resources": {"CPU": 8.0}}, {"Alive": True, "Resources": {"CPU": 2.0}},
             {"Alive": False, "Resources": {"CPU": 64.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_cores(4, 2)                        # 8 // 2 + 2 // 2 = 5 fit
    check_cores(1, 8)
    with pytest.raises(ConfigError, match=r"--replicas 6 x --threads 2 needs 12 CPUs .* \[8, 2\] CPUs \(5 replicas fit\)"):
        check_cores(6, 2)
    with pytest.raises(ConfigError, match="--threads 16 is more than any node's 8 CPUs"):
        check_cores(1, 16)
