"""Where the learner runs, and in what precision: resolved once per run from `--learner-device`
and `--mixed-precision`, and read by everything that makes a tensor for it.

    check_choice(spec, precision)    what is wrong on any machine, refused when the config is read
    learner_device(None)      cuda:0 when torch sees a GPU, else cpu
    learner_device("cuda:1")  that GPU (refused when torch does not see it, when the run starts)
    autocast_dtype(device, "auto")   bfloat16 on a CUDA device that supports it, else None (float32)

The learner keeps float32 master weights whatever the precision: autocast runs the matmuls in
bf16 (or fp16) and keeps the optimizer's state and the update in float32, as accelerate's
`mixed_precision="bf16"` and TRL's `bf16=True` do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.choices import MixedPrecision

# torch is imported where a device is resolved, not here: the training config reads this module,
# and every `dualvllm` command builds its parser from that config (torch alone is 2-5 s to import).
if TYPE_CHECKING:
    import torch


def check_choice(spec: str | None, precision: MixedPrecision) -> None:
    """Refuse what is wrong on any machine: a `--learner-device` that is no learner device, fp16 on the CPU.

    Whether the GPU exists is left to `learner_device`, asked when the run starts: a plan for a
    GPU machine (`--dry-run`) is written and checked on machines without one.
    """
    if spec is not None:
        _precision_fits(device_of(spec), precision)


def device_of(spec: str) -> torch.device:
    """`--learner-device` as a torch device the learner can run on (cpu, cuda, cuda:N; meta for plans and
    tests), without asking whether the hardware is there."""
    import torch

    try:
        device = torch.device(spec)
    except RuntimeError as err:
        raise InvalidInputError(
            f"--learner-device {spec!r} is not a torch device (cpu, cuda, cuda:1, ...): {err}"
        ) from err
    if device.type not in ("cpu", "cuda", "meta"):
        raise InvalidInputError(f"--learner-device {spec}: the learner runs on cpu or cuda, not {device.type}")
    return device


def learner_device(spec: str | None) -> torch.device:
    """The learner's device from `--learner-device` (None: the first CUDA device when there is one, else the CPU)."""
    import torch

    if spec is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = device_of(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"--learner-device {spec} asks for a GPU and torch sees none (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda is not None}); drop the flag to train on the CPU"
            )
        index = device.index if device.index is not None else 0
        if index >= torch.cuda.device_count():
            raise InvalidInputError(
                f"--learner-device {spec}: torch sees {torch.cuda.device_count()} GPU(s) "
                "(CUDA_VISIBLE_DEVICES renumbers them from 0); give one of them"
            )
        return torch.device("cuda", index)
    return device


def autocast_dtype(device: torch.device, precision: MixedPrecision) -> torch.dtype | None:
    """The dtype autocast computes in on `device` under `precision`; None: plain float32.

    auto: bfloat16 on a CUDA device that supports it (Ampere and newer), else float32. On the
    CPU, autocast to bf16 is slower than float32 on most cores, so auto keeps float32 there;
    asking for bf16 explicitly still works.
    """
    import torch

    if precision == "no" or device.type == "meta":
        return None
    if precision == "auto":
        # Emulated bf16 (before Ampere) is slower than float32: auto takes native support only.
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if cuda_bf16 else None
    _precision_fits(device, precision)
    return torch.bfloat16 if precision == "bf16" else torch.float16


def _precision_fits(device: torch.device, precision: MixedPrecision) -> None:
    if precision == "fp16" and device.type == "cpu":
        raise InvalidInputError(
            "--mixed-precision fp16 needs a CUDA learner (float16 autocast on the CPU is not supported); "
            "use --mixed-precision bf16 or no, or --learner-device cuda"
        )


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """torch.autocast on `device` in `dtype`; a no-op for None (float32)."""
    import torch

    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def describe(device: torch.device, dtype: torch.dtype | None) -> str:
    """How the learner computes, for the run's log: "cuda:0, bfloat16 autocast over float32 weights"."""
    if dtype is None:
        return f"{device}, float32"
    return f"{device}, {str(dtype).removeprefix('torch.')} autocast over float32 weights"
