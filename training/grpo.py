"""Streaming GRPO on q* rollouts, end to end: the recipe behind `dualvllm train`
(`GRPORecipe`; the inputs and the evaluation it shares with DPO are in training/recipe.py).

    setup    problems (dataset, templates, rewards: all checked before any server starts),
             servers (base in dev mode, on the newest checkpoint when resuming), learner,
             coordinator, verifier pool, the sampler task; or, under --engine transformers,
             in-process engines over the learner's live weights (training/inprocess.py)
    train    take a scored batch from the queue, drop it if too stale, update, push the
             new weights into the base server (verified), checkpoint, log metrics
    cleanup  stop the sampler, the pool and the servers

The held-out tasks are evaluated (dualvllm.training.evaluation: the base alone, greedy accuracy and
pass@k) at the start, every `eval_every` updates and after the last one (once, with the
sampler stopped). Every await of the shutdown is bounded (common/tasks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from dualvllm.common.clock import PhaseClock
from dualvllm.common.errors import InvalidInputError
from dualvllm.common.tasks import stop
from dualvllm.engines.transformers_engine import TransformersEngine
from dualvllm.training import checkpoint, lora, untie
from dualvllm.training.checkpoint import RunState
from dualvllm.training.config import AdaptiveTrainConfig, StreamingTrainConfig
from dualvllm.training.curriculum import Curriculum
from dualvllm.training.data_parallel import DataParallel, Ranks
from dualvllm.training.device import autocast_dtype, describe, learner_device
from dualvllm.training.inprocess import in_process
from dualvllm.training.forgetting import state_kl
from dualvllm.training.learner import Learner, Objective, pack
from dualvllm.training.regimes import NEVER, Regimes
from dualvllm.training.recipe import held_out, prepare
from dualvllm.training.rollouts import Lead, Rollout, Sampled, ScoredBatch, Task, produce, sample_batch
from dualvllm.training.serving import serving
from dualvllm.training.verifiers import verifier_pool
from dualvllm.training.weight_sync import BasePusher, new_push_dir, prune_pushed, push_metrics

log = logging.getLogger("dualvllm.training")

# Probe contexts for push verification: a few held-out prompts.
PUSH_PROBES = 4
# A cancelled sampler stops at its next await, within milliseconds (its sequences are
# cancelled, a reward being scored is left to its worker); the bound turns a bug into an error.
SAMPLER_STOP_S = 30.0
# A GRPO run whose groups have all scored alike this many updates is told, once, that it learns
# nothing and what has worked instead (benchmarks/README.md, "From likelihood to accuracy").
NO_SIGNAL_WARNING_STEPS = 20
# Options of the update that only some methods have (option -> Objective field): a method
# without one takes the Objective's default, which is what that method does (sft has no
# correction, grpo alone pools groups).
METHOD_OBJECTIVE_OPTIONS = {
    "correction": "correction",
    "scale_advantages": "scale_advantages",
    "is_cap": "is_cap",
    "share_cap": "share_cap",
    "normalization": "normalization",
    "guided_shaping": "shaping_gamma",
    "rft_min_reward": "rft_min_reward",
}


@dataclass(frozen=True)
class TrainReport:
    steps_done: int
    accuracy_before: float
    accuracy_after: float
    dropped_stale_batches: int
    metrics_path: Path


def objective(config: StreamingTrainConfig) -> Objective:
    """What one update of the run optimizes."""
    options = {
        field: getattr(config, name)
        for name, field in METHOD_OBJECTIVE_OPTIONS.items()
        if name in type(config).model_fields
    }
    return Objective(
        method=config.method,
        max_completion_length=config.max_tokens,
        teacher_advantage_coef=config.teacher_advantage_coef,
        distill_coef=config.distillation_coef,
        distill_beta=config.distill_beta,
        **options,
    )


async def train_grpo(config: StreamingTrainConfig, *, resume: bool = False, show_progress: bool = True) -> TrainReport:
    """`dualvllm train --method grpo`: the recipe below, set up, trained and cleaned up."""
    return await GRPORecipe(config, resume=resume, show_progress=show_progress).run()


class GRPORecipe:
    """setup / evaluate / train_step / train / cleanup, as torchtune's recipes are shaped."""

    def __init__(self, config: StreamingTrainConfig, *, resume: bool = False, show_progress: bool = True) -> None:
        self.config = config
        self.resume = resume
        self.show_progress = show_progress
        self.out = config.output_dir
        self.metrics_path = self.out / "metrics.jsonl"
        self._stack = contextlib.AsyncExitStack()
        self._sampler: asyncio.Task[None] | None = None
        self.dropped = 0
        self.objective = objective(config)
        self._live: TransformersEngine | None = None  # the base engine under --engine transformers
        self._start: Any = None  # the starting weights, frozen, for kl_from_start
        # Several learner processes (training/data_parallel.py): rank 0 runs the recipe, the others
        # only the learner's updates. None: this process alone.
        self._ranks = Ranks.from_environment()
        self.data_parallel: DataParallel | None = None
        self._failure: str | None = None  # rank 0's error, told to the other ranks
        self._report: TrainReport | None = None  # rank 0's, told to the other ranks

    @property
    def main(self) -> bool:
        """Whether this process runs the recipe (servers, sampling, evaluations, pushes, checkpoints)."""
        return self._ranks is None or self._ranks.main

    async def run(self) -> TrainReport:
        try:
            await self.setup()
            self._report = await self.train() if self.main else await self._follow()
            return self._report
        except BaseException as err:
            self._failure = f"{type(err).__name__}: {err}"
            raise
        finally:
            await self.cleanup()

    async def setup(self) -> None:
        """Inputs (checked before any server starts), learner, servers, coordinator, verifier pool."""
        from transformers import AutoModelForCausalLM

        config = self.config
        # A GPU that is not there: refused before anything loads.
        if self._ranks is None:
            device = learner_device(config.learner_device)
        else:  # one of several learner processes: cuda:LOCAL_RANK, and their process groups
            device = self._ranks.device(config.learner_device)
            self.data_parallel = DataParallel(self._ranks, device)
            self.data_parallel.open()
        precision = autocast_dtype(device, config.mixed_precision)
        newest = checkpoint.latest(self.out) if self.resume and self.out.is_dir() else None
        inputs = prepare(config, resume=self.resume)
        self.tokenizer, self.problems = inputs.tokenizer, inputs.problems
        start_dir = str(newest) if newest is not None else inputs.base_dir
        torch.manual_seed(config.seed)
        if config.lora_rank and newest is not None:
            model = lora.resume(inputs.base_dir, newest, torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
            if config.lora_rank:
                model = lora.wrap(model, rank=config.lora_rank, alpha=config.lora_alpha)
        if config.engine == "vllm":
            untie.refuse_tied(model, start_dir)
        model = model.to(device)  # loaded on the CPU in float32: the master weights, wherever they train
        if self.data_parallel is not None:
            self.data_parallel.broadcast_parameters(model)
        log.info("learner on %s", describe(device, precision))
        # The run's start, also when resuming: the base, not the checkpoint; measured by rank 0 alone.
        if config.kl_from_start_prompts and self.main:
            start = config.kl_from or inputs.base_dir
            # Typed as the Module it is: mypy does not bind transformers' wrapped `to` to the instance.
            frozen: torch.nn.Module = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
            self._start = frozen.to(device).eval()
            self._start.requires_grad_(False)
        self.learner = Learner(
            model,
            learning_rate=config.learning_rate,
            kl_coef=config.reference_kl_coef,
            pad_id=self.tokenizer.pad_token_id or 0,
            micro_batch_size=config.micro_batch_size,
            gradient_checkpointing=config.gradient_checkpointing,
            weight_decay=config.weight_decay,
            autocast_dtype=precision,
            data_parallel=self.data_parallel,
        )
        self.state = checkpoint.load_state(newest, self.learner.optimizer) if newest is not None else RunState(0, 0, 0)
        self._saved_step = self.state.step  # the newest checkpoint's (0: none needed to start again)
        if not self.main:  # the other ranks: the learner alone
            return
        if newest is not None:
            log.info("resuming from %s (step %d)", newest, self.state.step)
        elif self.resume and self.metrics_path.exists():
            log.info("resuming a run killed before its first checkpoint (--checkpoint-every): from step 0")
        self._chooser = _chooser(config, self.state, len(self.problems.train))
        # The in-process engine samples every update's weights at once: a push per update.
        self._lead = Lead(config.max_staleness, 1 if config.engine == "transformers" else config.push_every)
        if self.resume and self.metrics_path.exists():  # what was logged after the checkpoint (or, without
            # one, after the first evaluation) is done again: logged once
            _keep_metrics_until(self.metrics_path, self.state.step)
        self.pool = self._stack.enter_context(verifier_pool())
        batch_size = config.prompts_per_step * config.group_size
        if config.engine == "transformers":  # the base engine samples the live weights: no server, no push
            self.coordinator, self._live = await self._stack.enter_async_context(
                in_process(config, self.learner.model, self.tokenizer, batch_size=batch_size)
            )
            return
        self.coordinator = await self._stack.enter_async_context(
            serving(config, start_dir, log_dir=self.out, dev_mode=True, batch_size=batch_size)
        )
        probes = [list(t.prompt_ids) for t in self.problems.held_out[:PUSH_PROBES]]
        self.pusher = BasePusher(
            self.coordinator.base_engine, probes, via=config.weights_via, probe_every=config.push_probe_every
        )
        self._stack.push_async_callback(self.pusher.close)  # the run's NCCL group ends before its servers
        if config.theta_urls:  # servers started elsewhere serve whatever they were given: make it ours
            await self.pusher.push(self.learner.model, self.tokenizer, new_push_dir(self.out, self.state.step))

    async def evaluate(self) -> dict[str, float]:
        metrics = await held_out(self.coordinator, self.config, self.problems, self.pool)
        if self._start is not None:
            metrics |= await self._kl_from_start()
        return metrics

    async def _kl_from_start(self) -> dict[str, float]:
        """kl_from_start (nats per completion) and kl_from_start_per_token, at states the base alone
        samples from the first kl_from_start_prompts training prompts (training/forgetting.py). The
        same seed at every evaluation: the states change only as the policy does."""
        config, learner = self.config, self.learner
        tasks = self.problems.train[: config.kl_from_start_prompts]
        outputs = await self.coordinator.generate_batch(
            [t.prompt for t in tasks], config.sampling_params(fixed_alpha=0.0), seed=config.seed
        )
        rollouts = [
            Rollout(
                prompt_ids=t.prompt_ids,
                completion_ids=tuple(o.generated_tokens),
                logprobs_q=tuple(o.logprobs_q),
                alphas=(),
                text=o.generated_text,
                reward=0.0,
            )
            for t, o in zip(tasks, outputs)
            if o.ok and o.generated_tokens
        ]
        if not rollouts:
            log.warning("no completion to measure the KL from the start on: every one failed or was empty")
            return {}
        size = learner.micro_batch_size or len(rollouts)

        def measure() -> torch.Tensor:
            return torch.cat(
                [
                    state_kl(
                        learner.model,
                        self._start,
                        pack(rollouts[i : i + size], learner.pad_id, device=learner.device),
                        chunk=learner.logit_chunk_size,
                    )
                    for i in range(0, len(rollouts), size)
                ]
            )

        kl = await asyncio.to_thread(measure)
        return {
            "kl_from_start": float(kl.mean()),
            "kl_from_start_per_token": float(kl.sum()) / sum(len(r.completion_ids) for r in rollouts),
        }

    async def _sample(self, indices: Sequence[int], seed: int) -> Sampled:
        config = self.config
        chosen = [self.problems.train[i] for i in indices]
        if isinstance(config, AdaptiveTrainConfig):
            assert isinstance(self._chooser, Regimes), "an adaptive run chooses by regimes"
            return await self._sample_by_regime(config, chosen, self._chooser.regimes(indices), seed)
        return await self._sample_part(
            chosen, seed, fixed_alpha=config.sampling_alpha, on_policy=config.pooled_on_policy
        )

    async def _sample_part(
        self, chosen: Sequence[Task], seed: int, *, fixed_alpha: float | None, on_policy: int
    ) -> Sampled:
        config = self.config
        params = config.sampling_params(
            fixed_alpha=fixed_alpha,
            max_alpha=config.alpha_cap(self.state.step),
            record_topk=config.top_k if self.objective.needs_teacher_topk else 0,
        )
        return await sample_batch(
            self.coordinator,
            chosen,
            params,
            group_size=config.group_size,
            seed=config.seed * 1_000_003 + seed,
            spec=self.problems.spec,
            executor=self.pool,
            reward_timeout_s=config.reward_timeout,
            on_policy=on_policy,
            min_group=self.objective.min_group,
        )

    async def _sample_by_regime(
        self, config: AdaptiveTrainConfig, chosen: Sequence[Task], regimes: Sequence[int], seed: int
    ) -> Sampled:
        """Never-solved prompts: guided rollouts (guided_alpha) and probe_rollouts on-policy ones;
        the others: all on-policy. Both parts at once, merged in the order of `chosen`."""
        places = ([i for i, r in enumerate(regimes) if r == NEVER], [i for i, r in enumerate(regimes) if r != NEVER])
        guided, own = await asyncio.gather(
            self._sample_part(
                [chosen[i] for i in places[0]], seed, fixed_alpha=config.guided_alpha, on_policy=config.probe_rollouts
            ),
            self._sample_part([chosen[i] for i in places[1]], seed, fixed_alpha=0.0, on_policy=config.group_size),
        )
        counts = [sum(len(g) for g in part.groups) for part in (guided, own)]
        means = {
            name: sum(part.reward_means.get(name, 0.0) * n for part, n in zip((guided, own), counts))
            / max(sum(counts), 1)
            for name in {**guided.reward_means, **own.reward_means}
        }
        order = sorted(
            [(places[0][j], g) for j, g in zip(guided.group_tasks, guided.groups)]
            + [(places[1][j], g) for j, g in zip(own.group_tasks, own.groups)],
            key=lambda pair: pair[0],
        )
        return Sampled(
            groups=tuple(g for _, g in order),
            reward_means=means,
            unscored=guided.unscored + own.unscored,
            group_tasks=tuple(i for i, _ in order),
        )

    def _start_sampler(self, queue: asyncio.Queue[ScoredBatch]) -> None:
        self._sampler = asyncio.create_task(
            produce(
                queue,
                self._sample,
                len(self.problems.train),
                start=self.state.data_position,
                prompts_per_step=self.config.prompts_per_step,
                policy_version=lambda: self.state.policy_version,
                chooser=self._chooser,
                lead=self._lead,
            ),
            name="dualvllm-sampler",
        )

    async def _stop_sampler(self) -> None:
        if self._sampler is not None:
            await stop(self._sampler, what="the rollout sampler", timeout_s=SAMPLER_STOP_S)

    async def train_step(self, batch: ScoredBatch) -> dict[str, Any] | None:
        """One update on `batch`, its push, checkpoint and metrics; None when the batch is dropped."""
        config, state = self.config, self.state
        if not batch.groups:
            log.warning("a batch had no group with enough scored rollouts (%d); skipped", self.objective.min_group)
            return None
        staleness = state.policy_version - batch.policy_version
        if staleness > config.max_staleness:  # logged: its tokens were sampled (and the teacher queried) all the same
            self.dropped += 1
            log.info(
                "batch of policy version %d dropped: %d updates stale (max_staleness %d)",
                batch.policy_version,
                staleness,
                config.max_staleness,
            )
            _log_metrics(
                self.metrics_path,
                {
                    "step": state.step,
                    "event": "dropped_stale",
                    "staleness": staleness,
                    "rollout_tokens": batch.tokens,
                    "dropped_stale_batches": self.dropped,
                },
            )
            return None
        clock = PhaseClock()
        async with self._live.updating() if self._live is not None else contextlib.nullcontext():
            metrics = await asyncio.to_thread(self._update, batch)
        clock.lap("update")
        step, version = state.step + 1, state.policy_version
        if self._live is not None:  # the next forward pass samples the new weights
            version += 1
        elif step % config.push_every == 0 or step == config.steps:
            # Where an update's push costs more than BasePusher's own seconds: holding the sampler
            # (lockstep takes its sequences off the servers) and letting it go again.
            async with self.coordinator.paused():  # lockstep sequences resume on the new weights
                clock.lap("pause")
                push = await self.pusher.push(self.learner.model, self.tokenizer, new_push_dir(self.out, step))
                clock.lap("push")
            clock.lap("resume")
            version += 1
            metrics.update(
                # Only where a probe ran: a push its digests prove compares no logprobs.
                **({} if push.max_abs_diff is None else {"push_max_abs_diff": push.max_abs_diff}),
                push_replicas=push.replicas,
                push_replicas_dropped=len(push.dropped),
                **push_metrics(push),
            )
            prune_pushed(self.out)
        self.state = RunState(
            step=step, data_position=batch.data_position, policy_version=version, curriculum=batch.curriculum_state
        )
        if step % config.checkpoint_every == 0 or step == config.steps:
            await self._checkpoint()
        clock.lap("checkpoint")
        alphas = [a for g in batch.groups for r in g for a in r.alphas]
        metrics.update({f"reward/{name}": mean for name, mean in batch.reward_means.items()})
        metrics.update(batch.curriculum_stats)
        metrics.update(
            step=step,
            staleness=staleness,
            policy_version=version,
            unscored=batch.unscored,
            rollout_tokens=batch.tokens,
            dropped_stale_batches=self.dropped,
            mean_alpha=sum(alphas) / max(len(alphas), 1),
            sample_tokens_per_s=batch.tokens / max(batch.sample_seconds, 1e-9),
            step_seconds=clock.total(),
            **{f"step_seconds/{phase}": round(seconds, 4) for phase, seconds in clock.laps.items()},
        )
        return metrics

    async def _checkpoint(self) -> None:
        """Save the run as it stands (training/checkpoint.py), unless its step is saved already."""
        if self._saved_step == self.state.step:
            return
        await asyncio.to_thread(
            checkpoint.save,
            self.out,
            self.learner.model,
            self.tokenizer,
            self.learner.optimizer,
            self.state,
            self.config.keep_checkpoints,
        )
        self._saved_step = self.state.step

    def _update(self, batch: ScoredBatch) -> dict[str, float]:
        """The learner's update on `batch`; with several learner processes, theirs too."""
        if self.data_parallel is None:
            return self.learner.train_step(batch, self.objective)
        return self.data_parallel.update(batch, lambda b: self.learner.train_step(b, self.objective))

    async def _follow(self) -> TrainReport:
        """Ranks > 0: rank 0's updates until it stops (training/data_parallel.py); rank 0's report."""
        assert self.data_parallel is not None, "only a rank of several follows"
        dp = self.data_parallel
        report = await asyncio.to_thread(dp.follow, lambda b: self.learner.train_step(b, self.objective))
        assert isinstance(report, TrainReport), f"rank 0 ended with {type(report).__name__}, not its report"
        return report

    async def train(self) -> TrainReport:
        """Evaluate, update until `steps`, evaluate every `eval_every` updates and once after the last."""
        config = self.config
        before = await self.evaluate()
        if not _evaluated_at(self.metrics_path, self.state.step):  # a resumed run evaluated its checkpoint's step
            _log_metrics(self.metrics_path, {"step": self.state.step, "event": "eval", **before})
        queue: asyncio.Queue[ScoredBatch] = asyncio.Queue(maxsize=config.queue_size)
        self._start_sampler(queue)
        assert self._sampler is not None
        final: dict[str, float] | None = None
        reached = 0  # evaluations in a row at or above stop_at_accuracy
        signal = False  # whether any group so far had a nonzero advantage
        with tqdm(
            total=config.steps, initial=self.state.step, desc=config.method, unit="step", disable=not self.show_progress
        ) as bar:
            while self.state.step < config.steps:
                metrics = await self.train_step(await _next_batch(queue, self._sampler))
                self._lead.trained()  # its push is done: the sampler may start the next batch
                if metrics is None:
                    continue
                step = self.state.step
                signal = signal or metrics["zero_advantage_groups"] < 1.0
                silent = step == config.no_signal_stop and not signal
                if step == NO_SIGNAL_WARNING_STEPS and not signal and config.method == "grpo":
                    log.warning(
                        "every group of the first %d updates scored alike (zero advantage): GRPO has no signal "
                        "here, the rollouts are never right or never wrong. If the base cannot solve these "
                        "prompts, train on the teacher's distribution instead (--method distill: forward KL on "
                        "q* states, or with --fixed-alpha 1 on the teacher's), or use --stop-without-signal N "
                        "to end runs like this one",
                        step,
                    )
                if step == config.steps or silent:  # nothing more to sample: the last evaluation runs alone
                    await self._stop_sampler()
                if step % config.eval_every == 0 or step == config.steps or silent:
                    evaluation = await self.evaluate()
                    metrics.update(evaluation)
                    target = config.stop_at_accuracy
                    reached = reached + 1 if target is not None and evaluation["held_out_accuracy"] >= target else 0
                    if step == config.steps or reached == 2 or silent:
                        final = evaluation
                _log_metrics(self.metrics_path, metrics)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['reward_mean']:.2f}",
                    held_out=f"{metrics.get('held_out_accuracy', float('nan')):.2f}",
                )
                if reached == 2:
                    log.info(
                        "held-out greedy accuracy reached %.2f at two evaluations in a row; stopping at step %d",
                        config.stop_at_accuracy,
                        step,
                    )
                    break
                if silent:
                    log.info("every group of the first %d updates had zero advantage: no signal; stopping", step)
                    break
        await self._stop_sampler()
        await self._checkpoint()  # a run that stopped early (accuracy reached, no signal) between checkpoints
        after = final if final is not None else await self.evaluate()  # a resumed run that was done
        _log_metrics(self.metrics_path, {"step": self.state.step, "event": "eval", **after})
        return TrainReport(
            steps_done=self.state.step,
            accuracy_before=before["held_out_accuracy"],
            accuracy_after=after["held_out_accuracy"],
            dropped_stale_batches=self.dropped,
            metrics_path=self.metrics_path,
        )

    async def cleanup(self) -> None:
        """Stop the sampler, then the coordinator, the servers and the verifier pool (each bounded)."""
        try:
            await self._stop_sampler()
        finally:
            try:
                await self._stack.aclose()
                if self.main:
                    prune_pushed(self.out)
            finally:
                if self.data_parallel is not None:  # rank 0 tells the others to stop, with its error if any
                    self.data_parallel.close(self._failure, self._report)


