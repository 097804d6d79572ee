"""Suite `spec`: speculative decoding vs target-alone vs transformers' assisted generation.

One process, one run, the same fp32 target for everything (then `default_profile`: the shipped
serve_config.yaml's llama.cpp target against its own speculation, one stream):
- target alone: our decode loop without speculation;
- ours: the speculative config of configs/cpu-exact.yaml (and, unless --quick, each
  candidate proposer, so the shipped default is the measured winner);
- HF assisted: `model.generate` with prompt lookup (5 and 10 tokens a round) and with an int8
  copy of the target as the assistant; per workload the fastest of them counts.
Greedy decoding throughout, so `lossless` compares token ids with target-alone on every prompt.
`json_schema`: target alone vs ours with a JSON-schema grammar on (structured outputs), and
the grammar's mask cost per row.
"""

from __future__ import annotations

import copy
import time

import torch
from tqdm import tqdm

from bench.stats import summary
from bench.workloads import conversations
from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config
from engines.types import GenerateRequest, SamplingParams

CANDIDATES = ("ngram", "draft_model", "ngram+draft_model")


def _decode(service, ids: list[int], max_tokens: int, speculate: bool, spec_config=None, structured=None) -> dict:
    from target.decoding import Generation, Speculation
    from target.adaptive import KChooser

    speculation = None
    if speculate:
        if spec_config is None:
            speculation = service._speculation()
        else:
            proposers, costs = spec_config
            speculation = Speculation(proposers, KChooser(costs))
    if service.draft_engine is not None and hasattr(service.draft_engine, "forget_prefixes"):
        service.draft_engine.forget_prefixes()  # every run starts with a cold draft cache
    request = GenerateRequest("bench", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured))
    start = time.perf_counter()
    gen = Generation(service.engine, request, speculation)
    chunks, stamps = [gen.prefill()], [time.perf_counter()]
    while not gen.finished:
        chunks.append(gen.step())
        stamps.append(time.perf_counter())
    itl = []
    for (a, b), chunk in zip(zip(stamps, stamps[1:]), chunks[1:]):
        if chunk.num_tokens:
            itl.extend([(b - a) * 1000 / chunk.num_tokens] * chunk.num_tokens)
    last = chunks[-1]
    return {
        "tokens": gen.tokens[len(ids) :],
        "seconds": stamps[-1] - start,
        "first_token_s": stamps[0] - start,
        "itl_ms": itl,
        "proposed": int(last.timings_ms.get("spec_proposed", 0)),
        "accepted": int(last.timings_ms.get("spec_accepted", 0)),
        "mask_ms": last.timings_ms.get("grammar_mask", 0.0),
        "mask_rows": int(last.timings_ms.get("grammar_rows", 0)),
    }


def _hf_generate(model, ids: list[int], max_tokens: int, **kwargs) -> dict:
    input_ids = torch.tensor([ids])

    def generate(new_tokens: int):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                **kwargs,
            )
        return out, time.perf_counter() - start

    _, first = generate(1)  # prefill + first token, timed alone: generate() streams nothing
    out, seconds = generate(max_tokens)
    return {"tokens": out[0, len(ids) :].tolist(), "seconds": seconds, "first_token_s": min(first, seconds)}


def _rate(results: list[dict]) -> float:
    """Decode-phase tokens/s: tokens after the first, over the time after the first token.

    The prompt prefill is the same target forward pass for every method; leaving it out
    isolates what speculation changes (end-to-end rates are reported too)."""
    tokens = sum(max(0, len(r["tokens"]) - 1) for r in results)
    seconds = sum(r["seconds"] - r["first_token_s"] for r in results)
    return tokens / seconds if seconds else 0.0


def _e2e_rate(results: list[dict]) -> float:
    tokens = sum(len(r["tokens"]) for r in results)
    seconds = sum(r["seconds"] for r in results)
    return tokens / seconds if seconds else 0.0


def _measure(service, workloads: dict, candidates: dict, max_tokens: int) -> tuple[dict, bool]:
    """Target alone, ours and each candidate, then HF assisted generation, prompt by prompt."""
    results: dict[str, dict[str, list[dict]]] = {}
    lossless = True
    total = sum(len(v) for v in workloads.values())
    with tqdm(total=total, desc="spec: target vs speculative", unit="prompt") as bar:
        for name, prompts in workloads.items():
            per = results.setdefault(name, {"target": [], "ours": []})
            for ids in prompts:
                base = _decode(service, ids, max_tokens, speculate=False)
                ours = _decode(service, ids, max_tokens, speculate=True)
                lossless &= ours["tokens"] == base["tokens"]
                per["target"].append(base)
                per["ours"].append(ours)
                for cand, spec in candidates.items():
                    out = _decode(service, ids, max_tokens, speculate=True, spec_config=spec)
                    lossless &= out["tokens"] == base["tokens"]
                    per.setdefault(f"candidate:{cand}", []).append(out)
                bar.update()

    # transformers' assisted generation, with the best draft it can use.
    model = service.engine.model
    int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    with tqdm(total=total, desc="spec: HF assisted generation", unit="prompt") as bar:
        for name, prompts in workloads.items():
            for ids in prompts:
                results[name].setdefault("hf_prompt_lookup", []).append(
                    _hf_generate(model, ids, max_tokens, prompt_lookup_num_tokens=5)
                )
                results[name].setdefault("hf_prompt_lookup_10", []).append(  # as in transformers' docs
                    _hf_generate(model, ids, max_tokens, prompt_lookup_num_tokens=10)
                )
                results[name].setdefault("hf_int8_assistant", []).append(
                    _hf_generate(model, ids, max_tokens, assistant_model=int8)
                )
                bar.update()

    return results, lossless


