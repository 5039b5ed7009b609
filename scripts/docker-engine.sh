#!/usr/bin/env bash
# Make a Docker engine with gVisor available on a Debian/Ubuntu machine (root), idempotently:
#   1. install Debian's docker.io, runsc (gVisor), debootstrap and docker-compose (for
#      deploy/compose.yaml; skipped when the `docker compose` plugin answers) where missing;
#   2. register runsc as a runtime (runtime arguments $MCS_RUNSC_ARGS) and turn on the
#      engine's experimental API (checkpoints: a paused gVisor session keeps its memory)
#      in /etc/docker/daemon.json, merging into an existing file, never clobbering it;
#   3. start dockerd in the background if no engine answers, and wait (bounded) for it;
#   4. once an image exists locally, check `docker run --runtime=runsc IMAGE true`.
# Everything is printed to stderr. Environment:
#   MCS_DOCKERD_LOG      where a dockerd started here logs (default /var/log/mcs-dockerd.log)
#   MCS_ENGINE_WAIT      seconds to wait for the engine to answer (default 60)
#   MCS_RUNSC_ARGS       runsc's runtime arguments, space-separated (default
#                        "--network=none --host-uds=open"). The docker backend's agent
#                        connects to a Unix socket the host listens on (--connect), and a
#                        sandbox with network to its egress proxy's socket; under gVisor
#                        both need --host-uds=open (connect only, never create).
#   MCS_CHECK_IMAGE      image for the runsc check (default: the sandbox image if built,
#                        else any local image; skipped when there is none)
set -euo pipefail

log() { printf 'docker-engine: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

DAEMON_JSON=/etc/docker/daemon.json
DOCKERD_LOG=${MCS_DOCKERD_LOG:-/var/log/mcs-dockerd.log}
WAIT=${MCS_ENGINE_WAIT:-60}
RUNSC_ARGS=${MCS_RUNSC_ARGS:---network=none --host-uds=open}

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts dockerd)"

# Stop the Debian maintainer scripts from starting dockerd before runsc is registered.
export DEBIAN_FRONTEND=noninteractive

install_missing() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v runsc >/dev/null 2>&1 || [ -x /usr/bin/runsc ] || missing+=(runsc)
    command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
        || missing+=(docker-compose)
    if [ ${#missing[@]} -eq 0 ]; then
        log "docker.io, runsc, debootstrap and docker-compose are installed"
        return
    fi
    log "installing ${missing[*]}"
    local t0=$SECONDS
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
        apt-get update >&2
        apt-get install -y --no-install-recommends "${missing[@]}" >&2
    fi
    log "installed in $((SECONDS - t0))s"
}

runsc_path() {
    command -v runsc 2>/dev/null || echo /usr/bin/runsc
}

# Merge {"runtimes": {"runsc": {...}}, "experimental": true} into daemon.json; prints
# "changed" when it wrote.
register_runsc() {
    mkdir -p "$(dirname "$DAEMON_JSON")"
    python3 - "$DAEMON_JSON" "$(runsc_path)" "$RUNSC_ARGS" <<'PY'
import json, os, sys
path, runsc, args = sys.argv[1], sys.argv[2], sys.argv[3].split()
try:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    config = json.loads(text) if text.strip() else {}
except FileNotFoundError:
    config = {}
except ValueError as exc:
    sys.exit(f"docker-engine: error: {path} is not valid JSON ({exc}); fix it by hand")
if not isinstance(config, dict):
    sys.exit(f"docker-engine: error: {path} is not a JSON object")
wanted = {"path": runsc, "runtimeArgs": args}
runtimes = config.setdefault("runtimes", {})
# Checkpoints (pausing a gVisor session with its memory) are an experimental engine API.
if runtimes.get("runsc") == wanted and config.get("experimental") is True:
    sys.exit(0)
runtimes["runsc"] = wanted
config["experimental"] = True
tmp = path + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
print("changed")
PY
}

engine_answers() {
    timeout 10 docker info >/dev/null 2>&1
}

wait_for_engine() {
    local deadline=$((SECONDS + WAIT))
    until engine_answers; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "the engine did not answer within ${WAIT}s; last lines of $DOCKERD_LOG:"
            tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "dockerd is not answering"
        fi
        sleep 1
    done
}

start_dockerd() {
    log "starting dockerd (log: $DOCKERD_LOG)"
    # setsid + nohup: the daemon outlives this script and the shell that ran it.
    setsid nohup dockerd --config-file "$DAEMON_JSON" >>"$DOCKERD_LOG" 2>&1 </dev/null &
    local t0=$SECONDS
    wait_for_engine
    log "dockerd answers after $((SECONDS - t0))s"
}

check_runsc() {
    local image=${MCS_CHECK_IMAGE:-}
    if [ -z "$image" ]; then
        image=$(docker image ls --format '{{.Repository}}:{{.Tag}}' mcp-code-sandbox 2>/dev/null | head -n1)
    fi
    if [ -z "$image" ]; then
        image=$(docker image ls --format '{{.Repository}}:{{.Tag}}' 2>/dev/null | grep -v '<none>' | head -n1 || true)
    fi
    if [ -z "$image" ]; then
        log "no local image yet: the runsc check runs once an image exists (rerun this script)"
        return
    fi
    if docker run --rm --runtime=runsc --entrypoint true "$image" >&2; then
        log "runsc works (checked with $image)"
    else
        die "docker run --runtime=runsc --entrypoint true $image failed; see $DOCKERD_LOG"
    fi
}

install_missing
changed=$(register_runsc)
if engine_answers; then
    if [ -n "$changed" ]; then
        # dockerd reloads its runtimes on SIGHUP; no restart, running containers survive.
        pid=$(cat /var/run/docker.pid 2>/dev/null || true)
        [ -n "$pid" ] || die "runsc was registered in $DAEMON_JSON but the running engine's pid is unknown: reload it by hand"
        log "registered runsc in $DAEMON_JSON; reloading dockerd (pid $pid)"
        kill -HUP "$pid"
        sleep 1
    fi
    log "an engine answers"
else
    [ -z "$changed" ] || log "registered runsc in $DAEMON_JSON"
    start_dockerd
fi
docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' \
    || die "the engine does not list runsc among its runtimes (see $DAEMON_JSON)"
log "runtimes: $(docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}')"
if [ "$(docker info --format '{{.ExperimentalBuild}}' 2>/dev/null)" != "true" ]; then
    # Not reloaded by SIGHUP, and a restart here would stop running containers.
    log "warning: the running engine has no experimental API: paused gVisor sessions keep"
    log "their variables, not their whole memory, until dockerd is restarted"
fi
check_runsc
