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

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator, SamplingParams
from dualvllm.service.app import serve
from dualvllm.service.config import ServiceConfig
from tests import processes
from tests.recipes import TINY_ARITH
from dualvllm.tinymodels.task import problems

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
        plain = await openai_client.completions.create(model=MODEL, prompt=question, max_tokens=6, temperature=0,
                                                       logprobs=1)
        chat = await openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0)
        pieces = []
        stream = await openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0, stream=True)
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
        streamed, streamed_logprobs = [], []
        stream = await openai_client.completions.create(model=MODEL, prompt=question, max_tokens=6, temperature=0,
                                                 stream=True, seed=1, logprobs=1)
        async for chunk in stream:
            streamed.append(chunk.choices[0].text)
            streamed_logprobs += chunk.choices[0].logprobs.token_logprobs
    # the bundled chat template renders a user message as its text
    assert chat.choices[0].message.content == plain.choices[0].text == "".join(pieces) == "".join(streamed)
    assert streamed_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
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

    from dualvllm import tinymodels
    from dualvllm.training.config import EvalConfig
    from dualvllm.training.evaluation import evaluate
    from dualvllm.training.problems import load_problems
    from dualvllm.training.verifiers import verifier_pool

    config = EvalConfig.parse(config_file=TINY_ARITH, arms=("base", "q*"), eval_samples=0, eval_prompts=10_000)
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
            base, qstar = await evaluate(coordinator, held_out.held_out, held_out.spec, pool,
                                         SamplingParams(max_tokens=config.max_tokens), arms=config.arms)
    assert qstar.tasks == 484
    results = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]
    # both greedy (temperature 0) over the same distributions: the same completions, the same scores
    assert results["dualvllm_arithmetic"]["exact_match,none"] == pytest.approx(qstar.greedy_accuracy)
    assert results["dualvllm_arithmetic_base"]["exact_match,none"] == pytest.approx(base.greedy_accuracy)
    assert base.greedy_accuracy < 0.5 < qstar.greedy_accuracy  # q* leans on the teacher, which solves the task


# -- q* loglikelihoods (echo) ------------------------------------------------------------

async def test_echoed_log_q_star_matches_the_exact_full_vocabulary_q_star(vllm_pair):
    """Each prompt token's log q* and alpha* from the service (both servers' top-20 prompt
    logprobs) against the exact q* over the whole vocabulary (tests/exact_q.py on the
    in-process transformers engines' full distributions), on whole problem lines. The bound
    is the top-k error docs/topk-accuracy.md states for the bundled models at k = 20: mean
    |alpha error| 0.0051 (the target is 0.01) and mean TV(q*) 0.0021, so a token's q* moves
    by at most 2 TV."""
    import numpy as np
    from transformers import AutoTokenizer

    from dualvllm import tinymodels
    from dualvllm.engines.transformers_engine import TransformersEngine
    from tests.exact_q import exact_q_star

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    lines = [tokenizer(p.prompt + p.answer + "<eos>", add_special_tokens=False).input_ids
             for p in problems("test", n=24, seed=5)]
    async with running_service(vllm_pair) as (url, _), client(url) as openai_client:
        answers = {name: await openai_client.completions.create(
            model=name, prompt=lines, max_tokens=0, echo=True, logprobs=0)
            for name in (MODEL, f"{MODEL}@alpha=0", f"{MODEL}@alpha=1")}
    async with TransformersEngine(tinymodels.BASE_DIR) as base, TransformersEngine(tinymodels.TEACHER_DIR) as teacher:
        contexts = [line[:j] for line in lines for j in range(1, len(line))]
        full_base, full_teacher = await base.next_token_logprobs(contexts), await teacher.next_token_logprobs(contexts)
    tokens = np.array([t for line in lines for t in line[1:]])
    rows = np.arange(len(tokens))
    exact = [exact_q_star(b, t) for b, t in zip(full_base, full_teacher)]
    want_q = np.array([q[y] for (q, _), y in zip(exact, tokens)])
    want_alpha = np.array([alpha for _, alpha in exact])

    def served(name: str, field: str) -> np.ndarray:
        choices = answers[name].choices
        if field == "logprobs_q":
            return np.array([v for c in choices for v in c.logprobs.token_logprobs[1:]])
        return np.array([v for c in choices for v in c.model_extra["dualvllm"]["prompt"][field][1:]])

    assert [c.logprobs.token_logprobs[0] for c in answers[MODEL].choices] == [None] * len(lines)
    q_error = np.abs(np.exp(served(MODEL, "logprobs_q")) - want_q)
    alpha_error = np.abs(served(MODEL, "alpha") - want_alpha)
    assert q_error.mean() <= 2 * 0.0021 and alpha_error.mean() <= 0.01, (q_error.mean(), alpha_error.mean())
    # The servers' raw logprobs of each token are the models' own (vLLM's kernels against transformers').
    assert served(MODEL, "logprobs_theta") == pytest.approx(full_base[rows, tokens], abs=1e-4)
    assert served(MODEL, "logprobs_t") == pytest.approx(full_teacher[rows, tokens], abs=1e-4)
    # A fixed alpha scores with one model, renormalized over the candidates: within 2 TV too.
    for name, full in ((f"{MODEL}@alpha=0", full_base), (f"{MODEL}@alpha=1", full_teacher)):
        assert set(served(name, "alpha")) == {float(name[-1])}
        assert np.abs(np.exp(served(name, "logprobs_q")) - np.exp(full[rows, tokens])).mean() <= 2 * 0.0021


