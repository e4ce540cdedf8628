#!/usr/bin/env bash
# Build the real Containerfile on this machine and check the image runs the compiled data plane: a manual and
# release check (15-30 minutes the first time), not part of ./dev test. docs/deploy.md, "Build and check the image
# here".
#
# No container registry needs to be reachable (only Debian's mirror and PyPI): the base image is made here, the
# equivalent of python:3.12-slim-bookworm from Debian packages (debootstrap bookworm minbase with python3,
# python3-venv, python3-dev and `python` on PATH; Debian's Python is 3.11), imported with `podman import`, and
# the Containerfile is built unchanged on it with `buildah bud --build-arg PYTHON_IMAGE=...`. Its build stage
# fails unless every hot module runs compiled (`python -m llmgw.compiled --require`). Then the image's own
# `llmgw serve` (the demo: two simulated replicas) is started on the host's network, its start-up line
# `data plane: N of N hot modules compiled with mypyc` is read from its log, and /health and a chat completion
# are asked. Needs root (debootstrap, chroot, buildah); installs buildah, podman and debootstrap with apt-get
# when they are missing.
#
#   deploy/check-image.sh [--work DIR] [--base IMAGE] [--tag IMAGE] [--port PORT] [--rebuild-base] [--keep]
#                         [--dry-run]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=/var/tmp/llmgw-image      # the base's root filesystem and the logs
BASE=localhost/llmgw-base:bookworm
TAG=localhost/llmgw:check
PORT=18000                     # the demo's data port; its control port is PORT+1
REBUILD_BASE=0 KEEP=0 DRY_RUN=0
# What the base holds: python:3.12-slim-bookworm's equivalent from Debian (ca-certificates: pip reaches PyPI).
BASE_PACKAGES=python3,python3-venv,python3-dev,python-is-python3,ca-certificates
SUITE=bookworm MIRROR=http://deb.debian.org/debian

usage() { sed -n '/^#   deploy/,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; }
refuse() { echo "check-image: $*" >&2; usage >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --work|--base|--tag|--port) [ -n "${2:-}" ] || refuse "$1 needs a value" ;;&
    --work) WORK=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    --keep) KEEP=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) refuse "unknown argument $1" ;;
  esac
