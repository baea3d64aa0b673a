"""pass@k: the chance that at least one of k samples is correct, estimated from n >= k.

With c correct among n samples of a problem, the unbiased estimator (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code", eq. 1) is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

The product form avoids the huge binomials: each factor is in [0, 1), and the product is
empty (pass@k = 0) when c = 0; when n - c < k every draw of k holds a correct sample, so
pass@k = 1. Averaged over problems it is the benchmark's pass@k.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: np.ndarray, c: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per problem -> float64 [P], from samples n [P] and correct counts c [P]."""
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    if k < 1 or np.any(n < k) or np.any((c < 0) | (c > n)):
        raise ValueError(
            f"pass@{k} needs 1 <= k <= n and 0 <= c <= n per problem; got k={k}, "
            f"n in [{n.min()}, {n.max()}], c in [{c.min()}, {c.max()}]"
        )
    width = int(c.max(initial=0))
    i = (n - c)[:, None] + 1 + np.arange(width)  # [P, w]: the terms n-c+1 .. n, padded past c
    used = np.arange(width) < c[:, None]  # [P, w]
    factors = np.where(used, 1.0 - k / i, 1.0)
    return np.where(n - c < k, 1.0, 1.0 - np.prod(factors, axis=-1))
