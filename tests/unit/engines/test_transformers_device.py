"""The in-process engine's `device` option: auto, cpu, cuda or cuda:N (the learner's, under
`--engine transformers`), refused with the engine's name where it cannot work."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualvllm.common.errors import InvalidInputError  # noqa: E402
from dualvllm.engines.transformers_engine import engine_device  # noqa: E402


def test_auto_is_the_first_gpu_when_torch_sees_one_else_the_cpu():
    assert engine_device("auto", "t").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert engine_device("cpu", "t") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where torch sees no GPU")
@pytest.mark.parametrize("choice", ["cuda", "cuda:1"])
def test_a_gpu_without_one_is_refused_naming_the_engine(choice):
    with pytest.raises(InvalidInputError, match=f"t engine asked for device '{choice}' but torch sees no GPU"):
        engine_device(choice, "t")


@pytest.mark.parametrize("choice", ["gpu", "mps", "meta"])
def test_a_device_the_engine_does_not_run_on_is_refused(choice):
    with pytest.raises(InvalidInputError, match=f"t engine: device '{choice}' is not auto, cpu, cuda or cuda:N"):
        engine_device(choice, "t")


@pytest.mark.gpu
async def test_an_engine_on_cuda_answers_as_the_cpu_one():
    from dualvllm import tinymodels
    from dualvllm.engines.transformers_engine import TransformersEngine

    contexts = [[1, 5, 7], [2, 3]]
    async with TransformersEngine(tinymodels.TEACHER_DIR, device="cpu") as cpu:
        want = await cpu.next_token_logprobs(contexts)
    async with TransformersEngine(tinymodels.TEACHER_DIR, device="cuda:0") as gpu:
        got = await gpu.next_token_logprobs(contexts)
    assert abs(got - want).max() < 1e-4  # float32 on both; GPU kernels sum in another order
