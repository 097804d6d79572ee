"""Keeps an ingress replica's gate in step with the controller, off the request path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from admission.ledger import AdmissionShare, ReplicaReport
from admission.policy import AdmissionPolicy

log = logging.getLogger(__name__)

ReportFn = Callable[[str, ReplicaReport], Awaitable[AdmissionShare]]


class AdmissionSync:
    def __init__(
        self, policy: AdmissionPolicy, report: ReportFn, replica_id: str, interval_s: float,
        on_invalidated: Callable[[list[str | None]], None] | None = None,
    ) -> None:
        self.policy = policy
        self.on_invalidated = on_invalidated  # cache invalidations the fleet made: the near cache drops them
        self.invalidation_seq = -1
        self._report = report
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.last_share: AdmissionShare | None = None
        self.observations_seq = -1  # the other replicas' completions learned from, by the ledger's count

    async def sync_once(self) -> AdmissionShare:
        gate = self.policy.gate
        report = ReplicaReport(
            gate.inflight, gate.queued, gate.admitted, sum(gate.rejected.values()), gate.running_by_model(),
            self.invalidation_seq, gate.shares.active_here(), self.policy.take_observations(), self.observations_seq,
        )
        share = await self._report(self.replica_id, report)
        self.policy.learn_from_others(share.observations)
        self.observations_seq = share.observations_seq
        if share.invalidations is not None:
            if share.invalidations.tenants and self.on_invalidated is not None:
                self.on_invalidated(share.invalidations.tenants)
            self.invalidation_seq = share.invalidations.seq
        self.policy.synced(
            share.max_inflight, share.max_queued, share.others_by_replica, share.live_replicas, share.replicas,
            share.others_tenants,
        )
        self.last_share = share
        return share

    async def run_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.sync_once(), timeout=max(1.0, 2 * self.interval_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last limits; admission must not depend on the controller being up
                log.warning("admission sync failed, keeping current limits: %r", exc)
            await asyncio.sleep(self.interval_s)
