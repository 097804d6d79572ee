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
