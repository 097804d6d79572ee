"""Suite `contention`: the two models decoding at once on the same cores, at each OS priority.

On the 2-core box the target (torch, 2 threads, speculation as served) and the small model
(llama.cpp, 1 thread) are separate processes. Each runs here in its own child process, as its
replica runs it (`ModelService`, one worker thread, the stage from serve_config.yaml), at a
given niceness, one greedy request after another for the same window; they start together.
Per setting: each model's ms per output token and TTFT, against each alone.

torch's OpenMP threads spin at every barrier: when a third busy thread takes one of the cores,
a descheduled team member holds the whole team up, and which process loses depends on who
yields. This suite shows what the gap between the two models' niceness does about it, and what
`share_cores` (one thread per pass while another process is busy, host_tuning/cores.py) does. The
children start at this process's level (0 from a shell), so the levels are the ones set; in
the service Ray starts every worker at 15 (`RAY_worker_niceness`), the ingress and proxy too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from tqdm import tqdm

from bench.stack import timed_answer
from bench.stats import summary

PROMPT = "Write a detailed story about a dragon and a knight, part {i}."
# (target nice, small model nice, share_cores); None: that model does not run. share_cores: the
# engines' setting (host_tuning/cores.py), off to show what the niceness gap alone does.
SETTINGS = [
    (19, None, True), (None, 19, True),
    (19, 19, True), (19, 19, False), (15, 19, True), (15, 19, False),
    (13, 19, False), (10, 19, False), (0, 19, False),
]


def _worker(stage_name: str, nice: int, seconds: float, start_at: float, max_tokens: int, share_cores: bool) -> dict:
    from configs.serve_config import load_serve_config
    from configs.schemas import HostTuningConfig
    from host_tuning.niceness import set_niceness
    from target.service import ModelService
    from ingress.prompts import PromptBuilder

    set_niceness(nice)  # as the replica does, before any thread starts: every later one inherits it
    stage = getattr(load_serve_config().args, stage_name).model_copy(deep=True)
    service = ModelService(stage, host=HostTuningConfig(enabled=True, share_cores=share_cores))
    builder = PromptBuilder(service.engine.tokenizer)

    async def loop() -> tuple[list[float], list[float]]:
        while time.time() < start_at:
            await asyncio.sleep(0.01)
        ttft, per_token = [], []
        began, i = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            answer = await timed_answer(service, builder, f"{stage_name}-{i}", PROMPT.format(i=i), max_tokens)
            ttft.append(answer.ttft_ms)
            per_token.append(answer.ms_per_token)
            i += 1
        return ttft, per_token

    ttft, per_token = asyncio.run(loop())
    service.executor.shutdown()
    return {"requests": len(ttft), "ttft_ms": summary(ttft), "ms_per_token": summary(per_token)}


def _setting(target_nice: int | None, small_nice: int | None, share_cores: bool, seconds: float, max_tokens: int) -> dict:
    start_at = time.time() + 20  # both loaded and warm before the window opens
    children = {}
    for stage, nice in (("target", target_nice), ("draft", small_nice)):
        if nice is not None:
            children[stage] = subprocess.Popen(
                [sys.executable, "-m", "bench.contention", "--worker", stage, "--nice", str(nice),
                 "--seconds", str(seconds), "--start-at", str(start_at), "--max-tokens", str(max_tokens),
                 "--share-cores", str(int(share_cores))],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
    out: dict = {"target_nice": target_nice, "small_nice": small_nice, "share_cores": share_cores}
    for stage, child in children.items():
        stdout, _ = child.communicate(timeout=seconds + 300)
        if child.returncode != 0:
            raise RuntimeError(f"the {stage} worker failed (exit {child.returncode})")
        out["target" if stage == "target" else "small"] = json.loads(stdout.strip().splitlines()[-1])
    return out


def run(quick: bool = False, seconds: float = 30.0, max_tokens: int = 96) -> dict:
    if quick:
        seconds = 12.0
    settings = [_setting(t, s, share, seconds, max_tokens) for t, s, share in tqdm(SETTINGS, desc="settings", unit="setting")]
    alone = {"target": settings[0]["target"]["ms_per_token"]["p50"], "small": settings[1]["small"]["ms_per_token"]["p50"]}
    for s in settings:
        for model in ("target", "small"):
            if model in s:
                s[f"{model}_slowdown_vs_alone"] = round(s[model]["ms_per_token"]["p50"] / alone[model], 2)
    return {"seconds_per_setting": seconds, "max_tokens": max_tokens, "settings": settings}


if __name__ == "__main__":  # a child process of `run`
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=["target", "draft"])
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--share-cores", type=int, default=1)
    a = parser.parse_args()
    print(json.dumps(_worker(a.worker, a.nice, a.seconds, a.start_at, a.max_tokens, bool(a.share_cores))))
