"""Ingress replicas on one node see each other's prompts in prefill (admission/prefill_board.py):
two gates, each with its own board on one shared directory, as two ingress processes have."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from admission.estimates import ServiceEstimates
from admission.gate import AdmissionGate, Ticket
from admission.prefill_board import PrefillBoard


def _gates(directory, now: list[float], shared_cores: bool = False) -> tuple[AdmissionGate, AdmissionGate]:
    gates = []
    for _ in range(2):
        # 2 ms a prompt token, 10 ms a decode step; no decode safety
        gate = AdmissionGate(8, 8, 1, ServiceEstimates(10.0, 2.0), safety=1.0, clock=lambda: now[0])
        gate.board = PrefillBoard(str(directory), clock=lambda: now[0], memo_s=0.0)
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
    mine = PrefillBoard(str(tmp_path), clock=lambda: now[0], memo_s=0.0)
    mine.publish([Ticket("m", "t", 0, 10, 10, started_at=now[0], first_at=now[0] + 1)])
    assert mine.others() == [], "its own prompts are the gate's running tickets already"
    dead = tmp_path / "999999999-0.prefills"  # no such process
    dead.write_text("[]")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    mine.others()
    assert not dead.exists()
    other = PrefillBoard(str(tmp_path), clock=lambda: now[0], memo_s=0.0)
    assert len(other.others()) == 1
    mine.close()
    assert other.others() == [], "a replica that shuts down takes its prompts with it"


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
    policy.gate.board = PrefillBoard(str(tmp_path), memo_s=0.0)
    other = PrefillBoard(str(tmp_path), memo_s=0.0)
    now = time.monotonic()
    other.publish([Ticket("m", "t", 0, 10, 10, started_at=now, first_at=now + 5)])
    assert policy.snapshot()["others_prefilling"] == 1
