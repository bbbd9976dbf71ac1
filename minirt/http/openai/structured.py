"""Structured output on the HTTP side: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` as the front door's ``StructuredOutput``, refused with a 400 naming the
field as the client spelled it when malformed here, or when the front door's grammar engine
cannot compile it (its refusal names ``params.structured.<kind>``; ``Spelling`` maps that back).

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
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from messages.common import StructuredOutput
from minirt.http.errors import invalid


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


@dataclass
class Spelling:
    """How the client spelled the constraint: the front door's field (``structured.<kind>``)
    to the HTTP parameter, and the parameter for the constraint as a whole."""

    fields: dict[str, str] = field(default_factory=dict)
    whole: str = "response_format"
    # other front-door fields as the client spelled them: (regex, replacement), applied in turn
    renames: list[tuple[str, str]] = field(default_factory=list)

    def rename(self, front_door_field: str) -> str:
        out = front_door_field
        for pattern, repl in self.renames:
            out = re.sub(pattern, repl, out)
        return out

    def param(self, front_door_field: str) -> str:
        sub = front_door_field.removeprefix("params.structured").lstrip(".")
        if not sub or sub == "whitespace":
            return self.whole
        return self.fields.get(sub.split(".")[0], self.whole)


def structured_of(req: Any, spelling: Spelling) -> StructuredOutput | None:
    """The request's constraint (None: free text); raises ApiError(400) naming the field when
    it is malformed. Whether it compiles is the front door's to say; ``spelling`` learns how
    to name its fields in that answer."""
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
        spelling.fields, spelling.whole = _SO_FIELDS, "structured_outputs"
        out = _from_vllm(so)
        if len(out.kinds()) != 1:
            raise invalid(
                "structured_outputs",
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                "must be set",
            )
        return out
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise invalid(
                "response_format.json_schema.schema",
                "response_format.json_schema.schema: required for type 'json_schema'",
            )
        spelling.fields = {"json_schema": "response_format.json_schema.schema"}
        return StructuredOutput(json_schema=spec.schema_)
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
