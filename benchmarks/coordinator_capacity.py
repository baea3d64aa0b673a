"""How many tokens per second one lockstep coordinator can decide, without model servers.

    python benchmarks/coordinator_capacity.py                       # batch 1, 64, 256, 1024
    python benchmarks/coordinator_capacity.py --batch 256 --tokens 64 --top-k 20
    python benchmarks/coordinator_capacity.py --floor --batch 1       # also the messaging alone
    python benchmarks/coordinator_capacity.py --batch 256 --step-threads 4   # the step on 4 threads
    python benchmarks/coordinator_capacity.py --batch 256 --processes 1 2     # 1, then 2 coordinators at once

The coordinator's side is the real one: `LockstepScheduler` (coordinator/lockstep/) with
its TCP channel, merge, alpha* and sampling. The servers are synthetic plugin clients, one
process per role, that speak the plugin's real wire format (engines/vllm_plugin/wire.py): at
every step each sends ONE report with a row of top-k per running request and waits for the
reply over the plugin's own connection code (engines/vllm_plugin/link.py), as
engines/vllm_plugin/processor.py does inside vLLM, then applies the forced tokens.
Their top-k rows come from a precomputed table, so a step costs them next to nothing and the
figure is the coordinator's ceiling: what it would sustain beside servers that decode
instantly. That figure carries over to GPU machines, where the servers' decode steps take
10-30 ms and the coordinator has a core of its own.

It runs on the `dualvllm` command's event loop, uvloop (common/loop.py);
`DUALVLLM_EVENT_LOOP=asyncio` runs it on the standard one.

A request reaches a client over a control pipe instead of HTTP (in production the HTTP
request is sent once per sequence, not per token), and the client answers it with its
finish reason when the sequence ends.

Reported per batch size: tokens/s of the whole run (wall), the coordinator process's CPU time
per token and per step (time.process_time over the run: the coordinator's event loop, its
sockets, numpy) and its inverse, the tokens one coordinator CPU-second decides (the capacity
of a process with a core of its own); the round trip of every full report as its client saw
it (from the report leaving the client to its tokens arriving: both reports meeting, the
decision, the sockets), and the decision alone (merge, alpha*, sampling, records).
The synthetic top-k rows draw their ids from the real vocabulary's range (`--vocab`, Qwen's
151,936), the two roles sharing three quarters of each row's ids. `--floor` first measures the messaging alone: a
client process sends reports of the batch's size, the coordinator's channel receives,
decodes and answers each (no table, no decision); a step has two such round
trips, so twice that figure is the least a step can cost with this transport. Before it, the
same round trip over plain blocking sockets (no event loop) gives the machine's own floor:
loopback TCP and waking a sleeping process, which no code of ours can remove. On a machine
with fewer than three free cores the clients and the coordinator share cores, which lowers
tokens/s but not CPU per token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from benchmarks import harness  # noqa: E402
from dualvllm.common import heap, loop  # noqa: E402
from dualvllm.coordinator import kernel  # noqa: E402
from dualvllm.coordinator.config import CoordinatorConfig  # noqa: E402
from dualvllm.coordinator.sequence import SamplingParams  # noqa: E402
from dualvllm.coordinator.lockstep import LockstepScheduler  # noqa: E402
from dualvllm.coordinator.sequence import SequenceState  # noqa: E402
from dualvllm.coordinator.stats import Statistics  # noqa: E402
from dualvllm.engines.lockstep_channel import LockstepChannel  # noqa: E402
from dualvllm.engines.vllm_plugin import wire  # noqa: E402
from dualvllm.engines.vllm_plugin.link import CoordinatorLink  # noqa: E402

VOCAB = 151_936  # Qwen2/3's vocabulary: top-k ids spread over the real id range (--vocab)
PROMPT_LEN = 16
STOP_TOKEN = 0  # never in a client's top-k, so only END stops a request
TABLE_ROWS = 997  # distinct synthetic top-k rows per client; a row is picked by (id + position)


# -- the synthetic plugin client (its own process) ------------------------------------------

def client_main(requests: multiprocessing.connection.Connection, finishes: multiprocessing.connection.Connection,
                seed: int, top_k: int, ready: multiprocessing.synchronize.Event, vocab: int = VOCAB) -> None:
    """One synthetic server: takes requests from `requests`, reports each step to the coordinator
    address a request names, applies the reply, sends a request's finish reason to `finishes`
    when it ends."""
    # Both roles rank the same ids (one seed), the teacher with a quarter of each row its own,
    # as two models of one family mostly agree on their top-k: ~25 merged candidates a row.
    shared = np.random.default_rng(0)
    ids = np.stack([1 + shared.choice(vocab - 1, size=top_k + top_k // 4, replace=False) for _ in range(TABLE_ROWS)])
    ids = ids[:, :top_k] if seed == 1 else np.concatenate((ids[:, : top_k - top_k // 4], ids[:, top_k:]), axis=1)
    rng = np.random.default_rng(seed)
    logits = np.sort(rng.normal(scale=2.0, size=(TABLE_ROWS, top_k)), axis=1)[:, ::-1]
    # Top-k of a distribution over VOCAB ids: the rest of the mass lies outside the top-k.
    logprobs = (logits - np.logaddexp.reduce(logits, axis=1, keepdims=True) - 0.05).astype(np.float32)
    ids = ids.astype(np.int32)
    links: dict[str, CoordinatorLink] = {}
    running: dict[int, list] = {}  # id -> [address, position, max_position]
    round_trips: list[tuple[float, float, int]] = []  # (sent at, seconds to the reply, rows), per report
    # A thread drains the control pipe as requests come: the coordinator's sends must never
    # wait for this process, which may be waiting for the coordinator's reply.
    incoming: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=_drain, args=(requests, incoming), daemon=True).start()
    ready.set()
    while True:
        while not running or not incoming.empty():  # idle: block for work
            message = incoming.get()
            if message.get("quit"):
                finishes.send({"round_trips": round_trips})
                return
            _start(running, message)
        by_address: dict[str, list[int]] = {}
        for request_id, (address, _, _) in running.items():
            by_address.setdefault(address, []).append(request_id)
        for address, members in by_address.items():
            link = links.get(address) or links.setdefault(address, CoordinatorLink(address))
            link.step += 1
            member_ids = np.array(members, dtype=np.int64)
            positions = np.array([running[m][1] for m in members], dtype=np.int64)
            rows = positions % TABLE_ROWS  # both roles see one row at one position
            deadline = time.monotonic() + 60
            message = wire.encode_report(link.step, 0, 1 << 20, member_ids, positions, ids[rows], logprobs[rows])
            # The round trip: from the report leaving this process to its tokens arriving, as a
            # plugin inside vLLM would see it (clock: CLOCK_MONOTONIC, shared by every process).
            sent = time.perf_counter()
            link.send(message, deadline)
            reply = link.receive(deadline)
            round_trips.append((sent, time.perf_counter() - sent, len(members)))
            if reply is None:
                raise RuntimeError(f"the coordinator {link.problem}")
            ended = []
            for request_id, token in zip(members, reply.tolist()):
                state = running[request_id]
                state[1] += 1
                if token == wire.END or token == STOP_TOKEN:
                    ended.append((request_id, "stop"))
                elif state[1] >= state[2]:
                    ended.append((request_id, "length"))
            for request_id, finish in ended:
                del running[request_id]
                finishes.send({"id": request_id, "finish": finish})


def _drain(control: multiprocessing.connection.Connection, incoming: queue.Queue) -> None:
    while True:
        message = control.recv()
        incoming.put(message)
        if message.get("quit"):
            return


def _start(running: dict[int, list], message: dict) -> None:
    args = message["args"]
    running[args[wire.ARG_ID]] = [args[wire.ARG_ADDRESS], args[wire.ARG_OFFSET],
                                  args[wire.ARG_OFFSET] + message["max_tokens"]]


# -- the coordinator's view of a client ---------------------------------------------------

class RemoteClient:
    """What LockstepScheduler calls on a server (forced_generation, health, detokenize), sent
    to a client process over its control pipes: one each way, because the event loop watches
    the finishes' end, and uvloop makes a watched descriptor non-blocking (a two-way pipe's
    sends then failed with EAGAIN once its buffer filled, at batch 1,024)."""

    def __init__(self, name: str, requests: multiprocessing.connection.Connection,
                 finishes: multiprocessing.connection.Connection) -> None:
        self.name, self.url = name, f"synthetic://{name}"
        self._requests, self._finishes = requests, finishes
        self._waiting: dict[int, asyncio.Future[str]] = {}
        self._watched = False
        self.round_trips: list[tuple[float, float, int]] = []  # the client's, sent when it quits

    async def forced_generation(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token: int,
                                lockstep_args: dict[str, int | str],
                                on_accepted: Callable[[], None] | None = None) -> str:
        if not self._watched:
            asyncio.get_running_loop().add_reader(self._finishes.fileno(), self._read)
            self._watched = True
        finished = self._waiting[int(lockstep_args[wire.ARG_ID])] = asyncio.get_running_loop().create_future()
        self._requests.send({"args": lockstep_args, "max_tokens": max_tokens})
        if on_accepted is not None:
            on_accepted()
        return await finished

    def _read(self) -> None:
        # A finish is one write of less than PIPE_BUF bytes, so a readable pipe holds whole messages.
        while self._finishes.poll(0):
            message = self._finishes.recv()
            if "round_trips" in message:
                self.round_trips = message["round_trips"]
                continue
            future = self._waiting.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result(message["finish"])

    async def health(self) -> None:
        return None

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return ""

    async def close(self) -> None:
        if self._watched:
            asyncio.get_running_loop().remove_reader(self._finishes.fileno())
        self._requests.send({"quit": True})
        self._requests.close()
        os.set_blocking(self._finishes.fileno(), True)  # the event loop made it non-blocking; the
        # round trips are one message larger than the pipe's buffer
        if self._finishes.poll(30):  # its round trips come last
            message = self._finishes.recv()
            self.round_trips = message.get("round_trips", self.round_trips)
        self._finishes.close()


async def _take(sink: asyncio.Queue, n: int) -> list:
    return [await sink.get() for _ in range(n)]


class CollectionTimer:
    """Process CPU spent in Python's garbage collections while counting, per generation."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.counting = False
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        elif self.counting:
            self.seconds[info["generation"]] += time.process_time() - self._started
            self.collections[info["generation"]] += 1


