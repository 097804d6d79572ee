"""Suite `vllm_tax`: the whole graph on the vLLM profile against vLLM's own OpenAI server.

Both serve the same weights in the same dtype (the profile's, resolved as the graph's target
resolves it), with the same batch size and prefix caching, each started as its users start it
(`vllm serve ...`; `serve run configs/cpu-vllm.yaml`, or gpu.yaml on a GPU) in its own process
group and stopped before the other starts. One client drives both: the openai SDK streaming
chat completions, 1, 4 and 16 streams, two waves each, greedy, `max_tokens` tokens. The graph
gets `Cache-Control: no-cache, no-store` (every request reaches the model) and FIFO admission
(nothing is shed): the engine's cost behind the graph, not its features. `reps` repetitions,
the systems' order alternating, so drift on the box falls on both; the ratio graph / vLLM of
each repetition's tokens/s, and its spread. Where vLLM is installed: `bash scripts/peers.sh
vllm ours_vllm`, then `.venv-peers/ours-vllm/bin/python -m bench vllm_tax --out FILE`.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

import yaml

from bench.engines import CONCURRENCY, _graph_point
from bench.peer_systems import MODEL, OurVLLMProfile, VLLMServe

WAVES = 2


def _profile_path() -> str:
    from vllm.platforms import current_platform

    return "configs/cpu-vllm.yaml" if current_platform.is_cpu() else "configs/gpu.yaml"


def _dtype() -> str:
    """The dtype the profile's target computes in here."""
    from vllm.platforms import current_platform

    from configs.serve_config import load_serve_config
    from engines.vllm_service import resolve_dtype

    return resolve_dtype(load_serve_config(_profile_path()).args.target.engine.vllm.dtype, current_platform.is_cpu())


class _Alone(VLLMServe):
    dtype = "float32"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--dtype") + 1] = self.dtype
        return cmd


class _Graph(OurVLLMProfile):
    dtype = "float32"
    model = MODEL  # the target named, as `vllm serve` serves it: the router keeps it there

    def prepare(self) -> None:
        self.profile = _profile_path()
        super().prepare()
        doc = yaml.safe_load(self.config_path.read_text())
        args = doc["applications"][0]["args"]
        args["target"]["engine"]["vllm"]["dtype"] = self.dtype
        args["admission"]["allow_mode_header"] = True  # the client asks for fifo
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


async def _warm(base: str, model: str) -> None:
    await _graph_point(base, model, 1, 8, 1)  # the first request through each hop
    await _graph_point(base, model, 4, 16, 1)


def _measure(system, max_tokens: int) -> list[dict]:
    base = system.start()
    try:
        asyncio.run(_warm(base, system.model))
        points = []
        for c in CONCURRENCY:
            points.append(asyncio.run(_graph_point(base, system.model, c, max_tokens, WAVES)))
            print(system.name, points[-1], flush=True)
        return points
    finally:
        system.stop()


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("vllm", "o-"), ("graph", "s-")):
        reps = [rep[name] for rep in result["repetitions"]]
        for i, points in enumerate(reps):
            label = None if i else {"vllm": "vllm serve", "graph": "the graph on vLLM"}[name]
            color = "C0" if name == "vllm" else "C1"
            ax1.plot(CONCURRENCY, [p["tokens_per_s"] for p in points], style, color=color, alpha=0.7, label=label)
            ax2.plot(CONCURRENCY, [p["ttft_p50_ms"] for p in points], style, color=color, alpha=0.7, label=label)
    ax1.set(xlabel="concurrent streams", ylabel="tokens/s", xscale="log", title="throughput")
    ax2.set(xlabel="concurrent streams", ylabel="TTFT p50 (ms)", xscale="log", title="time to first token")
    for ax in (ax1, ax2):
        ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
        ax.legend()
    fig.suptitle(f"the graph's tax over vLLM alone ({result['dtype']}, {result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(max_tokens: int = 64, quick: bool = False, out: str | None = None, reps: int = 3) -> dict:
    import vllm

    from bench.engines import _device

    dtype = _dtype()
    reps = 1 if quick else reps
    result: dict = {"vllm_version": vllm.__version__, "device": _device(), "profile": _profile_path(),
                    "dtype": dtype, "model": MODEL, "max_tokens": max_tokens, "waves": WAVES, "repetitions": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            alone, graph = _Alone(Path(tmp)), _Graph(Path(tmp))
            alone.dtype = graph.dtype = dtype
            measured = {}
            order = [("vllm", alone), ("graph", graph)]
            for name, system in order if rep % 2 == 0 else order[::-1]:
                measured[name] = _measure(system, max_tokens)
            result["repetitions"].append(measured)
    ratios = {str(c): [round(rep["graph"][i]["tokens_per_s"] / rep["vllm"][i]["tokens_per_s"], 3)
                       for rep in result["repetitions"]] for i, c in enumerate(CONCURRENCY)}
    result["graph_over_vllm_tokens_per_s"] = {
        c: {"median": round(statistics.median(r), 3), "min": min(r), "max": max(r), "each": r} for c, r in ratios.items()
    }
    result["ttft_p50_ms"] = {
        name: {str(c): [rep[name][i]["ttft_p50_ms"] for rep in result["repetitions"]] for i, c in enumerate(CONCURRENCY)}
        for name in ("vllm", "graph")
    }
    if out:
        png = Path(out).with_suffix(".png")
        _plot(result, png)
        result["plot"] = str(png)
    return result
