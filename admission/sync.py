"""Keeps an ingress replica's gate in step with the controller, off the request path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from admission.gate import AdmissionGate
from admission.ledger import AdmissionShare, ReplicaReport

log = logging.getLogger(__name__)

ReportFn = Callable[[str, ReplicaReport], Awaitable[AdmissionShare]]


class AdmissionSync:
    def __init__(self, gate: AdmissionGate, report: ReportFn, replica_id: str, interval_s: float) -> None:
        self.gate = gate
        self._report = report
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.last_share: AdmissionShare | None = None

    async def sync_once(self) -> AdmissionShare:
        gate = self.gate
        share = await self._report(
            self.replica_id, ReplicaReport(gate.inflight, gate.queued, gate.admitted, gate.rejected)
        )
        gate.set_limits(share.max_inflight, share.max_queued)
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
