"""LLM providers: seed 002's six, the in-process ``local`` model, and ``scripted`` for tests.

``create_provider()`` builds the one the settings name (``LLM_PROVIDER``, ``LLM_MODEL``, the
provider's key and base URL). Modules are imported on demand, so a provider's optional
dependency (llama-cpp-python for ``local``) is only needed when it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from sandlot.agent.config import AgentSettings, get_agent_settings
from sandlot.agent.providers.base import (
    Completion,
    GenerationParams,
    HttpProvider,
    Message,
    Provider,
    extract_json,
)
from sandlot.errors import ConfigError

# Seed 000's name for the interface every provider implements.
LLMProvider = Provider


@dataclass(frozen=True)
class ProviderSpec:
    """One provider: where its class is, what it needs, and what it runs by default."""

    target: str  # "module:Class", imported on first use
    recommended_model: str  # seed 002's pick; ``local`` names a shipped GGUF (weights.MODELS)
    # The AgentSettings fields of its key and base URL (None: it needs no key / no URL).
    key_setting: str | None = None
    url_setting: str | None = None
    # An optional dependency (its import name), and what to install when it is missing.
    requires: str | None = None
    install_hint: str = ""

    @property
    def key_variable(self) -> str:
        """The environment variable a user sets for the key (the setting's name, capitalized)."""
        return (self.key_setting or "").upper()


_HERE = "sandlot.agent.providers"
PROVIDERS: dict[str, ProviderSpec] = {
    "groq": ProviderSpec(
        target=f"{_HERE}.openai_compat:GroqProvider",
        recommended_model="llama-3.3-70b-versatile",
        key_setting="groq_api_key",
        url_setting="groq_base_url",
    ),
    "openrouter": ProviderSpec(
        target=f"{_HERE}.openai_compat:OpenRouterProvider",
        recommended_model="qwen/qwen-2.5-coder-32b-instruct:free",
        key_setting="openrouter_api_key",
        url_setting="openrouter_base_url",
    ),
    "anthropic": ProviderSpec(
        target=f"{_HERE}.anthropic:AnthropicProvider",
        recommended_model="claude-3-5-sonnet-20241022",
        key_setting="anthropic_api_key",
        url_setting="anthropic_base_url",
    ),
    "google": ProviderSpec(
        target=f"{_HERE}.gemini:GeminiProvider",
        recommended_model="gemini-1.5-flash",
        key_setting="google_api_key",
        url_setting="google_base_url",
    ),
    "ollama": ProviderSpec(
        target=f"{_HERE}.ollama:OllamaProvider",
        recommended_model="qwen2.5-coder:7b",
        url_setting="ollama_host",
    ),
    "openai": ProviderSpec(
        target=f"{_HERE}.openai_compat:OpenAIProvider",
        recommended_model="gpt-4o-mini",
        key_setting="openai_api_key",
        url_setting="openai_base_url",
    ),
    "local": ProviderSpec(
        target=f"{_HERE}.local:LocalProvider",
        recommended_model="qwen2.5-coder-1.5b",
        requires="llama_cpp",
        install_hint="pip install 'sandlot[local]' (it builds llama.cpp, about 6 minutes)",
    ),
}


def provider_class(name: str) -> type[Provider]:
    """The class of provider ``name``.

    Raises:
        ConfigError: no provider has that name, or what it needs is not installed (the
            message says what to install).
    """
    try:
        spec = PROVIDERS[name]
    except KeyError:
        known = ", ".join(sorted(PROVIDERS))
        raise ConfigError(f"unknown LLM_PROVIDER {name!r}; choose one of: {known}") from None
    # Checked now, not when the model first loads: the run fails before any sandbox starts.
    if spec.requires is not None and importlib.util.find_spec(spec.requires) is None:
        raise ConfigError(
            f"LLM_PROVIDER={name} needs the {spec.requires} module: {spec.install_hint}"
        )
    module_name, _, class_name = spec.target.partition(":")
    found: type[Provider] = getattr(importlib.import_module(module_name), class_name)
    return found


def create_provider(
    name: str | None = None,
    model: str | None = None,
    *,
    settings: AgentSettings | None = None,
    **overrides: Any,
) -> Provider:
    """The provider ``name`` (default ``LLM_PROVIDER``) with the settings' key and limits."""
    settings = settings or get_agent_settings()
    name = name or settings.llm_provider
    cls = provider_class(name)
    spec = PROVIDERS[name]
    default_model = settings.local_model if name == "local" else spec.recommended_model
    model = model or settings.llm_model or default_model
    common: dict[str, Any] = {
        "max_tokens": settings.llm_max_tokens,
        "temperature": settings.llm_temperature,
    }
    if name == "local":
        common.update(
            threads=settings.local_threads,
            context_tokens=settings.local_context_tokens,
            timeout_s=settings.llm_timeout_s,
            model_path=settings.local_model_path,
            models_dir=settings.models_dir,
        )
    elif spec.url_setting is not None:
        common.update(
            base_url=getattr(settings, spec.url_setting),
            timeout_s=settings.llm_timeout_s,
            retries=settings.llm_retries,
        )
        if spec.key_setting is not None:
            api_key = getattr(settings, spec.key_setting)
            if not api_key and "api_key" not in overrides:
                raise ConfigError(
                    f"LLM_PROVIDER={name} needs {spec.key_variable} (or pick another provider)"
                )
            common["api_key"] = api_key
    common.update(overrides)
    return cls(model, **common)


__all__ = [
    "PROVIDERS",
    "Completion",
    "GenerationParams",
    "HttpProvider",
    "LLMProvider",
    "Message",
    "Provider",
    "ProviderSpec",
    "create_provider",
    "extract_json",
    "provider_class",
]
