"""Predict lockstep's speed against native decoding on a GPU from what was measured here.

    python benchmarks/coordinator_capacity.py --batch 64 256 --tokens 512   # the inputs (CPU only)
    python benchmarks/throughput_model.py                                   # the table
    python benchmarks/throughput_model.py --plugin-us 150 --forward-ms 2 5 10 20

The model. A decode step of native vLLM takes `f` (the forward pass and vLLM's own sampling).
In lockstep the server's plugin then takes the step's top-k, copies it to the host and sends
it (`p`, the plugin's own work), and waits for the coordinator's tokens before the next
forward can start: the token of step n is an input of step n+1, so none of the wait overlaps
a forward. The wait is the round trip `w(B)` measured by coordinator_capacity.py with
synthetic servers that answer at once: from the moment a report leaves a server's process to
the moment its tokens arrive, which holds both servers' reports meeting, the coordinator's
decision over B rows and the sockets. So per step

    lockstep / native = f / (f + p + w(B))

with both servers decoding in parallel (the slower one's f). The coordinator's CPU per token
bounds it too: one process decides at most 1 / (CPU per token) tokens per second, which
caps a pair at B / max(f + p + w, B * cpu per token).

`p` on a GPU (a top-k over [B, V] logits, a [B, k] copy to the host, a few syscalls) is not
measured on this machine (no GPU): it is an input, 0 by default, so the table shows the
coordinator's share alone. The CPU build's `p` (0.8-1.0 ms per token at V = 151,936) is
not a GPU's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ratio(forward_s: float, plugin_s: float, wait_s: float, batch: int, cpu_per_token_s: float) -> float:
    """Lockstep tokens/s over native tokens/s for one pair at `batch` (see the module docstring)."""
    step = max(forward_s + plugin_s + wait_s, batch * cpu_per_token_s)
    return forward_s / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, default=Path("benchmarks/results/coordinator_capacity.json"))
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[2.0, 5.0, 10.0, 20.0])
    parser.add_argument("--plugin-us", type=float, default=0.0,
                        help="the plugin's own work per step on the GPU server (not measured here)")
    args = parser.parse_args()
    measured = json.loads(args.inputs.read_text())
    rows = sorted(measured["rows"], key=lambda r: r["batch"])
    print(f"inputs: {args.inputs} ({measured.get('cpu', 'CPU not recorded')}); plugin {args.plugin_us:g} µs per step")
    print("| batch | round trip median / p99 (µs) | coordinator CPU per token (µs) | "
          + " | ".join(f"f = {f:g} ms" for f in args.forward_ms) + " |")
    print("|---|---|---|" + "---|" * len(args.forward_ms))
    for row in rows:
        trip = row["round_trip_us"]
        cpu = row["coordinator_cpu_us_per_token"] * 1e-6
        cells = []
        for forward_ms in args.forward_ms:
            median = ratio(forward_ms * 1e-3, args.plugin_us * 1e-6, trip["median"] * 1e-6, row["batch"], cpu)
            worst = ratio(forward_ms * 1e-3, args.plugin_us * 1e-6, trip["p99"] * 1e-6, row["batch"], cpu)
            cells.append(f"{median:.2f}x ({worst:.2f}x at p99)")
        print(f"| {row['batch']} | {trip['median']:,.0f} / {trip['p99']:,.0f} | "
              f"{row['coordinator_cpu_us_per_token']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
