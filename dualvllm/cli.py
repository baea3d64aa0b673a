"""The `dualvllm` command: serve, generate, demo, train, eval.

Each subcommand parses its flags into the project's config objects and calls one
function. Flags of coordinator, server and training options are generated from
CoordinatorConfig, ServerConfig and the training configs, so their types, bounds, defaults
and help live in one place; a flag left unset falls back to the schema (for the
coordinator, to DUALVLLM_* variables first). `train` and `eval` also read a recipe file
(`--config recipes/tiny-arith.yaml`): the flags given override its values, which override
the schema's defaults (training/config_sources.py). Everything a user typed is checked
before any server starts or is contacted, and a bad value is one line on stderr, exit
code 2. `serve`, `train` and `eval` take `--dry-run`: the plan of the servers they would start
(command lines, environments, ports, GPUs, start order; for `train`, the learner's device) is
printed and nothing starts; `--plan-gpus N` plans for a machine of N GPUs (engines/placement.py).

The flags stay argparse's, not pydantic-settings' CliSettingsSource: that source spells an
option of several values as a repeated flag or a JSON list, not as `--reward exact length`,
and parses one model, where `train` takes the options of every method and picks the
method's class from `--method` (the reasons in full: training/config_sources.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Iterable, Sequence

from pydantic import BaseModel

from dualvllm.common import loop
from dualvllm.common.errors import DualVLLMError, InvalidInputError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.engines import placement
from dualvllm.engines.launcher import (
    ServerConfig,
    launch_replicas,
    replica_configs,
    server_names,
    visible_gpus,
    with_ports,
)

# Coordinator fields exposed as flags (the rest are for the Python API / environment).
COORDINATOR_FLAGS = (
    "theta_url",
    "t_url",
    "theta_urls",
    "t_urls",
    "top_k",
    "fill_rule",
    "max_batch_size",
    "max_retries",
    "request_timeout",
    "seed",
    "speculative_gamma",
    "speculative_drafter",
    "speculative_proposal",
    "local_tokenizers",
    "mode",
    "replica_probe_interval",
    "step_threads",
)
# q* endpoint fields exposed as flags of `serve`.
SERVICE_FLAGS = (
    "service_host",
    "service_port",
    "api_key",
    "served_model_name",
    "max_queued_sequences",
    "max_request_tokens",
    "max_body_bytes",
    "default_max_tokens",
    "scoring_call_tokens",
    "workers",
)
# Server fields exposed as flags; the model directories are --base/--teacher, and the options
# `train` and `eval` share (placement per role, dtype, context, KV cache) are ServerOptions'.
SERVER_FLAGS = (
    "host",
    "max_logprobs",
    "skip_tokenizer_init",
    "scoring_route",
    "dev_mode",
    "weight_transfer",
    "lockstep",
    "lockstep_timeout_s",
)


# Flags whose values may start with "-" (vLLM arguments): given as `--flag VALUE`, they are
# handed to argparse as `--flag=VALUE`, which it never reads as an option of its own.
DASH_VALUE_FLAGS = frozenset(
    "--" + name.replace("_", "-")
    for name, field in placement.ServerOptions.model_fields.items()
    if field.json_schema_extra == placement.REPEATED_FLAG
)


def main(argv: Sequence[str] | None = None) -> int:
    _stop_on_signals()
    parser = _parser()
    args = parser.parse_args(_join_dash_values(sys.argv[1:] if argv is None else list(argv)))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return loop.run(args.command(args))
    except DualVLLMError as err:
        print(f"dualvllm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _join_dash_values(argv: list[str]) -> list[str]:
    """`--base-vllm-arg --enable-prefix-caching` -> `--base-vllm-arg=--enable-prefix-caching`."""
    joined: list[str] = []
    taking = False
    for word in argv:
        if taking:
            joined[-1] += "=" + word
        else:
            joined.append(word)
        taking = not taking and word in DASH_VALUE_FLAGS
    return joined


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM both stop the command cleanly, servers included.

    A shell starts background jobs with SIGINT ignored, and Python keeps an inherited
    SIG_IGN, so `dualvllm serve &` would otherwise ignore `kill -INT`; SIGTERM (what
    process managers send) would kill us without stopping the servers' process groups.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _as_sigint)


def _as_sigint(signum: int, frame: object) -> None:
    """SIGTERM takes Ctrl-C's path. Inside asyncio.run, SIGINT's handler cancels the main
    task, so every `async with` unwinds and stops what it started. Raising KeyboardInterrupt
    here instead lands in whatever frame runs, and when that is a finalizer (`__del__`, a
    GC callback) Python prints it and carries on: the likely cause of a `dualvllm serve` that
    once went on serving after a SIGTERM, which Ctrl-C never did."""
    signal.raise_signal(signal.SIGINT)


async def _serve(args: argparse.Namespace) -> int:
    from dualvllm.serve import serve_endpoint, serve_servers
    from dualvllm.service.app import listening_socket
    from dualvllm.service.config import ServiceConfig
    from dualvllm.service.workers import started_workers

    if args.dry_run:
        print(_dry_run(args, default_local=True))
        return 0
    if args.servers_only:
        if getattr(args, "workers", None) not in (None, 1):
            raise InvalidInputError(
                f"--workers {args.workers} runs endpoint processes, and --servers-only starts no endpoint; drop one"
            )
        await serve_servers(_server_configs(args))
        return 0
    # bad flags fail before servers start; --dev-mode opens the servers' dev routes and the service's
    config = ServiceConfig(**_given(args, ServiceConfig, SERVICE_FLAGS), dev_mode=bool(args.dev_mode))
    if config.workers > 1 and args.engine == "transformers":
        raise InvalidInputError(
            f"--workers {config.workers} with --engine transformers: each worker would load both models "
            "again; serve the in-process engines with one worker, or serve vLLM servers"
        )
    launched: list[Any] = []
    with listening_socket(config) as sock:  # a port in use fails before the servers start, too
        async with _coordinator(args, default_local=True, launched=launched) as coordinator:
            if config.workers == 1:
                await serve_endpoint(coordinator, config, launched, sock)
                return 0
            log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dualvllm-workers-"))
            async with started_workers(
                coordinator.config, config, count=config.workers, port=sock.getsockname()[1], log_dir=log_dir
            ) as (workers, place):
                await serve_endpoint(coordinator, config, launched, sock, workers=workers, place=place)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from dualvllm.jsonl_job import check_output, read_jobs, run_jobs

    jobs = read_jobs(args.input)
    check_output(args.output, input_path=args.input)
    if CoordinatorConfig(**_given(args, CoordinatorConfig, COORDINATOR_FLAGS)).self_teacher:
        same = next((job for job in jobs if not isinstance(job.prompt, tuple) or job.prompt[0] == job.prompt[1]), None)
        if same is not None:
            raise InvalidInputError(
                f"--theta-url and --t-url are one server, so the teacher is the base model shown another prompt: "
                f"every line needs a theta_prompt and a t_prompt that differ (id {same.id} has one prompt for both)"
            )
    # Checked before any server starts.
    params = SamplingParams(
        args.max_tokens,
        temperature=args.temperature,
        stop=tuple(args.stop or ()),
        fixed_alpha=args.fixed_alpha,
        return_diagnostics=args.diagnostics,
    )
    async with _coordinator(args) as coordinator:
        report = await run_jobs(
            coordinator,
            args.input,
            args.output,
            params,
            seed=coordinator.config.seed or 0,
            show_progress=not args.quiet,
        )
        stats = coordinator.get_statistics()
    print(
        f"{report.written} written, {report.skipped} already done, {len(report.failed)} failed "
        f"of {report.total}; {stats['tokens']} tokens at {stats['tokens_per_s']:.1f} tokens/s, "
        f"mean alpha {stats['mean_alpha']:.3f}"
    )
    if report.failed:
        first_id, first_error = report.failed[0]
        print(
            f"dualvllm: {len(report.failed)} prompts failed (first: id {first_id}: {first_error}). "
            "They were not written; rerun the same command to retry them.",
            file=sys.stderr,
        )
        return 1
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from dualvllm.demo import DEMO_MAX_TOKENS, run_demo

    if args.num_prompts < 1:
        raise InvalidInputError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    SamplingParams(DEMO_MAX_TOKENS, temperature=args.temperature)  # checked before any server starts
    async with _coordinator(args, default_local=True) as coordinator:
        report = await run_demo(coordinator, num_prompts=args.num_prompts, temperature=args.temperature)
    print(report.render())
    return 0


def _train_config(args: argparse.Namespace) -> Any:
    """The flags given over the --config recipe over the defaults of the method's class."""
    from dualvllm.training.config import TRAIN_OPTIONS, TrainConfig

    return TrainConfig.parse(config_file=args.config, **_given(args, TrainConfig, TRAIN_OPTIONS))


