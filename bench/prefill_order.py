"""Suite `prefill_order`: on an engine without batching (the small model, llama.cpp), does a new
prompt wait for the decode steps queued before it?

Each sequence's decode step is its own job on the replica's one worker thread. Three long
answers decode while short requests arrive one after another; per arm, the short requests'
TTFT and `engine_queue`, and the long answers' ITL. Arms alternate in blocks on one engine in
this process (no Ray, no HTTP), so the box's drift hits both alike:
- `prefill_first` (the service's behaviour): a new prefill goes ahead of queued steps;
- `fifo`: it waits behind them.
"""

from __future__ import annotations

import asyncio

from tqdm import tqdm

from bench.stack import timed_answer
from bench.stats import summary
from configs.serve_config import load_serve_config


async def _block(service, builder, block: int, streams: int, arrivals: int) -> tuple[list, list]:
    """`streams` long answers decoding, `arrivals` short requests one after another meanwhile."""
    longs = [
        asyncio.create_task(timed_answer(service, builder, f"long-{block}-{i}", f"Write a long story about dragon {block}-{i}.", 120))
        for i in range(streams)
    ]
    await asyncio.sleep(1.0)  # every long answer is past its prefill
    shorts = []
    for j in range(arrivals):
        shorts.append(await timed_answer(service, builder, f"short-{block}-{j}", f"Name a colour, case {block}-{j}.", 2))
        await asyncio.sleep(0.15)
    return shorts, await asyncio.gather(*longs)


def run(requests: int = 8, quick: bool = False, blocks: int = 6, streams: int = 3) -> dict:
    from target.service import ModelService
    from ingress.prompts import PromptBuilder

    if quick:
        blocks = 2
    stage = load_serve_config().args.draft.model_copy(deep=True)
    service = ModelService(stage)
    if service.max_batch != 1:
        raise SystemExit(f"{stage.engine.model_id} batches its decode steps: this suite needs an engine that does not")
    builder = PromptBuilder(service.engine.tokenizer)
    arms = {"prefill_first": {"ttft": [], "queue": [], "itl": []}, "fifo": {"ttft": [], "queue": [], "itl": []}}
    order = [arm for b in range(blocks // 2) for arm in (("prefill_first", "fifo") if b % 2 == 0 else ("fifo", "prefill_first"))]
    loop = asyncio.new_event_loop()
    try:
        for block, arm in enumerate(tqdm(order, desc="prefill order", unit="block")):
            service.prefill_first = arm == "prefill_first"
            shorts, longs = loop.run_until_complete(_block(service, builder, block, streams, requests))
            arms[arm]["ttft"] += [s.ttft_ms for s in shorts]
            arms[arm]["queue"] += [s.engine_queue_ms for s in shorts]
            arms[arm]["itl"] += [gap for answer in longs for gap in answer.chunk_gaps_ms]
    finally:
        loop.close()
        service.executor.shutdown()
    out = {arm: {"new_prompt_ttft_ms": summary(v["ttft"]), "new_prompt_engine_queue_ms": summary(v["queue"]),
                 "decoding_itl_ms": summary(v["itl"])} for arm, v in arms.items()}
    p50 = lambda arm, key: out[arm][key]["p50"]  # noqa: E731
    return {
        "model": stage.engine.model_id,
        "decoding_streams": streams,
        "arms": out,
        "ttft_p50_ratio_fifo_vs_prefill_first": round(p50("fifo", "new_prompt_ttft_ms") / p50("prefill_first", "new_prompt_ttft_ms"), 3),
        "itl_mean_ratio_prefill_first_vs_fifo": round(
            out["prefill_first"]["decoding_itl_ms"]["mean"] / out["fifo"]["decoding_itl_ms"]["mean"], 3),
    }
