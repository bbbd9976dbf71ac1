"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Fields are spelled as OpenAI (and vLLM, for its extensions) spell them. Unknown fields are accepted
and ignored (``extra="ignore"``), as OpenAI-compatible servers do: clients routinely send fields
such as ``best_of: 1`` or ``stop: null``. A field OpenAI or vLLM defines that this server does not
implement is refused (400 naming it) unless it asks for what the server does anyway
(``NOT_IMPLEMENTED``): a client that relies on it must not get a 200 that ignored it. Range checks live here so an error names the field by
its HTTP name (``temperature``, ``messages[1].content``); what pydantic cannot express (a value
that depends on the model, a combination of fields) is checked in ``convert``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minirt.http.openai.structured import JsonSchemaFormat, StructuredOutputsIn

MAX_N = 64
MAX_LOGPROBS = 20
MAX_TOOLS = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Body):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None  # type "json_schema" (see http/structured.py)


# OpenAI's and vLLM's request fields this server does not implement: name -> (the values that
# ask for nothing this server does not do anyway, why it is refused otherwise)
NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), "beam search is not implemented (sample n choices instead)"),
    "length_penalty": ((None, 1, 1.0), "a beam search setting; beam search is not implemented"),
    "early_stopping": ((None, False), "a beam search setting; beam search is not implemented"),
    "truncate_prompt_tokens": ((None,), "not implemented: the prompt is never truncated"),
    "include_stop_str_in_output": ((None, False), "not implemented"),
    "skip_special_tokens": ((None, True), "not implemented: special tokens are always skipped"),
    "spaces_between_special_tokens": ((None, True), "not implemented"),
    "logits_processors": ((None, []), "custom logits processors are not implemented"),
    "return_tokens_as_token_ids": ((None, False), "not implemented"),
    "guided_json": ((None,), "use response_format or structured_outputs"),
    "guided_regex": ((None,), "use structured_outputs.regex"),
    "guided_choice": ((None,), "use structured_outputs.choice"),
    "guided_grammar": ((None,), "use structured_outputs.grammar"),
    "guided_decoding_backend": ((None,), "use structured_outputs"),
    "guided_whitespace_pattern": ((None,), "not implemented"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not implemented"),
    "mm_processor_kwargs": ((None,), "multimodal inputs are not implemented"),
    "vllm_xargs": ((None,), "not implemented"),
    "store": ((None, False), "stored completions are not implemented"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "only text output is implemented"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "reasoning_effort": ((None,), "not implemented: the model's template decides"),
    "functions": ((None,), "deprecated by OpenAI: use tools"),
    "function_call": ((None,), "deprecated by OpenAI: use tool_choice"),
}
CHAT_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((None, False), "not implemented for chat"),
    "add_generation_prompt": ((None, True), "not implemented: the prompt always ends open"),
    "continue_final_message": ((None, False), "not implemented"),
    "add_special_tokens": ((None, False), "not implemented for chat"),
    "documents": ((None,), "not implemented"),
    "chat_template": ((None,), "the model's own chat template is used"),
}


def refused_fields(req: BaseModel, table: dict[str, tuple[tuple[Any, ...], str]]) -> list[str]:
    """The fields of ``table`` that ``req`` sets to something this server does not do."""
    extra = req.model_extra or {}
    return [k for k, (ok, _) in table.items() if k in extra and extra[k] not in ok]


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")  # read for NOT_IMPLEMENTED, otherwise ignored

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # 0 and -1 (vLLM's spelling) both turn it off
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: KV sharing scope
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None  # vLLM's extension
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt scored, nothing more
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (if any) before a text prompt


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCallIn(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's field)


class FunctionIn(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (none: no arguments)
    strict: bool | None = None


class ToolIn(_Body):
    type: Literal["function"] = "function"
    function: FunctionIn


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}


class EmbeddingRequest(_Body):
    """OpenAI's embeddings request, with vLLM's ``add_special_tokens`` and ``normalize``."""

    model_config = ConfigDict(extra="allow")  # read for EMBED_NOT_IMPLEMENTED, otherwise ignored

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: --pooler-config's
    priority: int = 0


EMBED_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncate_prompt_tokens": ((None,), "not implemented: the input is never truncated"),
    "use_activation": ((None,), "not implemented (no activation after pooling)"),
}


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` (its ``lora_int_id`` is ignored)."""

    lora_name: str


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