async def _train(args: argparse.Namespace) -> int:
    from dualvllm.training.serving import describe_run, run_plan

    config = _train_config(args)
    if config.engine == "transformers" and (servers := config.server_flags_given()):
        raise InvalidInputError(
            f"--engine transformers samples in this process and starts no server; {', '.join(servers)} "
            "set the servers: drop them or use --engine vllm"
        )
    from dualvllm.training.data_parallel import Ranks

    ranks = Ranks.from_environment()  # several learner processes (accelerate launch), or None
    main_rank = ranks is None or ranks.main  # prints what the run prints, once
    if args.dry_run:
        if main_rank:
            print(describe_run(config, plan_gpus=_plan_gpus(args)))
        return 0
    _plan_gpus(args)
    if config.engine == "vllm" and not config.theta_urls:
        run_plan(config)  # servers that cannot be placed are refused before any model loads
    if config.method == "dpo":
        if ranks is not None:
            raise InvalidInputError(
                "--method dpo trains with TRL's DPOTrainer in one process: start it without accelerate launch "
                "(several learner processes are for the streaming methods)"
            )
        if args.resume:
            raise InvalidInputError("--resume applies to grpo runs; a dpo run is short, start it again")
        from dualvllm.training.dpo import train_dpo

        dpo = await train_dpo(config)
        print(
            f"{dpo.pairs} preference pairs ({dpo.pairs_path}); held-out greedy accuracy of the base "
            f"{dpo.accuracy_before:.1%} -> {dpo.accuracy_after:.1%}; model in {dpo.model_dir}"
        )
        return 0
    from dualvllm.training.grpo import train_grpo

    report = await train_grpo(config, resume=args.resume)
    if not main_rank:  # every rank ends with rank 0's report
        return 0
    print(
        f"{report.steps_done} steps; held-out greedy accuracy of the base {report.accuracy_before:.1%} -> "
        f"{report.accuracy_after:.1%}; {report.dropped_stale_batches} stale batches dropped; "
        f"metrics in {report.metrics_path}"
    )
    return 0


