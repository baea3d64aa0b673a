"""The q* service over the two real vLLM servers, called by real clients written elsewhere:
the official `openai` package, and lm-evaluation-harness (lm-eval) in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import openai
import pytest

from coordinator import CoordinatorConfig, DualVLLMCoordinator
from service.app import serve
from service.config import ServiceConfig
from tests import processes
from tinymodels.task import problems

REPO = Path(__file__).resolve().parents[2]
MODEL = "base+teacher"


@contextlib.asynccontextmanager
async def running_service(pair, **coordinator: Any) -> AsyncIterator[tuple[str, DualVLLMCoordinator]]:
    """(base URL of the OpenAI API, coordinator) of a q* service on the suite's servers."""
    theta, t = pair
    config = CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20, **coordinator)
    async with DualVLLMCoordinator(config) as c:
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(c, ServiceConfig(service_port=0),
                                         ready=lambda url, model: listening.set_result(url)))
        try:
            yield await asyncio.wait_for(listening, 30) + "/v1", c
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def client(url: str) -> openai.AsyncOpenAI:
    """The official client, without its own retries (a failure here should show)."""
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


def prompts(n: int) -> list[str]:
    return [p.prompt for p in problems("test", n=n, seed=3)]


async def test_openai_completions_match_the_python_api(vllm_pair):
    async with running_service(vllm_pair) as (url, coordinator), client(url) as openai_client:
        assert coordinator.mode == "lockstep"  # the suite's servers carry the plugin
        answer = await openai_client.completions.create(
            model=MODEL, prompt=prompts(6), max_tokens=6, temperature=0,
            extra_body={"dualvllm": {"return_token_ids": True}})
        direct = await coordinator.generate_batch(prompts(6), max_tokens=6, temperature=0)
    assert [c.text for c in answer.choices] == [o.generated_text for o in direct]
    assert [c.finish_reason for c in answer.choices] == ["stop"] * 6  # the models end their answers
    for choice, output in zip(answer.choices, direct):
        record = choice.model_extra["dualvllm"]
        assert record["token_ids"] == output.generated_tokens
        assert record["logprobs_q"] == pytest.approx(output.logprobs_q, abs=1e-5)
        assert record["alpha"] == pytest.approx(output.alpha_history, abs=1e-6)
    assert answer.usage.completion_tokens == sum(len(o.generated_tokens) for o in direct)


async def test_openai_chat_renders_the_bundled_template_and_streams(vllm_pair):
    question = prompts(1)[0]
    async with running_service(vllm_pair) as (url, _), client(url) as openai_client:
        plain = await openai_client.completions.create(model=MODEL, prompt=question, max_tokens=6, temperature=0)
        chat = await openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0)
        pieces = []
        stream = await openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0, stream=True)
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
        streamed = []
        stream = await openai_client.completions.create(model=MODEL, prompt=question, max_tokens=6, temperature=0,
                                                 stream=True, seed=1)
        async for chunk in stream:
            streamed.append(chunk.choices[0].text)
    # the bundled chat template renders a user message as its text
    assert chat.choices[0].message.content == plain.choices[0].text == "".join(pieces) == "".join(streamed)
    assert chat.choices[0].message.role == "assistant"


async def test_openai_errors_are_typed_by_the_client(vllm_pair):
    async with running_service(vllm_pair) as (url, _), client(url) as openai_client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await openai_client.completions.create(model="gpt-4", prompt="1+1=", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="maximum context length") as caught:
            await openai_client.completions.create(model=MODEL, prompt="1+1=", max_tokens=500)
        assert caught.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="unknown field"):  # 400 as vLLM and OpenAI, not 422
            await openai_client.completions.create(model=MODEL, prompt="1+1=", extra_body={"alpha": 0.5})
        # The vocabulary comes from the served model's config: refused here, not by vLLM (a 502 before).
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as caught:
            await openai_client.completions.create(model=MODEL, prompt=[5, 99999], max_tokens=2)
        assert caught.value.code == "invalid_token_id"


LM_EVAL_TASK = REPO / "benchmarks" / "lm_eval_tasks"


async def test_lm_eval_scores_q_star_as_dualvllm_eval_does(vllm_pair, tmp_path):
    """lm-eval's local-completions model, on tasks over the bundled test problems, gets the
    greedy accuracies that `dualvllm eval --arms base q* --eval-samples 0` computes for them
    (its problems and evaluate(), on the same servers): q* and, with the task's
    `dualvllm.fixed_alpha` 0, the base alone."""
    from transformers import AutoTokenizer

    import tinymodels
    from training.config import EvalConfig
    from training.evaluation import evaluate
    from training.problems import load_problems
    from training.verifiers import verifier_pool

    config = EvalConfig(arms=("base", "q*"), eval_samples=0, eval_prompts=10_000)
    held_out = load_problems(config, AutoTokenizer.from_pretrained(tinymodels.BASE_DIR))
    async with running_service(vllm_pair) as (url, coordinator):
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model={MODEL},base_url={url}/completions,tokenizer_backend=none,"
                            "tokenized_requests=False,num_concurrent=16,max_retries=1",
            "--include_path", str(LM_EVAL_TASK), "--tasks", "dualvllm_arithmetic,dualvllm_arithmetic_base",
            "--output_path", str(tmp_path / "lm_eval"),
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            log, _ = await asyncio.wait_for(process.communicate(), 600)
        finally:  # ended on every path, a timeout included
            if process.returncode is None:
                processes.end_tree(process.pid)
                await process.wait()
        assert process.returncode == 0, log.decode()[-3000:]
        with verifier_pool() as pool:
            base, qstar = await evaluate(coordinator, held_out.held_out, held_out.spec, pool, arms=config.arms,
                                         max_tokens=config.max_tokens)
    assert qstar.tasks == 484
    results = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]
    # both greedy (temperature 0) over the same distributions: the same completions, the same scores
    assert results["dualvllm_arithmetic"]["exact_match,none"] == pytest.approx(qstar.greedy_accuracy)
    assert results["dualvllm_arithmetic_base"]["exact_match,none"] == pytest.approx(base.greedy_accuracy)
    assert base.greedy_accuracy < 0.5 < qstar.greedy_accuracy  # q* leans on the teacher, which solves the task
