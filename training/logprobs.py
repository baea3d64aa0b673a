"""Log-probabilities of chosen tokens without ever holding [B, T, V] logits.

At a real vocabulary the logits are by far the largest tensor of an update: Qwen3's
V = 151,936 over 64 rollouts x 1,024 completion tokens is 40 GB in float32, and a
log_softmax over them is 40 GB more. Yet the learner's losses read only a few entries of
each next-token distribution: log pi(y_t) of the sampled token (every policy-gradient and
SFT term) and log pi at the teacher's top-k ids (the distillation term, dualvllm.training.distill),
each log pi(v) = z_v - logsumexp(z). So, as TRL computes `selective_log_softmax` row by
row and Liger's fused linear cross-entropy runs the head chunk by chunk:

1. the transformer body runs once and yields the last hidden states [B, L, H]; the caller
   keeps those at real completion positions only, [M, H];
2. the lm_head runs on `chunk` positions at a time: logits [N, V] -> logsumexp and the J
   chosen logits -> log-probabilities [N, J];
3. each chunk runs under torch.utils.checkpoint, so its logits are freed as soon as the
   chunk's J values exist and are recomputed in the backward pass. Without it autograd
   would keep every chunk's [N, V] logits for logsumexp's backward: [M, V] again.

Peak memory for the head is then a few [N, V] buffers (the recomputed logits, their
softmax and its gradient, in one chunk's backward), whatever B and T.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from dualvllm.training import lora

# Config fields of causal LMs whose forward transforms the head's output (Gemma 2/3 soft-cap the
# logits, Cohere and Granite scale them), each with its value meaning "untransformed":
# log-probabilities from the bare head would be wrong for any other value.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def body_and_head(model: Any) -> tuple[Any, Any]:
    """(transformer body -> last hidden states, lm_head) of a Hugging Face causal LM, peft-wrapped or not.

    A peft model injects its adapters into the base model's own modules, so the base's body
    and head run them. Models that transform the head's output are refused (see
    LOGIT_TRANSFORMS): their log-probabilities need the full forward.
    """
    base = model.get_base_model() if lora.is_lora(model) else model
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(base.config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"{type(base).__name__} applies {name}={value} to its logits, which the chunked "
                "log-probabilities (dualvllm.training.logprobs) do not; train a model without it"
            )
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base).__name__} exposes no output embeddings (lm_head); the learner needs a causal LM")
    return base.get_decoder(), head


def last_hidden_states(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The body's final (normed) hidden states, [B, L] -> [B, L, H]; no KV cache (training)."""
    body, _ = body_and_head(model)
    return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def _chunk_logprobs(hidden: torch.Tensor, head: Any, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(head(h))[ids] for one chunk: [N, H], [N, J] -> [N, J]."""
    logits = head(hidden)  # [N, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32 for the logsumexp
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, J]


def selected_logprobs(hidden: torch.Tensor, head: Any, ids: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """log pi(ids) at each position from its hidden state, `chunk` positions at a time: [M, H], [M, J] -> [M, J].

    With gradients enabled each chunk is checkpointed (see the module docstring): its
    [chunk, V] logits are recomputed in backward instead of kept.
    """
    assert chunk >= 1, f"chunk must be a positive number of positions, got {chunk}"
    ids = ids.clamp(min=0)  # padded top-k entries (-1) read id 0; the caller masks them
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, i = hidden[start : start + chunk], ids[start : start + chunk]  # [N, H], [N, J]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, h, head, i, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, head, i))
    if not pieces:
        return hidden.new_zeros((0, ids.shape[-1]), dtype=torch.promote_types(hidden.dtype, torch.float32))
    return torch.cat(pieces)  # [M, J]
