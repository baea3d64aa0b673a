"""q* rollouts for TRL: `GRPOTrainer(..., rollout_func=QStarRollouts(config, ...))`.

TRL 1.16 calls `rollout_func(prompts, trainer)` synchronously, once per generation batch,
with this process's prompts (each already repeated `num_generations` times). The
coordinator is asyncio and holds connections, so it lives on one event loop in a
background thread for the trainer's lifetime, opened once and closed once (`close()`,
bounded); each call hands one `generate_batch` to that loop and waits for it.

    prompts (text or chat) --render as TRL would--> base prompt ids
                           --teacher column / template--> teacher prompt ids (optional)
    coordinator.generate_batch(pairs, max_completion_length, trainer's temperature)
    -> prompt_ids, completion_ids, logprobs = log q* per token (the behaviour policy),
       and extra fields alpha, logprob_t, logprob_theta (teacher_topk_ids and
       teacher_topk_logprobs with record_topk), which TRL hands to the reward functions
       and dualvllm.training.trl_trainer.QStarGRPOTrainer's loss reads

The teacher's prompt comes from the dataset, as in `dualvllm train` (training/data.py): a
column (`teacher_column`, text or a chat) or a template over the row's fields and `prompt`,
the base prompt as rendered text (`teacher_template="{prompt}The answer is {answer}. "`).
TRL passes the rollout function prompts only, so the rows are looked up by their prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
from typing import Any, TypeVar
from collections.abc import Awaitable, Iterable, Mapping, Sequence

import numpy as np

from dualvllm.common import loop
from dualvllm.common.errors import GenerationFailedError, InvalidInputError, LifecycleError, ShutdownTimeoutError
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator, GenerationOutput
from dualvllm.engines.protocol import Engine
from dualvllm.training.data import format_template

T = TypeVar("T")
# Opening checks both servers (health, tokenizers, top-k): seconds, unless a server is still starting.
OPEN_TIMEOUT_S = 300.0
# Closing ends the coordinator's scheduler and clients, each already bounded; this bounds the whole.
CLOSE_TIMEOUT_S = 60.0
# How many distinct base prompts are kept as probe contexts for weight-push verification.
PROBES_KEPT = 4


class QStarRollouts:
    """A TRL rollout function sampling from q* through one DualVLLMCoordinator.

    `dataset` (rows, e.g. the trainer's train_dataset) is needed only for a teacher prompt:
    `teacher_column` names the field holding it, or `teacher_template` builds it. Without
    either the teacher sees the base prompt. `fixed_alpha` replaces alpha* (0 = the base
    alone, 1 = the teacher alone); `record_topk=k` records the teacher's top-k per token
    (the distillation term needs it). `theta_engine`/`t_engine` replace the HTTP clients
    (in-process engines, not yet entered: the rollouts enter and close them). Use as a context manager, or call `close()` when training ends.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        dataset: Iterable[Mapping[str, Any]] | None = None,
        teacher_column: str | None = None,
        teacher_template: str | None = None,
        fixed_alpha: float | None = None,
        record_topk: int = 0,
        seed: int = 0,
        theta_engine: Engine | None = None,
        t_engine: Engine | None = None,
        call_timeout_s: float | None = None,
        open_timeout_s: float = OPEN_TIMEOUT_S,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        if teacher_column is not None and teacher_template is not None:
            raise InvalidInputError("give the teacher's prompt as teacher_column or teacher_template, not both")
        if (teacher_column is not None or teacher_template is not None) and dataset is None:
            raise InvalidInputError(
                "a teacher column or template reads the rows: pass dataset=the trainer's "
                "train_dataset (TRL hands the rollout function prompts only)"
            )
        self.teacher_column, self.teacher_template = teacher_column, teacher_template
        self._rows = _rows_by_prompt(dataset, teacher_column, teacher_template) if dataset is not None else {}
        self.fixed_alpha, self.record_topk, self.seed = fixed_alpha, record_topk, seed
        self.call_timeout_s, self.close_timeout_s = call_timeout_s, close_timeout_s
        self.probe_prompt_ids: list[list[int]] = []  # the first distinct base prompts, for push verification
        self._calls = 0
        self._closed = False
        self._loop = loop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dualvllm-qstar-rollouts", daemon=True)
        self._thread.start()
        self._stack = contextlib.AsyncExitStack()
        try:
            self._coordinator = self.run(
                self._open(config, theta_engine, t_engine), timeout_s=open_timeout_s, what="opening the coordinator"
            )
        except BaseException:
            self._stop_loop()
            raise

    async def _open(self, config: CoordinatorConfig, theta: Engine | None, t: Engine | None) -> DualVLLMCoordinator:
        # Given engines are entered here, on the loop they will serve, and closed with the rollouts.
        for engine in dict.fromkeys(e for e in (theta, t) if e is not None):
            await self._stack.enter_async_context(engine)  # type: ignore[arg-type]
        return await self._stack.enter_async_context(DualVLLMCoordinator(config, theta_engine=theta, t_engine=t))

    @property
    def coordinator(self) -> DualVLLMCoordinator:
        """The open coordinator; use it only through `run` (it belongs to the background loop)."""
        self._require_open()
        return self._coordinator

    def run(self, awaitable: Awaitable[T], *, timeout_s: float | None, what: str) -> T:
        """Run `awaitable` on the coordinator's loop and wait for its result (None = no bound).

        Past `timeout_s` it is cancelled and GenerationFailedError names `what`.
        """
        if self._closed:
            raise LifecycleError("these QStarRollouts are closed; create new ones")
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise GenerationFailedError(
                f"{what} took longer than {timeout_s:g} s; check the servers, or raise call_timeout_s"
            ) from exc

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """TRL's rollout function: one q* rollout per entry of `prompts` (TRL repeats each prompt per group)."""
        self._require_open()
        theta_ids = self.render(prompts, trainer)
        pairs: list[Any] = []
        for prompt, ids in zip(prompts, theta_ids):
            t_ids = self._teacher_ids(prompt, trainer)
            pairs.append(ids if t_ids is None or t_ids == ids else (ids, t_ids))
        self._keep_probes(theta_ids)
        rank = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0))
        # Distinct seeds per call, per process and per rollout: repeated prompts must not repeat samples.
        seeds = np.random.SeedSequence([self.seed, self._calls, rank]).generate_state(len(pairs), dtype=np.uint64)
        self._calls += 1
        outputs = self.run(
            self._coordinator.generate_batch(
                pairs,
                max_tokens=trainer.max_completion_length,
                temperature=trainer.temperature,
                seeds=[int(s) for s in seeds],
                fixed_alpha=self.fixed_alpha,
                record_topk=self.record_topk,
            ),
            timeout_s=self.call_timeout_s,
            what=f"sampling {len(pairs)} q* rollouts",
        )
        failed = [o for o in outputs if not o.ok]
        if failed:
            raise GenerationFailedError(
                f"{len(failed)} of {len(outputs)} q* rollouts failed (first: {failed[0].error}); "
                "TRL cannot train on a partial batch. Check the servers and rerun"
            )
        return rollout_fields(theta_ids, outputs, record_topk=self.record_topk)

    def render(self, prompts: Sequence[Any], trainer: Any) -> list[list[int]]:
        """Base prompt ids, as TRL's GRPOTrainer tokenizes prompts for its own generation: a chat with the
        processing class's chat template and the generation prompt, text with its tokenizer."""
        tokenizer = trainer.processing_class
        if not prompts:
            return []
        if _is_chat(prompts[0]):
            rendered = tokenizer.apply_chat_template(
                conversation=list(prompts),
                tools=getattr(trainer, "tools", None) or None,
                chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}),
            )
            return [list(ids) for ids in rendered["input_ids"]]
        return [list(ids) for ids in tokenizer(text=list(prompts))["input_ids"]]

    def _teacher_ids(self, prompt: Any, trainer: Any) -> list[int] | None:
        if self.teacher_column is None and self.teacher_template is None:
            return None
        key = _key(prompt)
        if key not in self._rows:
            raise InvalidInputError(
                f"the prompt {key[:60]!r} is not in the dataset QStarRollouts was given, so its "
                "teacher prompt is unknown; pass dataset=the trainer's train_dataset"
            )
        line, row = self._rows[key]
        if self.teacher_column is not None:
            return self.render([row[self.teacher_column]], trainer)[0]
        tokenizer = trainer.processing_class
        chat = _is_chat(prompt)
        base_text = (
            tokenizer.apply_chat_template(
                prompt,
                tokenize=False,
                add_generation_prompt=True,
                chat_template=getattr(trainer, "chat_template", None),
                **(getattr(trainer, "chat_template_kwargs", None) or {}),
            )
            if chat
            else prompt
        )
        assert self.teacher_template is not None
        text = format_template(
            self.teacher_template, "teacher template", {**row, "prompt": base_text}, source="the dataset", line=line
        )
        # A rendered chat holds its own special tokens: add none on top (as `dualvllm train` does).
        return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])

    def _keep_probes(self, theta_ids: list[list[int]]) -> None:
        for ids in theta_ids:
            if len(self.probe_prompt_ids) < PROBES_KEPT and ids not in self.probe_prompt_ids:
                self.probe_prompt_ids.append(ids)

    def close(self) -> None:
        """Close the coordinator (bounded by close_timeout_s), then stop the loop's thread. Idempotent."""
        if self._closed:
            return
        try:
            self.run(self._stack.aclose(), timeout_s=self.close_timeout_s, what="closing the coordinator")
        except GenerationFailedError as exc:
            raise ShutdownTimeoutError(f"the coordinator did not close within {self.close_timeout_s:g} s") from exc
        finally:
            self._closed = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            raise ShutdownTimeoutError(
                f"the rollouts' event loop thread did not stop within {self.close_timeout_s:g} s"
            )
        self._loop.close()

    def _require_open(self) -> None:
        if self._closed:
            raise LifecycleError("these QStarRollouts are closed; create new ones")

    def __enter__(self) -> QStarRollouts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def rollout_fields(
    prompt_ids: Sequence[Sequence[int]], outputs: Sequence[GenerationOutput], *, record_topk: int = 0
) -> dict[str, list]:
    """What a TRL rollout function returns, one entry per rollout, from the coordinator's outputs.

    `logprobs` is log q* of every sampled token (the behaviour policy); `alpha`, `logprob_t`
    and `logprob_theta` are per token too; with `record_topk` the teacher's top-k ids and raw
    logprobs per token ([T][k] lists, -inf where it reported fewer).
    """
    if len(prompt_ids) != len(outputs):
        raise InvalidInputError(f"{len(outputs)} outputs for {len(prompt_ids)} prompts; give one output per prompt")
    fields: dict[str, list] = {
        "prompt_ids": [list(ids) for ids in prompt_ids],
        "completion_ids": [list(o.generated_tokens) for o in outputs],
        "logprobs": [list(o.logprobs_q) for o in outputs],
        "alpha": [list(o.alpha_history) for o in outputs],
        "logprob_t": [list(o.logprobs_t) for o in outputs],
        "logprob_theta": [list(o.logprobs_theta) for o in outputs],
    }
    if record_topk:
        missing = [o.index for o in outputs if o.topk_ids is None or o.topk_logprobs is None]
        if missing:
            raise InvalidInputError(f"outputs {missing[:5]} carry no recorded top-k; sample with record_topk")
        # Row 1 of the recorded [T, 2, k] arrays is the teacher's (row 0 the base's).
        fields["teacher_topk_ids"] = [o.topk_ids[:, 1].clip(min=0).tolist() for o in outputs]  # type: ignore[index]
        fields["teacher_topk_logprobs"] = [o.topk_logprobs[:, 1].tolist() for o in outputs]  # type: ignore[index]
    return fields