async def measure(batch: int, tokens: int, top_k: int, rounds: int, freeze: bool, vocab: int = VOCAB,
                  step_threads: int = 1) -> dict:
    """One coordinator, two client processes, `rounds` batches of `batch` sequences of `tokens` tokens;
    `freeze`: freeze the start-up heap as DualVLLMCoordinator does (CoordinatorConfig.freeze_gc_heap)."""
    spawn = multiprocessing.get_context("spawn")
    requests = [spawn.Pipe(duplex=False) for _ in ("theta", "t")]  # (client's end, ours)
    finishes = [spawn.Pipe(duplex=False) for _ in ("theta", "t")]  # (ours, client's end)
    clients = [RemoteClient(role, send, receive)
               for role, (_, send), (receive, _) in zip(("theta", "t"), requests, finishes)]
    readies = [spawn.Event() for _ in clients]
    processes = [spawn.Process(target=client_main, args=(take, give, seed, top_k, ready, vocab), daemon=True)
                 for (take, _), (_, give), seed, ready in zip(requests, finishes, (1, 2), readies)]
    for process in processes:
        process.start()
    channel = LockstepChannel()
    threads = {"step_threads": step_threads} if step_threads > 1 else {}  # (runs on checkouts without it too)
    config = CoordinatorConfig(top_k=top_k, max_batch_size=max(batch, 1), lockstep_stall_timeout=60.0, **threads)
    stats = Statistics()
    scheduler = LockstepScheduler(clients[0], clients[1], config=config, eos_ids=frozenset({STOP_TOKEN}),  # type: ignore[arg-type]
                                  max_len=PROMPT_LEN + tokens + 2, stats=stats, channel=channel,
                                  stop_token=STOP_TOKEN, capacity=batch, vocab_size=vocab)
    collections = CollectionTimer()
    kernel.warm_up(*threads.values())
    gc.callbacks.append(collections)  # both undone in `finally`, whatever fails
    if freeze:
        heap.freeze()
    try:
        for ready in readies:
            if not ready.wait(60):
                raise RuntimeError("a synthetic client did not start within 60 s")
        params = SamplingParams(tokens, ignore_eos=True)
        results = []
        windows = []  # (start, end) of the measured rounds, perf_counter
        for round_index in range(rounds + 1):  # round 0 warms up (imports, sockets, caches)
            sink: asyncio.Queue = asyncio.Queue()
            sequences = [SequenceState(index=i, prompt="", theta_prompt_ids=[1 + i % 7] * PROMPT_LEN,
                                       t_prompt_ids=[1 + i % 5] * PROMPT_LEN, params=params,
                                       rng=np.random.default_rng([round_index, i]), sink=sink) for i in range(batch)]
            tokens_before, steps_before = stats.tokens, scheduler.counters.replies
            wall, cpu = time.perf_counter(), time.process_time()
            collections.counting = bool(round_index)
            scheduler.submit(sequences)
            outputs = await asyncio.wait_for(_take(sink, len(sequences)), 600)  # one timer, not one per output
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            collections.counting = False
            failed = [o.error for o in outputs if not o.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} sequences failed, e.g. {failed[0]}")
            if round_index:
                windows.append((time.perf_counter() - wall, time.perf_counter()))
                made = stats.tokens - tokens_before
                # A step: one report of each server, paired and replied to.
                results.append((made, (scheduler.counters.replies - steps_before) / 2, wall, cpu))
    finally:
        await asyncio.wait_for(scheduler.close(), 60)
        for client in clients:
            await client.close()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        channel.close()
        gc.callbacks.remove(collections)
        if freeze:
            heap.thaw()
    made, steps, wall, cpu = (sum(r[i] for r in results) for i in range(4))
    # Round trips of full reports (every sequence of the batch running) in the measured rounds.
    trips = np.array([seconds for client in clients for sent, seconds, rows in client.round_trips
                      if rows == batch and any(start <= sent <= end for start, end in windows)])
    if not trips.size:
        raise RuntimeError("the synthetic clients reported no round trip inside the measured rounds")
    # The coordinator's part of a round trip: one decision (merge, alpha*, sample, records), per full step.
    decisions = [1e6 * (t.total_s - t.servers_s) for t in stats.step_timings if t.batch == batch]
    return {"batch": batch, "tokens": made, "steps": steps, "tokens_per_s": made / wall,
            "tokens_per_cpu_s": made / cpu,
            "round_trip_us": {"median": 1e6 * float(np.median(trips)), "p90": 1e6 * float(np.quantile(trips, 0.9)),
                              "p99": 1e6 * float(np.quantile(trips, 0.99)), "count": int(trips.size)},
            "decision_us_median": float(np.median(decisions)) if decisions else float("nan"),
            "coordinator_cpu_us_per_token": 1e6 * cpu / made, "coordinator_cpu_us_per_step": 1e6 * cpu / max(steps, 1),
            "frozen_heap": freeze, "collections": collections.collections, "collection_cpu_s": collections.seconds,
            "collection_share": sum(collections.seconds) / cpu}


