"""TRL's own importance-sampling settings on q* rollouts against this project's corrections (issue 44, item 3).

    python benchmarks/trl_settings.py --seeds 0 1 2 3 4 5 --steps 150 --eval-every 25 --jobs 2   # the table
    python benchmarks/trl_settings.py --seeds 0 --steps 3 --eval-every 3 --jobs 2   # smoke: every arm and task

Every arm is a TRL run in process through benchmarks/trl_compare.run_trl, as trl_compare's TRL arm
is: q* rollouts from QStarRollouts over a live TransformersEngine of the model being trained and
the task's teacher beside it; the same seed, the same 8 prompts x 8 rollouts at every update (TRL's
sampler unshuffled over dualvllm train's order, checked), learning rate, dapo normalization with
group-std scaling, AdamW at a constant rate, float32. At update 1 every arm trains on the very same
rollouts (same weights, same sampling seeds); after that they differ as the weights do.

- `ours-<correction>`: QStarGRPOTrainer with this project's correction (sequence, token, none,
  vespo), its advantages and loss (training/trl_trainer.py).
- `trl-off`: TRL's stock GRPOTrainer with `use_vllm=False`: it ignores the rollouts' logprobs and
  trains on q* rollouts as if they were on-policy (the gradient of `ours-none`).
- `trl-<mode>-cap<C>`: TRL's stock GRPOTrainer with `vllm_importance_sampling_correction=True`,
  `vllm_importance_sampling_mode=<mode>` and `vllm_importance_sampling_clip_max=C` (clip_min at
  TRL's default, None): each token's loss times pi_theta/q* (token modes) or the rollout's
  prod pi_theta/q* (sequence modes), clamped to C (truncate) or zeroed above C (mask).
  `token_truncate` at cap 2 is `ours-token`'s weight min(pi_theta/q*, 2) on TRL's loss.

TRL applies that correction only when its trainer's `use_vllm` is set (trl/trainer/grpo_trainer.py
1.16: lines 2644, 2660, 2908, 3146), and `use_vllm=True` in the config builds a vLLM backend at
init (line 1105: in-process vLLM in colocate mode, a server in server mode). With a rollout_func,
that backend's only duty is `sync_weights()` before a step's rollouts (line 2202), which in process
has nothing to do: the sampler reads the live weights (run_trl drops the engine's cached keys and
values after every update instead). So `trl-<mode>-*` arms build the trainer with `use_vllm=False`
and then set `use_vllm` with a backend whose sync does nothing (sampler_is_trainer): every line of
TRL's correction and loss runs as shipped, on log q* as `dualvllm serve` hands it to a stock TRL
trainer in server mode.

Tasks: `arithmetic`, the bundled two-digit sums (tiny-arith recipe, the bundled teacher), and
`hard`, three-digit sums the base never solves with the hard teacher (train_compare's
hard-methods: tinymodels/data/hard_*.jsonl, 5 tokens). On the hard task greedy accuracy stays
near 0 for every GRPO arm within hundreds of updates (benchmarks/README.md), so each evaluation
also measures the base's mean log p(right answer + EOS) on the 500 test problems, in nats.

Each (task, seed, arm) cell writes OUTPUT/<task>/seed-<s>/<arm>/result.json when it finishes; a
cell already finished with the same settings is read back, not rerun (an interrupted cell starts
over: TRL's runs keep no checkpoint here). `--jobs N` runs N cells at once, each in its own
process pinned to one core with one torch thread (its log beside its folder), then summarises.
Prints per task and arm the median [interquartile range] over seeds of held-out greedy accuracy
(and answer log-probability) at every evaluation, and the seconds per update; writes
OUTPUT/trl_settings.json (accuracies as fractions, log-probabilities in nats, seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from benchmarks import train_compare  # noqa: E402
from benchmarks.trl_compare import GROUP_SIZE, PROMPTS_PER_STEP, RECIPE, Probe, TrainerChoice, run_trl  # noqa: E402
from benchmarks.trl_compare import train_config  # noqa: E402
from dualvllm.training.config import TRAIN_OPTIONS, GRPOTrainConfig  # noqa: E402
from dualvllm.training.config_sources import read_recipe  # noqa: E402
from dualvllm.training.losses import Correction  # noqa: E402

CORRECTIONS: tuple[str, ...] = get_args(Correction)
# TRL 1.16's vllm_importance_sampling_mode values (trl/trainer/grpo_trainer.py:2680-2707) and its default cap,
# GRPOConfig.vllm_importance_sampling_clip_max (grpo_config.py:947); checked against the installed TRL before a run.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TRL_DEFAULT_MODE, TRL_DEFAULT_CAP = "sequence_mask", 3.0
# TRL's default cap; this project's is_cap (min(pi/q*, 2) per token, `ours-token`); a loose one.
CAPS = (2.0, TRL_DEFAULT_CAP, 10.0)
TASKS = {"arithmetic": train_compare.TASKS["arithmetic"], "hard": train_compare.TASKS["hard-methods"]}
RESULT = "result.json"
# What each evaluation measured (only the hard task has the second): name, title, scale and unit when printed.
METRICS = (("held_out_accuracy", "held-out greedy accuracy", 100, "%"),
           ("answer_logprob_nats", "log p(right answer + EOS) of the base", 1, "nats"))
# What TRL logs at each update that says how an arm weighed its rollouts: the rollouts' mean reward and the share of
# groups whose rewards were all alike (no signal); TRL's importance ratios after its cap (trl-<mode>-* arms); the
# sequence weights' effective sample size over the group size and the share of them capped (ours-sequence).
DIAGNOSTICS = ("reward", "frac_reward_zero_std", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/min", "qstar/ess_ratio", "qstar/clip_fraction")


@dataclass(frozen=True)
class Arm:
    """How an arm weighs q* rollouts: this project's `correction` in QStarGRPOTrainer, or (correction None)
    TRL's own loss with its sampler importance sampling in `is_mode` at `cap` (is_mode None: off)."""

    correction: str | None = None
    is_mode: str | None = None
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.correction is not None:
            if self.correction not in CORRECTIONS or self.is_mode is not None or self.cap is not None:
                raise ValueError(f"correction {self.correction!r}: use one of {CORRECTIONS}, without TRL's mode or cap")
        elif self.is_mode is not None:
            if self.is_mode not in IS_MODES or self.cap is None or self.cap <= 0:
                raise ValueError(f"TRL's mode {self.is_mode!r} at cap {self.cap}: use one of {IS_MODES} at a cap > 0")
        elif self.cap is not None:
            raise ValueError(f"cap {self.cap} without TRL's correction does nothing: give is_mode too")

    @property
    def folder(self) -> str:
        if self.correction is not None:
            return f"ours-{self.correction}"
        return "trl-off" if self.is_mode is None else f"trl-{self.is_mode}-cap{self.cap:g}"

    def trl_options(self) -> dict[str, Any]:
        """The arm's GRPOConfig options beside run_trl's shared ones (QStarGRPOConfig's for a correction)."""
        if self.correction is not None:
            return {"correction": self.correction}
        if self.is_mode is None:
            return {"vllm_importance_sampling_correction": False}
        return {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": self.is_mode,
                "vllm_importance_sampling_clip_max": self.cap}

    def trainer(self) -> TrainerChoice:
        """run_trl's trainer: QStarGRPOTrainer, TRL's GRPOTrainer, or it with the sampler correction applied."""

        def choose(options: dict[str, Any]) -> tuple[type, Any]:
            if self.correction is not None:
                from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer

                return QStarGRPOTrainer, QStarGRPOConfig(**options, **self.trl_options())
            from trl import GRPOConfig, GRPOTrainer

            trainer_class = GRPOTrainer if self.is_mode is None else sampler_is_trainer()
            return trainer_class, GRPOConfig(**options, **self.trl_options())

        return choose


