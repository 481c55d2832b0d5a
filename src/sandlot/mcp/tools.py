"""The MCP tools over a :class:`~sandlot.service.SandboxService` (imports the MCP SDK)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations

from sandlot._version import __version__
from sandlot.config import get_settings
from sandlot.errors import InvalidRequest, SandboxError, SandboxNotFound
from sandlot.mcp.sessions import Binding, DefaultSandboxes, Resolver, SessionKey
from sandlot.models import ExecResult, Result, volume_mounts
from sandlot.requests import (
    SANDBOX_ID_PATTERN,
    FilePath,
    ListFiles,
    ReadFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    WriteFile,
    build,
)
from sandlot.service import SandboxService, ToolService
from sandlot.tools import ToolExecutor, ToolRegistry, default_registry

# A file read whole into one MCP message: past this, the client gets an error naming the size.
# The MCP SDK's client takes an event of at most 1 MiB (it failed on anything read past
# ~1 MiB until 2026-12-06); a model reads a MiB of text as ~250,000 tokens, past any context;
# and the answer is written on the server's one event loop, twice (the SDK's JSON, then its
# event stream's frame): 8 MiB of control characters, 48 MiB as JSON, held it ~1.6 s a call
# (red team, 2026-12-06). So: 1 MiB less room for the message around it...
MAX_READ_BYTES = 1024 * 1024 - 4096
# ...and as much as JSON, where a control character takes 6 bytes (an image's base64 4/3).
MAX_READ_JSON_BYTES = MAX_READ_BYTES
# A run's answer is held to the same, less this for its ending line and what surrounds it,
ENDING_ROOM_BYTES = 4096
# ...counting each block's own keys (`{"type":"text","text":""}`, an image's `mimeType`)...
BLOCK_KEYS_BYTES = 96
# ...and at most this many blocks (a cell may display 1,000 outputs, up to 4 blocks each).
MAX_BLOCKS = 256
# Bytes JSON writes as \u00XX (6 bytes), and as a two-byte escape (\n, \", ...).
_ESCAPED_6 = bytes(c for c in range(0x20) if c not in b"\b\t\n\f\r")
_ESCAPED_2 = b'\b\t\n\f\r"\\'
IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}

INSTRUCTIONS = (
    "Run Python and shell commands in an isolated sandbox (no network unless asked). "
    "Calls that name no sandbox_id share this session's own sandbox: variables, imports and "
    "files persist between run_code calls, and it is destroyed when the session ends. "
    "Files live under /workspace; paths are relative to it."
)
T = TypeVar("T")


@contextmanager
def tool_errors() -> Iterator[None]:
    """sandlot's errors become the tool's error result (isError, with the message), not a
    crash of the server nor the SDK's "unexpected exception" log with a traceback."""
    try:
        yield
    except SandboxError as exc:
        raise ToolError(f"{exc.code}: {exc.message}") from exc


class Call:
    """One tool call: whom it acts as and which sandbox it means."""

    def __init__(self, ctx: Context, resolve: Resolver, defaults: DefaultSandboxes) -> None:
        request = ctx.request_context.request
        self.binding: Binding = resolve(request)
        self.defaults = defaults
        # The SDK keeps per-connection teardown on the Connection, which its tool Context
        # does not expose yet; the session reaches it (None keeps this best-effort).
        self.connection: Any = getattr(ctx.request_context.session, "_connection", None)
        session_id = getattr(self.connection, "session_id", None)
        self.key: SessionKey = (self.binding.caller, session_id or "")

    @property
    def service(self) -> SandboxService:
        return self.binding.service

    async def sandbox(self, sandbox_id: str | None) -> str:
        if sandbox_id is not None:
            if not re.fullmatch(SANDBOX_ID_PATTERN, sandbox_id):
                raise InvalidRequest(f"not a sandbox id: {sandbox_id[:80]!r}")
            return sandbox_id
        found, made = await self.defaults.get(self.key, self.service)
        if made and self.key[1] and self.connection is not None:
            # A session of streamable HTTP: its sandbox goes when the session does (the
            # client's DELETE, the idle timeout). Stdio and sessionless HTTP have no such
            # end: the process's exit, or the server's, closes them (DefaultSandboxes.close).
            key = self.key
            self.connection.exit_stack.push_async_callback(self.defaults.end, key)
        return found

    def gone(self, sandbox_id: str) -> None:
        self.defaults.forget(self.key, sandbox_id)

    async def on(self, sandbox_id: str | None, action: Callable[[str], Awaitable[T]]) -> T:
        """``action`` on the sandbox meant; a default sandbox found gone (its TTL, an
        operator) is forgotten, so the session's next call makes a new one."""
        target = await self.sandbox(sandbox_id)
        try:
            return await action(target)
        except SandboxNotFound as exc:
            if sandbox_id is None:
                self.gone(target)
                raise SandboxNotFound(
                    f"{exc.message}; this session's sandbox is gone: the next call makes a new one"
                ) from exc
            raise


