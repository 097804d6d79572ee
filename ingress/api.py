"""The HTTP surface: OpenAI routes on top of a `Pipeline`. No Ray here, so it is testable alone."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ingress.errors import APIError, describe
from ingress.pipeline import Pipeline
from ingress.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def build_api(pipeline: Pipeline, stalled_readers: Callable[[], int] = lambda: 0) -> FastAPI:
    """The OpenAI-shaped HTTP API over `pipeline`; `stalled_readers` counts responses the direct
    listener cut for a reader that stopped reading (/health)."""
    app = FastAPI(title="latency-serve", version="0.1.0", docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await pipeline.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await pipeline.handle(request, "completion")

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        return await pipeline.create_embeddings(request)

    @app.delete("/v1/cache")
    async def invalidate_cache(request: Request) -> Response:
        return await pipeline.invalidate(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            pipeline.authorize(request)
            await pipeline.wait_ready()
        except APIError as err:
            return err.response()
        return JSONResponse(pipeline.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            status_code=200 if pipeline.readiness.ready else 503,
            content={
                "status": "ok" if pipeline.readiness.ready else "warming",
                "admission": pipeline.admission.snapshot(),
                "router": pipeline.placement.stats(),
                "cache": {"lookup_failures": pipeline.cache.failures},
                "stalled_readers_cut": stalled_readers(),
            },
        )

    # Everything else, in the OpenAI error shape too: unknown paths, wrong methods, bugs.
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return APIError(400, str(exc.errors()[:1]), code="invalid_request").response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        if type(exc).__name__ == "TaskCancelledError":  # Ray cancelled the call: the client disconnected
            return Response(status_code=499)
        # The frames carry no user data and are what a bug report needs; the message may quote input.
        log.error(
            "unhandled error in the ingress: %s\n%s",
            describe(exc, with_message=pipeline.args.ingress.log_prompts),
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        return APIError(500, f"internal error: {type(exc).__name__}", code="server_error").response()

    app.openapi = lambda: _openapi_schema(app, pipeline)  # type: ignore[method-assign]
    return app


# Request headers the pipeline reads (ingress/context.py), documented so clients and fuzzers see them.
_HEADERS = {
    "x-request-deadline-ms": ("number", "Deadline for the whole request, in milliseconds from now."),
    "x-slo-tier": ("string", "SLO tier (admission.tiers in serve_config.yaml; default: the key's tier, else "
                   "admission.default_tier, standard as shipped)."),
    "x-admission-mode": ("string", "predictive or fifo; honored only with admission.allow_mode_header (benchmarks)."),
    "x-tenant": ("string", "A namespace inside the API key's tenant: [A-Za-z0-9_.:-]{1,64}."),
    "x-request-id": ("string", "Echoed back and logged; the service's own ids are generated."),
    "cache-control": ("string", "no-cache: skip the cache lookup; no-store: do not cache the answer."),
}


def _openapi_schema(app: FastAPI, pipeline: Pipeline) -> dict[str, Any]:
    """FastAPI's schema plus what it can't see: the routes read their bodies themselves (for the
    size limit and our error shape), so the request schemas are added here from the pydantic models."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    served = [m["id"] for m in pipeline.models()["data"]]
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        body["properties"]["model"] = {"type": "string", "enum": served, "title": "Model"}
        components[model.__name__] = body
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        enums = {"x-slo-tier": list(pipeline.args.admission.tiers), "x-admission-mode": ["predictive", "fifo"]}
        operation["parameters"] = [
            {
                "name": name, "in": "header", "required": False, "description": text,
                "schema": {"type": kind, **({"enum": enums[name]} if name in enums else {})},
            }
            for name, (kind, text) in _HEADERS.items()
        ]
    app.openapi_schema = schema
    return schema
