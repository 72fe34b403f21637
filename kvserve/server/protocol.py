"""Request and response models of the OpenAI-compatible API (names and defaults as in vLLM).

Request models are strict about the fields they know, and their constraints mirror
`SamplingParams`, so `/openapi.json` tells the truth about what is accepted. Fields they
do not know are kept aside (`extra="allow"`, as vLLM does), for the server to ignore or,
under `--strict-fields`, refuse (`unknown_fields`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from kvserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams


def _whole_number(value: object) -> object:
    """JSON Schema's integers include 2.0: take it as 2 (a strict pydantic int would refuse it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _unicode(value: str) -> str:
    """JSON may escape lone surrogates, which no tokenizer (or UTF-8) takes."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ValueError("must be valid Unicode: it has a lone surrogate") from e
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]
Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyStr = Annotated[Text, Field(min_length=1)]
TokenId = Annotated[Int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Number = Annotated[float, Field(allow_inf_nan=False)]


# vLLM's defaults: yes for a text prompt, no for chat messages, whose template writes its own
AddSpecialTokens = Annotated[
    bool, Field(description="the tokenizer's special tokens (a <bos>) around the prompt: text yes, chat no")
]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def unknown_fields(model: BaseModel, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Paths of the fields a request had that its models do not know, nested ones too."""
    found = [(*path, name) for name in model.model_extra or ()]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                found += unknown_fields(item, (*path, name) if i is None else (*path, name, i))
    return found


