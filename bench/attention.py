"""Suite `attention`: the llama.cpp engine's decode step and prefill with ggml's flash-attention
kernel off and on (the shipped `auto` picks one by the CPU), by context length and sequences a step.

For each of serve_config.yaml's two llama.cpp models (the small model and the target), two
engines that differ only in `flash_attention` run in this process (no Ray, no HTTP), taking
turns point by point with the order alternating each repetition, so the box's drift hits both
alike. A point: `seqs` random prompts of `context` tokens, each prefilled cold (no prefix held),
then `steps` greedy decode steps of all of them in one batched pass. Reported per point and
setting: the median step in ms and the prefill's ms per prompt token over the repetitions, and
`off_over_on` for both (below 1: off is faster).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from configs.serve_config import load_serve_config

CONTEXTS = (128, 512, 1024)
SEQS = (1, 4)
SETTINGS = ("off", "on")


def _point(engine, rng: random.Random, context: int, seqs: int, steps: int) -> tuple[float, float]:
    engine.forget_prefixes()
    running, tokens, prefill_s = [], [], 0.0
    for _ in range(seqs):
        ids = [rng.randrange(100, 40000) for _ in range(context)]
        seq = engine.new_sequence()
        start = time.perf_counter()
        logits = engine.prefill(seq, ids)
        prefill_s += time.perf_counter() - start
        running.append(seq)
        tokens.append(int(logits.argmax()))
    start = time.perf_counter()
    for _ in range(steps):
        tokens = [int(t) for t in engine.decode_batch(running, tokens).argmax(-1)]
    step_ms = (time.perf_counter() - start) * 1000 / steps
    for seq in running:
        engine.release(seq)
    return step_ms, prefill_s * 1000 / (seqs * context)


def _plot(models: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items()):
        for seqs in SEQS:
            for setting, style in zip(SETTINGS, ("-", "--")):
                ys = [model["points"][f"{c}x{seqs}"][setting]["step_ms"] for c in CONTEXTS]
                ax.plot(CONTEXTS, ys, style, marker="o", label=f"{seqs} seq, flash attention {setting}")
        ax.set_xlabel("context, tokens")
        ax.set_ylabel("decode step, ms")
        ax.set_title(f"{name} ({model['weights']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, repetitions: int | None = None, out: str | None = None, **_: object) -> dict:
    from engines.llamacpp_engine import LlamaCppEngine

    reps = repetitions or (1 if quick else 3)
    steps = 8 if quick else 24
    args = load_serve_config().args
    models = {}
    for name, config in (("small model", args.draft.engine), ("target", args.target.engine)):
        if config.kind != "llama_cpp":
            continue
        config = config.model_copy(update={"max_sequences": max(SEQS)})
        engines = {s: LlamaCppEngine(config.model_copy(update={"flash_attention": s})) for s in SETTINGS}
        rng = random.Random(0)
        raw: dict[str, dict[str, list[tuple[float, float]]]] = {}
        grid = [(c, n) for c in CONTEXTS for n in SEQS]
        for rep in tqdm(range(reps), desc=f"attention: {name}", unit="rep"):
            for context, seqs in grid:
                order = SETTINGS if rep % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    raw.setdefault(f"{context}x{seqs}", {}).setdefault(setting, []).append(
                        _point(engines[setting], rng, context, seqs, steps))
        points = {}
        for key, by_setting in raw.items():
            row = {s: {"step_ms": round(statistics.median(x[0] for x in v), 2),
                       "step_ms_range": [round(min(x[0] for x in v), 2), round(max(x[0] for x in v), 2)],
                       "prefill_ms_per_token": round(statistics.median(x[1] for x in v), 3)}
                   for s, v in by_setting.items()}
            row["off_over_on"] = {k: round(row["off"][k] / row["on"][k], 3) for k in ("step_ms", "prefill_ms_per_token")}
            points[key] = row
        models[name] = {"model_id": config.model_id, "weights": config.weights, "prefill_quant": config.prefill_quant,
                        "threads": config.num_threads, "points": points}
        del engines
    result = {"repetitions": reps, "steps": steps, "contexts": list(CONTEXTS), "seqs": list(SEQS), "models": models}
    if out:
        result["plot"] = _plot(models, Path(out))
    return result
