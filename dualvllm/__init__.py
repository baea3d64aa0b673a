"""dualvllm: RL post-training with optimal sampling from two vLLM servers.

This namespace holds only what every layer shares (the error tree) and the command
line. The layers, each importing only those to its left:

    dualvllm.errors <- theory (numpy/scipy) <- engines, coordinator (asyncio/aiohttp)
                    <- training (torch) <- dualvllm.cli
"""

__version__ = "0.1.0"
