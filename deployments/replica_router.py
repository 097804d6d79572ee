"""Ray Serve request routers. For the model deployments: prefix affinity (router/prefix_affinity.py).
For the SemanticCache deployment: `ScopeShardRouter`, every call for a cache scope to one replica.

Enabled per deployment in serve_config.yaml:

    request_router_config:
      request_router_class: deployments.replica_router:PrefixAffinityRouter
      request_router_kwargs: {block_size: 16, imbalance: 2}

It runs inside every caller's deployment handle (the ingress), with no hop: Ray's own
PrefixCacheAffinityRouter asks a prefix-tree actor, a blocking call per request.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from engines.blocks import salt_root
from engines.types import GenerateRequest
from router.prefix_affinity import PrefixAffinity


def _prompt(pending: PendingRequest | None) -> tuple[list[int], int] | None:
    """The request's prompt ids and salt (its replica keys prefix KV by both)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], GenerateRequest):
        return None  # stats(), propose() ...: no prompt to match
    request = pending.args[0]
    return request.prompt_token_ids, salt_root(request.cache_salt)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 2, max_blocks: int = 200_000) -> None:
        self.affinity = PrefixAffinity(block_size=block_size, imbalance=imbalance, max_blocks=max_blocks)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        ids, root = _prompt(pending_request) or ([], 0)
        ranked, _ = self.affinity.rank(ids, loads, root)
        return [[by_id[rid] for rid in group] for group in ranked if group]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        prompt = _prompt(pending_request)
        if prompt and prompt[0]:  # hashing again (microseconds) beats keeping state for requests that never get routed
            self.affinity.record(self.affinity.hashes(*prompt), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


# The SemanticCache methods that carry a shard key, and where: lookup(key, scope, query),
# store(entry), verified(shard, entry_key, score, correct).
def _shard(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args:
        return None
    method, args = pending.metadata.call_method, pending.args
    if method == "lookup" and len(args) >= 2:
        return args[1] or args[0]  # the scope, or the exact key where there is none
    if method == "store":
        return getattr(args[0], "shard", None) or None
    if method == "verified":
        return args[0]
    return None  # stats(), invalidate(), channel(): any replica


def _weight(shard: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{shard}|{replica}".encode(), digest_size=8).digest(), "big")


class ScopeShardRouter(RequestRouter):
    """Each cache scope (a tenant's model, context and sampling; or an exact key without one) lives
    on one SemanticCache replica, picked by rendezvous hashing over the live replicas: its lookups,
    writes and verification outcomes all go there, so adding replicas splits the entries instead
    of scattering them (a hit stays a hit at any replica count), and a replica that goes away
    moves only its own scopes. The owner is asked first; the next in rank only if it is full."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        shard = _shard(pending_request)
        if shard is None:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _weight(shard, r.replica_id.unique_id), reverse=True)
        return [[r] for r in ranked]