done
[[ $PORT =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1024 ] && [ "$PORT" -le 65534 ] \
  || refuse "--port takes a port from 1024 to 65534 (the control port is PORT+1)"

run() {  # print a step, then run it (--dry-run: print only)
  echo "+ $*" >&2
  [ "$DRY_RUN" = 1 ] || "$@"
}
say() { echo "check-image: $*" >&2; }

make_base() {  # debootstrap the base's root filesystem and import it as $BASE
  local rootfs=$WORK/rootfs
  run rm -rf "$rootfs"
  run debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$MIRROR"
  # apt sources as the slim image has them (the build stage's apt-get install gcc takes the current updates)
  run tee "$rootfs/etc/apt/sources.list" <<EOF >/dev/null
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
  # This machine's own certificate authorities (a TLS-inspecting proxy's): pip in the build reaches PyPI through it.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    run cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    run chroot "$rootfs" update-ca-certificates
  fi
  run cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
  run chroot "$rootfs" apt-get update -qq
  run chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade
  run chroot "$rootfs" apt-get clean
  run rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs/etc/resolv.conf"
  run touch "$rootfs/etc/resolv.conf"
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ tar -C $rootfs -c . | podman import --change ENV LANG=C.UTF-8 --change CMD [\"python3\"] - $BASE" >&2
  else
    tar -C "$rootfs" -c . | podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
  fi
}

if [ "$DRY_RUN" = 0 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "check-image: run it as root (debootstrap, chroot and buildah need it)" >&2; exit 1; }
  for tool in buildah podman debootstrap; do
    if ! command -v "$tool" >/dev/null; then
      say "installing buildah, podman and debootstrap (apt-get)"
      DEBIAN_FRONTEND=noninteractive apt-get -qq update
      DEBIAN_FRONTEND=noninteractive apt-get -qq install -y buildah podman debootstrap >/dev/null
      break
    fi
  done
  mkdir -p "$WORK"
fi

started=$SECONDS
if [ "$REBUILD_BASE" = 1 ] || [ "$DRY_RUN" = 1 ] || ! podman image exists "$BASE"; then
  say "making the base image $BASE from Debian $SUITE (a few minutes)"
  make_base
else
  say "reusing the base image $BASE (--rebuild-base makes it again)"
fi
base_took=$((SECONDS - started))

say "building $REPO/Containerfile on $BASE (the compiled build: 5-20 minutes; log: $WORK/build.log)"
started=$SECONDS
build=(buildah bud --layers --isolation chroot --build-arg "PYTHON_IMAGE=$BASE" -t "$TAG" -f "$REPO/Containerfile" "$REPO")
if [ "$DRY_RUN" = 1 ]; then
  echo "+ ${build[*]}" >&2
else
  echo "+ ${build[*]}" >&2
  "${build[@]}" >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; say "the build failed"; exit 1; }
fi
build_took=$((SECONDS - started))

# The image's llmgw serve, as the image runs it (its user, environment and working directory): buildah run with
# chroot isolation on the host's network, which works where podman run cannot set its limits (in a container).
control=$((PORT + 1))
serve=(llmgw serve --listen "127.0.0.1:$PORT" --control-listen "127.0.0.1:$control" --stop-engines)
if [ "$DRY_RUN" = 1 ]; then
  echo "+ buildah run --isolation chroot \$(buildah from $TAG) -- ${serve[*]}" >&2
  exit 0
fi
container=$(buildah from "$TAG")
log=$WORK/serve.log
buildah run --isolation chroot "$container" -- "${serve[@]}" >"$log" 2>&1 &
server=$!
descendants() { local child; for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done; }
stop() {  # Ctrl-C to llmgw serve itself (buildah run kills its child outright, which would orphan the engines)
  local pid
  for pid in $(descendants "$server"); do
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q '^/opt/llmgw/bin/python3* /opt/llmgw/bin/llmgw serve '
    then kill -INT "$pid"; break; fi
  done
  for _ in $(seq 1 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -INT "$server" 2>/dev/null && { wait "$server" 2>/dev/null || true; }
  buildah rm "$container" >/dev/null 2>&1 || true
  if [ "$KEEP" = 0 ]; then buildah rmi "$TAG" >/dev/null 2>&1 || true; fi
}
trap stop EXIT
ready=""
for _ in $(seq 1 180); do  # up to 3 minutes: the demo starts its simulated replicas first
  ready=$(curl -sf --max-time 2 "http://127.0.0.1:$control/ready" || true)
  [ -n "$ready" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; say "llmgw serve ended before it was ready"; exit 1; }
  sleep 1
done
[ -n "$ready" ] || { tail -40 "$log" >&2; say "not ready on 127.0.0.1:$control/ready in 3 minutes"; exit 1; }
health=$(curl -sf --max-time 5 "http://127.0.0.1:$control/health" || true)
line=$(grep -o 'data plane: .*' "$log" | head -1 || true)
answer=$(curl -sf --max-time 30 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}' || true)
size=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "image:      $TAG ($((size / 1000000)) MB), built in ${build_took} s on $BASE (base: ${base_took} s)"
echo "start-up:   ${line:-no data plane line in $log}"
echo "/health:    $health"
echo "completion: ${answer:0:200}"
case "$line" in
  "data plane: "*" of "*" hot modules compiled with mypyc")
    read -r n m <<<"$(sed -E 's/data plane: ([0-9]+) of ([0-9]+) .*/\1 \2/' <<<"$line")"
    [ "$n" = "$m" ] && [ -n "$answer" ] && { say "ok: the image runs the compiled data plane"; exit 0; } ;;
esac
say "FAILED: the image does not run every hot module compiled, or did not answer (log: $log)"
exit 1