# Slow (three lm-eval runs, ~120 s): lm-eval against the service is also the test above's, and the
# echoed loglikelihoods test_echoed_log_q_star_matches_the_exact_full_vocabulary_q_star's.
@pytest.mark.slow
async def test_lm_eval_multiple_choice_puts_q_star_between_the_base_and_the_teacher(vllm_pair, tmp_path):
    """benchmarks/lm_eval_loglikelihood.py: lm-eval's local-completions model scores the
    multiple-choice task (and the loglikelihood_rolling one) three times through one endpoint,
    as q* and, by model name, with alpha fixed at 0 and 1. (Its check of the echoed values
    against the exact q* is skipped: test_echoed_log_q_star_matches_the_exact_full_vocabulary_q_star
    is that check.)"""
    results = tmp_path / "results.json"
    async with running_service(vllm_pair) as (url, _):
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(REPO / "benchmarks" / "lm_eval_loglikelihood.py"), "--url", url, "--limit", "24",
            "--exact-lines", "0", "--output", str(results), cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            log, _ = await asyncio.wait_for(process.communicate(), 600)
        finally:  # ended on every path, a timeout included, with the lm-eval runs it started
            if process.returncode is None:
                processes.end_tree(process.pid)
                await process.wait()
    assert process.returncode == 0, log.decode()[-3000:]
    arms = json.loads(results.read_text())["arms"]
    assert [arms[a]["model"] for a in ("base", "q*", "teacher")] == [f"{MODEL}@alpha=0", MODEL, f"{MODEL}@alpha=1"]
    accuracy = {arm: row["mc_accuracy"] for arm, row in arms.items()}
    assert accuracy["base"] < accuracy["q*"] <= accuracy["teacher"], accuracy
    assert all(0 < row["bits_per_byte"] < 10 for row in arms.values()), arms


async def test_tokens_in_tokens_out_answers_parse_as_the_pinned_vllms_own(vllm_pair):
    """/v1/chat/completions/render and /inference/v1/generate, read by vLLM's own protocol models
    (vllm.entrypoints.scale_out): the shapes are the pinned server's, not a guess."""
    protocol = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
    import aiohttp

    async with running_service(vllm_pair) as (url, _), aiohttp.ClientSession() as session:
        root = url.removesuffix("/v1")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompts(1)[0]}], "max_tokens": 5,
                "n": 2, "seed": 1, "logprobs": True, "top_logprobs": 3}
        async with session.post(root + "/v1/chat/completions/render", json=chat) as response:
            rendered = await response.json()
            assert response.status == 200, rendered
        request = protocol.GenerateRequest.model_validate(rendered)  # vLLM takes our render as its request
        assert request.sampling_params.n == 2 and request.sampling_params.logprobs == 3
        async with session.post(root + "/inference/v1/generate", json=rendered) as response:
            body = await response.json()
            assert response.status == 200, body
    answer = protocol.GenerateTokensResponse.model_validate(body)
    assert len(answer.choices) == 2 and answer.usage.prompt_tokens == len(rendered["token_ids"])
    for choice in answer.choices:
        assert choice.token_ids and len(choice.logprobs.content) == len(choice.token_ids)
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
