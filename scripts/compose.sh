#!/usr/bin/env bash
# Bring pdserve's compose setups up and down (docs/deployment.md), with Docker Engine where there is one
# and with Debian's podman + docker-compose v1 where there is none.
#
#   scripts/compose.sh build                 build pdserve:cpu
#   scripts/compose.sh up                    build if needed, bring the cpu profile up, wait for the gateway
#   scripts/compose.sh down                  remove the setup (containers, network, volumes); stop podman's socket
#   scripts/compose.sh test                  the compose tests (pytest -m compose): build, up, generate, bench, down
#   scripts/compose.sh build-rocm-standin    the ROCm image's Python layer on a CPU stand-in base
#   scripts/compose.sh compose ARGS...       docker compose / docker-compose with this script's settings
#   scripts/compose.sh engine ARGS...        docker / podman with this script's settings
#
# Settings (environment): COMPOSE_PROJECT_NAME (default pdserve), GATEWAY_PORT (50051), BASE_IMAGE (the
# Dockerfile's, python:3.11-slim), PDSERVE_CACHE (base image and wheelhouse: /var/cache/pdserve as root,
# else ~/.cache/pdserve), PDSERVE_ENGINE (docker | podman: skip the detection), UP_TIMEOUT (seconds, 900).
#
# Without Docker Engine (podman, as root): installs podman, docker-compose, debootstrap, runc, netavark,
# aardvark-dns and iptables (netavark sets up its bridge with it) from Debian; configures podman (runc,
# cgroupfs, no default ulimits: crun fails on hybrid cgroups and setting RLIMIT_NOFILE is refused); serves
# podman's Docker-compatible API on a unix socket for docker-compose; runs the containers' health checks
# (podman schedules them with systemd timers, and there is no systemd here); makes a local Debian base image
# when BASE_IMAGE cannot be pulled; and installs every Python package in the image from a wheelhouse
# prepared on the host with the host's pip (its index, local wheel sources and CA bundle: the CPU build of
# torch, not the index's CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-pdserve}
export GATEWAY_PORT=${GATEWAY_PORT:-50051}
DEFAULT_BASE=python:3.11-slim
LOCAL_BASE=localhost/pdserve-base:bookworm
STANDIN_BASE=localhost/pdserve-torch-cpu:latest
if [ "$(id -u)" = 0 ]; then CACHE=${PDSERVE_CACHE:-/var/cache/pdserve}; RUN_DIR=/run/pdserve-compose
else CACHE=${PDSERVE_CACHE:-$HOME/.cache/pdserve}; RUN_DIR=${XDG_RUNTIME_DIR:-/tmp}/pdserve-compose; fi
SOCKET=$RUN_DIR/podman.sock
PODMAN_CONF=/etc/containers/containers.conf
CONF_MARK="# written by pdserve scripts/compose.sh"

log() { echo "compose.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# ------------------------------------------------------------------ engine detection
detect_engine() {
    if [ -n "${PDSERVE_ENGINE:-}" ]; then ENGINE=$PDSERVE_ENGINE
    elif [ -z "${DOCKER_HOST:-}" ] && command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
    else ENGINE=podman; fi
    if [ "$ENGINE" = docker ]; then
        if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
        else COMPOSE=(docker-compose); fi
        ENGINE_CLI=(docker)
    else
        COMPOSE=(docker-compose)
        ENGINE_CLI=(podman)
        export DOCKER_HOST=unix://$SOCKET
    fi
}

# ------------------------------------------------------------------ podman set-up
install_podman() {
    local missing=()
    for tool in podman docker-compose debootstrap runc netavark aardvark-dns iptables; do
        command -v "$tool" >/dev/null || [ -x "/usr/lib/podman/$tool" ] || missing+=("$tool")
    done
    [ ${#missing[@]} = 0 ] && return 0
    [ "$(id -u)" = 0 ] || die "no Docker engine and podman is missing (${missing[*]}); run as root to install it"
    command -v apt-get >/dev/null || die "no Docker engine, and no apt-get to install podman with"
    log "installing podman docker-compose debootstrap runc netavark aardvark-dns iptables (Debian packages)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman docker-compose debootstrap runc netavark aardvark-dns iptables ca-certificates >/dev/null
}

configure_podman() {
    # An operator's own configuration is left alone: ours then goes through CONTAINERS_CONF.
    local target=$PODMAN_CONF
    if [ -f "$target" ] && ! grep -qF "$CONF_MARK" "$target"; then
        target=$CACHE/containers.conf
        export CONTAINERS_CONF=$target
    fi
    mkdir -p "$(dirname "$target")"
    cat >"$target" <<EOF
$CONF_MARK
[containers]
default_ulimits = []
[network]
network_backend = "netavark"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

start_socket() {
    mkdir -p "$RUN_DIR"
    if [ -f "$RUN_DIR/service.pid" ] && kill -0 "$(cat "$RUN_DIR/service.pid")" 2>/dev/null; then return 0; fi
    rm -f "$SOCKET"
    setsid podman system service --time=0 "unix://$SOCKET" >"$RUN_DIR/service.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/service.pid"
    for _ in $(seq 150); do [ -S "$SOCKET" ] && return 0; sleep 0.2; done
    die "podman's API socket did not appear ($RUN_DIR/service.log: $(tail -3 "$RUN_DIR/service.log"))"
}

start_health_ticker() {
    if [ -f "$RUN_DIR/health.pid" ] && kill -0 "$(cat "$RUN_DIR/health.pid")" 2>/dev/null; then return 0; fi
    setsid "$ROOT/scripts/compose.sh" _health-ticker >"$RUN_DIR/health.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/health.pid"
}

health_ticker() {
    # What systemd's timers would do: run each running container's health check every interval.
    local interval=${PDSERVE_HEALTH_INTERVAL:-10}  # compose.yaml's health interval
    while [ -S "$SOCKET" ]; do
        for id in $(podman ps -q --filter "label=com.docker.compose.project" 2>/dev/null); do
            podman healthcheck run "$id" >/dev/null 2>&1 || true
        done
        sleep "$interval"
    done
}

stop_pidfile() {
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -- "-$pid" 2>/dev/null || kill "$pid"  # started with setsid: its process group, children too
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$file"
}

release_podman_lock() {
    # podman keeps its locks in /dev/shm/libpod_lock; with no container, pod or volume left it holds
    # nothing, and podman makes a new one when it next runs.
    [ -z "$(podman ps -aq)$(podman pod ps -q)$(podman volume ls -q)" ] || return 0
    for _ in $(seq 60); do  # podman and conmon processes still exiting hold it open
        if ! pgrep -x podman >/dev/null && ! pgrep -x conmon >/dev/null; then
            rm -f /dev/shm/libpod_lock
            return 0
        fi
        sleep 0.5
    done
    log "podman is still running: /dev/shm/libpod_lock kept"
}

# ------------------------------------------------------------------ base image and wheelhouse (podman)
image_exists() { "${ENGINE_CLI[@]}" image exists "$1" 2>/dev/null; }

registry_reachable() {
    command -v curl >/dev/null || return 0  # no way to probe: let the pull try
    curl -s -o /dev/null --max-time 10 https://registry-1.docker.io/v2/
}

resolve_base_image() {
    local wanted=${BASE_IMAGE:-$DEFAULT_BASE}
    if image_exists "$wanted"; then echo "$wanted"; return; fi
    if registry_reachable && timeout 300 podman pull -q "docker.io/library/$wanted" >/dev/null 2>&1; then
        echo "$wanted"; return
    fi
    [ -z "${BASE_IMAGE:-}" ] || die "BASE_IMAGE=$BASE_IMAGE cannot be pulled"
    if ! image_exists "$LOCAL_BASE"; then
        local tarball=$CACHE/base/bookworm-python3.tar
        if [ ! -f "$tarball" ]; then
            log "$wanted cannot be pulled: making a Debian bookworm base with Python 3.11 (debootstrap)"
            local rootfs=$CACHE/base/rootfs
            rm -rf "$rootfs"; mkdir -p "$rootfs"
            debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
                "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/base/debootstrap.log" 2>&1 \
                || die "debootstrap failed: $(tail -3 "$CACHE/base/debootstrap.log")"
            chroot "$rootfs" /usr/bin/python3 -m venv /opt/venv  # `python` and `pip` as in python:3.11-slim
            rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
            tar -C "$rootfs" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
            rm -rf "$rootfs"
        fi
        podman import -q --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            --change "ENV LANG=C.UTF-8" "$tarball" "$LOCAL_BASE" >/dev/null
    fi
    echo "$LOCAL_BASE"
}

prepare_wheelhouse() {
    # Every Python package the image installs, for CPython 3.11 on x86-64 Linux, keyed by the requirements.
    local requirements key wheelhouse
    requirements=$(python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
    requirements=$(printf '%s\n' "torch==2.13.0" "setuptools>=68" "wheel" "$requirements" | sort -u)
    key=$(printf '%s' "$requirements" | sha256sum | cut -c1-12)
    wheelhouse=$CACHE/wheelhouse-$key
    if [ ! -f "$wheelhouse/.complete" ]; then
        log "preparing the wheelhouse $wheelhouse (pip download on the host)"
        mkdir -p "$wheelhouse"
        local previous  # the last complete wheelhouse: pip downloads only what it lacks
        previous=$(ls -dt "$CACHE"/wheelhouse-*/.complete 2>/dev/null | head -1)
        [ -z "$previous" ] || cp -l "$(dirname "$previous")"/*.whl "$wheelhouse"/ 2>/dev/null || true
        # shellcheck disable=SC2086
        python3 -m pip download --quiet --disable-pip-version-check -d "$wheelhouse" --only-binary=:all: \
            --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $requirements >&2
        python3 -c "import sys, pathlib; sys.exit(not any('+cpu' in p.name for p in pathlib.Path(sys.argv[1]).glob('torch-*.whl')))" \
            "$wheelhouse" || die "the wheelhouse's torch is not the CPU build: configure pip (find-links) with it"
        touch "$wheelhouse/.complete"
        find "$CACHE" -maxdepth 1 -name 'wheelhouse-*' ! -path "$wheelhouse" -exec rm -rf {} +
    fi
    echo "$wheelhouse"
}

build_image() {
    # podman: every package from the wheelhouse (no index needed); Docker Engine: the Dockerfile's sources.
    local target=$1 tag=$2 dockerfile=$3 wheelhouse=$4 source="--no-index --find-links /wheels"
    shift 4
    [ -z "$target" ] || set -- --target "$target" "$@"
    if [ "$ENGINE" = docker ]; then docker build -f "$dockerfile" -t "$tag" "$@" .; return; fi
    podman build --layers --network host -f "$dockerfile" -t "$tag" \
        --volume "$wheelhouse:/wheels:ro" --build-arg "PIP_SOURCE=$source" --build-arg "TORCH_SOURCE=$source" \
        "$@" .
    # docker-compose asks podman's API for the short name, which podman reads as docker.io/library/...
    podman tag "$tag" "docker.io/library/${tag#localhost/}"
    podman image prune -f >/dev/null  # earlier builds of the same tags
}

# ------------------------------------------------------------------ commands
cmd_build() {
    if [ "$ENGINE" = docker ]; then "${COMPOSE[@]}" --profile cpu build; return; fi
    local base wheelhouse
    base=$(resolve_base_image)
    wheelhouse=$(prepare_wheelhouse)
    log "building pdserve:cpu on $base"
    build_image cpu pdserve:cpu docker/Dockerfile.cpu "$wheelhouse" --build-arg "BASE_IMAGE=$base"
}

cmd_build_rocm_standin() {
    # The ROCm Dockerfile on a stand-in base (the CPU image's `torch` stage: Python 3.11 + CPU torch), with
    # no AITER and no ROCm torch check: proves the Python layer, not the GPU one.
    local base=${BASE_IMAGE:-$DEFAULT_BASE} wheelhouse=""
    if [ "$ENGINE" = podman ]; then base=$(resolve_base_image); wheelhouse=$(prepare_wheelhouse); fi
    build_image torch "$STANDIN_BASE" docker/Dockerfile.cpu "$wheelhouse" --build-arg "BASE_IMAGE=$base"
    build_image "" pdserve:rocm-standin docker/Dockerfile.rocm "$wheelhouse" --build-arg "BASE_IMAGE=$STANDIN_BASE" \
        --build-arg INSTALL_AITER=0 --build-arg REQUIRE_ROCM_TORCH=0
}

print_logs() {
    log "the containers' state and logs:"
    "${COMPOSE[@]}" --profile cpu ps >&2 || true
    "${COMPOSE[@]}" --profile cpu logs --no-color --tail 200 >&2 || true
}

cmd_up() {
    image_exists pdserve:cpu || cmd_build
    [ "$ENGINE" = docker ] || start_health_ticker
    log "bringing the cpu profile up (project $COMPOSE_PROJECT_NAME, gateway port $GATEWAY_PORT)"
    "${COMPOSE[@]}" --profile cpu up -d || { print_logs; exit 1; }
    local deadline=$((SECONDS + ${UP_TIMEOUT:-900})) gateway_id status
    gateway_id=$("${COMPOSE[@]}" --profile cpu ps -q gateway-cpu)
    while :; do
        status=$("${ENGINE_CLI[@]}" inspect --format '{{.State.Health.Status}}' "$gateway_id" 2>/dev/null || echo gone)
        [ "$status" = healthy ] && break
        if [ "$status" = unhealthy ] || [ "$status" = gone ] || [ $SECONDS -ge $deadline ]; then
            log "the gateway is $status"; print_logs; exit 1
        fi
        sleep 2
    done
    log "pdserve is up: gateway 127.0.0.1:$GATEWAY_PORT (SERVING)"
    echo "127.0.0.1:$GATEWAY_PORT"
}

cmd_down() {
    # Twice: docker-compose v1 removes containers in parallel, and podman refuses to remove decode's
    # container while prefill (in its IPC namespace) still exists; the second pass removes what is left.
    "${COMPOSE[@]}" --profile cpu --profile bench down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1 \
        || "${COMPOSE[@]}" --profile cpu --profile bench down --volumes --remove-orphans --timeout 20
    if [ "$ENGINE" = podman ] && [ -z "$(podman ps -aq --filter label=com.docker.compose.project)" ]; then
        stop_pidfile "$RUN_DIR/health.pid"
        stop_pidfile "$RUN_DIR/service.pid"
        rm -f "$SOCKET"
        release_podman_lock
    fi
    log "down: project $COMPOSE_PROJECT_NAME removed"
}

cmd_test() {
    local python=${PYTHON:-$ROOT/.venv/bin/python}
    [ -x "$python" ] || python=python3
    exec "$python" -m pytest -q -p no:cacheprovider -m compose tests/deploy "$@"
}

main() {
    local command=${1:-}
    [ $# -gt 0 ] && shift
    case "$command" in
        _health-ticker) health_ticker; return ;;
        test) cmd_test "$@"; return ;;
        build|up|down|build-rocm-standin|compose|engine) ;;
        *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
    detect_engine
    mkdir -p "$CACHE" "$CACHE/base"
    if [ "$ENGINE" = podman ]; then
        install_podman
        configure_podman
        case "$command" in up|down|compose) start_socket ;; esac
    fi
    local status=0
    case "$command" in
        build) cmd_build ;;
        up) cmd_up ;;
        down) cmd_down ;;
        build-rocm-standin) cmd_build_rocm_standin ;;
        compose) "${COMPOSE[@]}" "$@" || status=$? ;;
        engine) "${ENGINE_CLI[@]}" "$@" || status=$? ;;
    esac
    case "$ENGINE:$command" in podman:build|podman:build-rocm-standin|podman:engine) release_podman_lock ;; esac
    return $status
}

main "$@"
