"""On a busy box, auto requests go to the small model: one engine at a time on shared cores.

On a small CPU box both models' replicas run on the same cores. Two engines decoding side by
side each get about one core, and a batched decode step is compute: in `bench peers`' 2x burst
(2 cores) the float32 target's step of 8 sequences took ~95 ms beside the bf16 small model
(~40 ms alone), the small model's step of 4 ~48 ms (~20 alone). So once `from_running`
requests run on the box's models, an auto request whose tier may be downgraded goes to the
small model while it has a free seat, and the large model finishes what it runs and leaves the
cores to it. Admission may still send it back up (the small model predicted to miss the
deadline where the large one would not). A lightly loaded box routes by difficulty.

The same burst, one session, goodput under the SLO: 1.22 req/s routed by difficulty and load
alone; 1.58 from 4 requests running; 1.73 from 2, as much as sending every request to the
small model (1.73). At half capacity, from 1 (the default) rather than 2: TTFT p50 of
shared-prefix chat 252 and 245 ms against 303 and 280, of chat 142 against 187 (alternating,
one session), since one request on the float32 target beside one on the small model kept
both engines busy.
"""

from __future__ import annotations


class BusyBox:
    def __init__(self, from_running: int | None) -> None:
        self.from_running = from_running  # None: off (GPU profiles, or host tuning off)

    def to_small(self, gate, small_model_id: str) -> bool:
        """Send a downgradable auto request bound for the large model to the small one? `gate`:
        admission's (its `concurrency()` and `seat_free(model)`), read only when this is on."""
        if self.from_running is None:
            return False
        return gate.concurrency() >= self.from_running and gate.seat_free(small_model_id)
