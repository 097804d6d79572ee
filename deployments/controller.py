"""AdmissionController: the fleet's one coordinator, off the request path.

It shares the service-wide admission limits out among the live ingress replicas, hands each
the others' load, counts the model replicas, and keeps the cache invalidations every
SemanticCache replica and every ingress's near cache applies.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from admission.ledger import AdmissionLedger, AdmissionShare, ReplicaReport
from configs.schemas import AdmissionConfig
from deployments.serve_status import deployment_states_async
from semantic_cache.invalidations import InvalidationLog, Invalidations
from telemetry.metrics import ControllerMetrics

log = logging.getLogger(__name__)


@serve.deployment(name="AdmissionController")
class AdmissionController:
    """Shares the service-wide admission limits out among live ingress replicas."""

    def __init__(self, args: dict, metrics_enabled: bool = True) -> None:
        self.ledger = AdmissionLedger(AdmissionConfig.model_validate(args))
        self.invalidations = InvalidationLog()  # every cache replica and near cache applies these
        # Replica counts by deployment: ingresses size model seats with them (and, with metrics
        # on, this one replica exports the fleet's counts).
        self.replicas: dict[str, int] = {}
        recorder = ControllerMetrics() if metrics_enabled else None
        self._replicas_task = asyncio.create_task(self._count_replicas_forever(recorder))

    async def _count_replicas_forever(self, recorder: ControllerMetrics | None, every_s: float = 5.0) -> None:
        app = serve.get_replica_context().app_name
        while True:
            try:
                states = await deployment_states_async(app)  # a controller call: off the loop
                self.replicas = {name: d.replicas.get("RUNNING", 0) for name, d in states.items()}
                if recorder is not None:
                    recorder.replicas(self.replicas)
            except Exception as exc:
                log.debug("replica count failed: %r", exc)
            await asyncio.sleep(every_s)

    async def report(self, replica_id: str, report: ReplicaReport) -> AdmissionShare:
        share = self.ledger.report(replica_id, report)
        share.replicas = dict(self.replicas)
        share.invalidations = self.invalidations.since(report.invalidation_seq)
        return share

    async def invalidate(self, tenant: str) -> int:
        """Record that `tenant`'s cached answers are dropped, for every replica to apply."""
        return self.invalidations.add(tenant)

    async def invalidations_since(self, seq: int) -> Invalidations:
        return self.invalidations.since(seq)

    async def totals(self) -> dict[str, int]:
        return self.ledger.totals()