def _rows_by_prompt(
    dataset: Iterable[Mapping[str, Any]], column: str | None, template: str | None
) -> dict[str, tuple[int, dict[str, Any]]]:
    """key of the row's prompt -> (row number from 1, row); every row checked before training starts."""
    rows: dict[str, tuple[int, dict[str, Any]]] = {}
    for line, row in enumerate(dataset, start=1):
        row = dict(row)
        if "prompt" not in row:
            raise InvalidInputError(
                f"row {line} of the dataset has no 'prompt', which TRL's GRPOTrainer reads; it has {sorted(row)}"
            )
        if column is not None and row.get(column) is None:
            raise InvalidInputError(
                f"row {line} of the dataset has no {column!r}, the teacher column; add it or "
                "build the teacher prompt with teacher_template"
            )
        if template is not None:  # checked now with a stand-in prompt; formatted per call with the rendered one
            format_template(template, "teacher template", {**row, "prompt": ""}, source="the dataset", line=line)
        key = _key(row["prompt"])
        if key in rows and rows[key][1] != row:
            raise InvalidInputError(
                f"rows {rows[key][0]} and {line} of the dataset share a prompt and differ, so "
                "which teacher prompt it gets is ambiguous; make the prompts distinct"
            )
        rows.setdefault(key, (line, row))
    return rows


def _key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable
