"""Percentile summaries for latency samples."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: name;dur=1.2, other;dur=3.4` -> {"name": 1.2, "other": 3.4}."""
    out = {}
    for part in header.split(","):
        if ";dur=" in part:
            name, dur = part.strip().split(";dur=", 1)
            out[name] = float(dur)
    return out


def server_timing_count(header: str, name: str) -> float:
    """A count carried as `name;desc=N` (not a duration, so `server_timing` leaves it out); 0 if absent."""
    for part in header.split(","):
        if part.strip().startswith(f"{name};desc="):
            return float(part.strip().split(";desc=", 1)[1])
    return 0.0


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 3) if values else float("nan"),
        "p50": round(percentile(values, 0.50), 3),
        "p95": round(percentile(values, 0.95), 3),
        "p99": round(percentile(values, 0.99), 3),
    }
