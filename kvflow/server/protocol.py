"""Request bodies of the OpenAI-compatible API (pydantic), and the error object.

Types are strict: `"max_tokens": "16"` is a 400, not a silent coercion. Unknown fields are
ignored (OpenAI clients send fields kvflow does not use); fields kvflow knows but does not
implement are rejected when they ask for something other than the default (e.g. n=2). Integers
must fit in int64 and numbers must be finite (as vLLM's bounds), so no huge or infinite value
reaches torch.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# int64, like torch tensors and generators: a larger value is a 400, not an overflow in the engine.
Int = Annotated[StrictInt, Field(ge=-2**63, le=2**63 - 1)]
# A seed may also be unsigned 64-bit: torch.Generator.manual_seed takes [-2**63, 2**64).
Seed = Annotated[StrictInt, Field(ge=-2**63, le=2**64 - 1)]
# Strict, but ints are accepted (and become floats); Infinity/NaN/1e999 are 400s.
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]
TokenIds = list[Int]


def printable(text: str) -> str:
    """text with lone surrogates as \\udxxx escapes: always encodable as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None) -> None:
        super().__init__(message)
        message, param = printable(message), param if param is None else printable(param)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    max_tokens: Int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int | None = None
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Int] | None = None
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: Int = 0
    ignore_eos: StrictBool = False
    min_tokens: Int = 0
    user: StrictStr | None = None
    request_id: StrictStr | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    min_p: Number | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[Int] | None = None
    prompt_logprobs: Int | None = None      # vLLM's extra: logprobs of the prompt's tokens
    best_of: Int | None = None
    # vLLM's and OpenAI's fields that change the output; kvflow does not implement them yet, so
    # they are declared (not dropped as unknown) and refused unless neutral (UNSUPPORTED).
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    response_format: Any = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Int | None = None         # top logprobs per token (the chosen one's always)
    echo: StrictBool = False            # the prompt before the completion (and its logprobs)
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: StrictStr
    content: StrictStr | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    add_generation_prompt: StrictBool = True
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    echo: StrictBool = False            # vLLM's: repeat the last message; not implemented
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    tokens: TokenIds


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (declared in the OpenAPI document)."""
    error: ErrorInfo


# Field -> the values that ask for nothing (None always does); anything else is a 400.
UNSUPPORTED = {
    "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "truncate_prompt_tokens": (), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "return_tokens_as_token_ids": (False,),
}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