async def _eval(args: argparse.Namespace) -> int:
    from dualvllm.training.config import EvalConfig
    from dualvllm.training.evaluation import run_eval

    config = EvalConfig.parse(config_file=args.config, **_given(args, EvalConfig, EvalConfig.model_fields))
    if args.dry_run:
        from dualvllm.training.serving import describe_run

        print(describe_run(config, plan_gpus=_plan_gpus(args)))
        return 0
    _plan_gpus(args)
    report = await run_eval(config)
    print(report)
    return 0


@contextlib.asynccontextmanager
async def _coordinator(
    args: argparse.Namespace, default_local: bool = False, launched: list[Any] | None = None
) -> AsyncIterator[DualVLLMCoordinator]:
    """A coordinator on the servers named by the flags, starting local ones if asked (added
    to `launched`), or on two in-process transformers engines with `--engine transformers`."""
    overrides = _given(args, CoordinatorConfig, COORDINATOR_FLAGS)
    config = CoordinatorConfig(**overrides)  # bad flags fail here, before any server starts
    local = _starts_servers(args, default_local)
    if local and args.replicas > 1:  # what pools cannot do is refused before any server starts
        CoordinatorConfig(**overrides | {"theta_urls": [f"http://replica-{i}" for i in range(args.replicas)]})
    async with contextlib.AsyncExitStack() as stack:
        if args.engine == "transformers":
            engines = await stack.enter_async_context(_in_process_engines(args))
            yield await stack.enter_async_context(
                DualVLLMCoordinator(config, theta_engine=engines[0], t_engine=engines[1])
            )
            return
        if local:
            pairs = _server_configs(args)
            servers = await stack.enter_async_context(launch_replicas(pairs))
            if launched is not None:
                launched.extend(server for pair in servers for server in pair)
            overrides.update(theta_urls=[theta.url for theta, _ in servers], t_urls=[t.url for _, t in servers])
            if pairs[0][0].skip_tokenizer_init:  # servers without tokenizers: the coordinator must tokenize
                overrides["local_tokenizers"] = True
            elif "local_tokenizers" not in config.model_fields_set:
                # The model directories are on this machine, so tokenize here: a /tokenize request per
                # text per server cost the servers a seventh of a scored request's CPU at Qwen's
                # vocabulary (benchmarks/README.md, scoring_throughput.py). --no-local-tokenizers: over HTTP.
                overrides["local_tokenizers"] = True
            config = CoordinatorConfig(**overrides)
        yield await stack.enter_async_context(DualVLLMCoordinator(config))


