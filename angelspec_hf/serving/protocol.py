"""The OpenAI API's request and response shapes for `/v1/chat/completions` and `/v1/completions`.

Requests are validated by pydantic before anything reaches the engine; a bad field is answered 400 with the field
named (`param`), as OpenAI answers. Fields the engine cannot honour (`n` > 1, `logprobs`, `tools`, ...) are refused
by name rather than ignored; fields this server does not know are ignored, as OpenAI-compatible servers do (clients
send their own extras).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share: the model, the length, sampling, stop strings and streaming."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not string for string in strings):
            raise ValueError("a stop string must not be empty")
        return strings

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise ValueError("only n=1 is served")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs not in (None, False, 0):
            raise ValueError("logprobs are not served")
        return logprobs

    def unsupported(self) -> str | None:
        """The first known field this server refuses rather than ignores, or None."""
        for name in ("tools", "functions", "response_format", "best_of", "echo", "suffix", "logit_bias"):
            if (self.model_extra or {}).get(name) not in (None, False, [], {}):
                return name
        return None

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        """The content as one string (text parts joined; other parts refused)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are served, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def length(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str = Field(min_length=1)

    @property
    def length(self) -> int | None:
        return self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """The ids, object names and choice layout of one endpoint's responses and stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, finish_reason: str, usage_record: dict, speculation: dict) -> dict:
        """The whole answer; `speculation` (τ, drafted and accepted tokens) is this server's own addition."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage_record, "speculation": speculation}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One server-sent event's payload: a piece of text, or the end (`finish_reason`)."""
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return self._envelope(
                "chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
            )
        return self._envelope(
            "text_completion", [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        )

    def usage_chunk(self, usage_record: dict) -> dict:
        return {
            **self._envelope("chat.completion.chunk" if self.chat else "text_completion", []),
            "usage": usage_record,
        }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
