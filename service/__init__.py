"""The coordinator as an OpenAI-compatible HTTP service (dualvllm.service.app): any client, eval
harness or RL framework asks it for q* samples.

Imports go one way (tests/unit/test_layers.py): errors, schema, config, tokens -> scoring ->
responses -> formats (completion and chat) -> jobs (Job, RequestQueue) -> metrics, streaming
(written against its own narrow `Generation`) -> app.
"""
