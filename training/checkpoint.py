"""Checkpoints of a training run: model, optimizer, step, RNG and data position.

    OUTPUT/checkpoints/step-000040/   model (HF format, servable by vLLM), tokenizer,
                                      optimizer.pt, state.json

A checkpoint directory is written under a temporary name and renamed into place, so a
run killed mid-save never leaves a half checkpoint that resume would pick up. The newest
`keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualvllm.training import lora

PREFIX = "step-"


@dataclass(frozen=True)
class RunState:
    step: int  # updates done
    data_position: int  # index of the next unused training task
    policy_version: int  # weight pushes done
    curriculum: dict | None = None  # Curriculum.state_dict() when the run uses one


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def save(
    output_dir: Path, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, state: RunState, keep: int
) -> Path:
    final = checkpoint_dir(output_dir, state.step)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    lora.save_full(model, partial)  # what a restarted server starts on
    lora.save_adapter(model, partial)  # what a LoRA learner resumes on
    tokenizer.save_pretrained(partial)
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # a learner on a GPU samples dropout and the like from the CUDA generators
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, partial / "rng.pt")
    (partial / "state.json").write_text(json.dumps(asdict(state)) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in all_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def all_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = output_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".partial") and (p / "state.json").is_file()
    )


def latest(output_dir: Path) -> Path | None:
    found = all_checkpoints(output_dir)
    return found[-1] if found else None


def load_state(path: Path, optimizer: torch.optim.Optimizer) -> RunState:
    """Restore the optimizer and RNGs from checkpoint `path` (the model is loaded from it directly).

    Loaded onto the CPU first, so a checkpoint a GPU learner wrote resumes on a machine without
    one (or on another GPU): the optimizer moves each state tensor to its parameter's device."""
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return RunState(**json.loads((path / "state.json").read_text()))