def _chooser(config: StreamingTrainConfig, state: RunState, n_tasks: int) -> Curriculum | Regimes | None:
    """What picks the run's prompts: the adaptive recipe's regimes, or --curriculum's curriculum,
    resumed from the checkpoint's state, else new; None: the data in order."""
    if isinstance(config, AdaptiveTrainConfig):
        chooser: Curriculum | Regimes = (
            config.regimes(n_tasks) if state.curriculum is None else Regimes.from_state(state.curriculum)
        )
    elif config.curriculum:
        chooser = (
            Curriculum(n_tasks=n_tasks, seed=config.seed)
            if state.curriculum is None
            else Curriculum.from_state(state.curriculum)
        )
    else:
        return None
    if chooser.n_tasks != n_tasks:
        raise InvalidInputError(
            f"the checkpoint's prompt choices cover {chooser.n_tasks} prompts and the dataset "
            f"has {n_tasks}; resume with the dataset of the first run"
        )
    return chooser


async def _next_batch(queue: asyncio.Queue[ScoredBatch], sampler: asyncio.Task[None]) -> ScoredBatch:
    """The next scored batch; if the sampler died, its error instead of waiting forever."""
    getter = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({getter, sampler}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    sampler.result()  # raises the sampler's error
    raise AssertionError("the sampler returned; it runs until cancelled")


def _records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a last line cut short by a kill is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _keep_metrics_until(path: Path, step: int) -> None:
    """Drop the records of updates after `step` (those the resumed run makes again)."""
    kept = [r for r in _records(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def _evaluated_at(path: Path, step: int) -> bool:
    return any(r.get("step") == step and "held_out_accuracy" in r for r in _records(path))


def _log_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
