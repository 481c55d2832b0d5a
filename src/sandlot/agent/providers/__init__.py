"""LLM providers: seed 002's six, the in-process ``local`` model, and ``scripted`` for tests.

``create_provider()`` builds the one the settings name (``LLM_PROVIDER``, ``LLM_MODEL``, the
provider's key and base URL). Modules are imported on demand, so a provider's optional
dependency (llama-cpp-python for ``local``) is only needed when it is used.
"""

from __future__ import annotations

import importlib
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

# Seed 002's recommended model per provider; ``local`` names a shipped GGUF (local.MODELS).
RECOMMENDED_MODELS: dict[str, str] = {
    "groq": "llama-3.3-70b-versatile",
    "openrouter": "qwen/qwen-2.5-coder-32b-instruct:free",
    "anthropic": "claude-3-5-sonnet-20241022",
    "google": "gemini-1.5-flash",
    "ollama": "qwen2.5-coder:7b",
    "openai": "gpt-4o-mini",
    "local": "qwen2.5-coder-1.5b",
}

_CLASSES: dict[str, tuple[str, str]] = {
    "groq": ("sandlot.agent.providers.openai_compat", "GroqProvider"),
    "openrouter": ("sandlot.agent.providers.openai_compat", "OpenRouterProvider"),
    "openai": ("sandlot.agent.providers.openai_compat", "OpenAIProvider"),
    "anthropic": ("sandlot.agent.providers.anthropic", "AnthropicProvider"),
    "google": ("sandlot.agent.providers.gemini", "GeminiProvider"),
    "ollama": ("sandlot.agent.providers.ollama", "OllamaProvider"),
    "local": ("sandlot.agent.providers.local", "LocalProvider"),
}

# Which setting holds each HTTP provider's key and base URL.
_KEYS = {
    "groq": ("groq_api_key", "groq_base_url", "GROQ_API_KEY"),
    "openrouter": ("openrouter_api_key", "openrouter_base_url", "OPENROUTER_API_KEY"),
    "openai": ("openai_api_key", "openai_base_url", "OPENAI_API_KEY"),
    "anthropic": ("anthropic_api_key", "anthropic_base_url", "ANTHROPIC_API_KEY"),
    "google": ("google_api_key", "google_base_url", "GOOGLE_API_KEY"),
}


def provider_class(name: str) -> type[Provider]:
    if name not in _CLASSES:
        known = ", ".join(sorted(_CLASSES))
        raise ConfigError(f"unknown LLM_PROVIDER {name!r}; choose one of: {known}")
    module, cls = _CLASSES[name]
    found: type[Provider] = getattr(importlib.import_module(module), cls)
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
    default_model = settings.local_model if name == "local" else RECOMMENDED_MODELS[name]
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
    elif name == "ollama":
        common.update(
            base_url=settings.ollama_host,
            timeout_s=settings.llm_timeout_s,
            retries=settings.llm_retries,
        )
    else:
        key_field, url_field, env_name = _KEYS[name]
        api_key = getattr(settings, key_field)
        if not api_key and "api_key" not in overrides:
            raise ConfigError(f"LLM_PROVIDER={name} needs {env_name} (or pick another provider)")
        common.update(
            api_key=api_key,
            base_url=getattr(settings, url_field),
            timeout_s=settings.llm_timeout_s,
            retries=settings.llm_retries,
        )
    common.update(overrides)
    return cls(model, **common)


__all__ = [
    "RECOMMENDED_MODELS",
    "Completion",
    "GenerationParams",
    "HttpProvider",
    "Message",
    "Provider",
    "create_provider",
    "extract_json",
    "provider_class",
]