# --- errors ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- shared request fields ---------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields every generation request shares; None means the default."""

    model: Text | None = Field(None, description="must be the served model name; default: that model")
    n: Annotated[Int, Field(ge=1)] = 1
    temperature: Annotated[Number, Field(ge=0)] | None = Field(None, description="default 1.0")
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = Field(None, description="default 1.0")
    top_k: Annotated[Int, Field(ge=-1)] | None = Field(None, description="-1 or 0: all tokens")
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    seed: Annotated[Int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: NonEmptyStr | None = Field(
        None, description="splits the caller's prefix cache further; never shares it with another tenant"
    )
    use_beam_search: bool = Field(False, description="beam search with n beams; the n best are the choices (vLLM's)")
    length_penalty: Number = Field(1.0, description="beam search: a finished beam scores logprob sum / len ** this")
    early_stopping: bool | Literal["never"] = Field(
        False, description='beam search: true, false or "never", as in transformers'
    )
    return_token_ids: bool = Field(
        False, description="vLLM's: the prompt's token ids and each choice's generated ids beside the text"
    )
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description="vLLM's prefill/decode handoff: {do_remote_decode: true} to a prefill replica; its answer's "
        "kv_transfer_params (do_remote_prefill, remote_host, ...) to a decode replica",
    )

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @model_validator(mode="after")
    def _beam_search_takes_no_sampling_fields(self) -> SamplingRequest:
        if not self.use_beam_search:
            return self
        if self.stream:
            raise ValueError("stream is not supported with use_beam_search: beams change until the search ends")
        for name, neutral in _NOT_FOR_BEAM_SEARCH.items():
            if not _is_one_of(getattr(self, name, None), neutral):
                raise ValueError(f"{name} is not supported with use_beam_search (it picks beams by logprob sums)")
        return self

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )

    def sampling_fields(self) -> dict[str, Any]:
        """The fields SamplingParams shares with every request, where set (max_tokens, logprobs differ)."""
        names = {f.name for f in dataclasses.fields(SamplingParams) if f.init} & set(SamplingRequest.model_fields)
        return {k: v for k in names if (v := getattr(self, k)) is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# the values of sampling fields that leave beam search as it is (unset, or their no-op)
_NOT_FOR_BEAM_SEARCH: dict[str, tuple[object, ...]] = {
    "temperature": (None, 0),
    "top_p": (None, 1),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "seed": (None,),
    "min_tokens": (0,),
    "stop": (None, []),
    "logprobs": (None, False),  # completions: a count; chat: a flag
}


def _is_one_of(value: object, allowed: tuple[object, ...]) -> bool:
    """Equal to one of `allowed`, where a boolean equals only a boolean (logprobs 0 is not false)."""
    return any(value is a or (not isinstance(value, bool) and not isinstance(a, bool) and value == a) for a in allowed)


class TokenIdsResponse(BaseModel):
    """A response part with vLLM's `return_token_ids` fields: left out unless asked (None), as vLLM does."""

    @model_serializer(mode="wrap")
    def _leave_out_unasked_ids(self, handler: SerializerFunctionWrapHandler):  # unannotated: keeps the schema
        data = handler(self)
        for name in ("prompt_token_ids", "token_ids", "kv_transfer_params"):
            if name in data and data[name] is None:
                del data[name]
        return data


# --- completions ------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: (
        NonEmptyStr
        | TokenIds
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="a string, token ids, or a list of either (one set of choices per prompt)")
    max_tokens: Annotated[Int, Field(ge=0)] | None = Field(
        16, description="null: up to the context length; 0 (with echo): the prompt's logprobs alone"
    )
    echo: bool = Field(False, description="the prompt's text first; with logprobs, its tokens' logprobs too")
    add_special_tokens: AddSpecialTokens = True
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and (not self.echo or self.use_beam_search):
            raise ValueError("max_tokens must be >= 1, or 0 with echo (and no use_beam_search), got 0")
        return self

    @property
    def echo_without_generation(self) -> bool:
        """What lm-evaluation-harness asks for a loglikelihood: the prompt scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        # as vLLM: echo without generation still samples one token, which the response leaves out
        return SamplingParams(
            max_tokens=1 if max_tokens == 0 else max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            **self.sampling_fields(),
        )


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(TokenIdsResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids; streamed: in a choice's first chunk only
    token_ids: list[int] | None = None  # return_token_ids; streamed: the tokens generated since the last chunk


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo = Field(default_factory=PromptTokenUsageInfo)


class CompletionResponse(TokenIdsResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill replica's do_remote_prefill answer


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# --- chat completions ----------------------------------------------------------------------------


class ChatCompletionContentPartText(RequestModel):
    type: Literal["text"]
    text: Text


class ChatCompletionMessageParam(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ChatCompletionContentPartText]
    name: Text | None = None

    def to_template(self) -> dict[str, str]:
        """A message as the chat template takes it (text parts joined by newlines, as in vLLM)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="default: up to the context length"
    )
    max_tokens: Annotated[Int, Field(ge=1)] | None = Field(None, description="deprecated: max_completion_tokens")
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_special_tokens: AddSpecialTokens = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self.sampling_fields())


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(TokenIdsResponse):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(TokenIdsResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids (chat: here, not in the choices)
    kv_transfer_params: dict[str, Any] | None = None  # a prefill replica's do_remote_prefill answer


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens generated since the last chunk


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk (the role's) only


# --- models, tokenizer, version -------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: AddSpecialTokens = True


class TokenizeChatRequest(RequestModel):
    model: Text | None = None
    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    add_special_tokens: AddSpecialTokens = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: str


class LoadResponse(BaseModel):
    """The three gauges a router weighs, as /metrics reports them, without rendering every metric."""

    num_requests_running: int = Field(description="sequences running on the engine")
    num_requests_waiting: int = Field(description="requests waiting to be scheduled")
    kv_cache_usage_perc: float = Field(description="KV cache usage: 1 means 100 percent")


class KVEventsInfoResponse(BaseModel):
    endpoint: str = Field(description="ZMQ PUB address to connect a SUB socket to")
    replay_endpoint: str | None = Field(description="ZMQ ROUTER address that resends batches from a sequence number")
    topic: str
    token_ids: bool = Field(description="whether BlockStored events carry token ids")


class ServerInfoResponse(BaseModel):
    """What a router needs to route to this replica by its cache: no secret in it."""

    kvserve_version: str
    model: str = Field(description="as configured: a short name, a directory or a .gguf file")
    served_model_name: str
    tokenizer_dir: str = Field(description="absolute path of the checkpoint directory the tokenizer was loaded from")
    block_size: int
    num_kv_blocks: int
    kv_capacity_tokens: int
    kv_cache_dtype: str = Field(description="how K/V are stored: float32, bfloat16 or int8")
    kv_bytes_per_token: int = Field(description="K and V of every layer for one token, as stored")
    max_model_len: int
    kv_events: KVEventsInfoResponse | None
    kv_tiers: list[str] = Field(description="the tiers below the device pool, in order")
    api_keys_required: bool
    role: str = Field("both", description="prefill/decode disaggregation: prefill, decode or both")
    kv_transfer_endpoint: str | None = Field(
        None, description="where a decode replica pulls this prefill replica's blocks (POST, HMAC-authenticated)"
    )
