"""Forgetting, measured as RL's Razor measures it (arXiv 2509.04259): the KL from the starting
model, on the training task, at states the current policy visits.

    kl_from_start  E_x E_{y ~ pi(.|x)} sum_t KL(pi(.|x, y_<t) || pi_0(.|x, y_<t))

over training prompts x, one completion y each sampled from the base alone (alpha = 0) at
the run's temperature. Every term is the exact KL between two next-token distributions, over
the whole vocabulary, not a one-sample estimate: only the states are sampled. The head runs
`chunk` positions at a time, as the learner's does (training/logprobs.py), so no [B, T, V]
tensor exists at a real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from dualvllm.training.learner import Packed, completion_states
from dualvllm.training.logprobs import body_and_head


@torch.no_grad()
def state_kl(model: Any, start: Any, packed: Packed, *, chunk: int) -> torch.Tensor:
    """KL(model || start) at each completion state, summed over each row's completion -> float64 [B]."""
    real = packed.target_mask.bool()  # [B, T]
    (_, head), (_, start_head) = body_and_head(model), body_and_head(start)
    hidden, start_hidden = completion_states(model, packed), completion_states(start, packed)  # [M, H] each
    pieces = []
    for i in range(0, hidden.shape[0], chunk):
        logp = torch.log_softmax(head(hidden[i : i + chunk]).double(), dim=-1)  # [N, V]
        logp0 = torch.log_softmax(start_head(start_hidden[i : i + chunk]).double(), dim=-1)  # [N, V]
        pieces.append((logp.exp() * (logp - logp0)).sum(-1))  # [N]
    per_state = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float64)  # [M]
    return per_state.new_zeros(real.shape).index_put((real,), per_state).sum(1)  # [B]
