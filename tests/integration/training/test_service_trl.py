"""`dualvllm serve` as a drop-in vLLM server for TRL (issue 44), against real vLLM servers.

The q* service runs in dev mode over the session's dev pair (integration/conftest.py: the bundled base in
dev mode and the teacher, with the lockstep plugin), in a thread with its own event loop:
TRL's `trl.generation.vllm_client.VLLMClient` is synchronous. Then, with TRL's own code:

- the client: health, model, server info, generate (completion and chat) and
  get_sequence_logprobs; the logprobs it gets are the coordinator's log q*, and the
  teacher's scores (model "<name>@alpha=1") equal the teacher server's own to 1e-4;
- examples/trl_stock_grpo.py: a stock `GRPOTrainer` with `use_vllm=True, vllm_mode="server"`
  pointed at the service, with TRL's importance-sampling correction on. TRL's trainer-side
  weight sync needs CUDA (`init_communicator` refuses other devices): on CPU the example
  replaces its push with the CPU weight-transfer engine (dualvllm.training.weight_transfer) driven
  through the service's own four forwarded phases, and the base server is then checked to
  serve the trained weights. The CUDA/NCCL path through the service has not run (no GPU).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from collections.abc import Coroutine

import numpy as np
import pytest
import requests

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.service.app import serve
from dualvllm.service.config import ServiceConfig

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from trl.generation.vllm_client import VLLMClient as TRLClient  # noqa: E402


EXAMPLE_PATH = Path(__file__).resolve().parents[3] / "examples" / "trl_stock_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_stock_grpo", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()

ROWS = [{"prompt": "57+44=", "answer": "101"}, {"prompt": "85+10=", "answer": "95"},
        {"prompt": "45+27=", "answer": "72"}, {"prompt": "90+61=", "answer": "151"}]
STEPS = 2
START_TIMEOUT_S = 120.0  # the coordinator's start-up checks against both servers
CALL_TIMEOUT_S = 300.0


class ServiceThread:
    """The q* service (dev mode) on a coordinator over (theta, t), in a thread with its own loop."""

    def __init__(self, theta_url: str, t_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.url: Future[str] = Future()
        self.coordinator: DualVLLMCoordinator | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(theta_url, t_url),),
                                        name="qstar-service", daemon=True)

    async def _main(self, theta_url: str, t_url: str) -> None:
        self._stop = asyncio.Event()
        try:
            async with DualVLLMCoordinator(CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=20)) as c:
                self.coordinator = c
                task = asyncio.create_task(serve(c, ServiceConfig(service_port=0, dev_mode=True),
                                                 ready=lambda url, model: self.url.set_result(url)))
                stopped = asyncio.create_task(self._stop.wait())
                await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        except BaseException as exc:  # the test hears why the service never started
            if not self.url.done():
                self.url.set_exception(exc)
            raise

    def __enter__(self) -> ServiceThread:
        self._thread.start()
        self.url.result(timeout=START_TIMEOUT_S)
        return self

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the service's loop and wait for it (bounded)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=CALL_TIMEOUT_S)

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the q* service thread did not stop within 60 s"
        self.loop.close()


@pytest.fixture(scope="module")
def service(dev_servers):
    theta, t = dev_servers
    with ServiceThread(theta.url, t.url) as running:
        yield running


def client(url: str) -> TRLClient:
    with warnings.catch_warnings():  # TRL 1.16 names vLLM 0.31 as its newest tested; the pin is 0.32
        warnings.simplefilter("ignore")
        return TRLClient(base_url=url, connection_timeout=10)


def test_trls_client_gets_q_star_samples_and_the_teachers_own_scores(service, dev_pair):
    theta, t = dev_pair
    url = service.url.result()
    trl_client = client(url)
    info = trl_client.get_server_info()
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["weight_transfer_config"]["backend"] == "dualvllm_shm"
    assert trl_client.get_world_size() == 1

    out = trl_client.generate(["57+44=", "85+10="], n=2, max_tokens=4, logprobs=0, generation_kwargs={"seed": 1})
    assert len(out["prompt_ids"]) == 2 and len(out["completion_ids"]) == 4
    assert all(len(lp) == len(ids) for lp, ids in zip(out["logprobs"], out["completion_ids"]))

    # The logprobs TRL reads are the coordinator's log q* of each sampled token.
    answer = requests.post(f"{url}/v1/completions", timeout=CALL_TIMEOUT_S, json={
        "model": trl_client.model, "prompt": ["57+44="], "n": 2, "max_tokens": 4, "logprobs": 0, "seed": 2,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "dualvllm": {"return_token_ids": True}}).json()
    for choice in answer["choices"]:
        assert choice["token_ids"] == choice["dualvllm"]["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(choice["dualvllm"]["logprobs_q"], abs=1e-9)

    chat = trl_client.chat([[{"role": "user", "content": "57+44="}]], n=2, max_tokens=3, logprobs=0)
    assert len(chat["prompt_ids"]) == 1 and len(chat["completion_ids"]) == 2

    # Teacher scoring: the service's teacher alone against the teacher server itself.
    sequences = [out["prompt_ids"][0] + out["completion_ids"][0], out["prompt_ids"][1] + out["completion_ids"][2]]
    starts = [len(out["prompt_ids"][0]), len(out["prompt_ids"][1])]
    teacher = client(url + "/teacher")  # what a distillation trainer's teacher_model_server_url points at
    assert teacher.model == f"{trl_client.model}@alpha=1"
    ours = teacher.get_sequence_logprobs(sequences, starts, top_logprobs=5)
    theirs = client(t.url).get_sequence_logprobs(sequences, starts, top_logprobs=5)
    assert ours["logprob_token_ids"] == theirs["logprob_token_ids"]
    for key in ("logprobs", "actual_logprobs"):
        np.testing.assert_allclose(np.array(ours[key]), np.array(theirs[key]), atol=1e-4)


def test_the_stock_grpo_example_samples_q_star_and_pushes_through_the_service(service, dev_pair, tmp_path):
    """examples/trl_stock_grpo.py: a stock GRPOTrainer whose only change is vllm_server_base_url."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.engines.vllm_client import VLLMClient
    from dualvllm.training.weight_sync import compare_logprobs, learner_logprobs

    theta, _ = dev_pair
    trainer, pushes = EXAMPLE.train(service.url.result(), tmp_path, max_steps=STEPS, rows=ROWS)
    assert len(pushes) >= 2 and all(p.bytes > 0 for p in pushes)
    logged = [e for e in trainer.state.log_history if "reward" in e]
    assert len(logged) == STEPS
    # TRL's own IS correction is off, as docs/trl.md's table recommends on q* rollouts: no ratio is logged
    assert trainer.args.vllm_importance_sampling_correction is False
    assert not any(k.startswith("sampling/importance_sampling_ratio") for e in logged for k in e), logged[0]
    # After the last push the base server serves the trained weights (float32: to 1e-3).
    probes = [AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)(r["prompt"])["input_ids"] for r in ROWS]

    async def served() -> Any:
        async with VLLMClient(theta.url, name="theta") as base:
            return await base.next_token_topk(probes, 20)

    trained = learner_logprobs(trainer.model, probes)
    diff = compare_logprobs(service.run(served()), trained)
    assert diff.max_abs_diff <= 1e-3, diff
    start = learner_logprobs(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), probes)
    assert abs(trained - start).max() > 1e-2  # training moved them: the check above tells the two apart


