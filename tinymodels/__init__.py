"""The bundled tiny base and teacher models, their tokenizer and their task.

`BASE_DIR` and `TEACHER_DIR` are Hugging Face checkpoint directories (Qwen2
architecture, character-level tokenizer) built by `python -m dualvllm.tinymodels.build`; the
task (reversed-digit two-digit addition) is in `dualvllm.tinymodels.task`. The teacher solves
the task; the base is deliberately weak, so sampling from q* has something to gain.
`TEACHER_HARD_DIR` (`python -m dualvllm.tinymodels.build --hard-teacher`) also solves the hard
task, the same with three-digit operands, which the base almost never solves.
`BASE_HINT_DIR` (`python -m dualvllm.tinymodels.build --hint-base`) is the base trained further to
read a hint: shown the answer in front of the question (`dualvllm.tinymodels.task.HINT_TEMPLATE`)
it copies it, on either task; without one it is as weak as the base. It makes the base its
own privileged-information teacher (`--teacher self --teacher-template`).
`TEACHER_LONG_DIR` (`python -m dualvllm.tinymodels.build --long-teacher`) solves the long task
(two 19-digit numbers, 20-digit answers), which the base never solves.
`BASE_MIXED_DIR` and `TEACHER_MIXED_DIR` (`python -m dualvllm.tinymodels.build --mixed-pair`) are the
mixed task's pair (`dualvllm.tinymodels.task.mixed_problems`): a base that answers as the base does and
also copies a hint (the skill its training never asks for, so that forgetting shows), and a
teacher that solves two of the three difficulties: on the test split, two-digit 100%, long 100%,
three-digit 10.5% (see docs/training.md).
Importing this package does not import torch.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_DIR = HERE / "base"
TEACHER_DIR = HERE / "teacher"
TEACHER_HARD_DIR = HERE / "teacher-hard"
BASE_HINT_DIR = HERE / "base-hint"
TEACHER_LONG_DIR = HERE / "teacher-long"
BASE_MIXED_DIR = HERE / "base-mixed"
TEACHER_MIXED_DIR = HERE / "teacher-mixed"
BUILD_REPORT = HERE / "build_report.json"
# vLLM's --dtype auto serves float32 checkpoints in bfloat16, whose logprobs differ from
# the models' own by ~0.01 nats here; the tiny models are served as they were trained.
SERVER_DTYPE = "float32"

__all__ = [
    "BASE_DIR",
    "BASE_HINT_DIR",
    "BASE_MIXED_DIR",
    "BUILD_REPORT",
    "SERVER_DTYPE",
    "TEACHER_DIR",
    "TEACHER_HARD_DIR",
    "TEACHER_LONG_DIR",
    "TEACHER_MIXED_DIR",
]
