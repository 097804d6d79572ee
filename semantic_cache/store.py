"""Vector stores for the semantic cache, behind one small interface.

- `EdgeStore` (default): Qdrant's own engine embedded in the replica (`qdrant-edge-py`), HNSW
  and payload indexes included. qdrant-client's local mode is brute-force Python, far over the
  lookup's latency budget at 100k entries (docs/caching.md).
- `ClientStore`: `qdrant-client`, either `:memory:` (small caches, tests) or a Qdrant server
  URL, so every cache replica of a cluster shares one store.

Entries are filtered by `scope` (tenant + model + conversation context + sampling) and by
expiry, so a search can only ever return an answer that belongs to the asking scope.
"""

from __future__ import annotations

import collections
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from configs.schemas import VectorStoreConfig


@dataclass(frozen=True, slots=True)
class Match:
    point_id: str
    score: float
    payload: dict[str, Any]


class VectorStore(Protocol):
    def upsert(self, point_id: str, vector: np.ndarray, payload: dict[str, Any]) -> None: ...
    def search(self, vector: np.ndarray, scope: str, now: float, limit: int) -> list[Match]: ...
    def delete(self, point_ids: list[str]) -> None: ...
    def delete_tenant(self, tenant: str) -> None: ...
    def delete_expired(self, now: float) -> None: ...
    def count(self) -> int: ...
    def maintain(self) -> None: ...


def owner_of(tenant: str) -> str:
    """The key's tenant of an `x-tenant` namespace inside it ("owner/sub"), or the tenant itself."""
    return tenant.split("/", 1)[0]


def _tenant_fields(tenant: str) -> tuple[str, ...]:
    """Payload fields whose match drops `tenant`'s points: a key's tenant takes its namespaces too."""
    return ("tenant",) if "/" in tenant else ("tenant", "owner")


def point_id(key: str) -> str:
    """A stable UUID for an exact cache key, so rewriting an entry replaces it."""
    return str(uuid.UUID(hex=key[:32]))


class EdgeStore:
    def __init__(self, config: VectorStoreConfig, dimensions: int) -> None:
        import qdrant_edge as qe

        self._qe = qe
        self._tmp = None
        path = config.location
        if path is None:  # an in-process cache: nothing to keep across restarts
            self._tmp = tempfile.TemporaryDirectory(prefix="semantic-cache-")
            path = self._tmp.name
        edge_config = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=dimensions, distance=qe.Distance.Cosine),
            wal_enabled=config.location is not None,
            max_search_threads=1,
        )
        try:
            self.shard = qe.EdgeShard.load(path, edge_config)
        except Exception:
            self.shard = qe.EdgeShard.create(path, edge_config)
        for name, kind in (("scope", qe.PayloadSchemaType.Keyword), ("tenant", qe.PayloadSchemaType.Keyword),
                           ("owner", qe.PayloadSchemaType.Keyword), ("expires", qe.PayloadSchemaType.Float)):
            self.shard.update(qe.UpdateOperation.create_field_index(name, kind))
        # Writes and index builds are serialized; searches run alongside both. A write never
        # waits for the lock: while an index build (seconds) holds it, writes queue and the
        # holder applies them before letting go, so the replica's event loop, which also
        # answers lookups, is never held up by a build.
        self._write_lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._pending_lock = threading.Lock()

    def _update(self, op: Any) -> None:
        """Apply `op` now, or, while another thread holds the store, right after it."""
        with self._pending_lock:
            self._pending.append(op)
        self._drain()

    def _drain(self) -> None:
        while self._write_lock.acquire(blocking=False):
            try:
                while True:
                    with self._pending_lock:
                        if not self._pending:
                            break
                        op = self._pending.popleft()
                    self.shard.update(op)
            finally:
                self._write_lock.release()
            with self._pending_lock:  # one queued between the last pop and the release
                if not self._pending:
                    return

    @property
    def queued_writes(self) -> int:
        return len(self._pending)

    def upsert(self, point_id: str, vector: np.ndarray, payload: dict[str, Any]) -> None:
        self._update(self._qe.UpdateOperation.upsert_points([self._qe.Point(point_id, vector.tolist(), payload)]))

    def search(self, vector: np.ndarray, scope: str, now: float, limit: int) -> list[Match]:
        qe = self._qe
        where = qe.Filter(must=[
            qe.FieldCondition(key="scope", match=qe.MatchValue(scope)),
            qe.FieldCondition(key="expires", range=qe.RangeFloat(gt=now)),
        ])
        found = self.shard.query(
            qe.QueryRequest(limit=limit, query=qe.Query.Nearest(vector.tolist()), filter=where, with_payload=True)
        )
        return [Match(str(p.id), float(p.score), dict(p.payload or {})) for p in found]

    def delete(self, point_ids: list[str]) -> None:
        if point_ids:
            self._update(self._qe.UpdateOperation.delete_points(list(point_ids)))

    def delete_tenant(self, tenant: str) -> None:
        qe = self._qe
        where = qe.Filter(should=[qe.FieldCondition(key=f, match=qe.MatchValue(tenant)) for f in _tenant_fields(tenant)])
        self._update(qe.UpdateOperation.delete_points_by_filter(where))

    def delete_expired(self, now: float) -> None:
        qe = self._qe
        where = qe.Filter(must=[qe.FieldCondition(key="expires", range=qe.RangeFloat(lte=now))])
        self._update(qe.UpdateOperation.delete_points_by_filter(where))

    def count(self) -> int:
        return int(self.shard.count(self._qe.CountRequest(exact=True)))

    def maintain(self) -> None:
        """Build the HNSW index over new points (seconds at 10k entries; run off the request path)."""
        with self._write_lock:
            self.shard.optimize()
        self._drain()  # the writes that came meanwhile


