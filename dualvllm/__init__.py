"""dualvllm: RL post-training with optimal sampling from two vLLM servers.

This namespace is the top layer: the `dualvllm` command line and the jobs it runs
(`generate`, `demo`, `serve`). The shared error tree lives at the bottom, in `common`.
"""

__version__ = "0.1.0"
