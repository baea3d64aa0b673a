"""The recipe files the tests run the bundled models with (recipes/)."""

from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# The bundled tiny models' values (6-token answers, lr 2e-4, 200 steps): what `dualvllm train`
# took by default before its defaults became a real LLM's.
TINY_ARITH = RECIPES / "tiny-arith.yaml"
TINY_HARD = RECIPES / "tiny-hard.yaml"
QWEN_GSM8K = RECIPES / "qwen-gsm8k.yaml"
