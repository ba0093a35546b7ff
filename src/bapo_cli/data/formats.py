"""Row formats of a prompt file: plain fields, verl's RLVR parquet, OpenAI-style message lists.

    plain     {"problem": "...", "answer": "..."}  (column names: data.prompt_field/answer_field)
              the question goes through data.template
    verl      {"prompt": [{"role": "user", "content": "..."}, ...], "data_source": "...",
               "reward_model": {"ground_truth": "..."}, "extra_info": {...}}
    messages  {"messages": [{"role": ..., "content": ...}, ...], "answer": "..."}
              the reference is data.answer_field, else reward_model.ground_truth, else the
              content of a final assistant message (which is then not part of the prompt)

verl and messages rows are chat prompts: the model sees the tokenizer's chat template applied to
the messages (`models.format_messages`), not data.template. `detect` picks the format of a file
from its first row (data.format=auto); a row that does not fit its file's format is skipped with
the reason, like any unusable row (`records.load_records`).

Each ``*_row`` function is pure: a source row in, ``(messages, answer)`` out, or `RowError`
saying in a few words what the row lacks and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

FORMATS = ("auto", "plain", "verl", "messages")
CHAT_FORMATS = ("verl", "messages")
MESSAGE_SHAPE = "a list of {role, content} messages"

Messages = tuple[dict[str, str], ...]


class RowError(ValueError):
    """A row that does not fit its format: the message is the skip reason (a few words)."""


def detect(raw: Sequence[Any]) -> str:
    """The format of rows read from a file: from its first object row (plain when none)."""
    for item in raw:
        if isinstance(item, Mapping):
            if isinstance(item.get("prompt"), (list, tuple)):
                return "verl"
            if "messages" in item:
                return "messages"
            return "plain"
    return "plain"


def messages_of(value: Any, column: str) -> Messages:
    """``value`` as messages: a non-empty list of {role: str, content: str} (extra keys dropped)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError(f"{column!r} is not {MESSAGE_SHAPE}")
    out = []
    for message in value:
        if not isinstance(message, Mapping):
            raise RowError(f"{column!r} is not {MESSAGE_SHAPE}")
        role, content = message.get("role"), message.get("content")
        if not (isinstance(role, str) and role and isinstance(content, str)):
            raise RowError(f"{column!r} is not {MESSAGE_SHAPE}")
        out.append({"role": role, "content": content})
    return tuple(out)


def _ground_truth(item: Mapping[str, Any]) -> Any:
    model = item.get("reward_model")
    return model.get("ground_truth") if isinstance(model, Mapping) else None


def _prompt_checked(messages: Messages, column: str) -> Messages:
    if not messages:
        raise RowError(f"{column!r} has no message before the answer")
    if messages[-1]["role"] == "assistant":
        raise RowError(f"{column!r} ends with an assistant message: the prompt must end with user")
    if not any(m["content"].strip() for m in messages):
        raise RowError(f"{column!r} has only blank messages")
    return messages


def verl_row(item: Mapping[str, Any]) -> tuple[Messages, Any]:
    """verl: the prompt is ``prompt`` (messages), the reference ``reward_model.ground_truth``."""
    if "prompt" not in item:
        raise RowError("missing 'prompt' (verl format)")
    messages = _prompt_checked(messages_of(item["prompt"], "prompt"), "prompt")
    answer = _ground_truth(item)
    if answer is None:
        raise RowError("missing 'reward_model.ground_truth' (verl format)")
    return messages, answer


def messages_row(item: Mapping[str, Any], answer_field: str) -> tuple[Messages, Any]:
    """messages: ``messages``; the reference is ``answer_field``, reward_model.ground_truth, or a
    final assistant message (taken off the prompt)."""
    if "messages" not in item:
        raise RowError("missing 'messages' (messages format)")
    messages = messages_of(item["messages"], "messages")
    answer = item.get(answer_field)
    if answer is None:
        answer = _ground_truth(item)
    if answer is None and messages[-1]["role"] == "assistant":
        messages, answer = messages[:-1], messages[-1]["content"]
    if answer is None:
        raise RowError(
            f"no reference: needs {answer_field!r}, 'reward_model.ground_truth' or a final "
            "assistant message (messages format)"
        )
    return _prompt_checked(messages, "messages"), answer


def question_of(messages: Messages) -> str:
    """The text that stands for a chat prompt in logs and records: its last user message."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    return messages[-1]["content"]


def render_plain(messages: Messages) -> str:
    """The no-chat-template fallback: the messages' contents joined by newlines, no roles.

    A tokenizer without a chat template (the tiny model's) has no way to mark roles, so a
    single-turn prompt becomes exactly its user text, as a plain row would be without a template.
    """
    return "\n".join(m["content"] for m in messages)
