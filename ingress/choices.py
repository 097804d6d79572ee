"""`n` > 1: n independent generations of one request, answered as OpenAI's choices 0..n-1.

Each choice is a request of its own through the pipeline (its own admission slot, request id
and engine sequence; a seeded request's choice i samples with seed + i; greedy choices are
identical, as in vLLM), so a choice costs what a request costs. They never read or write the
cache. The model replica's prefix cache shares the prompt's KV between them where the engine
has one. Non-streamed, the n answers are joined into one body (usage: the prompt once, the
completions summed); streamed, their SSE frames are interleaved as they come, each choice's
`index` set, with one usage frame and one `[DONE]` at the end. The first choice that fails
fails the request and stops the others. Non-streamed choices take turns for this ingress's
admission slots; a stream needs them all at once (a 400 past the slots).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from ingress.errors import bad_request
from ingress.prepare import Prepared
from ingress.responses import usage


def clones(p: Prepared, n: int) -> list[Prepared]:
    """n copies of a prepared request, each its own request to the pipeline."""
    out = []
    for i in range(n):
        seed = None if p.sampling.seed is None else p.sampling.seed + i
        out.append(dataclasses.replace(
            p,
            ctx=dataclasses.replace(p.ctx, request_id=f"{p.ctx.request_id}-{i}"),
            sampling=dataclasses.replace(p.sampling, seed=seed),
            cache_key=None, scope=None, query=None,
        ))
    return out


def split(p: Prepared, n: int, at_once: int) -> list[Prepared]:
    """`p` as n requests of its own. A stream needs all its choices running together, so it may
    ask for no more than `at_once` (this ingress's admission slots); a 400 past them."""
    if p.stream and n > max(1, at_once):
        raise bad_request(
            f"n: a stream of {n} choices needs {n} generations at once and this service runs {at_once}; "
            f"ask for fewer, or for stream: false (its choices then take turns)", "n",
        )
    return clones(p, n)


def turns(p: Prepared, at_once: int) -> asyncio.Semaphore | None:
    """Non-streamed choices take turns for at most `at_once` slots (more would only fill this
    ingress's queue); a stream's choices all run at once (None)."""
    return None if p.stream else asyncio.Semaphore(max(1, at_once))


async def merge(p: Prepared, responses: list[Response]) -> Response:
    """The n choices' responses as one: the first that failed, else their bodies joined (or
    their streams interleaved)."""
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        for r in responses:
            if r is not failed and isinstance(r, StreamingResponse):
                await _close(r)
        return failed
    headers = {k: v for k, v in responses[0].headers.items() if k.startswith("x-") and k != "x-model-replica"}
    if not p.stream:
        return JSONResponse(_joined([json.loads(bytes(r.body)) for r in responses]), headers=headers)
    return StreamingResponse(
        _interleaved([r for r in responses if isinstance(r, StreamingResponse)], p.include_usage),
        media_type="text/event-stream", headers=headers,
    )


def _joined(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(bodies[0])
    out["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    prompt = bodies[0]["usage"]["prompt_tokens"]
    out["usage"] = usage(prompt, sum(b["usage"]["completion_tokens"] for b in bodies))
    return out


async def _interleaved(streams: list[StreamingResponse], include_usage: bool) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: StreamingResponse) -> None:
        try:
            async for frame in stream.body_iterator:
                await queue.put((i, frame if isinstance(frame, bytes) else str(frame).encode()))
        finally:
            await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams, prompt, completion = len(streams), 0, 0
    response_id: str | None = None
    usage_event: dict[str, Any] | None = None
    try:
        while open_streams:
            i, frame = await queue.get()
            if frame is None:
                open_streams -= 1
                continue
            for line in frame.split(b"\n\n"):
                if not line.startswith(b"data: {"):
                    continue  # [DONE] goes out once, at the end
                event = json.loads(line[6:])
                if "error" in event:
                    yield line + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                response_id = response_id or event.get("id")
                event["id"] = response_id
                if event.get("usage") and not event.get("choices"):
                    prompt = event["usage"]["prompt_tokens"]
                    completion += event["usage"]["completion_tokens"]
                    usage_event = event
                    continue
                for choice in event.get("choices", []):
                    choice["index"] = i
                yield b"data: " + json.dumps(event, ensure_ascii=False).encode("utf-8") + b"\n\n"
        if include_usage and usage_event is not None:
            usage_event["usage"] = usage(prompt, completion)
            yield b"data: " + json.dumps(usage_event, ensure_ascii=False).encode("utf-8") + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:  # a pump cancelled mid-read cancels its stream's model call
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await _close(stream)


async def _close(response: StreamingResponse) -> None:
    """Stop a stream nobody will read: its generator's cleanup cancels the model call."""
    close = getattr(response.body_iterator, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            pass
