"""POST /v1/embeddings: all-MiniLM-L6-v2, the model the semantic cache and the router already
run, in OpenAI's request and response shape (float or base64, one text or a batch, usage).

MiniLM reads at most 256 word pieces; a longer input is a 400 naming it (as vLLM's server
answers an input past its model's window), never silently cut. Token-id inputs are OpenAI
tokenizer ids, which MiniLM does not read: a 400 that says to send text.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from admission.errors import AdmissionError
from ingress.context import context_from_headers
from ingress.errors import APIError, bad_request, from_admission
from ingress.pacing import paced

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DIMENSIONS = 384  # its vectors' length
MAX_TOKENS = 256  # MiniLM's window, in its own word pieces, [CLS] and [SEP] included


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str = Field(..., min_length=1, max_length=256)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


# A MiniLM word piece holds one character at least; texts past this many characters per token
# of the request's budget are refused before they are tokenized.
CHARS_PER_TOKEN_BOUND = 8
# Texts embedded per pass: between passes a request whose client left stops.
CHUNK = 16


def parse(body: Any, max_inputs: int, max_tokens: int, dimensions: int) -> tuple[EmbeddingRequest, list[str]]:
    """The validated request and its texts; a 400 for anything MiniLM can't answer as asked."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or None
        raise bad_request(f"{where}: {first['msg']}" if where else first["msg"], where) from None
    if req.model != EMBEDDING_MODEL:
        raise APIError(404, f"model {req.model!r} does not exist; the embedding model is {EMBEDDING_MODEL!r}",
                       param="model", code="model_not_found")
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts:
        raise bad_request("input: at least one text", "input")
    if not all(isinstance(t, str) for t in texts):
        raise bad_request(f"input: token ids are not supported ({EMBEDDING_MODEL} has its own tokenizer); send text",
                          "input", "unsupported")
    if len(texts) > max_inputs:
        raise bad_request(f"input: {len(texts)} texts; this server takes at most {max_inputs} per request", "input")
    if any(not t for t in texts):
        raise bad_request("input: texts must be non-empty", "input")
    max_chars = max_tokens * CHARS_PER_TOKEN_BOUND
    if sum(len(t) for t in texts) > max_chars:
        raise bad_request(f"input: at most {max_chars} characters per request", "input", "prompt_too_long")
    if req.dimensions is not None and req.dimensions != dimensions:
        raise bad_request(f"dimensions: {EMBEDDING_MODEL} gives {dimensions}-d vectors only", "dimensions", "unsupported")
    return req, texts  # type: ignore[return-value]


def check_lengths(counts: list[int], max_tokens: int) -> None:
    """A 400 for a text over MiniLM's window (word pieces, [CLS]/[SEP] included), or texts
    over the request's token budget together."""
    for i, n in enumerate(counts):
        if n > MAX_TOKENS:
            raise bad_request(f"input[{i}]: {n} tokens; {EMBEDDING_MODEL} reads at most {MAX_TOKENS}",
                              "input", "context_length_exceeded")
    if sum(counts) > max_tokens:
        raise bad_request(f"input: {sum(counts)} tokens in all; this server embeds at most {max_tokens} per request "
                          "(send several requests)", "input", "too_many_tokens")


def response(vectors: np.ndarray, encoding: str, tokens: int) -> dict[str, Any]:
    def encode(v: np.ndarray) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.astype(np.float32).tolist()

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
        "model": EMBEDDING_MODEL,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


class EmbeddingsService:
    """POST /v1/embeddings on MiniLM: the caller's key and tenant rate limits as for a chat, the
    vectors made on the embedder's own thread, so an embeddings job never queues in front of the
    router's embedding of a chat request. The router's model on another thread where it runs in
    this ingress; else one loaded on the first embeddings call."""

    def __init__(self, args, keys, admission, preparer, embedder=None) -> None:
        self.args = args
        self.keys = keys
        self.admission = admission
        self.preparer = preparer
        self.embedder = embedder
        self._loading: asyncio.Future | None = None

    async def handle(self, request) -> Response:
        try:
            ctx = context_from_headers(request.headers, self.keys.identify(request.headers))
            self.admission.precheck_tenant(ctx)
            body = await self.preparer.read_json(request)
            limits = self.args.ingress.limits
            req, texts = parse(body, limits.max_embedding_inputs, limits.max_embedding_tokens, DIMENSIONS)
            embedder = await self._embedder()
            counts = await embedder.count_tokens_async(texts)
            check_lengths(counts, limits.max_embedding_tokens)
            self.admission.charge_tenant(ctx, sum(counts))
            parts = []
            for start in range(0, len(texts), CHUNK):  # a client that left stops its job here
                if start and await request.is_disconnected():
                    return Response(status_code=499)
                parts.append(await embedder.embed_many_async(texts[start:start + CHUNK]))
            return await asyncio.get_running_loop().run_in_executor(None, lambda: JSONResponse(
                response(np.concatenate(parts), req.encoding_format, sum(counts))
            ))
        except (APIError, AdmissionError) as raised:
            if isinstance(raised, AdmissionError):
                return from_admission(await paced(raised, self.args.ingress.over_limit_hold_s)).response()
            return raised.response()
        except ClientDisconnect:
            return Response(status_code=499)

    async def _embedder(self):
        if self._loading is None and self.embedder is not None:
            self._loading = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self.embedder.sibling))
        if self._loading is None:
            from semantic_cache.embedder import Embedder as Loaded

            semantic = self.args.cache.semantic
            self._loading = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, lambda: Loaded(precision=semantic.embed_precision, runtime=semantic.embed_runtime)
            ))
        return await asyncio.shield(self._loading)
