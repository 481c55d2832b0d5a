"""Settings of the agent layer (seed 002's variables), apart from the sandbox's own.

Precedence as for :mod:`sandlot.config`: explicit argument > environment > ``.env`` >
default. The default provider is ``local``: a model run in-process, so that the agent works
with no network and no key once the README's set-up has fetched the weights.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from sandlot.errors import ConfigError

Strategy = Literal["single", "reflexion", "sample_select", "sample_select+reflexion"]
ProviderName = Literal["local", "groq", "openrouter", "anthropic", "google", "openai", "ollama"]


def _env(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_file=".env", extra="ignore", populate_by_name=True, frozen=True
    )

    llm_provider: ProviderName = Field(
        default="local",
        validation_alias=_env("llm_provider", "LLM_PROVIDER"),
        description="Which provider writes the code.",
    )
    llm_model: str | None = Field(
        default=None,
        validation_alias=_env("llm_model", "LLM_MODEL"),
        description="Model name; unset takes the provider's recommended model.",
    )
    llm_max_tokens: int = Field(
        default=1024,
        ge=16,
        le=32_768,
        validation_alias=_env("llm_max_tokens", "LLM_MAX_TOKENS"),
        description="Most tokens one reply may have.",
    )
    llm_temperature: float = Field(
        default=0.2, ge=0, le=2, validation_alias=_env("llm_temperature", "LLM_TEMPERATURE")
    )
    llm_retry_temperature: float = Field(
        default=0.7,
        ge=0,
        le=2,
        validation_alias=_env("llm_retry_temperature", "LLM_RETRY_TEMPERATURE"),
        description="Sampling temperature of the loop's retries (the first attempt uses "
        "LLM_TEMPERATURE): decoded greedily, a small model rewrites the code it already wrote.",
    )
    llm_timeout_s: float = Field(
        default=120.0,
        gt=0,
        validation_alias=_env("llm_timeout_s", "LLM_TIMEOUT_SECONDS"),
        description="Most seconds one model call may take (HTTP or local decoding).",
    )
    llm_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        validation_alias=_env("llm_retries", "LLM_RETRIES"),
        description="Retries of a call the provider answered with 429, 5xx or a dropped link.",
    )
    groq_api_key: str | None = Field(default=None, validation_alias=_env("GROQ_API_KEY"))
    openrouter_api_key: str | None = Field(
        default=None, validation_alias=_env("OPENROUTER_API_KEY")
    )
    anthropic_api_key: str | None = Field(default=None, validation_alias=_env("ANTHROPIC_API_KEY"))
    google_api_key: str | None = Field(
        default=None, validation_alias=_env("GOOGLE_API_KEY", "GEMINI_API_KEY")
    )
    openai_api_key: str | None = Field(default=None, validation_alias=_env("OPENAI_API_KEY"))
    # Base URLs: self-hosted gateways, proxies, and the wire-format test servers.
    groq_base_url: str = Field(
        default="https://api.groq.com/openai/v1", validation_alias=_env("GROQ_BASE_URL")
    )
    openrouter_base_url: str = Field(
        default="https://openrouter.ai/api/v1", validation_alias=_env("OPENROUTER_BASE_URL")
    )
    anthropic_base_url: str = Field(
        default="https://api.anthropic.com", validation_alias=_env("ANTHROPIC_BASE_URL")
    )
    google_base_url: str = Field(
        default="https://generativelanguage.googleapis.com",
        validation_alias=_env("GOOGLE_BASE_URL", "GEMINI_BASE_URL"),
    )
    openai_base_url: str = Field(
        default="https://api.openai.com/v1", validation_alias=_env("OPENAI_BASE_URL")
    )
    ollama_host: str = Field(default="http://localhost:11434", validation_alias=_env("OLLAMA_HOST"))
    local_model: str = Field(
        default="qwen2.5-coder-1.5b",
        validation_alias=_env("local_model", "LOCAL_MODEL"),
        description="Which shipped GGUF the local provider runs (see `sandlot models`).",
    )
    local_model_path: Path | None = Field(
        default=None,
        validation_alias=_env("local_model_path", "LOCAL_MODEL_PATH"),
        description="A GGUF file of your own for the local provider; overrides LOCAL_MODEL.",
    )
    local_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        validation_alias=_env("local_threads", "LOCAL_THREADS"),
        description="Decoding threads. 1 by default: with every core asked for and one busy "
        "(a sandbox running), llama.cpp's decoding collapses below 1 token/s.",
    )
    local_context_tokens: int = Field(
        default=4096, ge=512, validation_alias=_env("local_context_tokens", "LOCAL_CONTEXT")
    )
    max_reflexion_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        validation_alias=_env("max_reflexion_attempts", "MAX_REFLEXION_ATTEMPTS"),
        description="Most code generations per task in the reflexion loop.",
    )
    agent_strategy: Strategy = Field(
        default="sample_select",
        validation_alias=_env("agent_strategy", "AGENT_STRATEGY"),
        description="How the agent solves a task: single (one generation), reflexion (the "
        "loop), sample_select (AGENT_SAMPLES candidates judged by running them against the "
        "examples and tests the model writes; the default, the best measured: HumanEval-164 "
        "+11 points over single shot at 2.91x its tokens, where the loop gained nothing), or "
        "sample_select+reflexion (the loop goes on from the best candidate when it still "
        "fails).",
    )
    agent_samples: int = Field(
        default=8,
        ge=1,
        le=32,
        validation_alias=_env("agent_samples", "AGENT_SAMPLES"),
        description="Candidates sample-and-select writes and runs, each in its own sandbox "
        "(with early stop, all of them only when the first fails an example or runs badly).",
    )
    agent_generated_tests: int = Field(
        default=6,
        ge=0,
        le=20,
        validation_alias=_env("agent_generated_tests", "AGENT_GENERATED_TESTS"),
        description="Asserts the model writes from the prompt for sample-and-select to judge "
        "by (0: only the prompt's own examples).",
    )
    agent_sample_early_stop: bool = Field(
        default=True,
        validation_alias=_env("agent_sample_early_stop", "AGENT_SAMPLE_EARLY_STOP"),
        description="Sample-and-select draws and runs the first (greedy) candidate alone, "
        "and the other samples only when it fails an example or runs badly; when it fails "
        "only tests the model wrote, one probe sample, and the vote between the two "
        "(false: always all of them).",
    )
    agent_sample_temperature: float = Field(
        default=0.8,
        ge=0,
        le=2,
        validation_alias=_env("agent_sample_temperature", "AGENT_SAMPLE_TEMPERATURE"),
        description="Temperature of every sample but the first (which uses LLM_TEMPERATURE).",
    )
    swarm_rounds: int = Field(
        default=2,
        ge=1,
        le=10,
        validation_alias=_env("swarm_rounds", "SWARM_MAX_ROUNDS"),
        description="Most review rounds of the swarm before it takes the best proposal.",
    )
    memory_enabled: bool = Field(
        default=False,
        validation_alias=_env("memory_enabled", "AGENT_MEMORY"),
        description="Recall past tasks and fixes from Qdrant (needs the `memory` extra).",
    )
    memory_max_records_per_tenant: int = Field(
        default=500,
        ge=1,
        le=1_000_000,
        validation_alias=_env(
            "memory_max_records_per_tenant", "AGENT_MEMORY_MAX_RECORDS_PER_TENANT"
        ),
        description="Most memory records kept per tenant (the SDK's and CLI's own runs count "
        "as one); storing one more evicts the tenant's oldest.",
    )
    memory_max_records: int = Field(
        default=5_000,
        ge=1,
        le=10_000_000,
        validation_alias=_env("memory_max_records", "AGENT_MEMORY_MAX_RECORDS"),
        description="Most memory records kept in all, every tenant's together (embedded mode "
        "holds them all in RAM: about 13 KiB a record at most, 65 MiB at 5,000); past it, the "
        "oldest of all are evicted down to 90%.",
    )
    memory_retention_s: float = Field(
        default=30 * 24 * 3600.0,
        gt=0,
        le=100 * 365 * 24 * 3600.0,
        validation_alias=_env("memory_retention_s", "AGENT_MEMORY_RETENTION_SECONDS"),
        description="Seconds a memory record is kept (default 30 days); older ones are never "
        "recalled, and deleted when the memory opens, when their tenant stores a record, and "
        "at most an hour after expiring while records are stored.",
    )
    qdrant_url: str | None = Field(
        default=None,
        validation_alias=_env("qdrant_url", "QDRANT_URL"),
        description="A Qdrant server; unset uses embedded local mode under the data dir.",
    )
    qdrant_path: Path | None = Field(
        default=None,
        validation_alias=_env("qdrant_path", "QDRANT_PATH"),
        description="Folder of the embedded Qdrant (default <data dir>/memory).",
    )
    models_dir: Path | None = Field(
        default=None,
        validation_alias=_env("models_dir", "SANDLOT_MODELS_DIR", "AGENT_SANDBOX_MODELS_DIR"),
        description="Where fetched model weights live (default <data dir>/models).",
    )


@lru_cache(maxsize=1)
def get_agent_settings() -> AgentSettings:
    try:
        return AgentSettings()
    except ValidationError as exc:
        raise ConfigError(f"invalid agent setting: {exc}") from exc
