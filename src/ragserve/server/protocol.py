"""Request bodies of the OpenAI-compatible API (pydantic lives only at this edge).

Unknown fields are ignored, as OpenAI's; a malformed known field is a 400 naming it: numbers
are strict (``"10"`` and ``true`` are not), floats finite, sampling ranges the engine's, every
string valid Unicode, no list or string unbounded. Unimplemented features (``n > 1``, tools,
logprobs) are rejected rather than ignored; documents follow ``ragserve.retrieval.limits``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from ragserve.graph.checks import MAX_SEED, check_sampling
from ragserve.retrieval.limits import DEFAULT_LIMITS, check_document

MAX_MESSAGES = 1_024  # chat messages per request
MAX_PROMPT_CHARS = 262_144  # characters of a prompt or of one message, before tokenization
MAX_TOKEN_IDS = 131_072  # token ids of a pre-tokenized prompt
MAX_DOCUMENTS = 10_000  # documents per upsert
MAX_INPUTS = 64  # keys of a chat request's ``inputs``
MAX_INPUT_CHARS = 65_536  # characters of one string in ``inputs``
MAX_INPUT_NAME = 64  # characters of an input's name
_JSON_TYPES = {list: "an array", dict: "an object", type(None): "null"}

PositiveInt = Annotated[StrictInt, Field(ge=1)]
StopStr = Annotated[StrictStr, Field(min_length=1, max_length=1_024)]
Text = Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Name = Annotated[StrictStr, Field(max_length=256)]
TokenId = Annotated[StrictInt, Field(ge=0)]


def _unpaired_surrogate(value: object, path: str) -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (an unpaired
    surrogate such as ``"\\ud800"``), or ``None``. Iterative: any depth is safe."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
            stack.extend((k, where or "(key)") for k in item if isinstance(k, str))
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item))
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(_Body):
    """A whole request body: every string in it (known field or not) must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if (where := _unpaired_surrogate(data, "")) is not None:
            raise ValueError(
                f"{where or 'body'}: string holds an unpaired surrogate (invalid Unicode)"
            )
        return data


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None

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
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Request):
    model: Name
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=MAX_SEED)] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    n: StrictInt = 1
    user: Name | None = None
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None

    # NOTE: field validators, so the 400's ``param`` names the unsupported field.
    @field_validator("n", "logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, value, info):
        if info.field_name == "n" and value != 1:
            raise ValueError("n > 1 is not supported (one choice per request)")
        if info.field_name != "n" and value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    @model_validator(mode="after")
    def _sampling_ranges(self):
        check_sampling(
            max_tokens=1,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
        )
        return self

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; extensions: ``workflow``, ``topk``, ``nprobe``, ``mode``
    and ``filter`` (as ``VectorIndex.search_text``), ``inputs`` (the workflow's declared
    inputs, each a string, boolean or number; the keys are checked against the workflow by
    ``graphs.request_inputs_or_400``). The question is the last user message."""

    messages: Messages
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    workflow: Name | None = None
    topk: Annotated[StrictInt, Field(ge=1, le=1000)] | None = None
    nprobe: PositiveInt | None = None
    mode: Literal["dense", "bm25", "hybrid", "ensemble"] | None = None
    filter: dict[str, Any] | None = None
    inputs: dict[str, StrictStr | StrictBool | StrictInt | Float] | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    response_format: dict | None = None

    @field_validator("tools", "tool_choice", "response_format")
    @classmethod
    def _unsupported_features(cls, value, info):
        if info.field_name == "response_format":
            if value is not None and (kind := value.get("type", "text")) != "text":
                raise ValueError(
                    f"type {kind!r} is not supported (no guided decoding); only 'text'"
                )
        elif value and value != "none":
            raise ValueError("tools are not supported")
        return value

    @field_validator("inputs", mode="before")
    @classmethod
    def _check_inputs(cls, value):
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("must be an object of input names to values")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_INPUT_NAME or not (key.isascii() and key.isidentifier()):
                raise ValueError(f"{key[:MAX_INPUT_NAME]!r} is not an input name (a state key)")
            if isinstance(item, str) and len(item) > MAX_INPUT_CHARS:
                raise ValueError(f"{key!r}: at most {MAX_INPUT_CHARS} characters, got {len(item)}")
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{key!r} must be a finite number, got {item}")
            if not isinstance(item, (str, bool, int, float)):
                what = _JSON_TYPES.get(type(item), type(item).__name__)
                raise ValueError(
                    f"{key!r} must be a string, a boolean, an integer or a number, not {what}"
                )
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
        if self.filter is not None:
            from ragserve.retrieval.filters import validate_filter

            validate_filter(self.filter)
        if not any(m.role == "user" and m.text().strip() for m in self.messages):
            raise ValueError("messages must contain a non-empty user message")
        return self

    def _question_index(self) -> int:
        users = [i for i, m in enumerate(self.messages) if m.role == "user" and m.text().strip()]
        return users[-1]  # validated: there is one

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
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
    )
    max_tokens: PositiveInt = 16
    echo: StrictBool = False
    ignore_eos: StrictBool = False
    top_k: PositiveInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_clear_error(cls, value):
        one_text = isinstance(value, list) and len(value) == 1 and isinstance(value[0], str)
        ids = isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value)  # noqa: E721 (bool is not a token)
        if not (isinstance(value, str) or one_text or ids):
            raise ValueError(
                "prompt must be a string, a list of one string, or a list of token ids"
            )
        return value

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
    """One document; its limits are ``ragserve.retrieval.limits.DEFAULT_LIMITS``."""

    id: StrictStr
    text: StrictStr
    title: StrictStr | None = None
    metadata: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _limits(self):
        check_document(self, DEFAULT_LIMITS)
        return self


class DocumentsRequest(_Request):
    """``POST /v1/documents``: upsert; acknowledged (200) means persisted."""

    documents: Annotated[list[DocumentIn], Field(min_length=1, max_length=MAX_DOCUMENTS)]


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``: vectors of the index's embedder (document side)."""

    model: Name
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: Name | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, value):
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(v, str) for v in texts):
            raise ValueError("input must be a string or a list of strings (token ids unsupported)")
        if not all(texts):
            raise ValueError("input texts must be non-empty")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` (through the chat template)."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids back to text."""

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