# -- the floor: messaging alone --------------------------------------------------------------

def echo_client_main(address: str, batch: int, top_k: int, count: int) -> None:
    """A synthetic plugin that sends `count` reports of `batch` rows and waits for each reply."""
    link = CoordinatorLink(address)
    ids, positions = np.arange(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    token_ids, logprobs = np.ones((batch, top_k), np.int32), np.zeros((batch, top_k), np.float32)
    for _ in range(count):
        link.step += 1
        deadline = time.monotonic() + 60
        link.send(wire.encode_report(link.step, 0, 1 << 20, ids, positions, token_ids, logprobs), deadline)
        if link.receive(deadline) is None:
            raise RuntimeError(f"the coordinator {link.problem}")
    link.close()


async def measure_floor(batch: int, top_k: int, count: int = 2000) -> dict:
    """Process CPU per round trip of the coordinator's messaging alone: the real channel
    (LockstepChannel in an event loop: receive and decode a report, encode and send its
    reply), no table, no decision. A lockstep step is two of them (one per server), so twice
    this is the least a step costs in this design."""
    channel = LockstepChannel()
    spawn = multiprocessing.get_context("spawn")
    client = spawn.Process(target=echo_client_main, args=(channel.address, batch, top_k, count), daemon=True)
    client.start()
    try:
        cpu = None
        async with asyncio.timeout(600):  # one bound for the run (a wait_for per message costs a task)
            for i in range(count):
                identity, report = await channel.receive()
                channel.reply(identity, report.step, np.zeros(batch, np.int64))
                if i == count // 10:  # after a warm-up
                    cpu, thread, counted = time.process_time(), time.thread_time(), count - i - 1
        cpu, thread = time.process_time() - cpu, time.thread_time() - thread
    finally:
        client.join(30)
        if client.is_alive():
            client.kill()
        channel.close()
    # The rest of the process's CPU is in other threads (zmq's I/O thread, when the channel was zmq).
    return {"batch": batch, "round_trips": counted, "cpu_us_per_round_trip": 1e6 * cpu / counted,
            "calling_thread_share": thread / cpu}


def plain_echo_client_main(port: int, report_bytes: int, reply_bytes: int, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            sock.sendall(b"r" * report_bytes)
            _receive_exactly(sock, reply_bytes)


def _receive_exactly(sock: socket.socket, size: int) -> None:
    while size:
        size -= len(sock.recv(size))


def measure_machine_floor(count: int = 2000) -> dict:
    """Process CPU per round trip of batch 1's message sizes over plain blocking sockets: no
    event loop, no Python between the system calls. What loopback TCP and waking a sleeping
    process cost on this machine, the part of `measure_floor` no code of ours can remove.
    (On the 2-core VMs this was measured on, an idle machine charges a process about ten
    times the CPU per wake-up of a busy one: compare only runs taken side by side.)"""
    report_bytes = len(wire.encode_report(1, 0, 1, np.zeros(1, np.int64), np.zeros(1, np.int64),
                                          np.ones((1, 20), np.int32), np.zeros((1, 20), np.float32)))
    reply_bytes = len(wire.encode_reply(1, np.zeros(1, np.int64)))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = multiprocessing.get_context("spawn").Process(
            target=plain_echo_client_main, args=(listener.getsockname()[1], report_bytes, reply_bytes, count),
            daemon=True)
        client.start()
        try:
            listener.settimeout(60)
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(60)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(count):
                    _receive_exactly(sock, report_bytes)
                    sock.sendall(b"a" * reply_bytes)
                    if i == count // 10:  # after a warm-up
                        cpu, counted = time.process_time(), count - i - 1
                cpu = time.process_time() - cpu
        finally:
            client.join(30)
            if client.is_alive():
                client.kill()
    return {"round_trips": counted, "cpu_us_per_round_trip": 1e6 * cpu / counted}


def _measure_here(results: multiprocessing.queues.Queue, start: multiprocessing.synchronize.Barrier,
                  kwargs: dict) -> None:
    """One coordinator process of `--processes N` (with its own two clients): its row, or its error."""
    try:
        start.wait(600)  # every coordinator's clients are up: the rounds overlap
        results.put(loop.run(measure(**kwargs)))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results.put({"error": repr(exc)})


def measure_processes(processes: int, **kwargs) -> dict:
    """`processes` coordinators at once, one pair of synthetic servers each (the "one per pair" of
    `dualvllm serve --workers`), each measured as `measure` does -> their rows and the sum of
    their tokens over the longest one's wall time."""
    spawn = multiprocessing.get_context("spawn")
    results, start = spawn.Queue(), spawn.Barrier(processes)
    # Not daemonic: each starts its own client processes.
    runs = [spawn.Process(target=_measure_here, args=(results, start, kwargs)) for _ in range(processes)]
    for run in runs:
        run.start()
    try:
        rows = [results.get(timeout=1800) for _ in runs]
    finally:
        for run in runs:
            run.join(60)
            if run.is_alive():
                run.kill()
    failed = [row["error"] for row in rows if "error" in row]
    if failed:
        raise RuntimeError(f"{len(failed)} of {processes} coordinators failed, e.g. {failed[0]}")
    wall = max(row["tokens"] / row["tokens_per_s"] for row in rows)
    return {"processes": processes, "batch": kwargs["batch"], "tokens_per_s": sum(r["tokens"] for r in rows) / wall,
            "tokens_per_cpu_s": [r["tokens_per_cpu_s"] for r in rows], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the id range the synthetic top-k rows draw from")
    parser.add_argument("--step-threads", type=int, default=1, help="CoordinatorConfig.step_threads")
    parser.add_argument("--rounds", type=int, default=3, help="measured batches per size (after one warm-up)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/coordinator_capacity.json"))
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the start-up heap to the garbage collector (the coordinator freezes it: "
                             "CoordinatorConfig.freeze_gc_heap)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1],
                        help="coordinator processes at once, each with its own pair of synthetic servers "
                             "(`dualvllm serve --workers`): their tokens/s together, per count")
    parser.add_argument("--floor", action="store_true",
                        help="also measure the messaging alone (a report in, its reply out, per round trip)")
    args = parser.parse_args()
    print(f"machine: {harness.machine()} (DUALVLLM_EVENT_LOOP=asyncio for the standard event loop)", flush=True)
    floors = []
    if args.floor:
        machine = measure_machine_floor()
        print(f"plain blocking sockets: {machine['cpu_us_per_round_trip']:7.1f} µs of CPU per report and reply "
              f"(this machine's floor: no event loop, no Python between the system calls)", flush=True)
        floors.append({"batch": 1, "plain_sockets": True, **machine})
        for batch in args.batch:
            row = loop.run(measure_floor(batch, args.top_k))
            floors.append({"batch": batch, "plain_sockets": False, **row})
            print(f"batch {batch:>5}: messaging alone {row['cpu_us_per_round_trip']:7.1f} µs of coordinator CPU "
                  f"per report and reply, {100 * row['calling_thread_share']:.0f}% of it in the calling thread "
                  f"({row['round_trips']:,} round trips; a step has two)", flush=True)
    together = []
    for processes in (n for n in args.processes if n > 1):
        for batch in args.batch:
            group = measure_processes(processes, batch=batch, tokens=args.tokens, top_k=args.top_k,
                                      rounds=args.rounds, freeze=not args.no_freeze, vocab=args.vocab,
                                      step_threads=args.step_threads)
            together.append(group)
            print(f"batch {batch:>5}, {processes} coordinator processes at once: {group['tokens_per_s']:>9,.0f} "
                  f"tokens/s together; each {', '.join(f'{c:,.0f}' for c in group['tokens_per_cpu_s'])} tokens "
                  f"per coordinator CPU-second", flush=True)
    rows = []
    for batch in (args.batch if 1 in args.processes else []):
        row = loop.run(measure(batch, args.tokens, args.top_k, args.rounds, freeze=not args.no_freeze,
                                     vocab=args.vocab, step_threads=args.step_threads))
        rows.append(row)
        print(f"batch {batch:>5}: {row['tokens_per_s']:>9,.0f} tokens/s, coordinator CPU "
              f"{row['coordinator_cpu_us_per_token']:>7.1f} µs/token, {row['coordinator_cpu_us_per_step']:>9.1f} µs/step "
              f"({row['tokens']:,} tokens, {row['steps']:,} steps); garbage collection "
              f"{100 * row['collection_share']:.1f}% of it ({'/'.join(map(str, row['collections']))} collections "
              f"of generations 0/1/2, heap {'frozen' if row['frozen_heap'] else 'not frozen'})", flush=True)
        trip = row["round_trip_us"]
        print(f"             capacity {row['tokens_per_cpu_s']:>9,.0f} tokens per coordinator CPU-second; round trip "
              f"(a report out of a client to its tokens back) median {trip['median']:,.0f} µs, p90 {trip['p90']:,.0f}, "
              f"p99 {trip['p99']:,.0f} over {trip['count']:,} full reports; the decision in it: median "
              f"{row['decision_us_median']:,.0f} µs", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "event_loop": loop.chosen(),
                                       "cpu": harness.machine(),
                                       "floor": floors, "rows": rows, "processes": together}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
