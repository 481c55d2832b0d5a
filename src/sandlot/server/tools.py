"""``/v1/tools`` and ``/v1/sandboxes/{id}/tools/{name}``: the server's tools (sandlot.tools),
listed, and run in a sandbox as one command each, audited like any command."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as FastPath

from sandlot.models import ExecResult
from sandlot.requests import RunTool
from sandlot.server.auth import Principal
from sandlot.server.deps import SandboxId, caller, state_of, unless_gone
from sandlot.server.routes import ERRORS, answer_run
from sandlot.tools import TOOL_NAME_PATTERN, ToolExecutor, ToolInfo, default_registry

router = APIRouter(tags=["tools"], responses=ERRORS)
Caller = Annotated[Principal, Depends(caller)]
ToolName = Annotated[str, FastPath(pattern=TOOL_NAME_PATTERN, description="A tool's name.")]


@router.get("/v1/tools", response_model=list[ToolInfo])
async def list_tools(request: Request, who: Caller) -> list[ToolInfo]:
    """The tools this server runs: name, description and input JSON Schema."""
    return default_registry(state_of(request).settings.registry_dir).list()


@router.get("/v1/tools/{name}", response_model=ToolInfo)
async def get_tool(name: ToolName, request: Request, who: Caller) -> ToolInfo:
    return default_registry(state_of(request).settings.registry_dir).get(name).info()


@router.post("/v1/sandboxes/{sandbox_id}/tools/{name}", response_model=ExecResult)
async def run_tool(
    sandbox_id: SandboxId, name: ToolName, body: RunTool, request: Request, who: Caller
) -> Response:
    """Run the tool in the sandbox: its result is a command's (a failing tool is a result;
    an unknown tool or a bad argument is a 4xx, and nothing ran)."""
    who.require_write()
    state = state_of(request)
    registry = default_registry(state.settings.registry_dir)
    async with state.audited(request, who, "sandbox.tool", sandbox_id, tool=name) as audit:
        executor = ToolExecutor(
            registry,
            lambda command: state.manager.run_command(sandbox_id, command, owner=who.owner_filter),
        )
        result = await unless_gone(request, executor.run(name, body.arguments, body.timeout_s))
        return answer_run(audit, result)