def arms(caps: tuple[float, ...] = CAPS) -> dict[str, Arm]:
    """folder -> arm: this project's corrections, TRL's correction off, and each of TRL's modes at each cap."""
    every = [Arm(correction=c) for c in CORRECTIONS] + [Arm()]
    every += [Arm(is_mode=mode, cap=cap) for mode in IS_MODES for cap in sorted(caps)]
    return {arm.folder: arm for arm in every}


@functools.cache
def sampler_is_trainer() -> type:
    """TRL's GRPOTrainer applying its vLLM importance-sampling correction to a rollout_func's logprobs in
    process (the module docstring says why this is TRL's own correction, unchanged). Denormals are flushed
    during a step, as QStarGRPOTrainer's are: tiny weights would otherwise slow the backward, not change it."""
    import dataclasses

    from trl import GRPOConfig, GRPOTrainer

    from dualvllm.training.learner import denormals_flushed

    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    installed = (defaults["vllm_importance_sampling_mode"], defaults["vllm_importance_sampling_clip_max"])
    assert installed == (TRL_DEFAULT_MODE, TRL_DEFAULT_CAP), f"TRL's defaults moved to {installed}: update the arms"

    class LiveWeights:
        """The vLLM backend's part on the rollout_func path: nothing to sync, the sampler reads the live weights."""

        def sync_weights(self) -> None:
            pass

    class SamplerISGRPOTrainer(GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            assert self.rollout_func is not None, "the correction reads the rollout function's logprobs"
            self.use_vllm = True
            self.vllm_generation = LiveWeights()  # type: ignore[assignment]  # the one duty it has on this path
            self._last_loaded_step = -1

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            with denormals_flushed():
                return super().training_step(*args, **kwargs)

    return SamplerISGRPOTrainer


def answer_logprob_probe(task: str) -> Probe | None:
    """What each evaluation measures beside greedy accuracy: on the hard task, the answer's log-probability."""
    if task != "hard":
        return None

    def probe(model: Any, tokenizer: Any) -> dict[str, float]:
        return {"answer_logprob_nats": train_compare.model_answer_logprob(model, tokenizer, "hard-methods")}

    return probe


def settings(task: str, arm: Arm, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """What a cell's result depends on: a finished cell with other settings is not reused."""
    fields = {k: str(v.relative_to(REPO) if isinstance(v, Path) and v.is_relative_to(REPO) else v)
              for k, v in TASKS[task].items()}  # the repository's own files wherever it is checked out
    return {"task": task, "task_fields": fields, "arm": arm.folder,
            "trl_options": arm.trl_options(), "seed": seed, "steps": args.steps, "eval_every": args.eval_every,
            "eval_prompts": args.eval_prompts, "learning_rate": args.learning_rate,
            "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE}


def run_cell(task: str, arm: Arm, seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """One cell's result: read back if finished with the same settings, else trained now (None with --no-train)."""
    out = args.output / task / f"seed-{seed}" / arm.folder
    wanted = settings(task, arm, seed, args)
    if (out / RESULT).exists():
        saved = json.loads((out / RESULT).read_text())
        if saved["settings"] != wanted:
            raise SystemExit(f"{out} holds a run with other settings; remove it or pass another --output")
        return saved
    if args.no_train:
        return None
    if out.exists():  # an interrupted cell: TRL's runs here keep no checkpoint, so it starts over
        shutil.rmtree(out)
    import trl

    config = train_config(out, seed, args, correction=arm.correction or "none", **TASKS[task])
    assert isinstance(config, GRPOTrainConfig), f"{task} trains with GRPO"
    started = time.perf_counter()
    result = run_trl(config, trainer=arm.trainer(), probe=answer_logprob_probe(task))
    saved = {"settings": wanted, "trl_version": trl.__version__, "wall_s": time.perf_counter() - started, **result}
    partial = out / f"{RESULT}.partial"
    partial.write_text(json.dumps(saved) + "\n")
    partial.replace(out / RESULT)
    return saved


def curves(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """A cell's evaluations as train_compare.summary reads them: metric -> [(update, value)], by update."""
    return {metric: sorted((int(step), value) for step, value in result[metric].items())
            for metric, *_ in METRICS if metric in result}


def timings(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """arm -> medians over its seeds of: one update's seconds (every update but each run's first, which holds
    the warm-up), one evaluation's, and a run's remaining seconds (loading, TRL's set-up, the first update)."""
    out = {}
    for arm, by_seed in runs.items():
        updates = [s for run in by_seed.values() for s in run["update_s"][1:]]
        evaluations = [s for run in by_seed.values() for s in run["eval_s"].values()]
        rest = [run["wall_s"] - sum(run["update_s"][1:]) - sum(run["eval_s"].values()) for run in by_seed.values()]
        out[arm] = {"update_s": float(np.median(updates)) if updates else float("nan"),
                    "eval_s": float(np.median(evaluations)), "rest_s": float(np.median(rest))}
    return out


def diagnostics(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """arm -> each of DIAGNOSTICS that TRL logged for it, averaged over every update of every seed."""
    out = {}
    for arm, by_seed in runs.items():
        logged = [entry for run in by_seed.values() for entry in run["log_history"]]
        out[arm] = {key: float(np.mean(values)) for key in DIAGNOSTICS
                    if (values := [entry[key] for entry in logged if key in entry])}
    return out


def print_table(table: dict[str, dict[int, tuple[float, float, float]]], title: str, scale: float, unit: str) -> None:
    """Arms as rows, updates as columns: median [25th, 75th percentile] times `scale`."""
    print(f"\n{title} (median [interquartile range] over seeds, {unit})")
    steps = sorted({step for rows in table.values() for step in rows})
    print(f"{'arm':>28}" + "".join(f"{step:>22}" for step in steps))
    for arm, rows in table.items():
        cells = [rows.get(step) for step in steps]
        print(f"{arm:>28}" + "".join(
            f"{'-':>22}" if c is None else f"{f'{scale * c[0]:.1f} [{scale * c[1]:.1f}, {scale * c[2]:.1f}]':>22}"
            for c in cells))


def run_in_parallel(args: argparse.Namespace, chosen: dict[str, Arm]) -> None:
    """Every unfinished cell as a job of this script, `args.jobs` at a time, each pinned to its own core."""
    argv = train_compare.argv_without(sys.argv[1:], {"--jobs": 1, "--tasks": len(args.tasks),
                                                     "--seeds": len(args.seeds), "--arms": len(args.arms or ())})
    jobs = [([*argv, "--tasks", task, "--seeds", str(seed), "--arms", folder, "--no-summary"],
             args.output / task / f"seed-{seed}" / f"{folder}.log")
            for task in args.tasks for seed in args.seeds for folder in chosen
            if not (args.output / task / f"seed-{seed}" / folder / RESULT).exists()]
    train_compare.run_pinned(__file__, jobs, args.jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=read_recipe(RECIPE, TRAIN_OPTIONS)["learning_rate"])
    parser.add_argument("--caps", type=float, nargs="+", default=list(CAPS),
                        help="vllm_importance_sampling_clip_max values each of TRL's modes runs at")
    parser.add_argument("--arms", nargs="+", help="Which arms to run, by folder name (default: all).")
    parser.add_argument("--jobs", type=int, default=1,
                        help="run this many cells at once, each in its own process pinned to one core; then summarise")
    parser.add_argument("--no-train", action="store_true", help="train nothing: summarise the finished cells")
    parser.add_argument("--no-summary", action="store_true", help=argparse.SUPPRESS)  # a --jobs child: its cell only
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/trl_settings"))
    args = parser.parse_args()
    every = arms(tuple(args.caps))
    unknown = sorted(set(args.arms or ()) - set(every))
    if unknown:
        parser.error(f"unknown arms {unknown}; the arms at --caps {args.caps} are {', '.join(every)}")
    chosen = {folder: arm for folder, arm in every.items() if args.arms is None or folder in args.arms}
    if args.jobs > 1 and not args.no_train:
        run_in_parallel(args, chosen)
        args.no_train = True  # every cell is trained (or failed, and is reported missing): summarise

    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}  # task -> arm -> seed -> cell
    for task in args.tasks:
        for seed in args.seeds:
            for folder, arm in chosen.items():
                cell = run_cell(task, arm, seed, args)
                if cell is None:
                    print(f"not run, skipped: {task} seed {seed} {folder}")
                    continue
                results.setdefault(task, {}).setdefault(folder, {})[seed] = cell
                print(f"{task} seed {seed} {folder}: accuracy {cell['held_out_accuracy']}, "
                      f"{np.mean(cell['update_s']):.2f} s per update, {cell['wall_s']:.0f} s in all", flush=True)
    if not args.no_summary:
        summarise(results, args, chosen)



def summarise(results: dict[str, dict[str, dict[int, dict[str, Any]]]], args: argparse.Namespace,
              chosen: dict[str, Arm]) -> None:
    """Print each task's tables (per arm and evaluation: median and IQR over seeds; seconds; what TRL logged)
    and write OUTPUT/trl_settings.json."""
    tables: dict[str, dict[str, Any]] = {}
    for task, runs in results.items():
        with_curves = {name: {seed: {"curves": curves(cell)} for seed, cell in by_seed.items()}
                       for name, by_seed in runs.items()}
        tables[task] = {}
        for metric, title, scale, unit in METRICS:
            if any(metric in cell for by_seed in runs.values() for cell in by_seed.values()):
                tables[task][metric] = train_compare.summary(with_curves, metric)
                print_table(tables[task][metric], f"{title} by update, task {task}, seeds {args.seeds}", scale, unit)
        print(f"\nseconds, task {task} (medians over seeds): per update (each run's first left out), per "
              "evaluation, and the rest of a run (loading, set-up, the first update)")
        for name, times in timings(runs).items():
            print(f"{name:>28}: " + ", ".join(f"{key} {value:.2f}" for key, value in times.items()))
        print(f"\nper update, task {task} (means over every update of every seed)")
        for name, values in diagnostics(runs).items():
            print(f"{name:>28}: " + ", ".join(f"{key} {value:.3g}" for key, value in values.items()))
    args.output.mkdir(parents=True, exist_ok=True)
    summary = {"command": {k: str(v) for k, v in vars(args).items()},
               "arms": {folder: arm.trl_options() for folder, arm in chosen.items()},
               "results": {task: {name: {str(seed): {k: v for k, v in cell.items() if k != "log_history"}
                                         for seed, cell in by_seed.items()}
                                  for name, by_seed in runs.items()} for task, runs in results.items()},
               "summary": {task: {metric: {name: {str(step): list(cell) for step, cell in rows.items()}
                                           for name, rows in table.items()} for metric, table in by_metric.items()}
                           for task, by_metric in tables.items()},
               "timings_median": {task: timings(runs) for task, runs in results.items()},
               "diagnostics_mean": {task: diagnostics(runs) for task, runs in results.items()}}
    (args.output / "trl_settings.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {args.output / 'trl_settings.json'}")

if __name__ == "__main__":
    main()
