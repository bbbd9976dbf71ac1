"""Structured output on the HTTP side: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` as the front door's ``StructuredOutput``, refused with a 400 naming the
field as the client spelled it when malformed or when the engine cannot compile it.

- ``response_format: {"type": "json_object"}``: any JSON object.
- ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: JSON
  valid against ``schema`` (``strict`` is accepted; the answer always follows the schema).
- ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}`` (vLLM, for
  completions and chat; ``json`` is a schema object or its JSON text; ``grammar`` is GBNF or Lark).

JSON answers are compact (no whitespace between tokens), as with vLLM's
``disable_any_whitespace``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from messages.common import StructuredOutput
from tokenizer_svc.http.errors import ApiError, invalid
from tokenizer_svc.requests import Invalid, check_structured


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class StructuredOutputsIn(BaseModel):
    """vLLM's ``structured_outputs`` (its other options are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


_SO_FIELDS = {  # StructuredOutput's field -> the HTTP spelling under structured_outputs
    "json_schema": "structured_outputs.json",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


def structured_of(req: Any, model: Any) -> StructuredOutput | None:
    """The request's constraint (None: free text); raises ApiError(400) naming the field."""
    fmt = req.response_format
    so = req.structured_outputs
    kind = fmt.type if fmt is not None else "text"
    if kind != "text" and so is not None:
        raise invalid(
            "response_format", "response_format: cannot be combined with structured_outputs"
        )
    if kind == "text":
        if so is None:
            return None
        return _checked(_from_vllm(so), model, _SO_FIELDS, "structured_outputs")
    if kind == "json_object":
        return _checked(StructuredOutput(json_object=True), model, {}, "response_format")
    if kind == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise invalid(
                "response_format.json_schema.schema",
                "response_format.json_schema.schema: required for type 'json_schema'",
            )
        fields = {"json_schema": "response_format.json_schema.schema"}
        return _checked(
            StructuredOutput(json_schema=spec.schema_), model, fields, "response_format"
        )
    raise invalid(
        "response_format.type",
        f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
    )


def _from_vllm(so: StructuredOutputsIn) -> StructuredOutput:
    schema = so.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise invalid(
                "structured_outputs.json", f"structured_outputs.json: not JSON: {e}"
            ) from None
        if not isinstance(schema, dict):
            raise invalid(
                "structured_outputs.json", "structured_outputs.json: must be a JSON object"
            )
    return StructuredOutput(
        json_schema=schema,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
    )


def _checked(
    s: StructuredOutput, model: Any, fields: dict[str, str], whole: str
) -> StructuredOutput:
    try:
        check_structured(s, model.tokenizer, model.vocab_size)
    except Invalid as e:
        sub = e.field.removeprefix("params.structured").lstrip(".")
        param = fields.get(sub.split(".")[0], whole) if sub else whole
        if sub == "whitespace":
            param = whole
        message = e.reason
        if whole == "structured_outputs" and not sub:
            message = "exactly one of json, regex, choice, grammar, json_object must be set"
        raise ApiError(400, f"{param}: {message}", param=param) from None
    return s