def make_server(
    resolve: Resolver, registry: ToolRegistry | None = None
) -> tuple[MCPServer[Any], DefaultSandboxes]:
    server: MCPServer[Any] = MCPServer(
        "sandlot", version=__version__, instructions=INSTRUCTIONS, log_level="WARNING"
    )
    defaults = DefaultSandboxes()

    def call(ctx: Context) -> Call:
        return Call(ctx, resolve, defaults)

    _run_tools(server, call)
    _registry_tools(server, call, registry or default_registry(get_settings().registry_dir))
    _file_tools(server, call)
    _lifecycle_tools(server, call, defaults)
    return server, defaults


CallMaker = Callable[[Context], Call]
READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)


def _lifecycle_tools(server: MCPServer[Any], call: CallMaker, defaults: DefaultSandboxes) -> None:
    @server.tool(structured_output=False)
    async def create_sandbox(
        ctx: Context,
        environment: str | None = None,
        memory_mb: int | None = None,
        timeout_s: float | None = None,
        network: bool | None = None,
        volumes: dict[str, str] | None = None,
    ) -> str:
        """Start a new sandbox and return its id. It lives until destroy_sandbox or its TTL.
        environment: a registry name (python3 by default); memory_mb: its memory cap;
        timeout_s: each run's default time limit; network: give it a network (default off);
        volumes: named volumes to attach, {name: directory under /workspace}, whose files
        outlive the sandbox (made with the REST API or `sandlot volume create`); a directory
        ending in ":ro" is mounted read-only."""
        with tool_errors():
            spec = build(
                SandboxSpec,
                environment=environment,
                memory_mb=memory_mb,
                timeout_s=timeout_s,
                network=network,
                volumes=volume_mounts(volumes),  # {name: path[:ro]}
            )
            info = await call(ctx).service.create(spec)
        return info.id

    @server.tool(structured_output=False, annotations=ToolAnnotations(destructive_hint=True))
    async def destroy_sandbox(ctx: Context, sandbox_id: str | None = None) -> str:
        """Destroy a sandbox (omitted: this session's own; the next call makes a new one)."""
        this = call(ctx)
        with tool_errors():
            if sandbox_id is None:
                sandbox_id = defaults.known(this.key)
                if sandbox_id is None:
                    return "this session has no sandbox"
            target = await this.sandbox(sandbox_id)
            this.gone(target)
            info = await this.service.destroy(target)
        return f"destroyed {info.id}"


def _run_tools(server: MCPServer[Any], call: CallMaker) -> None:
    @server.tool(structured_output=False)
    async def run_code(
        ctx: Context, code: str, sandbox_id: str | None = None, timeout_s: float | None = None
    ) -> CallToolResult:
        """Run Python in the sandbox's persistent interpreter (state is kept between calls).
        Returns stdout, stderr, the last expression's value, the error if one was raised,
        and rich outputs: matplotlib figures and images as images, HTML and Markdown as
        text."""
        this = call(ctx)
        with tool_errors():
            request = build(RunCode, code=code, timeout_s=timeout_s)
            result = await this.on(sandbox_id, lambda t: this.service.run_code(t, request))
        return exec_result(result)

    @server.tool(structured_output=False)
    async def run_command(
        ctx: Context, command: str, sandbox_id: str | None = None, timeout_s: float | None = None
    ) -> CallToolResult:
        """Run a bash command in the sandbox (cd and export persist between calls).
        Returns its exit code, stdout and stderr."""
        this = call(ctx)
        with tool_errors():
            request = build(RunCommand, command=command, timeout_s=timeout_s)
            result = await this.on(sandbox_id, lambda t: this.service.run_command(t, request))
        return exec_result(result)