# A structured-output workload: each answer must match this schema (response_format json_schema).
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "string"}},
        "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
        "minutes": {"type": "integer"},
    },
    "required": ["title", "steps", "difficulty", "minutes"],
    "additionalProperties": False,
}
JSON_PROMPTS = (
    "Give a recipe for pancakes as JSON: title, steps, difficulty and minutes.",
    "Describe how to change a bicycle tire as JSON: title, steps, difficulty and minutes.",
    "Explain how to set up a Python virtual environment as JSON: title, steps, difficulty and minutes.",
)


def _grammar_workload(service, builder, max_tokens: int) -> dict:
    """Target alone vs the shipped speculation, both under the JSON-schema grammar: the speedup
    the grammar leaves, whether the output stays identical, and the mask's cost per token."""
    import json

    from engines.types import StructuredOutput
    from ingress.protocol import ChatMessage

    structured = StructuredOutput("json_schema", json.dumps(JSON_SCHEMA))
    runs: dict[str, list[dict]] = {"target": [], "ours": []}
    lossless, valid = True, 0
    for text in tqdm(JSON_PROMPTS, desc="spec: JSON-schema workload", unit="prompt"):
        ids = builder.chat([ChatMessage(role="user", content=text)])
        base = service.executor.submit(_decode, service, ids, max_tokens, False, None, structured).result()
        ours = service.executor.submit(_decode, service, ids, max_tokens, True, None, structured).result()
        lossless &= ours["tokens"] == base["tokens"]
        runs["target"].append(base)
        runs["ours"].append(ours)
        try:
            json.loads(service.engine.tokenizer.decode([t for t in base["tokens"] if t not in service.engine.eos_token_ids]))
            valid += 1
        except ValueError:
            pass  # cut at max_tokens
    rows = sum(r["mask_rows"] for r in runs["ours"] + runs["target"])
    mask_ms = sum(r["mask_ms"] for r in runs["ours"] + runs["target"])
    proposed = sum(r["proposed"] for r in runs["ours"])
    return {
        "lossless": lossless,
        "complete_json": f"{valid}/{len(JSON_PROMPTS)}",
        "speedup_vs_target": round(_rate(runs["ours"]) / _rate(runs["target"]), 3),
        "e2e_speedup_vs_target": round(_e2e_rate(runs["ours"]) / _e2e_rate(runs["target"]), 3),
        "tokens_per_s": {"target": round(_rate(runs["target"]), 2), "ours": round(_rate(runs["ours"]), 2)},
        "acceptance_rate": round(sum(r["accepted"] for r in runs["ours"]) / proposed, 3) if proposed else 0.0,
        "mask_ms_per_row": round(mask_ms / rows, 3) if rows else None,
        "itl_ms": {"target": summary([x for r in runs["target"] for x in r["itl_ms"]]),
                   "ours": summary([x for r in runs["ours"] for x in r["itl_ms"]])},
    }


def _default_profile(workloads_text: dict, requests: int, max_tokens: int) -> dict:
    """serve_config.yaml's own target (llama.cpp in float32, drafted by the same file's Q4_1
    kernels and by prompt lookup), one stream: target alone against its speculation, lossless
    checked token by token, per workload and mixed."""
    from ingress.prompts import PromptBuilder
    from ingress.protocol import ChatMessage
    from target.service import ModelService

    stage = load_serve_config().args.target
    service = ModelService(stage)
    builder = PromptBuilder(service.engine.tokenizer)
    runs: dict[str, dict[str, list[dict]]] = {}
    lossless = True

    def measure() -> None:
        nonlocal lossless
        for name, convs in workloads_text.items():
            per = runs.setdefault(name, {"target": [], "ours": []})
            for conv in convs[:requests]:
                ids = builder.chat([ChatMessage(**m) for m in conv])
                base = _decode(service, ids, max_tokens, speculate=False)
                ours = _decode(service, ids, max_tokens, speculate=True)
                lossless &= ours["tokens"] == base["tokens"]
                per["target"].append(base)
                per["ours"].append(ours)

    service.executor.submit(measure).result()  # on the replica's one worker thread, as served
    service.executor.shutdown(wait=True)

    def block(r: dict[str, list[dict]]) -> dict:
        proposed = sum(x["proposed"] for x in r["ours"])
        return {
            "speedup_vs_target": round(_rate(r["ours"]) / _rate(r["target"]), 3),
            "e2e_speedup_vs_target": round(_e2e_rate(r["ours"]) / _e2e_rate(r["target"]), 3),
            "tokens_per_s": {"target": round(_rate(r["target"]), 2), "ours": round(_rate(r["ours"]), 2)},
            "acceptance_rate": round(sum(x["accepted"] for x in r["ours"]) / proposed, 3) if proposed else 0.0,
        }

    mixed: dict[str, list[dict]] = {"target": [], "ours": []}
    for r in runs.values():
        mixed["target"] += r["target"]
        mixed["ours"] += r["ours"]
    return {
        "engine": f"{stage.engine.kind} {stage.engine.weights}",
        "speculative": stage.speculative.method,
        "lossless": lossless,
        "mixed": block(mixed),
        "workloads": {name: block(r) for name, r in runs.items()},
    }


