"""A request's structured-output fields as one grammar: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `guided_json` / `guided_regex` / `guided_choice`.
The model then cannot produce anything else (engines/grammar.py).

Reading the fields is cheap and runs inline; converting the grammar is not, and runs on the
ingress's grammar thread under a time budget (`Preparer.check_grammar`)."""

from __future__ import annotations

import json
from typing import Any

from engines.grammar import MAX_SPEC_DEPTH, GrammarError, check_depth
from engines.types import StructuredOutput
from ingress.errors import bad_request

MAX_SPEC_CHARS = 65_536  # a schema or regex past this is refused before it is compiled


def structured_output(req: Any) -> tuple[str, StructuredOutput] | None:
    """(the field that asked, the grammar), or None. A 400 naming the field for a spec that is
    malformed, too long or nested deeper than MAX_SPEC_DEPTH; whether it compiles is checked later."""
    asked: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format or {}
    kind = fmt.get("type")
    if kind == "json_object":
        asked.append(("response_format", StructuredOutput("json")))
    elif kind == "json_schema":
        block = fmt.get("json_schema")
        schema = block.get("schema") if isinstance(block, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema: a JSON schema object is required",
                              "response_format")
        asked.append(("response_format", _schema(schema, "response_format")))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise bad_request(f"guided_json: over {MAX_SPEC_CHARS} characters", "guided_json")
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise bad_request(f"guided_json: nests deeper than {MAX_SPEC_DEPTH} levels", "guided_json") from None
            except ValueError:
                raise bad_request("guided_json: not valid JSON", "guided_json") from None
        if not isinstance(schema, dict):
            raise bad_request("guided_json: a JSON schema object is required", "guided_json")
        asked.append(("guided_json", _schema(schema, "guided_json")))
    if req.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutput("regex", req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutput("choice", json.dumps(req.guided_choice))))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"ask for one structured output at a time, not {names}", asked[1][0])
    param, structured = asked[0]
    if len(structured.spec) > MAX_SPEC_CHARS:
        raise bad_request(f"{param}: over {MAX_SPEC_CHARS} characters", param)
    return param, structured


def _schema(schema: dict[str, Any], param: str) -> StructuredOutput:
    """A schema as a grammar's spec: its depth checked before anything recurses into it."""
    try:
        check_depth(schema, param)
    except GrammarError as exc:
        raise bad_request(str(exc), param) from None
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True))