@contextlib.asynccontextmanager
async def _in_process_engines(args: argparse.Namespace) -> AsyncIterator[tuple[Any, Any]]:
    from dualvllm import tinymodels
    from dualvllm.engines.transformers_engine import TransformersEngine

    if args.theta_url or args.t_url or args.theta_urls or args.t_urls:
        raise InvalidInputError("--engine transformers runs the models in this process; drop the server URLs")
    dtype = args.dtype if args.dtype not in (None, "auto") else "float32"
    async with (
        TransformersEngine(args.base or tinymodels.BASE_DIR, name="theta", dtype=dtype) as theta,
        TransformersEngine(args.teacher or tinymodels.TEACHER_DIR, name="t", dtype=dtype) as t,
    ):
        yield theta, t


def _starts_servers(args: argparse.Namespace, default_local: bool) -> bool:
    """Whether the command starts local servers: --base/--teacher given, or (serve, demo) no server URLs."""
    given_urls = (args.theta_url or args.theta_urls) is not None and (args.t_url or args.t_urls) is not None
    return args.base is not None or args.teacher is not None or (default_local and not given_urls)


def _server_configs(args: argparse.Namespace) -> list[tuple[ServerConfig, ServerConfig]]:
    """Configs of the (base, teacher) pairs to start, placed (engines/placement.py) and with their
    ports chosen; they require the key the coordinator sends (DUALVLLM_API_KEY, kept out of argv
    so `ps` does not show it)."""
    if args.replicas < 1:
        raise InvalidInputError(f"--replicas must be at least 1, got {args.replicas}")
    secret = CoordinatorConfig().api_key
    options = _given(args, ServerConfig, SERVER_FLAGS)
    if secret is not None:
        options["api_key"] = secret.get_secret_value()
    server_options = placement.PlacementOptions(
        **_given(args, placement.ServerOptions, placement.ServerOptions.model_fields)
    )
    plan_gpus = _plan_gpus(args)
    visible = tuple(range(plan_gpus)) if plan_gpus is not None else visible_gpus()
    plan = placement.plan(server_options, replicas=args.replicas, visible=visible)
    pairs = replica_configs(
        args.base,
        args.teacher,
        replicas=args.replicas,
        log_dir=args.log_dir,
        plan=plan,
        **options,
        **server_options.server_fields(),
    )
    return with_ports(pairs)


def _plan_gpus(args: argparse.Namespace) -> int | None:
    """--plan-gpus N: the GPU count a dry run plans for (None: this machine's)."""
    if args.plan_gpus is None:
        return None
    if not args.dry_run:
        raise InvalidInputError(
            f"--plan-gpus {args.plan_gpus} plans for another machine and starts nothing; add --dry-run, or drop it"
        )
    if args.plan_gpus < 0:
        raise InvalidInputError(f"--plan-gpus must be 0 or more, got {args.plan_gpus}")
    return int(args.plan_gpus)


def _dry_run(args: argparse.Namespace, default_local: bool) -> str:
    """`serve --dry-run`: the servers it would start (engines/dry_run.py), or why it starts none."""
    from dualvllm.engines.dry_run import describe_servers

    CoordinatorConfig(**_given(args, CoordinatorConfig, COORDINATOR_FLAGS))  # its flags are checked too
    if args.engine == "transformers":
        return "--engine transformers: no server is started; both models run in this process"
    if not _starts_servers(args, default_local) and not args.servers_only:
        return "no server is started: the coordinator uses the servers of --theta-url(s) and --t-url(s)"
    return describe_servers(server_names(_server_configs(args)))


