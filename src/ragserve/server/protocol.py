"""Request bodies of the OpenAI-compatible API (pydantic lives only at this edge).

Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working;
known fields are validated strictly enough that a malformed value is a 400 naming the field.
Features we do not implement (``n > 1``, tools, logprobs) are rejected rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

PositiveInt = Annotated[int, Field(ge=1)]
StopStr = Annotated[StrictStr, Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _one_clear_error(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            return value
        raise ValueError('content must be a string or a list of {"type": "text", "text": ...}')

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: StrictStr | None = None
    logprobs: StrictBool | int | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``workflow``, ``topk``, ``nprobe``, ``mode`` and ``filter``
    (retrieval mode and metadata filter, as ``VectorIndex.search_text``) are extensions.

    The workflow's question is the last user message (earlier turns are not used);
    ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` apply to its answer nodes.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    workflow: StrictStr | None = None
    topk: Annotated[int, Field(ge=1, le=1000)] | None = None
    nprobe: PositiveInt | None = None
    mode: Literal["dense", "bm25", "hybrid"] | None = None
    filter: dict[str, Any] | None = None
    tools: list | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.tools:
            raise ValueError("tools are not supported")
        if self.filter is not None:
            from ragserve.retrieval.filters import validate_filter

            validate_filter(self.filter)
        if not any(m.role == "user" and m.text().strip() for m in self.messages):
            raise ValueError("messages must contain a non-empty user message")
        return self

    def question(self) -> str:
        """The RAG question: the last non-empty user message."""
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise AssertionError("validated above")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a plain LLM completion, no retrieval."""

    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
    )
    max_tokens: PositiveInt = 16
    echo: StrictBool = False
    ignore_eos: StrictBool = False
    top_k: PositiveInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_clear_error(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return value
        if (
            isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value)  # noqa: E721 (bool is not a token)
        ):
            return value
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")

    @model_validator(mode="after")
    def _check(self):
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def prompt_input(self) -> str | list[int]:
        """The prompt text, or its token ids when the client sent ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else list(self.prompt)


class DocumentIn(_Body):
    id: Annotated[str, Field(min_length=1, max_length=512)]
    text: Annotated[str, Field(min_length=1)]
    title: StrictStr | None = None
    metadata: dict = Field(default_factory=dict)


class DocumentsRequest(_Body):
    """``POST /v1/documents``: upsert; acknowledged (200) means persisted."""

    documents: Annotated[list[DocumentIn], Field(min_length=1, max_length=10_000)]
