"""The coordinator as an OpenAI-compatible HTTP service (service.app): any client, eval
harness or RL framework asks it for q* samples."""
