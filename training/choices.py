"""The training options that name a choice, as the types the config validates against: here, apart
from the torch code that implements them, so that reading a config (and building the `dualvllm`
parser from it) loads neither torch nor scipy."""

from __future__ import annotations

from typing import Literal

MixedPrecision = Literal["auto", "no", "bf16", "fp16"]  # training/device.py
Normalization = Literal["grpo", "dr_grpo", "dapo"]  # training/losses.py: how a batch's token losses are averaged
Correction = Literal["sequence", "token", "vespo", "none"]  # training/losses.py: the off-policy correction
