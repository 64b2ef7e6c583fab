"""Request bodies of the OpenAI-compatible API (pydantic lives only at this edge).

Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working;
known fields are validated strictly enough that a malformed value is a 400 naming the field.
Features we do not implement (``n > 1``, tools, logprobs) are rejected rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

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
    n: Annotated[int, Field(ge=1)] = 1
    user: StrictStr | None = None
    logprobs: StrictBool | int | None = None

    # NOTE: field validators, so the 400's ``param`` names the unsupported field.
    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("n > 1 is not supported (one choice per request)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``workflow``, ``topk`` and ``nprobe`` are extensions.

    The workflow's question is the last user message; the messages before it (``history()``)
    go to the answer node (and to nodes with ``with_history``) through the chat template;
    ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` apply to its answer nodes.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    workflow: StrictStr | None = None
    topk: Annotated[int, Field(ge=1, le=1000)] | None = None
    nprobe: PositiveInt | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, value):
        if value and value != "none":
            raise ValueError("tools are not supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value):
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value is not None and value.get("type", "text") != "text":
            raise ValueError(f"only type 'text' is supported, not {value.get('type')!r}")
        return value

    @field_validator("messages")
    @classmethod
    def _no_tool_messages(cls, value):
        for i, message in enumerate(value):
            if message.role == "tool":
                raise ValueError(f"messages[{i}]: role 'tool' is not supported (no tools)")
        return value

    @model_validator(mode="after")
    def _check(self):
        if not any(m.role == "user" and m.text().strip() for m in self.messages):
            raise ValueError("messages must contain a non-empty user message")
        return self

    def _question_index(self) -> int:
        for i in range(len(self.messages) - 1, -1, -1):
            message = self.messages[i]
            if message.role == "user" and message.text().strip():
                return i
        raise AssertionError("validated above")

    def question(self) -> str:
        """The RAG question: the last non-empty user message."""
        return self.messages[self._question_index()].text()

    def history(self) -> tuple[tuple[str, str], ...]:
        """``(role, content)`` of the messages before the question (system message, earlier
        turns), for the workflow's answer node (``developer`` is sent as ``system``)."""
        before = self.messages[: self._question_index()]
        return tuple(
            ("system" if m.role == "developer" else m.role, m.text())
            for m in before
            if m.text() or m.role != "assistant"
        )

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


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: vectors of the index's embedder (document side)."""

    model: StrictStr
    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, value):
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            if value == "" or (isinstance(value, list) and any(not v for v in value)):
                raise ValueError("input texts must be non-empty")
            return value
        raise ValueError("input must be a string or a list of strings (token ids unsupported)")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
