"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), validated by pydantic.

Unknown fields are ignored (``extra="ignore"``), as for the other endpoints. ``input`` is a string
or a list of items; each item is checked by ``responses_convert`` against the model of its
``type`` (``ITEMS``), so an error names it as ``input[2].call_id``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minirt.http.openai.schemas import MAX_TOOLS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextPart(_Body):
    """A content part: ``input_text`` / ``output_text`` (messages), ``reasoning_text``."""

    type: str
    text: str | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    content: list[TextPart] | None = None  # reasoning_text parts: carried on
    summary: list[Any] | None = None  # accepted, not used


ITEMS: dict[str, type[_Body]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Body):
    type: Literal["function"]  # other tool kinds (web_search, file_search, ...) are refused
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedFunction


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Any]  # items are checked one by one (responses_convert)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted, not used
    # vLLM's extensions, passed on to the chat request
    seed: int | None = Field(None, ge=0, lt=2**63)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
