"""The bottom layer every other package imports: the error tree and pydantic validation.

It imports nothing of the project, and nothing heavier than pydantic. The layers, each
importing only those to its left:

    common <- theory (numpy/scipy) <- engines, coordinator (asyncio/aiohttp)
           <- training (torch) <- dualvllm (the command line)
"""