def _registry_tools(server: MCPServer[Any], call: CallMaker, registry: ToolRegistry) -> None:
    """The registry's tools (sandlot.tools), each run as one command in the sandbox."""

    @server.tool(structured_output=False, annotations=READ_ONLY)
    async def list_sandbox_tools(ctx: Context) -> str:
        """The tools run_sandbox_tool can run in a sandbox: name, what it does, and its
        arguments as JSON Schema."""
        return "\n".join(
            f"{t.name}: {t.description}\n  arguments: {json.dumps(t.input_schema)}"
            for t in registry.list()
        )

    @server.tool(structured_output=False)
    async def run_sandbox_tool(
        ctx: Context,
        name: str,
        arguments: dict[str, Any] | None = None,
        sandbox_id: str | None = None,
        timeout_s: float | None = None,
    ) -> CallToolResult:
        """Run a registry tool (list_sandbox_tools names them) in the sandbox with
        ``arguments``. Returns its exit code, stdout and stderr."""
        this = call(ctx)
        with tool_errors():

            async def run(target: str) -> ExecResult:
                # A server's service audits the call as a tool's (server/mcp.py).
                if isinstance(this.service, ToolService):
                    return await this.service.run_tool(target, registry, name, arguments, timeout_s)
                executor = ToolExecutor(
                    registry, lambda command: this.service.run_command(target, command)
                )
                return await executor.run(name, arguments, timeout_s)

            result = await this.on(sandbox_id, run)
        return exec_result(result)


def _file_tools(server: MCPServer[Any], call: CallMaker) -> None:
    @server.tool(structured_output=False, annotations=READ_ONLY)
    async def read_file(ctx: Context, path: str, sandbox_id: str | None = None) -> ContentBlock:
        """Read a file under /workspace: text as text, PNG and JPEG as images."""
        this = call(ctx)
        with tool_errors():
            request = build(FilePath, path=path)
            info = await this.on(sandbox_id, lambda t: this.service.stat_file(t, request))
            if info.size_bytes > MAX_READ_BYTES:
                raise InvalidRequest(
                    f"{path} is {info.size_bytes} bytes; read_file returns at most "
                    f"{MAX_READ_BYTES}: read a part with run_command (head, tail, grep)"
                )
            # The size above is a hint: the sandbox's code can grow the file after it (one
            # call held 256 MiB, 1.4 GiB of the server's memory: red team, 2026-12-06), so
            # the read itself stops past the bound.
            bounded = build(ReadFile, path=path, max_bytes=MAX_READ_BYTES)
            data = await this.on(sandbox_id, lambda t: this.service.read_file(t, bounded))
        return file_content(path, data)

    @server.tool(structured_output=False)
    async def write_file(
        ctx: Context, path: str, content: str, sandbox_id: str | None = None
    ) -> str:
        """Write text to a file under /workspace (replaced if it exists)."""
        this = call(ctx)
        with tool_errors():
            request = build(WriteFile, path=path)
            data = content.encode()
            size = await this.on(sandbox_id, lambda t: this.service.write_file(t, request, data))
        return f"wrote {size} bytes to {path}"

    @server.tool(structured_output=False, annotations=READ_ONLY)
    async def list_files(
        ctx: Context, path: str = ".", depth: int = 1, sandbox_id: str | None = None
    ) -> str:
        """List a directory under /workspace: one line per entry, type, size, path."""
        this = call(ctx)
        with tool_errors():
            request = build(ListFiles, path=path, depth=depth)
            entries = await this.on(sandbox_id, lambda t: this.service.list_files(t, request))
        lines = [f"{e.type}\t{e.size_bytes}\t{e.path}" for e in entries]
        truncated = getattr(entries, "truncated", None)  # a service of its own may not say
        if truncated:
            lines.append(f"(not all: {truncated})")
        return "\n".join(lines) if lines else f"{path} is empty"


