"""`append_rows` (a whole step's records at once) against `SequenceState.append` row by row."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dualvllm.coordinator.sequence import SamplingParams, SequenceState, append_rows

EOS = frozenset({0, 1})
MAX_LEN = 12

settings_pool = [
    SamplingParams(4),
    SamplingParams(6, ignore_eos=True),
    SamplingParams(8, stop_token_ids=frozenset({3})),
    SamplingParams(30, stop_token_ids=frozenset({2, 3}), ignore_eos=True),
]


def make(spec: tuple[int, int, int], shared: SamplingParams | None) -> SequenceState:
    choice, prompt, done = spec
    seq = SequenceState(index=0, prompt="", theta_prompt_ids=[9] * prompt, t_prompt_ids=[9] * (prompt // 2 + 1),
                        params=shared or settings_pool[choice], rng=np.random.default_rng(0), sink=None)  # type: ignore[arg-type]
    seq.tokens.extend([7] * done)
    return seq


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.integers(0, 6), st.integers(0, 4)), min_size=1,
                max_size=12),
       st.booleans())
def test_a_step_appended_at_once_equals_row_by_row(rows, one_call):
    shared = settings_pool[rows[0][0]] if one_call else None
    by_row = [make(spec[:3], shared) for spec in rows]
    at_once = [make(spec[:3], shared) for spec in rows]
    tokens = np.array([spec[3] for spec in rows], dtype=np.int64)
    values = [np.linspace(-1.0, -0.1, len(rows)) * k for k in (1, 2, 3, 4)]
    for i, seq in enumerate(by_row):
        seq.append(int(tokens[i]), *(float(v[i]) for v in values), {}, EOS, MAX_LEN)
    finished = append_rows(at_once, tokens, *values, EOS, MAX_LEN)
    for one, other, over in zip(by_row, at_once, finished.tolist()):
        assert (one.tokens, one.alphas, one.logprobs_q, one.logprobs_theta, one.logprobs_t) == (
            other.tokens, other.alphas, other.logprobs_q, other.logprobs_theta, other.logprobs_t)
        assert one.finish_reason == other.finish_reason
        assert over == (other.finish_reason is not None)
        assert type(other.tokens[-1]) is int and type(other.alphas[-1]) is float
