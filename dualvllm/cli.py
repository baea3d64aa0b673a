"""The `dualvllm` command: serve, generate, demo.

Each subcommand parses its flags into the project's config objects and calls one
function. Coordinator flags are generated from CoordinatorConfig, so their defaults and
help live in one place (flags left unset fall back to DUALVLLM_* variables, then to the
schema's defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from coordinator.config import CoordinatorConfig
from coordinator.core import DualVLLMCoordinator
from common.errors import DualVLLMError, InvalidInputError
from engines.launcher import ServerConfig, VLLMServer, launch_pair, pair_configs

# Coordinator fields exposed as flags (the rest are for the Python API / environment).
COORDINATOR_FLAGS = ("theta_url", "t_url", "top_k", "fill_rule", "max_batch_size", "max_retries",
                     "request_timeout", "seed", "speculative_gamma", "speculative_drafter", "speculative_proposal",
                     "local_tokenizers")


def main(argv: Sequence[str] | None = None) -> int:
    _stop_on_signals()
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(args.command(args))
    except DualVLLMError as err:
        print(f"dualvllm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM both stop the command cleanly, servers included.

    A shell starts background jobs with SIGINT ignored, and Python keeps an inherited
    SIG_IGN, so `dualvllm serve &` would otherwise ignore `kill -INT`; SIGTERM (what
    process managers send) would kill us without stopping the servers' process groups.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


async def _serve(args: argparse.Namespace) -> int:
    from dualvllm.serve import serve_pair

    base, teacher = _server_configs(args)
    await serve_pair(base, teacher)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from dualvllm.jsonl_job import read_jobs, run_jobs

    read_jobs(args.input)  # fail on malformed input before starting any server
    async with _coordinator(args) as coordinator:
        report = await run_jobs(
            coordinator, args.input, args.output, seed=coordinator.config.seed or 0,
            max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop or None,
            return_diagnostics=args.diagnostics, fixed_alpha=args.fixed_alpha,
            show_progress=not args.quiet,
        )
        stats = coordinator.get_statistics()
    print(f"{report.written} written, {report.skipped} already done, {len(report.failed)} failed "
          f"of {report.total}; {stats['tokens']} tokens at {stats['tokens_per_s']:.1f} tokens/s, "
          f"mean alpha {stats['mean_alpha']:.3f}")
    if report.failed:
        first_id, first_error = report.failed[0]
        print(f"dualvllm: {len(report.failed)} prompts failed (first: id {first_id}: {first_error}). "
              "They were not written; rerun the same command to retry them.", file=sys.stderr)
        return 1
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from dualvllm.demo import run_demo

    async with _coordinator(args, default_local=True) as coordinator:
        report = await run_demo(coordinator, num_prompts=args.num_prompts, temperature=args.temperature)
    print(report.render())
    return 0


@contextlib.asynccontextmanager
async def _coordinator(args: argparse.Namespace, default_local: bool = False) -> AsyncIterator[DualVLLMCoordinator]:
    """A coordinator on the servers named by the flags, starting local ones if asked,
    or on two in-process transformers engines with `--engine transformers`."""
    overrides = {f: getattr(args, f) for f in COORDINATOR_FLAGS if getattr(args, f) is not None}
    given_urls = args.theta_url is not None and args.t_url is not None
    local = args.base is not None or args.teacher is not None or (default_local and not given_urls)
    async with contextlib.AsyncExitStack() as stack:
        if args.engine == "transformers":
            engines = await stack.enter_async_context(_in_process_engines(args))
            config = CoordinatorConfig(**overrides)
            yield await stack.enter_async_context(
                DualVLLMCoordinator(config, theta_engine=engines[0], t_engine=engines[1]))
            return
        if local:
            base, teacher = _server_configs(args)
            theta_server, t_server = await stack.enter_async_context(launch_pair(base, teacher))
            overrides.update(theta_url=theta_server.url, t_url=t_server.url)
            if args.skip_tokenizer_init:  # servers without tokenizers: the coordinator must tokenize
                overrides["local_tokenizers"] = True
        config = CoordinatorConfig(**overrides)
        yield await stack.enter_async_context(DualVLLMCoordinator(config))


@contextlib.asynccontextmanager
async def _in_process_engines(args: argparse.Namespace) -> AsyncIterator[tuple[Any, Any]]:
    import tinymodels
    from engines.transformers_engine import TransformersEngine

    if args.theta_url or args.t_url:
        raise InvalidInputError("--engine transformers runs the models in this process; drop --theta-url/--t-url")
    dtype = args.dtype if args.dtype not in (None, "auto") else "float32"
    async with TransformersEngine(args.base or tinymodels.BASE_DIR, name="theta", dtype=dtype) as theta, \
            TransformersEngine(args.teacher or tinymodels.TEACHER_DIR, name="t", dtype=dtype) as t:
        yield theta, t


def _server_configs(args: argparse.Namespace) -> tuple[ServerConfig, ServerConfig]:
    """Configs of the servers to start; they require the key the coordinator sends
    (DUALVLLM_API_KEY, kept out of argv so `ps` does not show it)."""
    import tinymodels

    secret = CoordinatorConfig().api_key
    api_key = secret.get_secret_value() if secret else None

    base = args.base or str(tinymodels.BASE_DIR)
    teacher = args.teacher or str(tinymodels.TEACHER_DIR)
    bundled = args.base is None and args.teacher is None
    dtype = args.dtype or (tinymodels.SERVER_DTYPE if bundled else "auto")
    common: dict[str, Any] = {"host": args.host, "max_logprobs": args.max_logprobs, "dtype": dtype,
                              "dev_mode": args.dev_mode, "api_key": api_key,
                              "skip_tokenizer_init": args.skip_tokenizer_init}
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    base_cfg, teacher_cfg = pair_configs(base, teacher, **common)
    if args.log_dir is not None:
        base_cfg = base_cfg.model_copy(update={"log_path": args.log_dir / "theta.log"})
        teacher_cfg = teacher_cfg.model_copy(update={"log_path": args.log_dir / "t.log"})
    return base_cfg, teacher_cfg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dualvllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="start the base and teacher vLLM servers until Ctrl-C")
    _add_server_flags(serve)
    serve.set_defaults(command=_serve)

    generate = commands.add_parser("generate", help="generate from q* for a JSONL file of prompts (resumable)")
    generate.add_argument("--input", type=Path, required=True, help="JSONL: one {\"prompt\": ...} per line")
    generate.add_argument("--output", type=Path, required=True, help="JSONL results; existing ids are skipped")
    _add_sampling_flags(generate)
    generate.add_argument("--diagnostics", action="store_true", help="add per-token KL/ESS/entropy summaries")
    generate.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_server_flags(generate)
    _add_coordinator_flags(generate)
    generate.set_defaults(command=_generate)

    demo = commands.add_parser(
        "demo", help="q* vs base vs teacher on the bundled tiny arithmetic models "
                     "(starts both servers unless --theta-url and --t-url are given)")
    demo.add_argument("--num-prompts", type=int, default=64, help="held-out problems per arm")
    demo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every arm")
    _add_server_flags(demo)
    _add_coordinator_flags(demo)
    demo.set_defaults(command=_demo)

    train = commands.add_parser(
        "train", help="GRPO or DPO on q* rollouts from the base and teacher servers")
    train.add_argument("--method", choices=("grpo", "dpo"), default="grpo",
                       help="grpo: streaming GRPO with weight pushes; dpo: TRL DPO on pairs mined from q* rollouts")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    _add_train_flags(train)
    train.set_defaults(command=_train)
    return parser


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy decoding of q*")
    parser.add_argument("--stop", action="append", help="stop string (repeatable); not included in the text")
    parser.add_argument("--fixed-alpha", type=float, default=None,
                        help="use this alpha instead of alpha* (0 = base only, 1 = teacher only)")


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("local servers (generate starts them only if --base/--teacher is given)")
    group.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                       help="vllm: servers (started or given by URL); transformers: both models in "
                            "this process, no vLLM needed (slower; the fallback and the exact reference)")
    group.add_argument("--base", help="base model (pi_theta) directory; default: the bundled tiny base")
    group.add_argument("--teacher", help="teacher model (pi_t) directory; default: the bundled tiny teacher")
    group.add_argument("--host", default="127.0.0.1", help="interface the servers bind to")
    group.add_argument("--max-logprobs", type=int, default=100, help="largest top_k the servers accept")
    group.add_argument("--dtype", default=None,
                       help="vLLM --dtype of both servers; default: float32 for the bundled models, else auto")
    group.add_argument("--skip-tokenizer-init", action="store_true",
                       help="start the servers without their tokenizers (faster per request; the coordinator "
                            "then tokenizes itself, from the model directories)")
    group.add_argument("--dev-mode", action="store_true",
                       help="enable /collective_rpc for weight pushes (loopback hosts only)")
    group.add_argument("--log-dir", type=Path, default=None, help="write theta.log and t.log here")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field; only the flags given override the schema's defaults."""
    import typing

    from training.config import TrainConfig

    for name, field in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        kind = inner[0] if inner and typing.get_origin(annotation) is not typing.Literal else annotation
        extra: dict[str, Any] = {}
        if typing.get_origin(kind) is typing.Literal:
            extra["choices"] = typing.get_args(kind)
            kind = str
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
            continue
        parser.add_argument(flag, type=kind, default=None, required=field.is_required(),
                            help=f"{field.description} (default: {field.default})" if not field.is_required()
                            else field.description, **extra)


