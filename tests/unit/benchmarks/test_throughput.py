"""benchmarks/throughput.py's long-context option: copies of the bundled models served past
the 64 positions they were trained on, so that the all-in figures can be taken at RL-like
lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualvllm import tinymodels
from benchmarks import harness
from dualvllm.engines.launcher import pair_configs
from tests.processes import REPO


def test_long_context_copies_of_the_bundled_models_change_their_configs_alone(tmp_path):
    options = harness.long_context_models(tmp_path, 640)
    assert options["max_model_len"] == 640 and options["dtype"] == tinymodels.SERVER_DTYPE
    for role, source in (("base_model", tinymodels.BASE_DIR), ("teacher_model", tinymodels.TEACHER_DIR)):
        copy = Path(options[role])
        assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in source.iterdir())
        config = json.loads((copy / "config.json").read_text())
        assert config == json.loads((source / "config.json").read_text()) | {"max_position_embeddings": 640}
        assert json.loads((copy / "tokenizer_config.json").read_text())["model_max_length"] == 640
        assert (copy / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    # A server can load the copy: its validation sees a model directory.
    pair_configs(options["base_model"], options["teacher_model"], max_model_len=640)


@pytest.mark.parametrize("option", [["--max-model-len", "640"], ["--shape", "small"]], ids=["context", "shape"])
def test_a_long_context_or_shape_for_servers_someone_else_started_is_refused_before_anything_runs(option):
    done = subprocess.run([sys.executable, "benchmarks/throughput.py", "--theta-url", "http://127.0.0.1:1",
                           "--t-url", "http://127.0.0.1:2", *option],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert "--max-model-len and --shape set the servers this script starts" in done.stderr
