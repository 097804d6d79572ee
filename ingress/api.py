"""The HTTP surface: OpenAI routes on top of a `Pipeline`. No Ray here, so it is testable alone."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ingress.errors import APIError
from ingress.pipeline import Pipeline

log = logging.getLogger(__name__)


def build_api(pipeline: Pipeline) -> FastAPI:
    app = FastAPI(title="latency-serve", version="0.1.0", docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await pipeline.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await pipeline.handle(request, "completion")

    @app.delete("/v1/cache")
    async def invalidate_cache(request: Request) -> Response:
        return await pipeline.invalidate(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(pipeline.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        gate = pipeline.gate
        return JSONResponse(
            status_code=200 if pipeline.ready else 503,
            content={
                "status": "ok" if pipeline.ready else "warming",
                "admission": {
                    "inflight": gate.inflight,
                    "queued": gate.queued,
                    "max_inflight": gate.max_inflight,
                    "max_queued": gate.max_queued,
                },
                "router": pipeline.router_stats(),
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
        log.exception("unhandled error in the ingress")
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()

    return app