def run(requests: int = 3, max_tokens: int = 128, quick: bool = False) -> dict:
    from target.service import ModelService
    from ingress.prompts import PromptBuilder
    from ingress.protocol import ChatMessage

    serve_file = load_serve_config(CPU_EXACT_CONFIG)
    stage = serve_file.args.target
    if stage.speculative.method == "none":
        raise SystemExit("configs/cpu-exact.yaml's target has speculative.method: none; nothing to measure")
    service = ModelService(stage)
    builder = PromptBuilder(service.engine.tokenizer)
    workloads = {
        name: [builder.chat([ChatMessage(**m) for m in conv]) for conv in convs[:requests]]
        for name, convs in conversations().items()
    }
    # Candidate drafters share the replica's engines and measured costs.
    candidates = {}
    if not quick:
        from draft.factory import build_proposers

        for method in CANDIDATES:
            if "draft_model" in method and service.draft_engine is None:
                continue
            cfg = stage.speculative.model_copy(update={"method": method})
            proposers, _ = build_proposers(cfg, draft_engine=service.draft_engine, target_engine=service.engine)
            candidates[method] = (proposers, copy.deepcopy(service.costs))

    # Every forward pass runs on the service's one worker thread, as in a replica: OpenMP keeps a
    # thread team per calling thread, and with two teams on 2 cores every parallel region of
    # every model (torch and llama.cpp share one libgomp) ran ~3x slower here.
    results, lossless = service.executor.submit(_measure, service, workloads, candidates, max_tokens).result()
    def block(runs: dict[str, list[dict]]) -> dict:
        target = _rate(runs["target"])
        ours = _rate(runs["ours"])
        hf = {k: _rate(v) for k, v in runs.items() if k.startswith("hf_")}
        best_hf = max(hf.values())
        proposed = sum(r["proposed"] for r in runs["ours"])
        accepted = sum(r["accepted"] for r in runs["ours"])
        out = {
            "speedup_vs_target": round(ours / target, 3),
            "speedup_vs_hf_assisted": round(ours / best_hf, 3),
            "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "tokens_per_s": {"target": round(target, 2), "ours": round(ours, 2), **{k: round(v, 2) for k, v in hf.items()}},
            "e2e_tokens_per_s": {k: round(_e2e_rate(v), 2) for k, v in runs.items() if not k.startswith("candidate:")},
            "e2e_speedup_vs_target": round(_e2e_rate(runs["ours"]) / _e2e_rate(runs["target"]), 3),
            "itl_ms": {
                "target": summary([x for r in runs["target"] for x in r["itl_ms"]]),
                "ours": summary([x for r in runs["ours"] for x in r["itl_ms"]]),
            },
            "best_hf_variant": max(hf, key=hf.get),
        }
        cands = {k.split(":", 1)[1]: round(_rate(v) / target, 3) for k, v in runs.items() if k.startswith("candidate:")}
        if cands:
            out["candidates_speedup_vs_target"] = cands
        return out

    workloads_out = {name: block(runs) for name, runs in results.items()}
    grammar = _grammar_workload(service, builder, max_tokens)
    service.executor.shutdown(wait=True)
    default_profile = _default_profile(conversations(), requests, max_tokens)
    mixed_runs: dict[str, list[dict]] = {}
    for runs in results.values():
        for key, value in runs.items():
            mixed_runs.setdefault(key, []).extend(value)
    return {
        "lossless": lossless and grammar["lossless"] and default_profile["lossless"],
        "mixed": block(mixed_runs),
        "default_profile": default_profile,
        "workloads": workloads_out,
        "json_schema": grammar,
        "config": {
            "prompts_per_workload": requests,
            "max_tokens": max_tokens,
            "speculative": stage.speculative.model_dump(),
            "calibrated": service.costs.calibrated,
            "verify_ms_by_tokens": [round(v.value, 1) for v in service.costs.verify],  # after the runs
            "draft_ms_per_token": round(service.costs.draft_per_token.value, 2),
            "draft_prefill_ms_per_token": round(service.costs.draft_prefill_per_token, 2),
        },
    }
