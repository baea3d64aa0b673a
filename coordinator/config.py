"""CoordinatorConfig: every knob of the coordinator, declared once.

Values come from keyword arguments, then `DUALVLLM_*` environment variables (e.g.
`DUALVLLM_TOP_K=50`), then the defaults below.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dualvllm.common.validation import RaisesInvalidInput
from dualvllm.engines.http import CONNECT_TIMEOUT_S, CONNECTION_POOL_SIZE, MAX_RETRIES, REQUEST_TIMEOUT_S, RETRY_DELAY_S


class CoordinatorConfig(RaisesInvalidInput, BaseSettings):
    """Settings of a DualVLLMCoordinator. Invalid values raise InvalidInputError."""

    model_config = SettingsConfigDict(env_prefix="DUALVLLM_", extra="forbid", frozen=True)

    theta_url: str = Field("http://127.0.0.1:8000", description="Base URL of the base-model (pi_theta) vLLM server.")
    t_url: str = Field("http://127.0.0.1:8001", description="Base URL of the teacher (pi_t) vLLM server.")
    theta_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Replicas of the base model (same weights), comma-separated in DUALVLLM_THETA_URLS; empty = theta_url alone. Each sequence stays on one replica; a replica that fails hands its sequences to the others (engines/pool.py).",
    )
    t_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Replicas of the teacher, comma-separated in DUALVLLM_T_URLS; empty = t_url alone."
    )
    replica_probe_interval: float = Field(
        2.0,
        gt=0,
        description="Seconds between probes of a replica marked down (/health, then the weights probe); it rejoins when both pass.",
    )
    theta_model: str | None = Field(
        None,
        description="Served model name to use on the base server (vLLM --served-model-name or a LoRA name); None = the first it lists.",
    )
    t_model: str | None = Field(
        None, description="Served model name to use on the teacher server; None = the first it lists."
    )
    api_key: SecretStr | None = Field(
        None, description="Bearer token both servers expect (vLLM --api-key); None = no auth."
    )
    top_k: int = Field(
        20,
        ge=1,
        le=1000,
        description="Next-token candidates fetched from each server per step; servers need --max-logprobs >= top_k.",
    )
    fill_rule: Literal["min", "floor", "spread"] = Field(
        "min",
        description="Logprob given to a candidate one model did not report: see dualvllm.theory.merge and theory/THEORY.md (min measured best).",
    )
    min_coverage_warning: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Warn once when a model's mean top-k covered mass is below this (k too small); 0 = never.",
    )
    alpha_tol: float = Field(1e-6, gt=0, lt=0.1, description="Tolerance of the alpha* root search.")
    alpha_max_iter: int = Field(20, ge=1, le=200, description="Iteration cap of the alpha* root search.")
    step_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="Threads each step's merge, alpha* and sampling run on (numba's pool; rows are split among them, results bit-identical): on a GPU node with spare cores, 4-8 shorten every lockstep step's round trip at batch 64 and more; a step of fewer than 32 rows per thread uses fewer.",
    )
    max_retries: int = Field(
        MAX_RETRIES,
        ge=0,
        le=20,
        description="Retries of a failed request (5xx, timeout, connection error; never 4xx); a call that changes state is retried only if it was never sent.",
    )
    retry_delay: float = Field(
        RETRY_DELAY_S, ge=0, le=60, description="First retry backoff in seconds; doubles per retry, with jitter."
    )
    request_timeout: float = Field(
        REQUEST_TIMEOUT_S, gt=0, description="Seconds one HTTP request may take before it counts as failed."
    )
    connect_timeout: float = Field(
        CONNECT_TIMEOUT_S,
        gt=0,
        description="Seconds opening a connection may take before it counts as failed (and is retried: nothing was sent).",
    )
    connection_pool_size: int = Field(
        CONNECTION_POOL_SIZE, ge=1, le=1024, description="Open connections kept per server."
    )
    max_batch_size: int = Field(
        64,
        ge=1,
        le=4096,
        description="Sequences generated concurrently; each step sends one request per server for all of them.",
    )
    local_tokenizers: bool = Field(
        False,
        description="Tokenize and detokenize in the coordinator with each model's own tokenizer (transformers, from the model directory the server reports, which must be readable here) instead of over HTTP; needed for servers started with --skip-tokenizer-init, which then skip detokenizing every top-k entry (faster per request). The CLI turns it on when it starts the servers itself (their model directories are here) unless --no-local-tokenizers.",
    )
    max_prompts_per_request: int = Field(
        1024,
        ge=1,
        description="Most prompts one request to a server may carry (vLLM refuses more than its VLLM_MAX_COMPLETION_PROMPTS, 1024 by default): a per-token step sends one per sequence, speculative scoring one per drafted token, split into requests of at most this many.",
    )
    mode: Literal["auto", "lockstep", "per_token"] = Field(
        "auto",
        description="How tokens reach the servers: lockstep = each server decodes every sequence in one long request while its dualvllm plugin asks the coordinator for each token (servers started with --lockstep; coordinator/lockstep/); per_token = one batched request per server per token; auto = lockstep when both servers carry the plugin, else per-token.",
    )
    lockstep_host: str = Field(
        "127.0.0.1",
        description="Interface the coordinator's lockstep socket binds, which the servers' plugins dial; another host than loopback must be listed in the servers' DUALVLLM_LOCKSTEP_ALLOWED_HOSTS.",
    )
    lockstep_stall_timeout: float = Field(
        5.0,
        gt=0,
        description="Lockstep: seconds a server may wait on sequences the other server has not reached (its batch is busy) before they are ended and resubmitted.",
    )
    lockstep_aligned_admission: bool = Field(
        True,
        description="Lockstep: start new sequences while both servers are blocked on the coordinator and hold them until both took the requests in, so both admit each sequence in the same step (coordinator/admission.py); False = send them as soon as there is room.",
    )
    lockstep_restart_timeout: float = Field(
        300.0,
        ge=0,
        description="Lockstep: seconds the sequences of a server whose requests broke wait for it to answer /health again (a restart, a network blip) before they fail; they then resume from their agreed tokens.",
    )
    speculative_gamma: int = Field(
        0,
        ge=0,
        le=64,
        description="Speculative q* sampling: tokens the drafter samples per round, kept up to the first one q*'s acceptance rule rejects (coordinator/speculative.py); 0 = per-token mode.",
    )
    speculative_drafter: Literal["theta", "t"] = Field(
        "theta",
        description="Which server drafts in speculative mode (the other scores the draft): theta = the base, t = the teacher.",
    )
    speculative_proposal: Literal["sample", "argmax"] = Field(
        "sample",
        description="What the drafter proposes in speculative mode: sample = tokens sampled from its top-k (one seeded request per sequence; acceptance 1 - TV), argmax = its greedy continuation (one batched request for all sequences; acceptance q*(argmax)). Both are exact.",
    )
    seed: int | None = Field(
        0, description="Seed of the per-sequence samplers when a call gives none; None = fresh entropy."
    )
    eos_token_ids: tuple[int, ...] | None = Field(
        None, description="Override the EOS ids learned from the servers (needed if they cannot tell)."
    )
    freeze_gc_heap: bool = Field(
        True,
        description="Freeze the process's heap (gc.freeze) once the coordinator is up, so that Python's full garbage collections skip the objects of start-up, as vLLM's servers do; thawed when the last coordinator closes (common/heap.py).",
    )
    enable_logging: bool = Field(
        False, description="Log start-up checks and per-step progress to the 'dualvllm' logger."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Level of that logger when logging is on."
    )

    @field_validator("theta_url", "t_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {url!r} must start with http:// or https://")
        return url.rstrip("/")

    @field_validator("theta_urls", "t_urls", mode="before")
    @classmethod
    def _url_list(cls, urls: object) -> object:
        if isinstance(urls, str):  # from the environment: "http://a:8000,http://b:8000"
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        if isinstance(urls, (list, tuple)):
            if len(set(urls)) != len(urls):
                raise ValueError(f"a replica is listed twice in {list(urls)}")
            return tuple(cls._http_url(u) for u in urls)
        return urls

    @property
    def theta_pool(self) -> tuple[str, ...]:
        """The base replicas' URLs (theta_url alone when theta_urls is empty)."""
        return self.theta_urls or (self.theta_url,)

    @property
    def t_pool(self) -> tuple[str, ...]:
        return self.t_urls or (self.t_url,)

    @model_validator(mode="after")
    def _requests_fit_the_servers(self) -> CoordinatorConfig:
        for name in ("max_batch_size", "speculative_gamma"):
            if getattr(self, name) > self.max_prompts_per_request:
                raise ValueError(
                    f"{name}={getattr(self, name)} is above max_prompts_per_request={self.max_prompts_per_request}: "
                    "one request carries that many prompts, and vLLM refuses more than its "
                    "VLLM_MAX_COMPLETION_PROMPTS (1024 by default). Lower it, or raise that variable on both "
                    "servers and max_prompts_per_request with it."
                )
        return self

    @model_validator(mode="after")
    def _one_mode(self) -> CoordinatorConfig:
        if (len(self.theta_pool) > 1 or len(self.t_pool) > 1) and self.speculative_gamma:
            raise ValueError(
                "replica pools (theta_urls/t_urls with more than one URL) run in lockstep or per-token "
                "mode, not speculative; set speculative_gamma=0, or give one URL per role"
            )
        if self.mode == "lockstep" and self.speculative_gamma:
            raise ValueError(
                "speculative_gamma > 0 is a per-token mode; lockstep needs speculative_gamma=0 "
                "(it gains more: no request per token at all)"
            )
        return self

    @property
    def self_teacher(self) -> bool:
        """One server plays both roles: the teacher is the base model shown another prompt
        (privileged information), so every call must give (theta_prompt, t_prompt) pairs that differ."""
        return self.theta_pool == self.t_pool and self.theta_model == self.t_model
