"""Ingress replicas on one node see what the others run now, and which of it is in prefill
(admission/node_board.py): two gates, each with its own board on one shared directory, as two
ingress processes have."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from admission.estimates import ServiceEstimates
from admission.gate import AdmissionGate, Ticket
from admission.node_board import Listed, NodeBoard


def _gates(directory, now: list[float], shared_cores: bool = False) -> tuple[AdmissionGate, AdmissionGate]:
    gates = []
    for name in ("a", "b"):
        # 2 ms a prompt token, 10 ms a decode step; no decode safety
        gate = AdmissionGate(8, 8, 1, ServiceEstimates(10.0, 2.0), safety=1.0, clock=lambda: now[0])
        gate.board = NodeBoard(str(directory), clock=lambda: now[0], memo_s=0.0, replica_id=name)
        gate.shared_cores = shared_cores
        gates.append(gate)
    return gates[0], gates[1]


def _started(gate: AdmissionGate, t: Ticket) -> None:
    """Admit `t` on `gate` and let the gate's loop turn, so that its board is written."""
    async def main():
        await gate.acquire(t)
        await asyncio.sleep(0)

    asyncio.run(main())


def _fresh(now: float, model: str = "m", ttft_s: float = 0.3) -> Ticket:
    return Ticket(model, "t", 0, 10, 10, arrived=now, deadline=now + 60, ttft_deadline=now + ttft_s)


def test_a_prompt_another_ingress_replica_has_in_prefill_delays_this_ones_first_token(tmp_path):
    """Replica A starts a 600 ms prefill; replica B, asked for a request whose first token is due
    in 300 ms, predicts it behind that prefill and sheds it (without the board it saw an idle
    model and would have started it). Once A's first token arrives, B takes the same request."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)

    async def main():
        long_prompt = Ticket("m", "t", 0, 300, 10, arrived=now[0])
        await a.acquire(long_prompt)
        await asyncio.sleep(0)  # A writes its board once its event loop is free
        assert b.check(_fresh(now[0])) is not None, "B must see A's prefill ahead of the request"
        blind = AdmissionGate(8, 8, 1, ServiceEstimates(10.0, 2.0), safety=1.0, clock=lambda: now[0])
        assert blind.check(_fresh(now[0])) is None, "a gate without the board would start it"
        assert b.predicted(_fresh(now[0])).ttft_ms >= 600.0
        now[0] += 0.2
        a.first_token(long_prompt)
        await asyncio.sleep(0)
        assert b.check(_fresh(now[0])) is None, "its prefill is done: nothing is ahead any more"

    asyncio.run(main())


def test_a_prompt_released_before_its_first_token_stops_counting_on_the_other_replicas(tmp_path):
    now = [1000.0]
    a, b = _gates(tmp_path, now)

    async def main():
        cancelled = Ticket("m", "t", 0, 300, 10, arrived=now[0])
        await a.acquire(cancelled)
        await asyncio.sleep(0)
        assert b._prefills_ahead_ms(now[0], "m") == pytest.approx(600.0)
        a.release(cancelled)  # its client went away mid-prefill
        await asyncio.sleep(0)
        assert b._prefills_ahead_ms(now[0], "m") == 0.0

    asyncio.run(main())


def test_another_replicas_prefill_on_another_model_counts_only_where_the_models_share_the_cores(tmp_path):
    now = [1000.0]
    a, b = _gates(tmp_path, now)
    _started(a, Ticket("small", "t", 0, 300, 10, arrived=now[0]))
    assert b._prefills_ahead_ms(now[0], "m") == 0.0
    b.shared_cores = True
    assert b._prefills_ahead_ms(now[0], "m") == pytest.approx(600.0)


def test_a_listed_prompt_counts_until_as_late_again_as_predicted_then_is_forgotten(tmp_path):
    """A prompt past its predicted first token counts as the gate counts its own (as late again
    as it already is), until it is as late again as it was predicted to take: a writer that
    died mid-prefill stops counting by then."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)
    late = Ticket("m", "t", 0, 300, 10, arrived=now[0])
    _started(a, late)
    predicted_s = late.first_at - late.started_at
    now[0] = late.first_at + predicted_s / 2
    assert b._prefills_ahead_ms(now[0], "m") == pytest.approx(predicted_s / 2 * 1000)
    now[0] = late.first_at + predicted_s + 0.001
    assert b._prefills_ahead_ms(now[0], "m") == 0.0