async def _train(args: argparse.Namespace) -> int:
    from training.config import TrainConfig
    from training.grpo import train_grpo

    values = {name: getattr(args, name) for name in TrainConfig.model_fields if getattr(args, name, None) is not None}
    if args.method == "dpo":
        from training.dpo import train_dpo

        if args.resume:
            raise InvalidInputError("--resume applies to grpo runs; a dpo run is short, start it again")
        dpo = await train_dpo(TrainConfig(**values))
        print(f"{dpo.pairs} preference pairs ({dpo.pairs_path}); held-out greedy accuracy of the base "
              f"{dpo.accuracy_before:.1%} -> {dpo.accuracy_after:.1%}; model in {dpo.model_dir}")
        return 0
    report = await train_grpo(TrainConfig(**values), resume=args.resume)
    print(f"{report.steps_done} steps; held-out greedy accuracy of the base {report.accuracy_before:.1%} -> "
          f"{report.accuracy_after:.1%}; {report.dropped_stale_batches} stale batches dropped; "
          f"metrics in {report.metrics_path}")
    return 0


def _add_coordinator_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("coordinator (unset flags fall back to DUALVLLM_* variables)")
    for name in COORDINATOR_FLAGS:
        field = CoordinatorConfig.model_fields[name]
        if field.annotation is bool:
            group.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None,
                               help=f"{field.description} (default: {field.default})")
            continue
        kind = field.annotation if field.annotation in (int, float, str) else None
        if name == "seed":
            kind = int
        group.add_argument("--" + name.replace("_", "-"), type=kind or str, default=None,
                           help=f"{field.description} (default: {field.default})")


if __name__ == "__main__":
    sys.exit(main())
