"""Streaming GRPO on q* rollouts, end to end: the recipe behind `dualvllm train`.

    setup    problems (dataset, templates, rewards: all checked before any server starts),
             servers (base in dev mode, on the newest checkpoint when resuming), learner,
             coordinator, verifier pool, the sampler task
    train    take a scored batch from the queue, drop it if too stale, update, push the
             new weights into the base server (verified), checkpoint, log metrics
    cleanup  stop the sampler, the pool and the servers

The held-out tasks are evaluated (training.evaluation: the base alone, greedy accuracy and
pass@k) at the start, every `eval_every` updates and after the last one (once, with the
sampler stopped). Every await of the shutdown is bounded (common/tasks.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import tinymodels
from common.errors import InvalidInputError
from common.tasks import stop
from training import checkpoint, lora
from training.checkpoint import RunState
from training.config import TrainConfig
from training.curriculum import Curriculum
from training.evaluation import evaluate
from training.learner import Learner
from training.problems import Problems, load_problems
from training.rollouts import ScoredBatch, Task, produce, sample_batch
from training.serving import serving
from training.verifiers import verifier_pool
from training.weight_sync import BasePusher

log = logging.getLogger("dualvllm.training")

# Probe contexts for push verification: a few held-out prompts.
PUSH_PROBES = 4
# A cancelled sampler stops at its next await, within milliseconds (its sequences are
# cancelled, a reward being scored is left to its worker); the bound turns a bug into an error.
SAMPLER_STOP_S = 30.0


@dataclass(frozen=True)
class TrainReport:
    steps_done: int
    accuracy_before: float
    accuracy_after: float
    dropped_stale_batches: int
    metrics_path: Path


async def train_grpo(config: TrainConfig, *, resume: bool = False, show_progress: bool = True) -> TrainReport:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = config.output_dir
    newest = checkpoint.latest(out) if resume and out.is_dir() else None
    if not resume and out.is_dir() and checkpoint.latest(out) is not None:
        raise InvalidInputError(f"{out} already holds checkpoints; pass --resume to continue that run "
                                "or choose a new --output-dir")
    base_dir = config.base or str(tinymodels.BASE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    problems = load_problems(config, tokenizer)  # refuses bad data before any server starts
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    start_dir = str(newest) if newest is not None else base_dir
    torch.manual_seed(config.seed)
    if config.lora_rank and newest is not None:
        model = lora.resume(base_dir, newest, torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
        if config.lora_rank:
            model = lora.wrap(model, rank=config.lora_rank, alpha=config.lora_alpha)
    learner = Learner(model, learning_rate=config.learning_rate, kl_coef=config.kl_coef,
                      pad_id=tokenizer.pad_token_id or 0)
    state = checkpoint.load_state(newest, learner.optimizer) if newest is not None else RunState(0, 0, 0)
    if newest is not None:
        log.info("resuming from %s (step %d)", newest, state.step)
    tasks, held_out = problems.train, problems.held_out
    probes = [list(t.prompt_ids) for t in held_out[:PUSH_PROBES]]
    metrics_path = out / "metrics.jsonl"

    with verifier_pool() as pool:
        async with serving(config, start_dir, log_dir=out, dev_mode=True,
                           batch_size=config.prompts_per_step * config.group_size) as coordinator:
            pusher = BasePusher(coordinator.base_engine, probes)
            if config.theta_urls:  # servers started elsewhere serve whatever they were given: make it ours
                await pusher.push(learner.model, tokenizer, _push_dir(out, state.step))
            async def sample(chosen: list[Task], seed: int):
                return await sample_batch(coordinator, chosen, group_size=config.group_size, max_tokens=config.max_tokens,
                                          temperature=config.temperature, fixed_alpha=config.fixed_alpha,
                                          seed=config.seed * 1_000_003 + seed, spec=problems.spec, executor=pool,
                                          reward_timeout_s=config.reward_timeout)

            async def held_out_metrics() -> dict[str, float]:
                return await _evaluate_base(coordinator, config, problems, pool)

            before = await held_out_metrics()
            _log_metrics(metrics_path, {"step": state.step, "event": "eval", **before})
            version = state.policy_version
            queue: asyncio.Queue[ScoredBatch] = asyncio.Queue(maxsize=config.queue_size)
            sampler = asyncio.create_task(produce(queue, sample, tasks, start=state.data_position,
                                                  prompts_per_step=config.prompts_per_step,
                                                  policy_version=lambda: version,
                                                  curriculum=_curriculum(config, state, len(tasks))))
            dropped = 0
            step = state.step
            final: dict[str, float] | None = None
            try:
                with tqdm(total=config.steps, initial=step, desc="grpo", unit="step", disable=not show_progress) as bar:
                    while step < config.steps:
                        batch = await _next_batch(queue, sampler)
                        if not batch.groups:
                            log.warning("a batch had no group of two or more scored rollouts; skipped")
                            continue
                        staleness = version - batch.policy_version
                        if staleness > config.max_staleness:
                            dropped += 1
                            continue
                        started = time.perf_counter()
                        metrics = await asyncio.to_thread(
                            learner.train_step, batch, correction=config.correction,
                            scale_advantages=config.scale_advantages, is_cap=config.is_cap, share_cap=config.share_cap,
                            normalization=config.normalization, max_completion_length=config.max_tokens)
                        step += 1
                        if step % config.push_every == 0 or step == config.steps:
                            async with coordinator.paused():  # lockstep sequences resume on the new weights
                                push = await pusher.push(learner.model, tokenizer, _push_dir(out, step))
                            version += 1
                            metrics.update(push_max_abs_diff=push.max_abs_diff, push_replicas=push.replicas,
                                           push_replicas_dropped=len(push.dropped))
                            _prune_pushed(out)
                        state = RunState(step=step, data_position=batch.data_position, policy_version=version,
                                         curriculum=batch.curriculum_state)
                        await asyncio.to_thread(checkpoint.save, out, learner.model, tokenizer, learner.optimizer,
                                                state, config.keep_checkpoints)
                        alphas = [a for g in batch.groups for r in g for a in r.alphas]
                        metrics.update({f"reward/{name}": mean for name, mean in batch.reward_means.items()})
                        metrics.update(batch.curriculum_stats)
                        metrics.update(step=step, staleness=staleness, policy_version=version, unscored=batch.unscored,
                                       mean_alpha=sum(alphas) / max(len(alphas), 1),
                                       sample_tokens_per_s=batch.tokens / max(batch.sample_seconds, 1e-9),
                                       step_seconds=time.perf_counter() - started)
                        if step == config.steps:  # nothing more to sample: the last evaluation runs alone
                            await stop(sampler, what="the rollout sampler", timeout_s=SAMPLER_STOP_S)
                        if step % config.eval_every == 0 or step == config.steps:
                            evaluation = await held_out_metrics()
                            metrics.update(evaluation)
                            if step == config.steps:
                                final = evaluation
                        _log_metrics(metrics_path, metrics)
                        bar.update(1)
                        bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}",
                                        held_out=f"{metrics.get('held_out_accuracy', float('nan')):.2f}")
            finally:
                await stop(sampler, what="the rollout sampler", timeout_s=SAMPLER_STOP_S)
            after = final if final is not None else await held_out_metrics()  # a resumed run that was done
            _log_metrics(metrics_path, {"step": step, "event": "eval", **after})
    _prune_pushed(out)
    return TrainReport(steps_done=step, accuracy_before=before["held_out_accuracy"],
                       accuracy_after=after["held_out_accuracy"],
                       dropped_stale_batches=dropped, metrics_path=metrics_path)


def _curriculum(config: TrainConfig, state: RunState, n_tasks: int) -> Curriculum | None:
    """The run's curriculum: resumed from the checkpoint's state, else new; None without --curriculum."""
    if not config.curriculum:
        return None
    if state.curriculum is None:
        return Curriculum(n_tasks=n_tasks, seed=config.seed)
    resumed = Curriculum.from_state(state.curriculum)
    if resumed.n_tasks != n_tasks:
        raise InvalidInputError(f"the checkpoint's curriculum covers {resumed.n_tasks} prompts and the dataset has "
                                f"{n_tasks}; resume with the dataset of the first run")
    return resumed


async def _evaluate_base(coordinator: Any, config: TrainConfig, problems: Problems, pool: Any) -> dict[str, float]:
    """The base alone on the held-out tasks: held_out_accuracy (greedy) and held_out_pass@k."""
    [base] = await evaluate(coordinator, problems.held_out, problems.spec, pool, arms=("base",),
                            max_tokens=config.max_tokens, samples=config.eval_samples, ks=config.pass_ks,
                            temperature=config.temperature, seed=config.seed, reward_timeout_s=config.reward_timeout)
    return {"held_out_accuracy": base.greedy_accuracy, **{f"held_out_pass@{k}": v for k, v in base.pass_at.items()}}


async def _next_batch(queue: asyncio.Queue[ScoredBatch], sampler: asyncio.Task[None]) -> ScoredBatch:
    """The next scored batch; if the sampler died, its error instead of waiting forever."""
    getter = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({getter, sampler}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    sampler.result()  # raises the sampler's error
    raise AssertionError("the sampler returned; it runs until cancelled")


def _log_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _push_dir(out: Path, step: int) -> Path:
    """A new directory per push (reloading an overwritten one can serve stale weights)."""
    return out / "pushed" / f"step-{step:06d}-{time.time_ns()}"


def _prune_pushed(out: Path, keep: int = 1) -> None:
    """Pushed weight directories are only needed while the server loads them."""
    pushed = sorted((out / "pushed").glob("step-*")) if (out / "pushed").is_dir() else []
    for old in pushed[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
