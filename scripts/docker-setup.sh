#!/bin/sh
# Make this machine run the docker backend: Debian's docker.io, gVisor's runsc registered as a
# runtime with --network=none, debootstrap for offline image builds, and a running dockerd.
# Idempotent: installs only what is missing, and leaves a running daemon alone unless it lacks
# the runsc runtime (then SIGHUP makes it reload daemon.json).
set -eu

missing=""
for pkg in docker.io runsc debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
fi

# Register runsc without touching any other setting an admin put in daemon.json.
mkdir -p /etc/docker
/usr/bin/python3 - <<'PY'
import json, pathlib
path = pathlib.Path("/etc/docker/daemon.json")
config = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
runtimes = config.setdefault("runtimes", {})
wanted = {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}
if runtimes.get("runsc") != wanted:
    runtimes["runsc"] = wanted
    path.write_text(json.dumps(config, indent=2) + "\n")
    print("registered runsc in", path)
PY

if docker info >/dev/null 2>&1; then
  if ! docker info --format '{{json .Runtimes}}' | grep -q runsc; then
    kill -HUP "$(cat /var/run/docker.pid)"
    sleep 1
  fi
else
  echo "starting dockerd (log: /var/log/dockerd.log)"
  # No systemd here: run it detached, so it outlives this make invocation.
  setsid dockerd >/var/log/dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
fi
docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /var/log/dockerd.log" >&2; exit 1; }
docker info --format '{{json .Runtimes}}' | grep -q runsc \
  || { echo "dockerd has no runsc runtime after reload" >&2; exit 1; }
echo "docker ready: $(docker version --format '{{.Server.Version}}'), runtimes: runc runsc"
