"""A request's stopwatch: consecutive stages on its critical path, plus overlapping details.

Stages run back to back: each lasts from the end of the previous one to its `stage()` call, so
together they account for the whole server time and `Server-Timing` adds up. Details are
sub-intervals that may overlap (the cache lookup beside routing, the model's prefill inside the
hop): they explain a stage and are shown as `stage.detail`, never added in. The same intervals
become the request's trace spans (telemetry/tracing.py).
"""

from __future__ import annotations

import time


class StageClock:
    __slots__ = ("start", "wall_start", "_last", "stages", "details", "counts")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.wall_start = time.time_ns()  # spans need wall-clock times; intervals use perf_counter
        self._last = self.start
        self.stages: list[tuple[str, float, float]] = []  # (name, start, end), perf_counter seconds
        self.details: list[tuple[str, float, float]] = []  # (stage.detail, start, end)
        self.counts: dict[str, float] = {}  # numbers that are not times (prefix tokens reused)

    def stage(self, name: str, end: float | None = None) -> float:
        """Close stage `name`: from the previous stage's end until now (or `end`)."""
        end = time.perf_counter() if end is None else end
        self.stages.append((name, self._last, end))
        self._last = end
        return end

    def stage_parts(self, parts: list[tuple[str, float]], rest: str, end: float | None = None) -> None:
        """Close the interval since the previous stage as several stages: `parts` with durations
        observed elsewhere (ms, e.g. by the model replica), the remainder as `rest` (the hop).
        The remainder is split around the parts (half out, half back) as a call's hops are.
        A part longer than the time left (it began before the previous stage ended: a prefill
        started beside the cache lookup) is cut to fit, and `<part>.whole` says how long it was."""
        end = time.perf_counter() if end is None else end
        span = max(0.0, end - self._last)
        known = []
        left = span
        for name, ms in parts:
            dur = min(max(0.0, ms / 1000), left)
            known.append((name, dur, max(0.0, ms / 1000)))
            left -= dur
        t = self._last
        self.stages.append((rest, t, t + left / 2))
        t += left / 2
        for name, dur, whole in known:
            self.stages.append((name, t, t + dur))
            if whole - dur > 0.00005:  # it ends where the stage ends, and began that much earlier
                self.details.append((f"{name}.whole", t + dur - whole, t + dur))
            t += dur
        self.stages.append((rest, t, end))
        self._last = end

    def detail(self, name: str, start: float, end: float | None = None) -> float:
        end = time.perf_counter() if end is None else end
        self.details.append((name, start, end))
        return end

    def details_within(self, start: float, end: float, parts: list[tuple[str, float]]) -> None:
        """Details observed elsewhere (ms, e.g. inside the cache replica), laid back to back in
        the middle of the call [start, end] that contained them: the rest is the hop out and back."""
        total = sum(max(0.0, ms) for _, ms in parts) / 1000
        t = start + max(0.0, (end - start) - total) / 2
        for name, ms in parts:
            dur = max(0.0, ms) / 1000
            self.details.append((name, t, t + dur))
            t += dur

    def details_in_stage(self, stage: str, parts: list[tuple[str, float]]) -> None:
        """Details observed elsewhere (ms) that explain the last `stage`, laid inside it."""
        for name, start, end in reversed(self.stages):
            if name == stage:
                self.details_within(start, end, parts)
                return

    def ms(self, name: str) -> float | None:
        """A stage's (summed) or a detail's duration in ms, or None if it never ran."""
        found = [e - s for n, s, e in self.stages if n == name] or [e - s for n, s, e in self.details if n == name]
        return sum(found) * 1000 if found else None

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def stage_ms(self) -> dict[str, float]:
        """Stage name -> ms, summed over repeats, in first-seen order."""
        out: dict[str, float] = {}
        for name, s, e in self.stages:
            out[name] = out.get(name, 0.0) + (e - s) * 1000
        return out

    def server_timing(self) -> str:
        """`Server-Timing`: the stages (they add up to `total`), then the details."""
        entries = [f"{name};dur={ms:.1f}" for name, ms in self.stage_ms().items()]
        entries += [f"{name};dur={(e - s) * 1000:.1f}" for name, s, e in self.details]
        entries += [f"{name};desc={value:g}" for name, value in self.counts.items()]
        entries.append(f"total;dur={self.elapsed_ms():.1f}")
        return ", ".join(entries)

    def wall_ns(self, t: float) -> int:
        """A perf_counter() instant as wall-clock ns (for span start/end times)."""
        return self.wall_start + int((t - self.start) * 1e9)


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
