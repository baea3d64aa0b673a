"""A user's reward function, in TRL's signature, for the integration tests' `--reward module:function`."""

from __future__ import annotations


def starts_with_a_digit(prompts, completions, **kwargs):
    """1.0 for a completion that starts with a digit; every row field arrives as a list."""
    assert len(kwargs["answer"]) == len(completions) == len(prompts)
    return [1.0 if text[:1].isdigit() else 0.0 for text in completions]


def letters(prompts, completions, **kwargs):
    """The share of a completion's characters that are letters: a reward that varies between
    any two samples, so GRPO has advantages even from models that make no sense."""
    return [sum(c.isalpha() for c in text) / max(len(text), 1) for text in completions]
