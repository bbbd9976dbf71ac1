"""The body of ``POST /v1/messages`` (Anthropic's Messages API), validated by pydantic. Unknown
fields are ignored, as for the other endpoints; fields Anthropic defines that change nothing
here (``metadata``, ``service_tier``, ``thinking``) are accepted and not acted on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minirt.http.openai.schemas import MAX_TOOLS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Body):
    """A content block: ``text``; an assistant's ``tool_use`` (``id``, ``name``, ``input``); a
    user's ``tool_result`` (``tool_use_id``, ``content``: text or text blocks)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
