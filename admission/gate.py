"""Deadline-aware admission, decided in-process inside each ingress replica (no hop).

Every request arrives as a `Ticket`: its model, tier priority, deadlines and token counts. The
gate predicts when it could start and when it would finish, from live state (who is running,
who is queued ahead, the other ingress replicas' requests: on this node's board now, elsewhere
as the controller synced them) and online service-time estimates:

    start now      a slot is free, nobody more urgent waits, it meets its own deadlines, and
                   the requests already running still meet theirs with one more sequence
                   sharing the model's decode steps; with a per-token target (`tpot_ms`), the
                   predicted time between tokens at one more sequence is within it, for it
                   and every running request (or it is its tenant's first, as others run);
    queue          it can't start now but is predicted to make it if it starts when the
                   running requests ahead of it finish; waits in (priority, deadline) order
                   (EDF within a tier), and is dropped the moment its latest useful start
                   time passes, before it ever reaches the model;
    shed           predicted to miss its deadline wherever it waits, or the queue is full:
                   503 at once, with the prediction and a Retry-After.

A tier may bound the wait (`max_queue_ms`). An idle model takes a request it can start in time
(`_idle_takes`). Tenants share fairly (admission/fair_share.py): each holds at most its share of
slots, seats and queue, and the queue is served by a virtual token counter, EDF within a
tenant (admission/wait_queue.py). Every first token calibrates its model's next predictions
(ttft_calibration.py). The why of each rule: docs/admission.md.

Concurrency counts every model's running requests: on one box the models share the cores, so
each model's ITL is learned against the total.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import Counter

from admission.arrivals import Arrivals
from admission.estimates import ServiceEstimates
from admission.fair_share import TenantShares
from admission.occupancy import Occupancy
from admission.node_board import Listed, NodeBoard, View
from admission.pacing import departures_needed, paced, targets
from admission.running import expected_end, finish_estimate, longest_end, prefills_ahead_ms
from admission.ticket import Prediction, Rejection, Ticket
from admission.ttft_calibration import TtftCalibration
from admission.wait_queue import WaitQueue

INF = float("inf")
# A request is queued only if it is predicted to make its deadline with this much to spare;
# otherwise it is shed at once. A queued request that is dropped later has waited for nothing.
# Its first token needs only the calibrated tail of lateness to spare (`_first_in_time`): a
# waiting request is predicted to start when a running one is predicted to end, and that
# estimate errs late, so a factor on top would shed at light load requests FIFO serves in time.
QUEUE_HEADROOM = 1.25


class AdmissionGate:
    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        retry_after_s: int = 1,
        estimates: ServiceEstimates | None = None,
        safety: float = 1.1,
        clock=time.monotonic,
        ttft_tail_quantile: float | None = 0.95,
        tenant_share: float = 1.0,
    ) -> None:
        self.shares = TenantShares(tenant_share, clock)
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.estimates = estimates or ServiceEstimates(60.0, 0.5)
        self.safety = safety
        self._clock = clock
        self.running: set[Ticket] = set()
        # The other ingress replicas' running requests by replica and model, as the controller last
        # synced them; a replica on this node's board counts by the board instead (`others_inflight`).
        self.synced_others: dict[str, dict[str, int]] = {}
        # Sequences a model's replicas hold at once (llama.cpp KV contexts x replicas); absent:
        # no fixed limit (a batching engine). Past it, a new request waits in the engine's queue
        # for a whole answer to finish, which a TTFT prediction from prefill costs never sees.
        self.seats: dict[str, int] = {}
        # The models share the box's cores (host tuning on): one model's prompt waits for every
        # model's prefills, not only its own's (a long pass runs alone: host_tuning/cores.py).
        self.shared_cores = False
        # The other ingress replicas' requests on this node, now (admission/node_board.py);
        # None: this gate sees only its own, and the others' as synced.
        self.board: NodeBoard | None = None
        self.arrivals = Arrivals(self._publish)  # requests about to be placed on a model
        self.queue = WaitQueue(self.shares)
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.calibration = TtftCalibration(ttft_tail_quantile, clock)
        self.occupancy = Occupancy(clock)  # what a request's decode ran beside (policy.observe)

    # ------------------------------------------------------------------ state

    @property
    def inflight(self) -> int:
        return len(self.running)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def running_by_model(self) -> dict[str, int]:
        return dict(Counter(t.model_id for t in self.running))

    def queued_by_model(self) -> dict[str, int]:
        return self.queue.by_model()

    def _tenant_room(self, t: Ticket) -> bool:
        return self.shares.room(t, self.running, self.max_inflight, self.seats.get(t.model_id))

    def crowded_by_others(self, t: Ticket) -> bool:
        """Do other tenants hold half or more of `t`'s model's seats (admission/fair_share.py)?
        Then `t` would wait on their batched steps (a flood's long answers) at every token."""
        return self.shares.crowded(t, self.running, self.seats.get(t.model_id), self.others_inflight.get(t.model_id, 0))

    def running_on(self, model_id: str) -> int:
        """Requests running on `model_id`, here and on the other ingress replicas."""
        return sum(1 for t in self.running if t.model_id == model_id) + self.others_inflight.get(model_id, 0)

    @property
    def others_inflight(self) -> dict[str, int]:
        """The other ingress replicas' running requests by model: those on this node's board as
        they are now, the rest as the controller last synced them (up to two syncs old)."""
        return (View() if self.board is None else self.board.view()).by_model(self.synced_others)

    def model_idle(self, model_id: str) -> bool:
        """Nothing runs on `model_id`, here or on the other ingress replicas."""
        return self.running_on(model_id) == 0

    def _waiting_tenants(self) -> set[str]:
        return self.queue.tenants()

    def concurrency(self) -> int:
        """Requests running on the box, every model's (see the module docstring)."""
        return len(self.running) + sum(self.others_inflight.values())

    def seat_free(self, model_id: str) -> bool:
        seats = self.seats.get(model_id)
        if seats is None:
            return True
        return self.running_on(model_id) < seats

    def _seat_free_at(self, t: Ticket, now: float) -> float:
        """When a seat of `t`'s model is expected to free up: the soonest of this ingress's own
        requests on it to finish. Where the other ingresses hold every seat (known only as
        counts), as late as `t` itself would take: expected now, `t` would stay on a model whose
        seats a flood holds for minutes, beside an idle one."""
        if self.seat_free(t.model_id):
            return now
        mine = [self._finish_estimate(r, now) for r in self.running if r.model_id == t.model_id]
        return min(mine) if mine else now + self._service_ms(t, max(1, self.concurrency()))[1] / 1000

    def set_limits(self, max_inflight: int, max_queued: int,
                   others_by_replica: dict[str, dict[str, int]] | None = None) -> None:
        """The controller's sync: this replica's share of the limits, and the other replicas'
        running requests by replica id and model."""
        self.max_inflight = max(1, max_inflight)
        self.max_queued = max(0, max_queued)
        if others_by_replica is not None:
            self.synced_others = {r: dict(c) for r, c in others_by_replica.items()}
            self.occupancy.set(self.concurrency())
        self._wake()

    # ------------------------------------------------------------------ prediction

    def _service_ms(self, t: Ticket, concurrency: float) -> tuple[float, float]:
        """(time to first token, time to last token) once started, at this concurrency."""
        est = self.estimates[t.model_id]
        itl = est.itl_ms(concurrency)
        # The engine finishes the step in progress before it prefills a new sequence: as long as
        # new prompts were seen to wait for one (a draft stops for a waiting prompt).
        step = est.prompt_wait_ms(concurrency - 1) if concurrency > 1 and not self.model_idle(t.model_id) else 0.0
        # The first token is calibrated (`bias`, and the tail margin in `_first_in_time`); the
        # decode after it is not, so it alone carries `safety`: on both, first tokens would come
        # early at the median; on neither, admitted requests under overload would finish past
        # their deadlines.
        first = (est.prefill_ms(t.prefill_tokens, concurrency) + step) * self.bias(t.model_id)
        return first, first + est.expected_tokens(t.max_tokens) * itl * self.safety

    def bias(self, model_id: str) -> float:
        return self.calibration.bias(model_id)

    def ttft_tail_ms(self) -> float:
        return self.calibration.tail_ms()

    def _first_in_time(self, t: Ticket, now: float, first_ms: float, headroom: float = 1.0) -> bool:
        """Would its first token, `first_ms` from now, make its TTFT deadline with `headroom`
        (a factor), or the recent tail of lateness (ms) if that is more, to spare?"""
        return t.ttft_deadline is None or now + self._first_needed_ms(first_ms, headroom) / 1000 <= t.ttft_deadline

    def _first_needed_ms(self, first_ms: float, headroom: float = 1.0) -> float:
        return max(first_ms * headroom, first_ms + self.ttft_tail_ms())

    def _prefills_ahead_ms(self, now: float, model_id: str) -> float:
        """The wait for the prompts still in prefill ahead of a new one on `model_id` (on any
        model, where the models share the cores), this gate's and the other ingress replicas'
        on the node: admission/running.py."""
        ahead = [*self.running, *(self.board.others() if self.board is not None else [])]
        return prefills_ahead_ms(ahead, now, None if self.shared_cores else model_id)

    def _publish(self) -> None:
        """Tell the node's other ingress replicas what this one runs (prefills marked) and holds."""
        if self.board is not None:
            self.board.publish_soon(lambda: ([self._listed(t) for t in self.running], self.arrivals.count))

    def _listed(self, t: Ticket) -> Listed:
        return Listed(t.model_id, t.started_at, t.first_at, t.finish_at, longest_end(t, self.estimates[t.model_id]), t.prefilled)

    def first_token(self, t: Ticket) -> None:
        """The ticket's first token arrived: how long it took against the prediction calibrates
        the next predictions, and its prefill no longer delays anyone (the head may start now)."""
        if not t.prefilled:
            if t.started_at:
                self.calibration.learn(t.model_id, self._clock() - t.started_at, t.first_at - t.started_at, t.ttft_scale)
            t.decode_from = self.occupancy.read()
        was_pending, t.prefilled = not t.prefilled and t in self.running, True
        if was_pending:
            self._publish()
        self._wake()

    def _fits_now(self, t: Ticket, now: float, ttft_headroom: float = 1.0) -> bool:
        """Can it start now without missing its own deadlines or pushing a running one past its?"""
        return self._misfit(t, now, ttft_headroom) is None

    def _misfit(self, t: Ticket, now: float, ttft_headroom: float = 1.0) -> str | None:
        """Why starting it now would miss its own deadlines or push a running one past its
        (docs/admission.md: `not_started`); None if it fits."""
        c = self.concurrency() + 1
        first_ms, last_ms = self._service_ms(t, c)
        ahead_ms = self._prefills_ahead_ms(now, t.model_id)
        first_ms, last_ms = first_ms + ahead_ms, last_ms + ahead_ms
        if not self._first_in_time(t, now, first_ms, ttft_headroom):
            return "first_token_late"
        if t.deadline is not None and now + last_ms / 1000 > t.deadline:
            return "deadline_late"
        if not self._paced(t, c) and not self.shares.first_of(t, self.running):
            return "per_token_target"
        stall = first_ms / 1000  # its prefill holds up the others' decode steps
        for r in self.running:
            if r.deadline is None:
                continue
            est = self.estimates[r.model_id]
            slowdown = est.itl_ms(c) / max(1e-6, est.itl_ms(r.concurrency_at_start))
            if now + max(0.0, r.finish_at - now) * slowdown + stall > r.deadline:
                return "running_deadline"
        return None

    def _paced(self, t: Ticket, concurrency: float) -> bool:
        """Would `concurrency` sequences on the box keep `t` and every running request within
        their per-token targets (admission/pacing.py)?"""
        return paced(targets((t, *self.running)), self.estimates, concurrency)

    def _over_pace(self, t: Ticket) -> int:
        """How many running requests must leave before `t` may start under the per-token targets
        (0: one more stream keeps them); priced as one, a request held for several queues in vain."""
        if self.shares.first_of(t, self.running):
            return 0
        return departures_needed(targets((t, *self.running)), self.estimates, self.concurrency() + 1)

    def _idle_takes(self, t: Ticket, now: float) -> bool:
        """An idle box takes any request: nothing else is slowed, and turning it away helps
        no one (a prompt too long for the TTFT target would get 503s forever). An idle model on
        a busy box takes a request whose first token it can deliver in time, even if the whole
        answer is predicted late (output length is a guess), but not one that would hold the
        shared cores past its TTFT target while others wait, or slow the box's streams past
        their per-token targets. Either way, a request whose first token could not even arrive
        before its end-to-end deadline is shed: it is hopeless."""
        idle_box = self.concurrency() == 0
        if not idle_box and not self.model_idle(t.model_id):
            return False
        if self.estimates[t.model_id].itl.levels == {}:
            return True  # nothing observed yet: try it, and learn
        first_ms, _ = self._service_ms(t, self.concurrency() + 1)
        first_ms += self._prefills_ahead_ms(now, t.model_id)
        if t.deadline is not None and now + first_ms / 1000 > t.deadline:
            return False
        return idle_box or (self._first_in_time(t, now, first_ms) and self._paced(t, self.concurrency() + 1))

    def predict(self, t: Ticket, ahead: list[Ticket], now: float) -> Prediction:
        """When `t` would start and finish if it waited behind `ahead`: each departure of a
        running request lets the next one in, at today's concurrency, once as many have left as
        the per-token targets need (`_over_pace`). While this replica has slots free, it waits
        for room on the box, so the other replicas' departures on this node count too."""
        c = max(1, self.concurrency())
        ends = [self._finish_estimate(r, now) for r in self.running]
        if self.board is not None and self.inflight < self.max_inflight:
            ends += [expected_end(r.finish_at, r.longest, now) for r in self.board.view().requests]
        over = self._over_pace(t)
        slots = sorted(ends)[max(0, over - 1):] or [max(ends, default=now)]
        slots = slots[: max(1, min(len(slots), self.max_inflight))]
        heapq.heapify(slots)
        for q in ahead:
            free = heapq.heappop(slots)
            heapq.heappush(slots, free + self._service_ms(q, c)[1] / 1000)
        busy = ahead or over or self.inflight >= self.max_inflight or not self.model_idle(t.model_id)
        start = slots[0] if busy else now
        start = max(start, self._seat_free_at(t, now))
        first_ms, last_ms = self._service_ms(t, c)
        pending_ms = self._prefills_ahead_ms(start, t.model_id)
        first_ms, last_ms = first_ms + pending_ms, last_ms + pending_ms
        wait_ms = (start - now) * 1000
        return Prediction(wait_ms, (now - t.arrived) * 1000 + wait_ms + first_ms, (now - t.arrived) * 1000 + wait_ms + last_ms)

    def predicted(self, t: Ticket, beside: int = 0) -> Prediction:
        """When `t` would start, see its first token and finish if it asked now, behind what the
        queue's order puts ahead of it, with `beside` requests about to start along with it."""
        now = self._clock()
        ahead = self._queue_ahead(t)
        if not self._can_start(t, ahead, now):
            return self.predict(t, ahead, now)
        first_ms, last_ms = self._service_ms(t, self.concurrency() + 1 + beside)
        pending_ms = self._prefills_ahead_ms(now, t.model_id)
        waited_ms = (now - t.arrived) * 1000
        return Prediction(0.0, waited_ms + first_ms + pending_ms, waited_ms + last_ms + pending_ms)

    def _finish_estimate(self, r: Ticket, now: float) -> float:
        """When a running request should end (admission/running.py)."""
        return finish_estimate(r, now, self.estimates[r.model_id])

    def would_meet(self, t: Ticket) -> bool:
        """Would `acquire` start or queue this ticket (rather than shed it) right now?"""
        return self.check(t) is None

    def in_time(self, t: Ticket, ttft_headroom: float = 1.0) -> bool:
        """Would it start now and meet its own deadlines, its first token with `ttft_headroom`
        to spare? Stricter than `would_meet`: an idle box takes a request even when its first
        token is predicted late."""
        now = self._clock()
        return (
            not self._queue_ahead(t) and self.inflight < self.max_inflight and self.seat_free(t.model_id)
            and self._fits_now(t, now, ttft_headroom)
        )

    def check(self, t: Ticket) -> Rejection | None:
        """The rejection `acquire` would raise at once, without queueing anything; None if it
        would start or queue the ticket."""
        now = self._clock()
        ahead = self._queue_ahead(t)
        not_now = self._not_now(t, ahead, now)
        return None if not_now is None else self._wait_rejection(t, ahead, now, not_now)

    def _can_start(self, t: Ticket, ahead: list[Ticket], now: float) -> bool:
        return self._not_now(t, ahead, now) is None

    def _not_now(self, t: Ticket, ahead: list[Ticket], now: float) -> str | None:
        """Why it can't start at once (docs/admission.md: `not_started`), or None if it can."""
        return "queued_ahead" if ahead else "slots_full" if self.inflight >= self.max_inflight else self._not_taken(t, now)

    def _not_taken(self, t: Ticket, now: float) -> str | None:
        """None where a seat on its model is free within its tenant's share, and an idle model
        takes it or there is room to fit it in; else why not."""
        if not self.seat_free(t.model_id):
            return "seats_full"
        if not self._tenant_room(t):
            return "tenant_share"
        return None if self._idle_takes(t, now) else self._misfit(t, now)

    def _wait_rejection(self, t: Ticket, ahead: list[Ticket], now: float, not_now: str | None) -> Rejection | None:
        """For a ticket that can't start now (`not_now` says why): why it may not wait either, or
        None to queue it."""
        if self.queued >= self.max_queued:
            return self.reject("queue_full", "the service is at capacity and its queue is full", t, len(ahead))
        if self.shares.queue_full(t.tenant, self.queue.of(t.tenant), self.max_queued):
            return self.reject("queue_full", "this API key's share of the queue is full", t, len(ahead), tenant_limit=True)
        predicted = self.predict(t, ahead, now)
        if not self._meets(t, predicted, now):
            return self.reject(
                "deadline_unmeetable", "the service can't meet this request's deadline at the current load",
                t, len(ahead), predicted, not_now=not_now,
            )
        if t.max_wait == 0 or (t.max_wait is not None and predicted.wait_ms > t.max_wait * 1000):
            limit = "this tier does not queue" if t.max_wait == 0 else f"this tier's queue-wait limit is {t.max_wait * 1000:.0f} ms"
            return self.reject(
                "queue_wait_limit", f"the service can't start this request now, and {limit}", t, len(ahead), predicted,
                not_now=not_now,
            )
        return None

    def _meets(self, t: Ticket, p: Prediction, now: float) -> bool:
        """Predicted to make it: its deadline with QUEUE_HEADROOM on the time still to come, its
        first token with the TTFT tail to spare."""
        spent = (now - t.arrived) * 1000
        e2e = spent + (p.e2e_ms - spent) * QUEUE_HEADROOM
        if not self._first_in_time(t, now, p.ttft_ms - spent):
            return False
        return t.deadline is None or t.arrived + e2e / 1000 <= t.deadline

    def _queue_ahead(self, t: Ticket) -> list[Ticket]:
        """The queued tickets that would start before `t` (admission/wait_queue.py)."""
        return self.queue.ahead(t, self._tenant_room)

    # ------------------------------------------------------------------ decisions

    def seen(self, t: Ticket) -> None:
        """`t`'s tenant is active now (the shares apply while more than one is)."""
        self.shares.seen(t.tenant)

    async def acquire(self, t: Ticket) -> None:
        """Start now, wait in (priority, deadline) order, or raise `Rejection`. Pair with `release(t)`."""
        self.seen(t)
        now = self._clock()
        ahead = self._queue_ahead(t)
        not_now = self._not_now(t, ahead, now)
        if not_now is None:
            self._start(t, now)
            return
        rejection = self._wait_rejection(t, ahead, now, not_now)
        if rejection is not None:
            raise self.count(rejection)
        waiter = self.queue.push(t)
        if self.board is not None:  # another replica's prefill or request ending is no event here
            self.board.watch(lambda: self.queued > 0, self._wake)
        # The latest start that can still meet its deadlines, its first token with the tail a
        # start needs to spare (`_first_in_time`): past it, nothing would start it; it is dropped.
        first_ms, last_ms = self._service_ms(t, max(1, self.concurrency()))
        by_deadline = (t.deadline or INF) - last_ms / 1000
        by_first = (t.ttft_deadline or INF) - self._first_needed_ms(first_ms) / 1000
        latest = min(by_deadline, by_first)
        timeout = None if latest == INF else max(0.0, latest - now)
        capped = t.max_wait is not None and (timeout is None or t.max_wait < timeout)
        if capped:
            timeout = t.max_wait
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # started in the same instant the timeout fired: keep the slot
            held = self._not_now(t, [q for q in self._queue_ahead(t) if q is not t], self._clock())  # what held it
            waiter.cancel()
            reason, message = (
                ("queue_timeout", "no slot freed within this tier's queue-wait limit") if capped
                else ("deadline_in_queue", "the request's first-token target could no longer be met while it waited"
                      if by_first < by_deadline else "the request's deadline could no longer be met while it waited")
            )
            waited_ms = (self._clock() - now) * 1000
            raise self.count(self.reject(reason, message, t, len(ahead), waited_ms=waited_ms, not_now=held)) from None
        except asyncio.CancelledError:  # the client went away while queued
            if waiter.done() and not waiter.cancelled():
                self.release(t)
            else:
                waiter.cancel()
            raise
        finally:
            self.queue.prune()
            self._wake()  # a dropped head may have held up requests that can start

    def release(self, t: Ticket) -> None:
        if t in self.running:
            self.running.discard(t)
            self._publish()
        self.occupancy.set(self.concurrency())
        self._wake()

    def count(self, rejection: Rejection) -> Rejection:
        """Count a rejection that is being raised (`check` alone counts nothing)."""
        self.rejected[rejection.reason] = self.rejected.get(rejection.reason, 0) + 1
        return rejection

    def _start(self, t: Ticket, now: float) -> None:
        self.shares.started(t, self._waiting_tenants())
        c = self.concurrency() + 1
        t.started_at, t.concurrency_at_start, t.ttft_scale = now, c, self.bias(t.model_id)
        first_ms, last_ms = self._service_ms(t, c)
        ahead_s = self._prefills_ahead_ms(now, t.model_id) / 1000
        t.first_at, t.finish_at = now + ahead_s + first_ms / 1000, now + ahead_s + last_ms / 1000
        t.behind_step = c > 1 and not self.model_idle(t.model_id) and ahead_s == 0
        self.running.add(t)
        self.occupancy.set(self.concurrency())
        self._publish()
        self.admitted += 1

    def _wake(self) -> None:
        """Start queued tickets in order while the head fits. A head that does not fit holds the
        line until a release makes room or its latest useful start passes (its waiter's timeout
        drops it, and wakes the next)."""
        while self.queue and self.inflight < self.max_inflight:
            found = self.queue.next(self._tenant_room)
            if found is None:
                return  # nothing queued, or only tenants at their cap: a release wakes them
            t, waiter = found
            now = self._clock()
            if self._not_taken(t, now) is not None:
                return  # head of line: more urgent requests are not overtaken
            self.queue.remove(t)
            self._start(t, now)  # the slot is handed over, not re-raced
            waiter.set_result(None)

    def reject(self, reason: str, message: str, t: Ticket, ahead: int, predicted: Prediction | None = None,
               waited_ms: float = 0.0, tenant_limit: bool = False, not_now: str | None = None) -> Rejection:
        now = self._clock()
        # Retry when the earliest running request is predicted to finish.
        soonest = min((r.finish_at for r in self.running), default=now)
        retry = max(self.retry_after_s, math.ceil(max(0.0, soonest - now)))
        return Rejection(reason, message, retry, ahead, waited_ms, predicted, tenant_limit, not_now)
