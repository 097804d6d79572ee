"""From an HTTP body to a `Prepared` request: read under limits, validate against the OpenAI
schema and the input limits, key it for the cache, tokenize it with the chat template, fit it
to the tier's input budget and the model's context window. Every failure is a 4xx."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from admission.budget import trim_conversation
from admission.policy import AdmissionPolicy, Mode
from admission.request import RequestContext
from configs.schemas import AppArgs, InputLimits, TierConfig
from engines.types import SamplingParams
from ingress.errors import APIError, bad_request
from ingress.prompts import PromptBuilder
from ingress.protocol import ChatCompletionRequest, CompletionRequest, lone_surrogate_at
from ingress.responses import Kind
from engines.grammar import GrammarError, check
from engines.types import StructuredOutput
from ingress.structured import structured_output
from ingress.tools import ToolSpec, tool_spec
from router.base import RouteFeatures
from semantic_cache.keys import exact_key, scope_key, split_query


@dataclass(frozen=True)
class Prepared:
    """A validated request: what the client asked, as the Preparer read it, and its prompt's
    token ids once `Preparer.tokenize` has made them (a new Prepared). No stage changes it: a
    stage returns what it finds (cache_client.py's CacheState, placement.py's Admitted,
    model_calls.py's Call), and what the response and telemetry report of it is the request's
    Record (accounting.py)."""

    kind: Kind
    ctx: RequestContext
    request: ChatCompletionRequest | CompletionRequest
    requested_model: str
    sampling: SamplingParams  # max_tokens fitted by `Preparer.tokenize`, from the prompt's length
    stream: bool
    include_usage: bool
    features: RouteFeatures  # prompt_tokens counted by `Preparer.tokenize`
    cache_key: str | None  # None: this request neither reads nor writes the cache
    scope: str | None  # semantic scope (None: exact match only)
    query: str | None  # the last user turn, what the semantic lookup compares
    tokenize: Callable[[PromptBuilder], list[int]]  # its prompt in a model's tokens (a routed model's too)
    tier: TierConfig
    mode: Mode
    chars: int = 0  # characters of message content or prompt: how long tokenizing it takes
    system_text: str = ""  # the system (and developer) messages: standing instructions, not the task
    tools: ToolSpec | None = None  # its function tools: prompt, grammar, and tool_calls in the answer
    grammar_param: str | None = None  # the field that asked for sampling.structured, for its 400
    prompt_ids: list[int] = field(default_factory=list)  # `Preparer.tokenize`, for the requested model
    notes: tuple[tuple[str, str], ...] = ()  # response headers: what fitting it to its tier changed

    @property
    def reshaped(self) -> bool:
        """The tier clamped max_tokens or trimmed the conversation: the answer is not the one the
        request's cache key names, so it is neither cached nor shared with identical requests."""
        return any(name in ("x-max-tokens-clamped", "x-context-trimmed") for name, _ in self.notes)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.ctx.request_id


# Prompts longer than this are tokenized (and trimmed) on a worker thread, not on the event
# loop every request and /health share: a long prompt's tokenizing would hold that loop.
INLINE_TOKENIZE_CHARS = 8192


class StandingPrompts:
    """System messages this ingress has seen before, per tenant: an app's standing instructions,
    which the router does not count as the request's length. A system message seen for the first
    time (a RAG app's retrieved context in it, say) counts. Keeps a hash and the token count of
    at most `size`, so a repeat costs a hash, not a second tokenization. Thread-safe: long
    prompts are tokenized off the event loop."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[bytes, int | None] = OrderedDict()  # hash -> tokens (None: seen once)
        self._lock = threading.Lock()

    def tokens(self, tenant: str | None, text: str, count: Callable[[str], int]) -> int:
        """`text`'s token count if it was seen before for `tenant`, else 0 (and remember it)."""
        key = hashlib.blake2b(f"{tenant}\0{text}".encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            known = key in self._seen
            n = self._seen.get(key)
            if known:
                self._seen.move_to_end(key)
            else:
                self._seen[key] = None
                if len(self._seen) > self.size:
                    self._seen.popitem(last=False)
        if not known:
            return 0
        if n is None:
            n = count(text)
            with self._lock:
                if key in self._seen:
                    self._seen[key] = n
        return n


class Preparer:
    def __init__(self, args: AppArgs, prompts: dict[str, PromptBuilder], admission: AdmissionPolicy) -> None:
        self.args = args
        self.standing = StandingPrompts()
        self.prompts = prompts  # model id -> prompt builder ("auto" uses the target's)
        self.admission = admission
        self.max_model_len = {
            args.target.engine.model_id: args.target.engine.max_model_len,
            args.draft.engine.model_id: args.draft.engine.max_model_len,
            args.router.auto_model_id: args.target.engine.max_model_len,
        }
        # Grammar conversions (xgrammar's C++, which releases the GIL): off the event loop, two
        # at a time at most, so one slow schema delays no other request's check for long.
        self._grammar_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")
        self._too_slow: OrderedDict[tuple[str, StructuredOutput], None] = OrderedDict()  # (tenant, grammar)
        self._converts: OrderedDict[tuple[str, StructuredOutput], None] = OrderedDict()  # known good, same key

    async def read_json(self, request: Request) -> Any:
        limit = self.args.ingress.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body over the {limit}-byte limit", code="body_too_large")
        raw = bytearray()

        async def read() -> None:
            async for piece in request.stream():
                raw.extend(piece)
                if len(raw) > limit:
                    raise APIError(413, f"request body over the {limit}-byte limit", code="body_too_large")

        timeout = self.args.ingress.body_timeout_s
        try:
            await asyncio.wait_for(read(), timeout)  # a client that stalls mid-body holds nothing for long
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding")
        try:
            body = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        where = lone_surrogate_at(text, body)
        if where is not None:
            raise bad_request(f"{where}: a lone UTF-16 surrogate is not text", where, "invalid_encoding")
        return body

    def prepare(
        self, kind: Kind, body: Any, ctx: RequestContext, tier: TierConfig | None = None, mode: Mode | None = None
    ) -> Prepared:
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        limits = self.args.ingress.limits
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and len(messages) > limits.max_messages:  # before validating them all
            raise bad_request(
                f"messages: {len(messages)} messages; this server takes at most {limits.max_messages} per request",
                "messages", "too_many_messages",
            )
        req = _validate(schema, body)
        chars = _check_sizes(req, limits)
        unsupported = req.unsupported()
        if unsupported:
            raise bad_request(f"not supported by this server: {', '.join(unsupported)}", unsupported[0], "unsupported")
        if req.model not in self.max_model_len:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; available: {', '.join(self.max_model_len)}",
                param="model",
                code="model_not_found",
            )
        asked = structured_output(req)
        grammar_param, structured = asked if asked is not None else (None, None)
        tools = None
        if kind == "chat":
            try:
                tools = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
            except ValueError as exc:
                raise bad_request(str(exc), "tool_choice" if str(exc).startswith("tool_choice") else "tools") from None
            if tools is not None:
                tool_grammar, grammar_param = tools.grammar(), "tools"
            if tools is not None and structured is not None:
                raise bad_request("tools and a structured output (response_format, guided_*) at once are not served; "
                                  "send one", "response_format")
            tokenize = lambda b: b.chat(req.messages, tools)  # noqa: E731
        else:
            tokenize = lambda b: b.completion(req.prompt)  # noqa: E731
        if kind == "chat":
            turns = [_turn(m) for m in req.messages]
            users = [t["content"] for t in turns if t["role"] == "user"]
            last_user, user_turns = (users[-1] if users else ""), len(users)
            system_text = "\n".join(t["content"] for t in turns if t["role"] in ("system", "developer"))
        else:
            turns = [{"role": "prompt", "content": json.dumps(req.prompt)}]
            last_user, user_turns = (req.prompt if isinstance(req.prompt, str) else ""), 1
            system_text = ""
        sampling = SamplingParams(
            max_tokens=0,  # the budget needs the prompt's length: _tokenize sets it
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=tuple(req.stop),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (req.logit_bias or {}).items() if b)),
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens or 0,
            ignore_eos=bool(req.ignore_eos),
            logprobs=req.logprobs_asked,
            structured=structured if tools is None else tool_grammar,
        )
        if kind == "chat" and req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        cache_key = scope = query = None
        # Only greedy answers are reproducible, so only they are cached unless the client opts in.
        cache = self.args.cache
        # A cached answer has no log-probabilities: such a request always generates.
        cacheable = sampling.greedy or (cache.sampled_opt_in and ctx.cache_sampled)
        if cache.enabled and cacheable and sampling.logprobs is None:
            # The *requested* max_tokens: the same conversation always gets the same budget, and
            # the key is known before tokenizing, so a repeat never pays for the tokenizer.
            # Left to the server, the budget follows its configured default.
            default = f"default:{self.args.ingress.sampling.default_max_tokens}"
            budget = req.output_limit if req.output_limit is not None else default
            sampling_key = {"max_tokens": budget, "stop": list(sampling.stop), "top_p": sampling.top_p}
            if sampling.adjusts_logits:  # penalties, biases, min_tokens, ignore_eos change the answer
                sampling_key.update(
                    presence=sampling.presence_penalty, frequency=sampling.frequency_penalty,
                    repetition=sampling.repetition_penalty, bias=[list(b) for b in sampling.logit_bias],
                    min_tokens=sampling.min_tokens, ignore_eos=sampling.ignore_eos,
                )
            if structured is not None:
                sampling_key.update(structured=[structured.kind, structured.spec])
            if tools is not None:
                sampling_key.update(tools.key())
            if not sampling.greedy:
                sampling_key.update(temperature=sampling.temperature, seed=sampling.seed, top_k=sampling.top_k,
                                    min_p=sampling.min_p)
            model_key = f"{kind}:{req.model}"
            cache_key = exact_key(tenant=ctx.tenant, model=model_key, messages=turns, sampling=sampling_key)
            context, query = split_query(turns if kind == "chat" else [{"role": "prompt", "content": last_user}])
            if query is not None and query.strip() and len(query) <= cache.semantic.max_query_chars:
                scope = scope_key(tenant=ctx.tenant, model=model_key, context=context, sampling=sampling_key)
            else:
                query = None
        return Prepared(
            kind=kind,
            ctx=ctx,
            request=req,
            requested_model=req.model,
            sampling=sampling,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            features=RouteFeatures(req.model, 0, req.output_limit or 0, user_turns, last_user[-2000:]),
            cache_key=cache_key,
            scope=scope,
            query=query,
            tokenize=tokenize,
            tier=tier or self.admission.tier(ctx),
            mode=mode or self.args.admission.mode,
            chars=chars,
            system_text=system_text,
            tools=tools,
            grammar_param=grammar_param,
        )

    async def check_grammar(self, p: Prepared) -> None:
        """A 400 naming the field when the request's grammar does not compile, or not within
        `limits.grammar_timeout_s`. The conversion runs on the grammar threads, never on the event
        loop; a grammar that ran out of time is remembered and refused at once after that."""
        structured = p.sampling.structured
        if structured is None or p.grammar_param is None:
            return
        param = p.grammar_param
        budget = self.args.ingress.limits.grammar_timeout_s
        key = (p.ctx.tenant, structured)
        if key in self._converts:  # this tenant's grammar converted before: no thread hop
            self._converts.move_to_end(key)
            return
        if key in self._too_slow:
            raise _too_complex(param, budget)
        future = asyncio.get_running_loop().run_in_executor(self._grammar_threads, check, structured, p.ctx.tenant)
        try:
            await asyncio.wait_for(asyncio.shield(future), budget)
        except asyncio.TimeoutError:
            self._too_slow[key] = None
            while len(self._too_slow) > 1024:
                self._too_slow.popitem(last=False)
            raise _too_complex(param, budget) from None
        except GrammarError as exc:
            what = "a function's parameters do not compile: " if param == "tools" else ""
            raise bad_request(f"{param}: {what}{exc}", param) from None
        self._converts[key] = None
        while len(self._converts) > 1024:
            self._converts.popitem(last=False)

    def tokenize(self, p: Prepared) -> Prepared:
        """`p` with its prompt ids and output budget; 400 when the prompt is empty or can't fit."""
        builder = self.prompts[p.requested_model]
        prompt_ids, tokenize, notes = p.tokenize(builder), p.tokenize, list(p.notes)
        if not prompt_ids:
            raise bad_request("the prompt is empty", "messages" if p.kind == "chat" else "prompt")
        budget = p.tier.max_input_tokens
        if budget is not None and len(prompt_ids) > budget:
            kept, dropped, tokens = self._trim(p, builder, budget, len(prompt_ids))
            tokenize = lambda b: b.chat(kept, p.tools)  # noqa: E731  (a routed model re-tokenizes the trimmed turns)
            notes.append(("x-context-trimmed", f"dropped_messages={dropped}; tokens={len(prompt_ids)}->{tokens}; "
                                               f"tier={p.ctx.tier}"))
            prompt_ids = tokenize(builder)
        vocab = len(builder.tokenizer)
        outside = [t for t, _ in p.sampling.logit_bias if t >= vocab]
        if outside:
            raise bad_request(f"logit_bias: token {outside[0]} is outside this model's vocabulary of {vocab}", "logit_bias")
        max_tokens = self._output_budget(p.request, len(prompt_ids))
        if p.sampling.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({p.sampling.min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens")
        cap = p.tier.max_output_tokens
        if cap is not None and max_tokens > cap:
            notes.append(("x-max-tokens-clamped", f"{max_tokens}->{cap}; tier={p.ctx.tier}"))
            max_tokens = cap
        # The router judges the conversation: a system prompt seen before is an app's standing
        # instructions (and a prefix the engines keep), not a sign of a hard request.
        system = self.standing.tokens(
            p.ctx.tenant, p.system_text, lambda text: len(builder.tokenizer.encode(text, add_special_tokens=False))
        ) if p.system_text else 0
        return dataclasses.replace(
            p, prompt_ids=prompt_ids, tokenize=tokenize, notes=tuple(notes),
            sampling=dataclasses.replace(p.sampling, max_tokens=max_tokens),
            features=dataclasses.replace(p.features, prompt_tokens=max(0, len(prompt_ids) - system)),
        )

    def _trim(self, p: Prepared, builder: PromptBuilder, budget: int, tokens: int) -> tuple[list[Any], int, int]:
        """Over the tier's input budget: the conversation without its oldest turns (never the
        system prompt or the last message), how many it dropped and its tokens; a prompt that
        can't be trimmed to fit is a 400."""
        req = p.request
        fitted = None
        if isinstance(req, ChatCompletionRequest):
            fitted = trim_conversation(
                req.messages, lambda m: m.role, builder.message_tokens(req.messages),
                lambda ms: len(builder.chat(ms, p.tools)),
                budget, tokens,
            )
        if fitted is None:
            raise bad_request(
                f"the {p.ctx.tier!r} tier allows {budget} input tokens and "
                + ("the system prompt plus the last message alone are" if p.kind == "chat" else "the prompt is")
                + f" over it ({tokens} tokens in all; the model's context window is "
                f"{self.max_model_len[p.requested_model]})",
                "messages" if p.kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        return fitted

    def _output_budget(self, req: ChatCompletionRequest | CompletionRequest, prompt_tokens: int) -> int:
        window = self.max_model_len[req.model]
        if prompt_tokens >= window:
            raise bad_request(
                f"this model's context window is {window} tokens and the prompt has {prompt_tokens}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                "context_length_exceeded",
            )
        asked = req.output_limit
        if asked is None:
            return min(self.args.ingress.sampling.default_max_tokens, window - prompt_tokens)
        if prompt_tokens + asked > window:
            raise bad_request(
                f"this model's context window is {window} tokens; you asked for {prompt_tokens + asked} "
                f"({prompt_tokens} in the prompt, {asked} in the completion)",
                "max_tokens",
                "context_length_exceeded",
            )
        return asked


def _turn(m: Any) -> dict[str, Any]:
    """A message as the cache key sees it: everything in it that changes the answer."""
    turn: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        turn["name"] = m.name
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.get("id"), "name": c["function"]["name"], "arguments": c["function"].get("arguments")}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _validate(schema: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or None
        raise bad_request(f"{where}: {first['msg']}" if where else first["msg"], where) from None


def _check_sizes(req: ChatCompletionRequest | CompletionRequest, limits: InputLimits) -> int:
    """400s for what validation alone lets through: a prompt too long to tokenize cheaply, a
    stop sequence whose hold-back would cost a decode of its length on every token."""
    if isinstance(req, ChatCompletionRequest):
        chars, param = sum(len(m.text()) for m in req.messages), "messages"
        if req.tools:
            tool_chars = len(json.dumps(req.tools))
            if tool_chars > limits.max_tools_chars:
                raise bad_request(
                    f"tools: {tool_chars} characters of definitions; this server takes at most "
                    f"{limits.max_tools_chars} per request", "tools", "tools_too_long",
                )
            chars += tool_chars  # the tools are rendered into the prompt: tokenized with it
    elif isinstance(req.prompt, str):
        chars, param = len(req.prompt), "prompt"
    else:
        chars, param = sum(len(p) if isinstance(p, (str, list)) else 1 for p in req.prompt), "prompt"
    if chars > limits.max_prompt_chars:
        raise bad_request(
            f"{param}: {chars} characters; this server takes at most {limits.max_prompt_chars} per request",
            param, "prompt_too_long",
        )
    if any(len(s) > limits.max_stop_chars for s in req.stop):
        raise bad_request(f"stop: each stop sequence may have at most {limits.max_stop_chars} characters", "stop")
    return chars


def grammar_cost(structured: StructuredOutput | None) -> int:
    """Tokens a grammar's conversion is charged as: its spec's length, as a prompt of that text."""
    return 0 if structured is None else len(structured.spec) // 4


def _too_complex(param: str, budget: float) -> APIError:
    return bad_request(
        f"{param}: the grammar does not compile within {budget:g} s; simplify it (fewer nested or "
        "repeated parts)", param, "grammar_too_complex",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")

