"""The coordinator against two real vLLM servers serving the bundled tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.common.errors import InvalidInputError, LockstepUnavailableError, ServerStartupError
from dualvllm.engines.launcher import ServerConfig, VLLMServer
from dualvllm.engines.vllm_client import VLLMClient
from tests.exact_q import chi_square_pvalue, exact_q_star
from dualvllm.tinymodels.task import problems, score


def config(pair, **kw) -> CoordinatorConfig:
    theta, t = pair
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, **kw)


async def test_q_star_sampling_end_to_end(vllm_pair):
    tasks = problems("test", n=24, seed=1)
    prompts = [p.prompt for p in tasks]
    async with DualVLLMCoordinator(config(vllm_pair, top_k=20, max_batch_size=8)) as c:
        mixed = await c.generate_batch(prompts, max_tokens=6, seed=0, return_diagnostics=True)
        teacher = await c.generate_batch(prompts, max_tokens=6, temperature=0, fixed_alpha=1.0)
        statistics = c.get_statistics()
    assert all(o.ok for o in mixed + teacher)
    # The bundled teacher is >= 95% accurate greedily; through the coordinator it must stay so.
    assert np.mean([score(p, o.generated_text) for p, o in zip(tasks, teacher)]) >= 0.9
    assert sum(o.finish_reason == "eos" for o in mixed) >= len(mixed) - 2
    alphas = np.concatenate([o.alpha_history for o in mixed])
    assert ((alphas >= 0) & (alphas <= 1)).all() and 0.0 < alphas.mean() < 1.0
    for out in mixed:
        # At alpha* the two KLs are equal (up to the solver tolerance).
        assert abs(out.diagnostics["kl_diff"]["max"]) < 1e-4
        assert 0.5 < out.diagnostics["coverage_t"]["min"] <= 1.0 + 1e-6
    all_tokens = sum(len(o.generated_tokens) for o in mixed + teacher)
    assert statistics["tokens"] == all_tokens and statistics["tokens_per_s"] > 0


async def test_recorded_logprobs_are_the_models_own(vllm_pair):
    """logprobs_theta / logprobs_t must equal the model's log-softmax at each position."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    async with DualVLLMCoordinator(config(vllm_pair, top_k=20)) as c:
        async with VLLMClient(vllm_pair[0].url) as client:
            outputs = await c.generate_batch(["37+48=", "90+15="], max_tokens=5, seed=2)
            prompt_ids = [await client.tokenize(o.prompt) for o in outputs]
    for model_dir, key in ((tinymodels.BASE_DIR, "logprobs_theta"), (tinymodels.TEACHER_DIR, "logprobs_t")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for out, ids in zip(outputs, prompt_ids):
            sequence = torch.tensor([ids + out.generated_tokens])
            with torch.no_grad():
                logp = torch.log_softmax(model(sequence).logits[0].double(), dim=-1)
            positions = range(len(ids) - 1, len(ids) - 1 + len(out.generated_tokens))
            for step, (pos, token) in enumerate(zip(positions, out.generated_tokens)):
                exact = logp[pos, token].item()
                in_top_k = (logp[pos] > exact).sum().item() < 20
                recorded = getattr(out, key)[step]
                if in_top_k:
                    assert recorded == pytest.approx(exact, abs=2e-3)
                else:  # a fill value: the model's smallest reported logprob, an upper bound
                    assert recorded >= exact - 2e-3


async def test_start_up_refuses_a_top_k_above_the_vocabulary_and_the_servers_keep_serving(vllm_pair):
    # vLLM's CPU engine dies when asked for more logprobs than the vocabulary holds, so the
    # refusal must come before any request: the same servers must still answer afterwards.
    with pytest.raises(InvalidInputError, match="top_k=99 is larger than the models' vocabulary of 98"):
        async with DualVLLMCoordinator(config(vllm_pair, top_k=99)):
            pass
    async with DualVLLMCoordinator(config(vllm_pair, top_k=98)) as c:
        [out] = [o async for o in c.stream(["12+34="], max_tokens=2, seed=0)]
    assert out.ok, out.error


# Slow (vLLM's imports before it fails, ~50 s in CI): the launcher's report of a server that exits is
# tests/unit/engines/test_launcher.py's; this holds it against what real vLLM prints.
@pytest.mark.slow
async def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    model = tmp_path / "no-such-model"  # a directory vLLM cannot load: an unknown architecture
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-model", "architectures": ["NoSuchModel"]}')
    server = VLLMServer(ServerConfig(model=str(model), startup_timeout_s=300, log_path=tmp_path / "bad.log"),
                        name="broken")
    with pytest.raises(ServerStartupError, match="broken vLLM server .* exited") as info:
        await server.start()
    assert "no-such-model" in str(info.value)  # the log tail says what vLLM complained about
    assert not server.running


async def test_stream_text_is_the_detokenized_ids_and_eos_stops(vllm_pair):
    tasks = problems("test", n=12, seed=4)
    async with DualVLLMCoordinator(config(vllm_pair, top_k=20, max_batch_size=4)) as c:
        outputs = [out async for out in c.stream([p.prompt for p in tasks], max_tokens=8, seed=3)]
        eos = c.eos_token_ids
        async with VLLMClient(vllm_pair[1].url) as client:
            for out in outputs:
                assert out.ok, out.error
                tokens = out.generated_tokens
                if out.finish_reason == "eos":
                    assert tokens[-1] in eos and not set(tokens[:-1]) & eos
                    tokens = tokens[:-1]
                else:
                    assert out.finish_reason == "max_tokens" and len(tokens) == 8
                assert out.generated_text == await client.detokenize(tokens)
    assert sorted(o.index for o in outputs) == list(range(len(tasks)))
    assert sum(o.finish_reason == "eos" for o in outputs) >= len(tasks) // 2


def _full_logprobs(prompt: str) -> tuple[np.ndarray, np.ndarray]:
    """Both models' full next-token logprobs after `prompt`, from transformers."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)(prompt, add_special_tokens=False)["input_ids"]
    logps = []
    for model_dir in (tinymodels.BASE_DIR, tinymodels.TEACHER_DIR):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        logps.append(torch.log_softmax(logits, dim=-1).numpy())
    return logps[0], logps[1]


@pytest.mark.parametrize("mode, batch", [("per_token", 500), ("lockstep", 128)])
async def test_first_token_follows_exact_q_star(vllm_pair, mode, batch):
    """With top_k = the whole vocabulary, the merge is exact: draws must follow q* exactly."""
    prompt = "4"  # the next character is an uncertain operand digit for both models
    q, alpha = exact_q_star(*_full_logprobs(prompt))
    draws = 3000
    async with DualVLLMCoordinator(config(vllm_pair, top_k=min(q.shape[0], 100), max_batch_size=batch,
                                          mode=mode)) as c:
        outputs = await c.generate_batch([prompt] * draws, max_tokens=1, seed=21)
    assert all(o.ok for o in outputs)
    np.testing.assert_allclose([o.alpha_history[0] for o in outputs], alpha, atol=1e-4)
    first = np.array([o.generated_tokens[0] for o in outputs])
    assert chi_square_pvalue(first, q, min_bins=3) > 1e-3


async def test_servers_without_tokenizers_generate_what_servers_with_them_generate(vllm_pair, tmp_path):
    """A --skip-tokenizer-init base (beside the session's teacher: the base's tokenizer is the one that
    reads prompts and writes texts) plus the coordinator's own tokenizers: same tokens, text, stops."""
    from dualvllm.common.errors import ServerStatusError
    from dualvllm.engines.launcher import VLLMServer, pair_configs

    prompts = [p.prompt for p in problems("test", n=16, seed=6)]
    kw = dict(max_tokens=6, temperature=0, stop=["+"])
    async with DualVLLMCoordinator(config(vllm_pair, top_k=20)) as c:
        assert c.mode == "lockstep"  # the shared servers carry the plugin
        expected = await c.generate_batch(prompts, **kw)
    base_config, _ = pair_configs(log_dir=tmp_path, max_logprobs=20, skip_tokenizer_init=True, lockstep=False)
    async with VLLMServer(base_config, name="theta") as bare_base:
        bare = (bare_base, vllm_pair[1])
        async with VLLMClient(bare_base.url) as client:  # the flag took effect: no tokenizer on the server
            with pytest.raises(ServerStatusError):
                await client.tokenize("12+34=")
        with pytest.raises(LockstepUnavailableError, match="no dualvllm lockstep plugin"):
            async with DualVLLMCoordinator(config(bare, top_k=20, local_tokenizers=True, mode="lockstep")):
                pass
        async with DualVLLMCoordinator(config(bare, top_k=20, local_tokenizers=True)) as c:
            assert c.mode == "per_token"  # no plugin: auto falls back
            outputs = await c.generate_batch(prompts, **kw)
    for got, want in zip(outputs, expected):
        assert got.ok, got.error
        assert (got.generated_tokens, got.generated_text, got.finish_reason) == \
            (want.generated_tokens, want.generated_text, want.finish_reason)
        np.testing.assert_allclose(got.logprobs_q, want.logprobs_q, atol=1e-4)
