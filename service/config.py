"""ServiceConfig: every knob of the OpenAI-compatible q* endpoint, declared once.

Values come from keyword arguments (the `dualvllm serve` flags), then `DUALVLLM_*`
environment variables (e.g. `DUALVLLM_SERVICE_PORT=8100`), then the defaults below.
`DUALVLLM_API_KEY` is the deployment's one key: clients must present it here, and the
coordinator sends it to the model servers (CoordinatorConfig.api_key reads the same variable).
"""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dualvllm.common.validation import RaisesInvalidInput
from dualvllm.engines.vllm_plugin.net import is_loopback


class ServiceConfig(RaisesInvalidInput, BaseSettings):
    """Settings of the q* HTTP service. Invalid values raise InvalidInputError."""

    model_config = SettingsConfigDict(env_prefix="DUALVLLM_", extra="forbid", frozen=True)

    service_host: str = Field(
        "127.0.0.1", description="Interface the q* endpoint binds; any other than loopback needs an API key."
    )
    service_port: int = Field(8100, ge=0, le=65535, description="Port of the q* endpoint; 0 picks a free one.")
    api_key: SecretStr | None = Field(
        None,
        description="Bearer token clients must send (Authorization: Bearer KEY), compared in constant time; None = no auth (loopback only). Set as DUALVLLM_API_KEY, it also keys the model servers (the coordinator sends it, `serve` starts them with it).",
    )
    served_model_name: str | None = Field(
        None, description="The name clients give as `model`; None = '<base>+<teacher>' from the servers' model names."
    )
    max_queued_sequences: int = Field(
        1024,
        ge=0,
        description="Sequences that may wait for a place in the running batch; a request that would exceed it gets HTTP 429 with Retry-After.",
    )
    max_request_tokens: int = Field(
        65536,
        ge=1,
        description="Ceiling on n x max_tokens x prompts of one request, plus the prompt tokens echo with logprobs scores, so one client cannot take the whole service.",
    )
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="Largest request body accepted (HTTP 413 above).")
    default_max_tokens: int = Field(
        16,
        ge=1,
        description="max_tokens of a completion request that gives none (OpenAI's default); chat requests default to the room left in the context.",
    )
    scoring_call_tokens: int = Field(
        16_384,
        ge=0,
        description="Prompt tokens per merged scoring call: concurrent echo and prompt_logprobs requests go to each server together, up to this many tokens per call (dualvllm.service.batching); 0 = each request on its own call.",
    )
    dev_mode: bool = Field(
        False,
        description="Serve vLLM's dev routes (server_info, the weight-transfer phases, reset_prefix_cache), forwarded to the base servers, so a trainer written for vLLM (TRL) can push weights through the service (dualvllm.service.dev_routes). Off loopback the API key guards them, as every route.",
    )

    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes serving the endpoint, each with its own coordinator (a core each) on the same servers and port: for more q* tokens per second than one coordinator decides. Each keeps its own batch (max_batch_size is per worker), metrics and statistics; responses name theirs in X-DualVLLM-Worker (dualvllm.service.workers).",
    )

    @model_validator(mode="after")
    def _one_worker_in_dev_mode(self) -> ServiceConfig:
        if self.dev_mode and self.workers > 1:
            raise ValueError(
                f"dev_mode with workers={self.workers}: a weight push through one worker would pause its own "
                "sequences and not the others', which would then decode across the push. Serve dev mode with "
                "one worker"
            )
        return self

    @model_validator(mode="after")
    def _key_off_loopback(self) -> ServiceConfig:
        if self.api_key is None and not is_loopback(self.service_host):
            raise ValueError(
                f"service_host={self.service_host!r} is not loopback, and no API key is set: anyone who can reach "
                "it could generate on your GPUs. Set --api-key or DUALVLLM_API_KEY, or bind 127.0.0.1"
            )
        return self
