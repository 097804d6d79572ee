"""Ray Serve request router for the model deployments: prefix affinity (router/prefix_affinity.py).

Enabled per deployment in serve_config.yaml:

    request_router_config:
      request_router_class: deployments.replica_router:PrefixAffinityRouter
      request_router_kwargs: {block_size: 16, imbalance: 2}

It runs inside every caller's deployment handle (the ingress), with no hop: Ray's own
PrefixCacheAffinityRouter asks a prefix-tree actor, a blocking call per request.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from engines.types import GenerateRequest
from router.prefix_affinity import PrefixAffinity


def _prompt(pending: PendingRequest | None) -> list[int] | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], GenerateRequest):
        return None  # stats(), propose() ...: no prompt to match
    return pending.args[0].prompt_token_ids


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 2, max_blocks: int = 200_000) -> None:
        self.affinity = PrefixAffinity(block_size=block_size, imbalance=imbalance, max_blocks=max_blocks)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        ranked, _ = self.affinity.rank(_prompt(pending_request) or [], loads)
        return [[by_id[rid] for rid in group] for group in ranked if group]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        ids = _prompt(pending_request)
        if ids:  # hashing again (microseconds) beats keeping state for requests that never get routed
            self.affinity.record(self.affinity.hashes(ids), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)
