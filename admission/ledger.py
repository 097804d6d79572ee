"""The controller's view: which ingress replicas are alive, and each one's share of the limits."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
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
    observations: list = field(default_factory=list)  # its completions since its last report (Observation)
    observations_seq: int = -1  # the other replicas' observations it has learned from


@dataclass(slots=True)
class AdmissionShare:
    max_inflight: int
    max_queued: int
    live_replicas: int
    # the other replicas' running requests, by replica id and model
    others_by_replica: dict[str, dict[str, int]] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)  # RUNNING replicas by deployment name (the controller's last count)
    invalidations: Any = None  # cache invalidations since the report's invalidation_seq (Invalidations)
    others_tenants: tuple[str, ...] = ()  # tenants active on the other replicas
    observations: list = field(default_factory=list)  # the other replicas' completions it has not seen
    observations_seq: int = -1  # the newest of them: the report's next observations_seq


# Completions kept for replicas to learn from each other: a replica that falls further behind
# than this (a stall of many syncs) skips the oldest.
OBSERVATIONS_KEPT = 1024


class AdmissionLedger:
    def __init__(self, config: AdmissionConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._seen: dict[str, tuple[float, ReplicaReport]] = {}
        # Every replica's completions, (seq, replica, observation), relayed to the others: each
        # ingress then prices a model by what every ingress saw it do, not by its half of them.
        self._observations: deque[tuple[int, str, object]] = deque(maxlen=OBSERVATIONS_KEPT)
        self._seq = itertools.count()
        self._last_seq = -1

    def report(self, replica_id: str, report: ReplicaReport) -> AdmissionShare:
        now = self._clock()
        self._seen[replica_id] = (now, report)
        # A replica that missed three syncs is gone (scaled down or dead): stop counting it.
        horizon = now - 3 * self.config.sync_interval_s
        self._seen = {rid: v for rid, v in self._seen.items() if v[0] >= horizon}
        live = len(self._seen)
        others: dict[str, dict[str, int]] = {}
        tenants: set[str] = set()
        for rid, (_, r) in self._seen.items():
            if rid != replica_id:
                others[rid] = dict(r.running_by_model)
                tenants.update(r.active_tenants)
        theirs = self._relay(replica_id, report)
        return AdmissionShare(
            max_inflight=max(1, math.ceil(self.config.max_inflight / live)),
            max_queued=math.ceil(self.config.max_queued / live),
            live_replicas=live,
            others_by_replica=others,
            others_tenants=tuple(sorted(tenants)),
            observations=theirs,
            observations_seq=self._last_seq,
        )

    def _relay(self, replica_id: str, report: ReplicaReport) -> list:
        """Keep the replica's new completions; return the other replicas' it has not seen. A
        replica's first report gets none: what was observed before it started is older than
        its own first observations, and would be learned as new."""
        since = report.observations_seq
        if since > self._last_seq:  # a seq of a ledger before this one (the controller restarted)
            since = -1
        theirs = [] if since < 0 else [o for seq, rid, o in self._observations if seq > since and rid != replica_id]
        for o in report.observations:
            self._last_seq = next(self._seq)
            self._observations.append((self._last_seq, replica_id, o))
        return theirs

    def totals(self) -> dict[str, int]:
        reports = [r for _, r in self._seen.values()]
        return {
            "replicas": len(reports),
            "inflight": sum(r.inflight for r in reports),
            "queued": sum(r.queued for r in reports),
            "admitted": sum(r.admitted for r in reports),
            "rejected": sum(r.rejected for r in reports),
        }
