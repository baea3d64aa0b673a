"""Prompt scoring through the q* service against vLLM's own prompt logprobs on the same server.

    python benchmarks/scoring_throughput.py                     # starts the bundled tiny models
    python benchmarks/scoring_throughput.py --clients 16 --seconds 30 --repeats 2
    python benchmarks/scoring_throughput.py --shape small    # a 151,936-token vocabulary
    python benchmarks/scoring_throughput.py --theta-url URL --t-url URL

Scoring requests (one text prompt per request, echo, `--max-tokens` 0, logprobs 1: lm-eval's
`local-completions` loglikelihood request, except that lm-eval sends max_tokens 1 and drops
the token; `--max-tokens 1` sends that), from `--clients` concurrent clients, the arms alternating
`--repeats` times (service_load.drive: a warm-up, then the window). Two server pairs run side
by side, one started with --no-scoring-route (echo only), one as shipped, each server bound
to its own core as the launcher binds them:
- `vllm`: straight to the shipped pair's base server, which scores the prompt alone: vLLM's
  own prompt-logprobs throughput, the reference;
- `vllm_top_k_echo`, `vllm_top_k_generate`: straight to the same server, the request the
  service sends each server per prompt (token ids, the top `--top-k`), by echo on
  /v1/completions and by /inference/v1/generate with detokenizing off: what each route costs
  a server;
- `service_echo_unmerged`: `dualvllm serve --scoring-call-tokens 0` on the echo-only pair:
  each request its own echo call per server (the service before issue 44);
- `service_echo_merged`: `dualvllm serve` on the echo-only pair: concurrent requests merged
  into one echo call per server while one is in flight (dualvllm.service.batching);
- `service`: `dualvllm serve` as shipped, on the shipped pair: each prompt's top-k from
  /inference/v1/generate with detokenizing off (dualvllm.engines.vllm_scoring);
- `service_local_tokenizers`: the same with `--local-tokenizers`: text prompts tokenized in
  the service with the models' own tokenizers instead of one /tokenize request per server;
- `service_local_tokenizers_unmerged`: the same with `--scoring-call-tokens 0`: each request's
  prompts sent at once instead of gathered while the previous call is in flight.
A service request costs both servers a prompt-logprobs pass (q* needs both models' top-k at
every position) where the reference costs one. With `--theta-url`/`--t-url`, those two
servers serve every arm, through whichever route they have. Each arm runs `--seconds` after a warm-up;
requests finished inside the window count. Reported: requests/s, latency p50/p95, the
servers' CPU seconds per 1,000 requests, and each service arm's requests/s over the vllm
arm's of the same repeat (issue 44's target: at least 0.8). Writes
benchmarks/results/scoring_throughput.json and .png.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.service_load import drive, running_service  # noqa: E402

ARMS = ("vllm", "vllm_top_k_echo", "vllm_top_k_generate", "service_echo_unmerged", "service_echo_merged", "service",
        "service_local_tokenizers", "service_local_tokenizers_unmerged")
ECHO_ARMS = ("service_echo_unmerged", "service_echo_merged")  # on the pair started with --no-scoring-route
TARGET_RATIO = 0.8
LOGPROBS = 1  # lm-eval's local-completions loglikelihood


def echo_request(url: str, model: str, prompts: list[str],
                 max_tokens: int = 0) -> Callable[[aiohttp.ClientSession, int], Awaitable[int]]:
    async def request(session: aiohttp.ClientSession, index: int) -> int:
        body = {"model": model, "prompt": prompts[index % len(prompts)], "max_tokens": max_tokens, "echo": True,
                "logprobs": LOGPROBS, "temperature": 0.0}
        async with session.post(url + "/completions", json=body) as answer:
            text = await answer.text()
            if answer.status != 200:
                raise RuntimeError(f"{url} answered {answer.status}: {text[:300]}")
        return 1  # service_load.drive counts what a request returns: here requests
    return request


async def measured(args: Any, theta: str, t: str, request: Callable[..., Awaitable[int]]) -> dict[str, Any]:
    cpus = (harness.ServerCPU(theta), harness.ServerCPU(t))
    before = [c.seconds() for c in cpus]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.clients)) as session:
        result = await drive(lambda index: request(session, index), args.clients, args.seconds)
    result["requests_per_s"] = result.pop("tokens_per_s")
    del result["tokens"]
    used = sum(c.seconds() for c in cpus) - sum(before)
    # the CPU also covers the warm-up and the requests cut at the window's edges: per request, an upper bound
    result["servers_cpu_s_per_1k_requests"] = used / max(result["requests"], 1) * 1000
    return result


def top_k_request(url: str, model: str, prompts: list[list[int]], k: int,
                  route: str) -> Callable[[aiohttp.ClientSession, int], Awaitable[int]]:
    """What the service sends a server per scored prompt: its top-k by echo (`route` "echo") or by
    /inference/v1/generate with detokenizing off ("generate"), as engines/vllm_scoring.py does."""
    async def request(session: aiohttp.ClientSession, index: int) -> int:
        ids = prompts[index % len(prompts)]
        if route == "echo":
            path, body = "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": k, "temperature": 0.0, "return_tokens_as_token_ids": True}
        else:
            path, body = "/inference/v1/generate", {"model": model, "token_ids": ids, "sampling_params": {
                "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k, "detokenize": False}}
        async with session.post(url + path, json=body) as answer:
            text = await answer.text()
            if answer.status != 200:
                raise RuntimeError(f"{url}{path} answered {answer.status}: {text[:300]}")
        return 1
    return request


async def arm(name: str, args: Any, theta: str, t: str, prompts: list[str]) -> dict[str, Any]:
    if name.startswith("vllm"):
        async with aiohttp.ClientSession() as session:
            async with session.get(theta + "/v1/models") as answer:
                model = (await answer.json())["data"][0]["id"]
            if name == "vllm":  # text, as lm-eval sends it
                return await measured(args, theta, t, echo_request(theta + "/v1", model, prompts, args.max_tokens))
            ids = []  # token ids, as the service sends them
            for prompt in prompts:
                async with session.post(theta + "/tokenize", json={"model": model, "prompt": prompt}) as answer:
                    ids.append((await answer.json())["tokens"])
        route = name.rsplit("_", 1)[1]
        return await measured(args, theta, t, top_k_request(theta, model, ids, args.top_k, route))
    flags = {"service_echo_unmerged": ("--scoring-call-tokens", "0"),
             "service_local_tokenizers": ("--local-tokenizers",),
             "service_local_tokenizers_unmerged": ("--local-tokenizers", "--scoring-call-tokens", "0")}.get(name, ())
    async with running_service(args, theta, t, *flags) as (url, model, _):
        return await measured(args, theta, t, echo_request(url, model, prompts, args.max_tokens))


async def run(args: Any) -> dict[str, Any]:
    prompts = [p + " " + p for p in harness.prompts_for(400, seed=0)]  # ~12 tokens, like a short MC choice
    rows = []
    lockstep = args.mode != "per_token"
    models = harness.shape_models(args.shape) if args.shape else {}
    async with (harness.servers(args.theta_url, args.t_url, max_logprobs=args.top_k, lockstep=lockstep,
                                **models) as shipped,
                harness.servers(args.theta_url, args.t_url, max_logprobs=args.top_k, lockstep=lockstep,
                                scoring_route=False, **models) as echo_only):
        for repeat in range(args.repeats):
            found = {}
            for name in args.arms:
                found[name] = await arm(name, args, *(echo_only if name in ECHO_ARMS else shipped), prompts)
                print(f"repeat {repeat} {name:<24} {found[name]['requests_per_s']:7.1f} requests/s  p50 "
                      f"{found[name]['latency_p50_ms']:6.1f} ms  p95 {found[name]['latency_p95_ms']:6.1f} ms  "
                      f"servers {found[name]['servers_cpu_s_per_1k_requests']:.1f} CPU s / 1k requests", flush=True)
            for name in args.arms:
                ratio = found[name]["requests_per_s"] / max(found["vllm"]["requests_per_s"], 1e-9)
                rows.append({"repeat": repeat, "arm": name, **found[name], "ratio_to_vllm": ratio})
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "shape": args.shape,
            "clients": args.clients, "max_tokens": args.max_tokens, "arms": args.arms,
            "seconds": args.seconds, "target_ratio": TARGET_RATIO, "rows": rows}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in report["arms"]:
        values = [r["requests_per_s"] for r in report["rows"] if r["arm"] == name]
        ax.bar(name, float(np.median(values)))
    ax.set(ylabel="requests/s (median of repeats)",
           title=f"echo scoring, {report['clients']} clients: vLLM alone against the q* service")
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (lm-eval's default here)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--mode", default="lockstep", choices=["lockstep", "per_token"])
    parser.add_argument("--max-tokens", type=int, default=0, choices=[0, 1],
                        help="tokens each request generates after its echo (lm-eval sends 1 and drops it)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                        help="the arms to run (vllm always: the others' ratios are to it)")
    parser.add_argument("--shape", choices=harness.SHAPE_NAMES,
                        help="serve a realistic-shape pair (dualvllm.tinymodels.shapes: a 151,936-token vocabulary, "
                             "built and cached on first use) instead of the bundled tiny models, in bfloat16")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scoring_throughput.json"))
    args = parser.parse_args()
    args.arms = ["vllm", *(a for a in ARMS if a in args.arms and a != "vllm")]
    if args.shape and (args.theta_url or args.t_url):
        parser.error("--shape sets the servers this script starts; given servers keep their own")
    report = loop.run(run(args))
    for row in report["rows"]:
        if row["arm"] != "vllm":
            print(f"repeat {row['repeat']} {row['arm']}: {row['ratio_to_vllm']:.2f}x vLLM's own requests/s "
                  f"(target {TARGET_RATIO})")
    harness.finish(report, args.output, plot)


if __name__ == "__main__":
    main()
