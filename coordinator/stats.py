"""Running counters of a coordinator, and the summary `get_statistics()` returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

# Percentiles over the most recent steps only, so memory stays flat on long runs.
LATENCY_WINDOW_STEPS = 10_000


@dataclass
class Statistics:
    tokens: int = 0  # tokens sampled (all sequences)
    steps: int = 0  # coordinator steps (one request per server each)
    sequences_finished: int = 0
    sequences_failed: int = 0
    alpha_sum: float = 0.0
    coverage_theta_sum: float = 0.0  # per-token top-k covered mass, summed
    coverage_t_sum: float = 0.0
    busy_s: float = 0.0  # wall time spent inside steps
    step_latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW_STEPS))

    def record_step(self, n_tokens: int, alpha_sum: float, seconds: float,
                    coverage_theta_sum: float = 0.0, coverage_t_sum: float = 0.0) -> None:
        self.steps += 1
        self.tokens += n_tokens
        self.alpha_sum += alpha_sum
        self.coverage_theta_sum += coverage_theta_sum
        self.coverage_t_sum += coverage_t_sum
        self.busy_s += seconds
        self.step_latencies_s.append(seconds)

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
            "mean_alpha": self.alpha_sum / self.tokens if self.tokens else float("nan"),
            "mean_coverage_theta": self.coverage_theta_sum / self.tokens if self.tokens else float("nan"),
            "mean_coverage_t": self.coverage_t_sum / self.tokens if self.tokens else float("nan"),
            "tokens_per_s": self.tokens / self.busy_s if self.busy_s else 0.0,
            "step_latency_p50_ms": float(np.percentile(latencies, 50)) if has else float("nan"),
            "step_latency_p95_ms": float(np.percentile(latencies, 95)) if has else float("nan"),
        }
