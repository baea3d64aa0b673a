"""Chats rendered with a model's own chat template, by a transformers tokenizer held here.

Engines that tokenize in this process (the in-process engine, the vLLM client with local
tokenizers) share it; a vLLM server renders with the same template behind /tokenize.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from dualvllm.common.errors import InvalidInputError


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], model: str, template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """Token ids of `messages` up to the prompt of the assistant's turn; `template_kwargs`: extra
    variables for the template (e.g. Qwen3's enable_thinking), as vLLM's chat_template_kwargs."""
    try:
        rendered = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **dict(template_kwargs or {})
        )
    except ValueError as err:  # transformers' answer when the model has no chat template
        raise InvalidInputError(f"the {model} model cannot render a chat: {err}") from err
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    return [int(t) for t in ids]
