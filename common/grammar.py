"""OpenAI `response_format` -> an llguidance grammar, and checking one before it is used.

Shared by the frontend (which turns a bad format into a 400 before anything reaches a
worker) and the worker (which compiles the grammar into a per-request matcher, see
worker/constraint.py). A grammar travels between them as llguidance's own string form:
either its serialized JSON (`{"grammars": [...]}`, what `LLMatcher.grammar_from_*`
return) or a Lark text with `%json {...}` rules (what frontend/tools.py builds for forced
tool calls); `llguidance.LLMatcher` accepts both.

Where the errors go:
  * a malformed `response_format` envelope (not an object, unknown `type`, no
    `json_schema.schema`, a schema that is not a JSON object, ...) raises `ValueError`
    from `grammar_for_response_format`;
  * a well-formed schema that llguidance cannot honour (unknown `type`, a keyword with a
    value of the wrong kind, a dangling `$ref`, a regex with look-around, ...) is reported
    by `validate_grammar`, which returns the message instead of raising.
The frontend answers 400 for both.

llguidance is imported inside the functions: it costs ~70 ms to import, which the
frontend's start-up (and every tool that imports pantheon.common) need not pay.
"""
from __future__ import annotations

import json

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def grammar_for_json_schema(schema: dict) -> str:
    """The grammar for JSON text matching `schema` (not yet checked: see validate_grammar).

    llguidance's defaults are kept: flexible whitespace between JSON tokens (small chat
    models write pretty-printed JSON far more fluently than the compact form, which in
    our tests made SmolLM2 loop) and, as JSON Schema says, extra properties allowed unless
    the schema sets `additionalProperties: false`."""
    from llguidance import LLMatcher
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as exc:  # e.g. values json cannot serialize
        raise ValueError(f"cannot read the JSON schema: {exc}") from None


def grammar_for_response_format(response_format: dict) -> str | None:
    """The grammar for an OpenAI `response_format`, or None when the output is free text.

    `{"type": "text"}` -> None; `{"type": "json_object"}` -> any JSON object;
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
    -> JSON matching that schema. The schema is enforced whether or not `strict` is set:
    constrained decoding costs nothing extra, and a non-strict reply that ignores the
    schema helps nobody. Raises ValueError for a malformed `response_format`."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got "
                         f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_for_json_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        name, strict = spec.get("name"), spec.get("strict")
        if name is not None and not isinstance(name, str):
            raise ValueError("response_format.json_schema.name must be a string")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        if "schema" not in spec:
            raise ValueError("response_format.json_schema.schema is required")
        schema = spec["schema"]
        if not isinstance(schema, dict):
            raise ValueError(f"response_format.json_schema.schema must be a JSON object, got "
                             f"{type(schema).__name__}")
        return grammar_for_json_schema(schema)
    raise ValueError(f"response_format.type must be one of "
                     f"{', '.join(map(repr, RESPONSE_FORMAT_TYPES))}, got {json.dumps(kind)}")


def validate_grammar(grammar: str) -> str | None:
    """None when llguidance can compile `grammar`, else a message fit for a 400 reply.

    Compiles without a tokenizer, so the frontend can check a request before it is
    queued; the worker compiles again against the model's vocabulary (ConstraintFactory),
    which for a grammar that passed here only fails on resource limits."""
    from llguidance import LLMatcher
    if not isinstance(grammar, str):
        return f"a grammar must be a string, got {type(grammar).__name__}"
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # llguidance raises only on API misuse; never crash a request
        return f"grammar check failed: {exc}"
    if not is_error:
        return None
    return (messages[0] if messages else "invalid grammar").strip()