def exec_result(result: ExecResult) -> CallToolResult:
    """An execution as an MCP result. How it ended (exit code, kill reason, lost state, the
    error's type) is the host's word, given twice where nothing from the sandbox can reach
    it: as ``structuredContent`` and as the first text block. What the sandbox produced
    follows, each block labelled. Failed before (red team): the ending came as text blocks
    after the output, and a cell could print or display blocks identical to them ("killed:
    timeout", "exit code: 137") on a run that had succeeded. A code failure is a result, not
    a tool error: ``isError`` stays false."""
    ending = {
        "exit_code": result.exit_code,
        "kill_reason": result.kill_reason,
        "state_lost": result.state_lost,
        "error_type": result.error.type if result.error is not None else None,
    }
    blocks = fit_answer(exec_content(result), MAX_READ_JSON_BYTES - ENDING_ROOM_BYTES)
    return CallToolResult(
        content=[TextContent(type="text", text=_ending_line(result)), *blocks],
        structured_content=ending,
    )


def _block_bytes(block: ContentBlock) -> int:
    if isinstance(block, TextContent):
        return answer_bytes(block.text.encode(errors="surrogatepass"))
    if isinstance(block, ImageContent):
        return len(block.data)
    return 0


def _cut(text: str, most_bytes: int) -> str:
    """``text``'s head and tail, with what was left out said between them, in at most
    ``most_bytes`` as JSON."""
    size = answer_bytes(text.encode(errors="surrogatepass"))
    keep = len(text) * max(most_bytes - 200, 0) // max(size, 1)
    while True:
        head, tail = text[: keep // 2], text[len(text) - keep // 2 :] if keep > 1 else ""
        note = f"\n[{len(text) - len(head) - len(tail)} characters left out: an MCP answer is "
        note += f"at most {MAX_READ_JSON_BYTES} bytes; run it with less output]\n"
        cut = head + note + tail
        if keep <= 0 or answer_bytes(cut.encode(errors="surrogatepass")) <= most_bytes:
            return cut
        keep = keep * 3 // 4


def _level(sizes: list[int], most_bytes: int) -> int:
    """The size every block larger is cut to, for ``sizes`` to fit in ``most_bytes``."""
    left, ordered = most_bytes, sorted(sizes)
    for k, size in enumerate(ordered):
        share = left // (len(ordered) - k)
        if size > share:
            return share
        left -= size
    return most_bytes


def fit_answer(blocks: list[ContentBlock], most_bytes: int) -> list[ContentBlock]:
    """``blocks`` cut to ``most_bytes`` as JSON together, each block's own keys counted: those
    past the size that lets the rest fit as they are cut to it (a text to its head and tail,
    an image left out with a note), in one pass; past :data:`MAX_BLOCKS`, the middle ones left
    out. The MCP SDK's client fails on an event past 1 MiB (a `cat` of a large file lost its
    whole result), and each byte is written twice on the server's event loop (a control
    character as 6). Counting no block's own keys and cutting one block a pass, 4,000 small
    blocks took 2.5 s of the loop and still came to 1.1 MB (red team, 2026-12-06)."""
    if len(blocks) > MAX_BLOCKS:
        left_out = len(blocks) - MAX_BLOCKS + 1
        note = f"[{left_out} more outputs left out: an MCP answer holds at most {MAX_BLOCKS}]"
        blocks = [*blocks[: MAX_BLOCKS - 2], TextContent(type="text", text=note), blocks[-1]]
    sizes = [_block_bytes(b) + BLOCK_KEYS_BYTES for b in blocks]
    if sum(sizes) <= most_bytes:
        return blocks
    level = _level(sizes, most_bytes)
    fitted: list[ContentBlock] = []
    for block, size in zip(blocks, sizes, strict=True):
        if size <= level:
            fitted.append(block)
        elif isinstance(block, TextContent):
            text = _cut(block.text, level - BLOCK_KEYS_BYTES)
            fitted.append(TextContent(type="text", text=text))
        else:
            note = f"[an image of {size - BLOCK_KEYS_BYTES} bytes left out: past the MCP answer's "
            note += "bound]"
            fitted.append(TextContent(type="text", text=note))
    return fitted


def _ending_line(result: ExecResult) -> str:
    parts = [f"exit code: {result.exit_code}"]
    if result.kill_reason is not None:
        parts.append(f"killed: {result.kill_reason}")
    if result.error is not None:
        parts.append(f"raised: {result.error.type}")
    if result.state_lost:
        parts.append("the interpreter was restarted: variables and imports are gone")
    return "[sandlot: how the run ended] " + "; ".join(parts)


def exec_content(result: ExecResult) -> list[ContentBlock]:
    """What the sandbox produced, as MCP content: the text parts first, each rich output in
    order (its ending is :func:`exec_result`'s)."""
    blocks: list[ContentBlock] = []

    def text(value: str) -> None:
        blocks.append(TextContent(type="text", text=value))

    if result.stdout:
        cut = "\n[stdout truncated]" if result.stdout_truncated else ""
        text("stdout:\n" + result.stdout + cut)
    if result.stderr:
        cut = "\n[stderr truncated]" if result.stderr_truncated else ""
        text("stderr:\n" + result.stderr + cut)
    for item in result.results:
        blocks.extend(result_content(item))
    if result.text is not None and not any(r.is_main_result for r in result.results):
        text(result.text)
    if result.results_truncated:
        text("[some rich outputs were left out: together they passed the output cap]")
    if result.error is not None:
        text(f"error: {result.error.type}: {result.error.message}\n{result.error.traceback}")
    if not blocks:
        text("(no output)")
    return blocks


def result_content(item: Result) -> list[ContentBlock]:
    """One rich output: its images as images, HTML and Markdown as text, and its plain text
    where nothing richer says more (a figure's "<Figure ...>" repr says nothing)."""
    blocks: list[ContentBlock] = []
    for data, mime in ((item.png, "image/png"), (item.jpeg, "image/jpeg")):
        if data is not None:
            blocks.append(ImageContent(type="image", data=data, mime_type=mime))
    for value in (item.markdown, item.html):
        if value is not None:
            blocks.append(TextContent(type="text", text=value))
    if item.text is not None and not blocks:
        blocks.append(TextContent(type="text", text=item.text))
    elif item.text is not None and item.html is not None and not item.png:
        # A table's text form is what a model reads best; its HTML is there for display.
        blocks.insert(0, TextContent(type="text", text=item.text))
    return blocks


def is_image(data: bytes) -> str | None:
    """The image type ``data`` starts as, if it is one MCP carries as an image."""
    return next((mime for magic, mime in IMAGE_MAGIC.items() if data.startswith(magic)), None)


def answer_bytes(data: bytes) -> int:
    """What :func:`file_content` of ``data`` takes as JSON: base64 for an image; for text, its
    UTF-8 bytes with JSON's escapes (computed without building the answer)."""
    if is_image(data):
        return (len(data) + 2) // 3 * 4
    escaped_6 = len(data) - len(data.translate(None, _ESCAPED_6))
    escaped_2 = len(data) - len(data.translate(None, _ESCAPED_2))
    return len(data) + 5 * escaped_6 + escaped_2


def file_content(path: str, data: bytes) -> ContentBlock:
    mime = is_image(data)
    text = None
    if mime is None:
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ToolError(
                f"{path} is binary ({len(data)} bytes) and not an image: inspect it with "
                "run_command (file, xxd, python)"
            ) from None
    as_json = answer_bytes(data)
    if as_json > MAX_READ_JSON_BYTES:
        form = "base64" if mime else "text, where control characters take 6 bytes each"
        raise ToolError(
            f"{path} is {as_json} bytes as JSON ({form}); read_file returns at most "
            f"{MAX_READ_JSON_BYTES}: inspect it with run_command (xxd, head, python)"
        )
    if mime is not None:
        return ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=mime)
    return TextContent(type="text", text=text or "")
