"""The app builder: binds the six deployments into one graph.

    Ingress ──► AdmissionController   (sync only, off the request path; it also keeps the cache
       │                                 invalidations every SemanticCache replica applies)
       ├──────► SemanticCache         (exact, then semantic; before the model starts by default)
       ├──────► Router                (asked only with router.placement: remote; always bound, since Serve rejects
       │                                 config for a deployment the app lacks)
       ├──────► TargetModel           (streams tokens; speculative, draft co-located by default)
       └──────► DraftModel            (the small model; drafts for remote speculation)
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from configs.limits import check_batches
from configs.schemas import AppArgs
from deployments.ingress import Ingress
from deployments.models import DraftModel, TargetModel
from deployments.cache import SemanticCache
from deployments.controller import AdmissionController
from deployments.router import Router


def build_app(args: AppArgs) -> Application:
    """`serve run` calls this with `applications[].args`, validated as AppArgs by Serve."""
    return build_graph(args)


def build_graph(
    args: AppArgs | dict,
    deployment_options: dict[str, dict[str, Any]] | None = None,
    logging_config: dict[str, Any] | None = None,
) -> Application:
    """Bind the graph. `deployment_options` and `logging_config` apply a config file's
    `deployments:` and `logging_config:` sections when the app is started from Python (tests,
    bench); `serve run` applies them itself.
    """
    if isinstance(args, dict):
        args = AppArgs.model_validate(args)
    check_batches(args)
    opts = deployment_options or {}

    def with_options(deployment):
        options = dict(opts.get(deployment.name, {}))
        if logging_config:  # replicas do not inherit serve.start()'s logging config
            options.setdefault("logging_config", logging_config)
        return deployment.options(**options) if options else deployment

    admission = with_options(AdmissionController).bind(args.admission.model_dump(), args.telemetry.metrics.enabled)
    cache = with_options(SemanticCache).bind(args.cache.model_dump(), admission, args.host_tuning.model_dump())
    router = with_options(Router).bind(
        args.router.model_dump(), args.target.engine.model_id, args.draft.engine.model_id
    )
    telemetry = args.telemetry.model_dump()
    host = args.host_tuning.model_dump()
    draft = with_options(DraftModel).bind(args.draft.model_dump(), telemetry, host)
    # Remote speculation: the target calls the draft deployment once per round.
    remote_draft = draft if args.target.speculative.placement == "remote" and "draft_model" in args.target.speculative.method else None
    target = with_options(TargetModel).bind(
        args.target.model_dump(), remote_draft, telemetry, args.handle_transport, host
    )
    return with_options(Ingress).bind(args.model_dump(), admission, cache, router, target, draft)