def test_a_board_reads_only_the_others_and_a_dead_writers_file_is_removed(tmp_path):
    now = [1000.0]
    mine = NodeBoard(str(tmp_path), clock=lambda: now[0], memo_s=0.0, replica_id="mine")
    mine.publish([Listed("m", now[0], now[0] + 1, now[0] + 2, now[0] + 3)])
    assert mine.others() == [] and mine.view().running == {}, "its own are the gate's running tickets already"
    dead = tmp_path / "999999999-0.running"  # no such process: killed without its shutdown
    dead.write_text('{"replica": "dead", "running": [["m", 1000.0, 1001.0, 1002.0, 1003.0, true]]}')
    assert "dead" not in mine.view().running, "a dead writer's requests count for nothing"
    assert not dead.exists()
    other = NodeBoard(str(tmp_path), clock=lambda: now[0], memo_s=0.0)
    assert len(other.others()) == 1 and other.view().running == {"mine": {"m": 1}}
    mine.close()
    assert other.others() == [] and other.view().running == {}, "a replica that shuts down takes its requests with it"


def test_a_request_queued_behind_another_replicas_prefill_starts_when_that_prefill_ends(tmp_path):
    """B's request can't start while replica A's 600 ms prefill is ahead of it (the stall would
    push B's running request past its deadline), so it queues. A's first token is no event on
    B: B looks at the board again while anything waits, and starts it then, not when its own
    running request ends or the request's latest start passes."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)

    async def main():
        await a.acquire(Ticket("m", "t", 0, 300, 10, arrived=now[0]))  # 600 ms of prefill
        await asyncio.sleep(0)
        running = Ticket("m", "t", 0, 10, 10, arrived=now[0])
        running.started_at, running.first_at, running.finish_at = now[0], now[0] + 0.02, now[0] + 0.3
        running.deadline, running.prefilled = now[0] + 0.5, True
        running.concurrency_at_start = 2  # beside A's request, which decodes on after its prefill
        b.running.add(running)
        waiting = Ticket("m", "t", 0, 10, 10, arrived=now[0], deadline=now[0] + 60, ttft_deadline=now[0] + 2)
        task = asyncio.create_task(b.acquire(waiting))
        await asyncio.sleep(0.05)
        assert not task.done() and b.queued == 1, "A's prefill ahead would stall the running request too long"
        for t in list(a.running):
            a.first_token(t)
        await asyncio.wait_for(task, 0.5)
        assert waiting in b.running and running in b.running

    asyncio.run(main())


def test_health_says_how_many_prompts_the_other_replicas_have_in_prefill(tmp_path):
    from admission.policy import AdmissionPolicy
    from configs.schemas import AdmissionConfig

    policy = AdmissionPolicy(AdmissionConfig())
    assert policy.snapshot()["others_prefilling"] is None, "no board: nothing shared to count"
    policy.gate.board = NodeBoard(str(tmp_path), memo_s=0.0)
    other = NodeBoard(str(tmp_path), memo_s=0.0)
    now = time.monotonic()
    other.publish([Listed("m", now, now + 5, now + 6, now + 7)])
    assert policy.snapshot()["others_prefilling"] == 1


def test_the_other_replicas_running_requests_count_as_they_are_now_not_as_last_synced(tmp_path):
    """The controller's counts are up to two syncs old. B's view of A comes from the board, in
    place of the controller's count for A: A's request that ended a moment ago no longer makes
    the box busy for B (the idle box takes a request whose first token is predicted late), and
    one A started since the last sync counts at once. A replica not on this node's board (another
    node's) still counts as synced."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)
    b.set_limits(8, 8, {"a": {"m": 1}, "elsewhere": {}})  # A ran one request at the last sync
    running = Ticket("m", "t", 0, 10, 10, arrived=now[0])
    _started(a, running)
    a.first_token(running)
    assert b.concurrency() == 1 and b.others_inflight == {"m": 1}
    a.release(running)
    a.board.publish([a._listed(t) for t in a.running])  # written once A's loop is free (here: no loop)
    assert b.concurrency() == 0, "A's request ended: the board says so before the next sync"
    # its prefill alone takes 200 ms, its first token is due in 50
    too_long = Ticket("m", "t", 0, 100, 10, arrived=now[0], deadline=now[0] + 60, ttft_deadline=now[0] + 0.05)
    assert b.check(too_long) is None, "the box is idle: it takes it"
    stale = AdmissionGate(8, 8, 1, ServiceEstimates(10.0, 2.0), safety=1.0, clock=lambda: now[0])
    stale.set_limits(8, 8, {"a": {"m": 1}})
    assert stale.concurrency() == 1, "by the controller's count alone the box is still busy"
    assert stale.check(too_long) is not None, "and the same request is shed as late"
    _started(a, Ticket("small", "t", 0, 10, 10, arrived=now[0]))
    _started(a, Ticket("small", "t", 0, 10, 10, arrived=now[0]))
    assert b.others_inflight == {"small": 2}, "A's two new requests, before any sync"
    b.set_limits(8, 8, {"a": {}, "elsewhere": {"m": 3}})
    assert b.others_inflight == {"small": 2, "m": 3}, "another node's replica counts as the controller synced it"