def _given(args: argparse.Namespace, schema: type[BaseModel], names: Iterable[str]) -> dict[str, Any]:
    """The schema's fields among `names` the user set on the command line (unset flags are None)."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _add_schema_flags(parser: argparse.ArgumentParser | Any, schema: type[BaseModel], names: Iterable[str]) -> None:
    """One flag per schema field: its type (Literal -> choices, bool -> --x/--no-x), its
    description and default as help. Flags default to None, so only given ones override."""
    for name in names:
        field = schema.model_fields[name]
        _add_flag(
            parser,
            name,
            field,
            (field.description or "") if field.is_required() else f"{field.description} (default: {field.default})",
        )


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option of any training method (the coordinator's are a recipe's section):
    the help gives each method's default where they differ, and the methods that take the
    option when not all do. --output-dir is required unless the recipe gives it."""
    from dualvllm.training.config import METHOD_CLASSES, TRAIN_OPTIONS, TrainConfig
    from dualvllm.training.config_sources import NESTED

    servers = _run_servers_group(parser)
    for name in TRAIN_OPTIONS:
        if name == NESTED:
            continue
        takers = {method: cls.model_fields[name] for method, cls in METHOD_CLASSES.items() if name in cls.model_fields}
        field = TrainConfig.model_fields.get(name) or next(iter(takers.values()))
        text = field.description or ""
        if name == "method":
            text += f" (default: {field.default})"
        elif not field.is_required():
            defaults: dict[str, list[str]] = {}
            for method, taken in takers.items():
                defaults.setdefault(str(taken.default), []).append(method)
            usual, *others = sorted(defaults, key=lambda d: -len(defaults[d]))
            text += f" (default: {usual}" + "".join(f"; {', '.join(defaults[d])}: {d}" for d in others) + ")"
        if len(takers) < len(METHOD_CLASSES):
            text += f" [--method {', '.join(takers)}]"
        _add_flag(
            servers if name in placement.ServerOptions.model_fields else parser, name, field, text, required=False
        )


def _run_servers_group(parser: argparse.ArgumentParser) -> Any:
    """The group of a run's server options (placement per role; engines/placement.py), with --dry-run."""
    group = parser.add_argument_group(
        "servers the run starts (placement per role: each server sees only its GPUs; engines/placement.py)"
    )
    _add_plan_flags(group)
    return group


def _add_plan_flags(group: Any) -> None:
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="print every server this would start (command line, the environment the launcher sets, port, "
        "log, GPUs, start order; for train the learner's device), then exit without starting anything",
    )
    group.add_argument(
        "--plan-gpus",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: plan for a GPU machine with N GPUs (0..N-1) instead of this one",
    )


def _add_flag(
    parser: argparse.ArgumentParser | Any, name: str, field: Any, text: str, required: bool | None = None
) -> None:
    flag = "--" + name.replace("_", "-")
    required = field.is_required() if required is None else required
    text = text.replace("%", "%%")  # argparse formats help strings
    kind, many = _flag_type(field.annotation)
    extra: dict[str, Any] = {"nargs": "+"} if many else {}
    spelling = field.json_schema_extra
    if spelling == placement.REPEATED_FLAG:  # once per value
        parser.add_argument(flag, action="append", default=None, metavar="ARGS", help=text)
    elif spelling == placement.CSV_FLAG:  # one value, the list comma-separated; the schema splits it
        parser.add_argument(flag, type=str, default=None, metavar="N,N,...", help=text)
    elif kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif isinstance(kind, tuple):
        parser.add_argument(flag, choices=kind, default=None, required=required, help=text, **extra)
    else:
        parser.add_argument(flag, type=kind, default=None, required=required, help=text, **extra)