class ClientStore:
    def __init__(self, config: VectorStoreConfig, dimensions: int) -> None:
        from qdrant_client import QdrantClient, models

        self._m = models
        location = config.location or ":memory:"
        if location.startswith(("http://", "https://")):
            self.client = QdrantClient(url=location, timeout=2)
        elif location == ":memory:":
            self.client = QdrantClient(location=":memory:")
        else:
            self.client = QdrantClient(path=location)
        self.collection = config.collection
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection, vectors_config=models.VectorParams(size=dimensions, distance=models.Distance.COSINE)
            )
            if location.startswith(("http://", "https://")):  # local mode has no payload indexes
                for name, kind in (("scope", models.PayloadSchemaType.KEYWORD),
                                   ("tenant", models.PayloadSchemaType.KEYWORD),
                                   ("owner", models.PayloadSchemaType.KEYWORD),
                                   ("expires", models.PayloadSchemaType.FLOAT)):
                    self.client.create_payload_index(self.collection, name, kind)

    def upsert(self, point_id: str, vector: np.ndarray, payload: dict[str, Any]) -> None:
        point = self._m.PointStruct(id=point_id, vector=vector.tolist(), payload=payload)
        self.client.upsert(self.collection, points=[point], wait=True)

    def search(self, vector: np.ndarray, scope: str, now: float, limit: int) -> list[Match]:
        m = self._m
        where = m.Filter(must=[
            m.FieldCondition(key="scope", match=m.MatchValue(value=scope)),
            m.FieldCondition(key="expires", range=m.Range(gt=now)),
        ])
        found = self.client.query_points(
            self.collection, query=vector.tolist(), query_filter=where, limit=limit, with_payload=True
        ).points
        return [Match(str(p.id), float(p.score), dict(p.payload or {})) for p in found]

    def delete(self, point_ids: list[str]) -> None:
        if point_ids:
            self.client.delete(self.collection, points_selector=self._m.PointIdsList(points=list(point_ids)))

    def delete_tenant(self, tenant: str) -> None:
        m = self._m
        where = m.Filter(should=[m.FieldCondition(key=f, match=m.MatchValue(value=tenant)) for f in _tenant_fields(tenant)])
        self.client.delete(self.collection, points_selector=m.FilterSelector(filter=where))

    def delete_expired(self, now: float) -> None:
        m = self._m
        where = m.Filter(must=[m.FieldCondition(key="expires", range=m.Range(lte=now))])
        self.client.delete(self.collection, points_selector=m.FilterSelector(filter=where))

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)

    def maintain(self) -> None:
        pass  # a Qdrant server indexes by itself


def make_store(config: VectorStoreConfig, dimensions: int) -> VectorStore:
    return EdgeStore(config, dimensions) if config.kind == "edge" else ClientStore(config, dimensions)