def test_a_request_that_waits_for_room_on_the_box_is_predicted_to_start_when_another_replicas_request_ends(tmp_path):
    """B has no request of its own running; A's request makes B's next one miss its per-token
    target if both ran. B's prediction for it is to start when A's request is predicted to end,
    not at once (its only own departures: none), so a request that can't wait that long is shed
    at arrival instead of queued and dropped at its latest start."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)
    for gate in (a, b):
        gate.estimates["m"].itl.add(1, 10.0)
        gate.estimates["m"].itl.add(2, 300.0)  # two sequences together: 300 ms a token each
    long_answer = Ticket("m", "t", 0, 10, 100, arrived=now[0])
    _started(a, long_answer)  # alone: 10 ms a token, 100 tokens
    a.first_token(long_answer)
    a.board.publish([a._listed(t) for t in a.running])
    ends_s = long_answer.finish_at - now[0]
    paced = Ticket("m", "t", 0, 10, 10, arrived=now[0], deadline=now[0] + 60, tpot_ms=200)
    assert b._not_now(paced, [], now[0]) == "per_token_target"
    p = b.predicted(paced)
    assert p.wait_ms == pytest.approx(ends_s * 1000, rel=0.01), "it starts when A's request ends"
    hurried = Ticket("m", "t", 0, 10, 10, arrived=now[0], deadline=now[0] + 60, tpot_ms=200,
                     ttft_deadline=now[0] + ends_s / 2)
    rejection = b.check(hurried)
    assert rejection is not None and rejection.reason == "deadline_unmeetable"
    blind = AdmissionGate(8, 8, 1, ServiceEstimates(10.0, 2.0), safety=1.0, clock=lambda: now[0])
    blind.estimates["m"].itl.add(1, 10.0)
    blind.estimates["m"].itl.add(2, 300.0)
    blind.set_limits(8, 8, {"a": {"m": 1}})
    assert blind.check(hurried) is None, "with no departure to wait for, it was queued as if starting now"


def test_requests_about_to_run_on_another_replica_count_until_placed(tmp_path):
    """A burst's requests wait for their verdicts side by side, some on each ingress replica:
    each replica counts its own as about to run, and the board tells the other, until they are
    placed on a model (or gone)."""
    now = [1000.0]
    a, b = _gates(tmp_path, now)
    first, second, other = a.arrivals.arrive(), a.arrivals.arrive(), b.arrivals.arrive()
    assert (a.arrivals.on_box(a.board), b.arrivals.on_box(b.board)) == (3, 3)
    first.end()
    assert (a.arrivals.on_box(a.board), b.arrivals.on_box(b.board)) == (2, 2)
    second.end()
    second.end()  # uncounted once
    other.end()
    assert (a.arrivals.on_box(a.board), b.arrivals.on_box(b.board)) == (0, 0)
    assert b.concurrency() == 0, "about to run is not running: the admission predictions do not count it"
