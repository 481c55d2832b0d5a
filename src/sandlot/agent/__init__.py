"""The agent layer: an LLM writes code, a sandbox runs it, a critic reads the failure.

A client of the sandbox like any other (it uses the public SDK only). Optional: install
``sandlot[agent]`` (LangGraph), plus ``[local]`` for the in-process model and
``[memory]`` for Qdrant.
"""

from __future__ import annotations

from sandlot.agent.code import function_task
from sandlot.agent.models import AgentEvent, AgentResult, Attempt, Execution, TaskSpec
from sandlot.agent.runtime import AgentRuntime

__all__ = [
    "AgentEvent",
    "AgentResult",
    "AgentRuntime",
    "Attempt",
    "Execution",
    "TaskSpec",
    "function_task",
]
