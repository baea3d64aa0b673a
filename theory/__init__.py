"""The math of optimal sampling from two models: pure numpy/scipy, no I/O.

q*(y) ∝ pi_theta(y)^(1 - alpha*) · pi_t(y)^alpha*, alpha* per token such that
KL(q* || pi_theta) = KL(q* || pi_t). Every function is vectorized over a batch of rows
of padded candidate arrays with a mask.
"""

from dualvllm.theory.alpha import alpha_kls, solve_alpha, symmetry_gap
from dualvllm.theory.diagnostics import DIAGNOSTIC_KEYS, summarize, token_diagnostics
from dualvllm.theory.merge import FILL_RULES, FillRule, MergedTopK, merge_topk
from dualvllm.theory.mixture import (
    apply_temperature,
    greedy_indices,
    log_normalize,
    log_partition,
    mixture_logprobs,
    sample_indices,
)
from dualvllm.theory.passk import pass_at_k

__all__ = [
    "DIAGNOSTIC_KEYS",
    "FILL_RULES",
    "FillRule",
    "MergedTopK",
    "alpha_kls",
    "apply_temperature",
    "greedy_indices",
    "log_normalize",
    "log_partition",
    "merge_topk",
    "mixture_logprobs",
    "pass_at_k",
    "sample_indices",
    "solve_alpha",
    "summarize",
    "symmetry_gap",
    "token_diagnostics",
]
