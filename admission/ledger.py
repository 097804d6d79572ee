"""The controller's view: which ingress replicas are alive, and each one's share of the limits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from configs.schemas import AdmissionConfig


@dataclass(slots=True)
class ReplicaReport:
    inflight: int
    queued: int
    admitted: int
    rejected: int
    running_by_model: dict[str, int] = field(default_factory=dict)
    invalidation_seq: int = -1  # the cache invalidations this replica has applied (semantic_cache/invalidations.py)
    active_tenants: tuple[str, ...] = ()  # its most recently active tenants (admission/fair_share.py)


@dataclass(slots=True)
class AdmissionShare:
    max_inflight: int
    max_queued: int
    live_replicas: int
    others_inflight: dict[str, int] = field(default_factory=dict)  # the other replicas' running, by model
    replicas: dict[str, int] = field(default_factory=dict)  # RUNNING replicas by deployment name (the controller's last count)
    invalidations: Any = None  # cache invalidations since the report's invalidation_seq (Invalidations)
    others_tenants: tuple[str, ...] = ()  # tenants active on the other replicas


class AdmissionLedger:
    def __init__(self, config: AdmissionConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._seen: dict[str, tuple[float, ReplicaReport]] = {}

    def report(self, replica_id: str, report: ReplicaReport) -> AdmissionShare:
        now = self._clock()
        self._seen[replica_id] = (now, report)
        # A replica that missed three syncs is gone (scaled down or dead): stop counting it.
        horizon = now - 3 * self.config.sync_interval_s
        self._seen = {rid: v for rid, v in self._seen.items() if v[0] >= horizon}
        live = len(self._seen)
        others: dict[str, int] = {}
        tenants: set[str] = set()
        for rid, (_, r) in self._seen.items():
            if rid != replica_id:
                for model, n in r.running_by_model.items():
                    others[model] = others.get(model, 0) + n
                tenants.update(r.active_tenants)
        return AdmissionShare(
            max_inflight=max(1, math.ceil(self.config.max_inflight / live)),
            max_queued=math.ceil(self.config.max_queued / live),
            live_replicas=live,
            others_inflight=others,
            others_tenants=tuple(sorted(tenants)),
        )

    def totals(self) -> dict[str, int]:
        reports = [r for _, r in self._seen.values()]
        return {
            "replicas": len(reports),
            "inflight": sum(r.inflight for r in reports),
            "queued": sum(r.queued for r in reports),
            "admitted": sum(r.admitted for r in reports),
            "rejected": sum(r.rejected for r in reports),
        }
