"""benchmarks/coordinator_capacity.py end to end: the real lockstep coordinator against its
synthetic plugin clients, on the command's event loop (uvloop), at a batch large enough to fill
its control pipes (batch 1,024 broke once on uvloop, when a watched two-way pipe's sends
failed with EAGAIN)."""

from __future__ import annotations

import json
import os
import sys

from tests.processes import REPO, start

BATCHES = (1, 1024)
TOKENS = 4


def test_the_capacity_benchmark_decides_every_token_and_measures_its_floors(tmp_path):
    output = tmp_path / "capacity.json"
    process = start([sys.executable, "benchmarks/coordinator_capacity.py", "--floor", "--batch", *map(str, BATCHES),
                     "--tokens", str(TOKENS), "--rounds", "1", "--output", str(output)],
                    cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=-1, stderr=-1, text=True)
    out, err = process.communicate(timeout=600)  # the conftest fixture ends it (and its clients) on any failure
    assert process.returncode == 0, err[-3000:]
    report = json.loads(output.read_text())
    assert report["event_loop"] == "uvloop"
    plain, *channel = report["floor"]
    assert plain["plain_sockets"] and plain["cpu_us_per_round_trip"] > 0
    assert [row["batch"] for row in channel] == list(BATCHES)
    assert all(row["round_trips"] > 1000 and row["cpu_us_per_round_trip"] > 0 for row in channel)
    # One measured round after the warm-up: every sequence ran to its last token, none failed.
    assert [(row["batch"], row["tokens"]) for row in report["rows"]] == [(b, b * TOKENS) for b in BATCHES]
    assert all(row["steps"] >= TOKENS and row["coordinator_cpu_us_per_token"] > 0 for row in report["rows"])
    # The start-up heap is frozen as the coordinator does it, and the collections are counted.
    assert all(row["frozen_heap"] and 0 <= row["collection_share"] < 1 for row in report["rows"])
    assert "plain blocking sockets" in out and "tokens/s" in out
