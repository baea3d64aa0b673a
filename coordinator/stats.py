"""Running counters of a coordinator, and the summary `get_statistics()` returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

# Percentiles over the most recent steps only, so memory stays flat on long runs.
LATENCY_WINDOW_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where one step's wall time went (seconds, from time.perf_counter).

    The two server calls run concurrently, so `servers_s` (both done) is about
    max(theta_s, t_s), not their sum; each call's time includes building its request and
    parsing its answer. The other phases run one after another: total_s ≈ servers_s +
    merge_s + alpha_s + sample_s + bookkeeping_s.
    """

    batch: int  # sequences in the step (= tokens it produced)
    theta_s: float  # base server call, request built to answer parsed
    t_s: float  # teacher server call
    servers_s: float  # both calls, from building the first request to parsing the last answer
    merge_s: float  # union of the two top-k lists and fill values
    alpha_s: float  # temperature and the alpha* solve
    sample_s: float  # q*, the sampled index, gathering the per-row results
    bookkeeping_s: float  # per-sequence records, stop rules and stop strings, statistics
    total_s: float


@dataclass
class Statistics:
    tokens: int = 0  # tokens sampled (all sequences)
    steps: int = 0  # coordinator steps (one request per server each)
    sequences_finished: int = 0
    sequences_failed: int = 0
    stop_checks: int = 0  # stop-string checks (one per token of a sequence with stop strings)
    stop_checks_decoded: int = 0  # ... that the detokenizer had to settle (coordinator/stop_filter.py)
    alpha_sum: float = 0.0
    coverage_theta_sum: float = 0.0  # per-token top-k covered mass, summed
    coverage_t_sum: float = 0.0
    busy_s: float = 0.0  # wall time spent inside steps
    step_latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW_STEPS))
    step_timings: deque[StepTiming] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW_STEPS))

    def record_step(
        self,
        n_tokens: int,
        alpha_sum: float,
        seconds: float,
        coverage_theta_sum: float = 0.0,
        coverage_t_sum: float = 0.0,
        timing: StepTiming | None = None,
    ) -> None:
        self.steps += 1
        self.tokens += n_tokens
        self.alpha_sum += alpha_sum
        self.coverage_theta_sum += coverage_theta_sum
        self.coverage_t_sum += coverage_t_sum
        self.busy_s += seconds
        self.step_latencies_s.append(seconds)
        if timing is not None:
            self.step_timings.append(timing)

    def summary(self, requests: int, retries: int, request_failures: int) -> dict[str, float]:
        latencies = np.asarray(self.step_latencies_s) * 1e3
        has = latencies.size > 0
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "requests": requests,
            "retries": retries,
            "request_failures": request_failures,
            "sequences_finished": self.sequences_finished,
            "sequences_failed": self.sequences_failed,
            "stop_checks": self.stop_checks,
            "stop_checks_decoded": self.stop_checks_decoded,
            "mean_alpha": self.alpha_sum / self.tokens if self.tokens else float("nan"),
            "mean_coverage_theta": self.coverage_theta_sum / self.tokens if self.tokens else float("nan"),
            "mean_coverage_t": self.coverage_t_sum / self.tokens if self.tokens else float("nan"),
            "tokens_per_s": self.tokens / self.busy_s if self.busy_s else 0.0,
            "step_latency_p50_ms": float(np.percentile(latencies, 50)) if has else float("nan"),
            "step_latency_p95_ms": float(np.percentile(latencies, 95)) if has else float("nan"),
        }
