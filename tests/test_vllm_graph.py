"""The whole graph on the vLLM profile (configs/cpu-vllm.yaml on a CPU, gpu.yaml on a GPU),
through the openai SDK, where vLLM is installed: `bash scripts/peers.sh vllm ours_vllm`, then
`RUN_SLOW=1 .venv-peers/ours-vllm/bin/python -m pytest tests/test_vllm_graph.py`. The rows the
CPU profile's tests pass that are vLLM's own: log-probabilities, a cached answer verified by
the model, near misses labelled only where they were verified."""

from __future__ import annotations

import pytest

from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_graph():
    pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/peers.sh vllm ours_vllm")
    from vllm.platforms import current_platform

    import ray

    from bench.local import another_app, free_port, running_service

    serve_file = load_serve_config(CPU_EXACT_CONFIG.with_name("cpu-vllm.yaml" if current_platform.is_cpu() else "gpu.yaml"))

    def exact(args) -> None:
        # float32: the checks below compare texts exactly (in bfloat16 a prefill and a decode
        # step may break a near-tie differently); fifo: nothing is shed on a slow box.
        args.target.engine.vllm.dtype = "float32"
        args.admission.mode = "fifo"

    model = serve_file.args.target.engine.model_id
    if ray.is_initialized():  # the suite's own service runs (SERVE_CONFIG, scripts/test-vllm.sh): one more app beside it
        args = serve_file.args.model_copy(deep=True)
        exact(args)
        args.ingress.direct_host, args.ingress.direct_port = "127.0.0.1", free_port()
        with another_app(serve_file, args, "vllm-exact", "", startup_timeout_s=400) as base:
            yield base, model
        return
    with running_service(serve_file, tweak=exact) as base:
        yield base, model


def test_logprobs_on_vllm_take_the_cpu_engines_shape(vllm_graph):
    from openai import OpenAI

    base, model = vllm_graph
    client = OpenAI(base_url=base + "/v1", api_key="sk-vllm")
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == done.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=1, stream=True)
    streamed = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content], "streamed, the same tokens"


def test_a_cached_answer_is_verified_by_vllm_and_the_answer_stays_the_models(vllm_graph):
    """A reworded question matches the first's cached answer (semantic mode verify): vLLM scores
    it in one prefill and goes on from what it agrees with; the answer is the one the model
    gives the reworded question uncached."""
    import httpx

    base, model = vllm_graph

    def ask(question: str, **headers) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
        return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)

    first = ask("Name three uses of copper.")
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    reworded = ask("Name three uses of copper")
    assert reworded.status_code == 200 and reworded.headers["x-cache"] in ("verified", "hint"), reworded.headers
    accepted = dict(kv.split("=") for kv in reworded.headers["x-cache-accepted"].split(";"))
    assert int(accepted["proposed"]) > 0 and 0 <= int(accepted["accepted"]) <= int(accepted["proposed"])
    alone = ask("Name three uses of copper", **{"cache-control": "no-cache"})
    assert alone.headers["x-cache"] == "bypass"
    assert reworded.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]


def test_the_vllm_engine_runs_in_a_session_apart_from_rays(vllm_graph):
    """host_tuning/engine_group.py on the real engine: the target replica's engine core and its
    workers share a session, not the replica's (the kernel's autogroup schedules them apart)."""
    import os

    import psutil

    cores = [p for p in psutil.process_iter(["name", "cmdline"])
             if "VLLM::EngineCore" in " ".join(p.info["cmdline"] or [p.info["name"] or ""])]
    in_graph = [p for p in cores if "ServeReplica" in " ".join(p.parent().cmdline() if p.parent() else [])]
    assert in_graph, "the graph's target replica started a vLLM engine core"
    for core in in_graph:
        assert os.getsid(core.pid) == core.pid != os.getsid(core.parent().pid)
        for worker in core.children(recursive=True):
            assert os.getsid(worker.pid) == core.pid