def test_trls_server_distillation_trains_at_q_star_states_with_the_teacher_route(service, dev_pair, tmp_path):
    """TRL's ServerDistillationTrainer: the student's on-policy completions come from the service
    (q* states, `vllm_server_base_url`), the teacher's top-k from its /teacher route
    (`teacher_model_server_url`); forward KL (beta 0) over the teacher's top 5 with the tail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    url = service.url.result()
    config = ServerDistillationConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=5, max_steps=STEPS,
        learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
        beta=0.0, loss_top_k=5, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        teacher_model_server_url=url + "/teacher")
    holder: dict[str, Any] = {}
    with EXAMPLE.cpu_weight_sync(url, lambda: holder["trainer"].model) as pushes, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = holder["trainer"] = ServerDistillationTrainer(
            model=AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), args=config,
            train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in ROWS]),
            processing_class=AutoTokenizer.from_pretrained(tinymodels.BASE_DIR))
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and all(np.isfinite(losses)), trainer.state.log_history
    assert pushes, "the student's weights reached the base server before it sampled"
    answered = requests.get(f"{url}/metrics", timeout=30).text  # which routes the trainer used, from the service
    for route in ("/v1/completions", "/teacher/v1/completions", "/start_weight_update"):
        assert f'dualvllm_requests_total{{route="{route}",status="200"}}' in answered, route