def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, takes several values) of a field: int, float, str, bool, Path, or a
    tuple of Literal choices; tuple[X, ...] fields take one or more X."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return typing.get_args(annotation), False
    if origin in (typing.Union, types.UnionType):
        return _flag_type(next(a for a in typing.get_args(annotation) if a is not type(None)))
    if origin is tuple:
        return _flag_type(typing.get_args(annotation)[0])[0], True
    return (annotation if annotation in (int, float, str, bool, Path) else str), False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dualvllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="the OpenAI-compatible q* endpoint, over the base and teacher servers it starts "
        "(or those of --theta-url/--t-url), until Ctrl-C",
    )
    serve.add_argument(
        "--servers-only",
        action="store_true",
        help="start the two vLLM servers and print their URLs, without the q* endpoint",
    )
    _add_server_flags(serve)
    _add_plan_flags(serve)
    _add_coordinator_flags(serve)
    group = serve.add_argument_group(
        "q* endpoint (unset flags fall back to DUALVLLM_* variables; prefer "
        "DUALVLLM_API_KEY to --api-key, which `ps` shows)"
    )
    from dualvllm.service.config import ServiceConfig

    _add_schema_flags(group, ServiceConfig, SERVICE_FLAGS)
    serve.set_defaults(command=_serve)

    generate = commands.add_parser("generate", help="generate from q* for a JSONL file of prompts (resumable)")
    generate.add_argument("--input", type=Path, required=True, help='JSONL: one {"prompt": ...} per line')
    generate.add_argument("--output", type=Path, required=True, help="JSONL results; existing ids are skipped")
    _add_sampling_flags(generate)
    generate.add_argument("--diagnostics", action="store_true", help="add per-token KL/ESS/entropy summaries")
    generate.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_server_flags(generate)
    _add_coordinator_flags(generate)
    generate.set_defaults(command=_generate)

    demo = commands.add_parser(
        "demo",
        help="q* vs base vs teacher on the bundled tiny arithmetic models "
        "(starts both servers unless --theta-url and --t-url are given)",
    )
    demo.add_argument("--num-prompts", type=int, default=64, help="held-out problems per arm")
    demo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every arm")
    _add_server_flags(demo)
    _add_coordinator_flags(demo)
    demo.set_defaults(command=_demo)

    train = commands.add_parser(
        "train",
        help="train the base on q* rollouts (grpo, sft, rft, opd, distill or dpo); the defaults are a real "
        "LLM's, the bundled tiny models' are --config recipes/tiny-arith.yaml",
    )
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    _add_config_flag(train)
    _add_train_flags(train)
    train.set_defaults(command=_train)

    evaluate = commands.add_parser(
        "eval", help="greedy accuracy and pass@k of the base alone, q* and the teacher alone on held-out prompts"
    )
    from dualvllm.training.config import EvalConfig
    from dualvllm.training.config_sources import NESTED

    _add_config_flag(evaluate)
    options = [name for name in EvalConfig.model_fields if name != NESTED]
    placed = placement.ServerOptions.model_fields
    _add_schema_flags(evaluate, EvalConfig, [name for name in options if name not in placed])
    _add_schema_flags(_run_servers_group(evaluate), EvalConfig, [name for name in options if name in placed])
    evaluate.set_defaults(command=_eval)
    return parser


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="RECIPE.yaml",
        help="a recipe file: options under their names, one a line, and the coordinator's in a "
        "coordinator: section (recipes/: tiny-arith.yaml is the bundled models' values); the "
        "flags given override it",
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy decoding of q*")
    parser.add_argument("--stop", action="append", help="stop string (repeatable); not included in the text")
    parser.add_argument(
        "--fixed-alpha",
        type=float,
        default=None,
        help="use this alpha instead of alpha* (0 = base only, 1 = teacher only)",
    )


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("local servers (generate starts them only if --base/--teacher is given)")
    group.add_argument("--base", help="base model (pi_theta) directory; default: the bundled tiny base")
    group.add_argument("--teacher", help="teacher model (pi_t) directory; default: the bundled tiny teacher")
    group.add_argument("--log-dir", type=Path, default=None, help="write theta.log and t.log here")
    group.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="start this many (base, teacher) pairs, each on its own GPUs (--base-gpus, --teacher-gpus, "
        "or the default plan) or, on the CPU build, its own cores when there are enough; the "
        "coordinator pools the replicas of each role, and a replica that dies hands its "
        "sequences to the others (default: 1)",
    )
    _add_schema_flags(group, ServerConfig, SERVER_FLAGS)
    _add_schema_flags(group, placement.ServerOptions, placement.ServerOptions.model_fields)
    parser.set_defaults(dry_run=False, plan_gpus=None)


def _add_coordinator_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("coordinator (unset flags fall back to DUALVLLM_* variables)")
    group.add_argument(
        "--engine",
        choices=("vllm", "transformers"),
        default="vllm",
        help="vllm: servers (started or given by URL); transformers: both models in "
        "this process, no vLLM needed (slower; the fallback and the exact reference)",
    )
    _add_schema_flags(group, CoordinatorConfig, COORDINATOR_FLAGS)


if __name__ == "__main__":
    sys.exit(main())
