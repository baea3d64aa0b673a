"""Model engines: what the coordinator calls to get next-token top-k logprobs.

`protocol.Engine` is the interface; `vllm_client.VLLMClient` implements it over a vLLM
server's HTTP API; `launcher` starts local vLLM servers. No torch is imported here.
"""

from dualvllm.engines.launcher import ServerConfig, VLLMServer, launch_pair, pair_configs
from dualvllm.engines.protocol import PAD_TOKEN_ID, Engine, ModelInfo, TopKBatch
from dualvllm.engines.vllm_client import VLLMClient

__all__ = [
    "PAD_TOKEN_ID",
    "Engine",
    "ModelInfo",
    "ServerConfig",
    "TopKBatch",
    "VLLMClient",
    "VLLMServer",
    "launch_pair",
    "pair_configs",
]
