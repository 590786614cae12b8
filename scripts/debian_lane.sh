#!/bin/bash
# A Debian lane: the suite on Debian's own torch, numpy and Python, the oldest
# and a middle stack users may still run (`make test-debian12`, `make
# test-debian13`).
#
#   scripts/debian_lane.sh 12   bookworm: torch 1.13, numpy 1.24, Python 3.11
#   scripts/debian_lane.sh 13   trixie: torch 2.6, numpy 2.2, Python 3.13
#   scripts/debian_lane.sh 13 prepare   only step 1 below (.ci/run does it
#                                       early, beside another lane)
#
# On a host of that release (and TORCHSHM_LANE_CHROOT unset) it installs
# PACKAGES with apt on the host. Otherwise:
# 1. On first use, builds a root of that release with debootstrap (its default
#    mirror) and installs PACKAGES in it. The root is cached outside the clone,
#    named after a hash of its recipe, so that a changed package list builds a
#    new one; it is built in a temporary directory and renamed into place only
#    once complete, so a failed bootstrap never leaves a root that looks valid.
# 2. Either way, copies this checkout's source files (tracked and
#    untracked-not-ignored) into a scratch tmpfs (inside the root), builds
#    torchshm there in a venv over the system torch, and runs the whole suite.
#    The checkout itself is never built into: its .venv is the pip lane's.
#
# Every stage runs in its own mount namespace (unshare -m), made private
# before anything is mounted: the bind mounts of /proc, /sys, /dev and
# /dev/shm, the read-only view of the cached root and the scratch tmpfs
# vanish with the namespace, on success or failure. The cached root itself is
# mounted read-only while the suite runs, so tests cannot change it.
#
# Environment: TORCHSHM_LANE_CACHE (default /var/cache/torchshm),
# TORCHSHM_LANE_CHROOT (1: a chroot even on a host of that release),
# TORCHSHM_VENDOR (default ../shared/vendor, next to the clone),
# PYTEST_ARGS (default -q -n 2), TORCHSHM_LANE_COMMAND (a shell command to run
# in the built checkout instead of the suite, with the lane's venv on PATH).
set -euo pipefail

RELEASE=${1:-}
ACTION=${2:-test}
case "$RELEASE:$ACTION" in
12:test | 12:prepare) SUITE=bookworm ;;
13:test | 13:prepare) SUITE=trixie ;;
# Stages: the release comes in the environment; __bootstrap's second
# argument is the root it builds.
__bootstrap:* | __test:test) ;;
*)
    echo "usage: $0 12|13 [prepare]" >&2
    exit 2
    ;;
esac
# The lane's Debian packages, the same on both releases: the suite's
# dependencies, python3-build for the sdist test, util-linux and mount for the
# unshare tests.
PACKAGES=(
    python3-torch libtorch-dev python3-dev python3-numpy python3-pybind11
    python3-venv python3-pip python3-setuptools python3-wheel python3-build
    g++ ninja-build python3-pandas python3-xarray python3-pytest
    python3-pytest-timeout python3-pytest-xdist python3-hypothesis
    python3-psutil python3-tqdm python3-matplotlib python3-nbclient
    python3-nbformat python3-ipykernel python3-portalocker util-linux mount
)
# Bump when the way the root is made changes (not only its package list).
RECIPE_VERSION=1

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/scripts/debian_lane.sh"
CACHE=${TORCHSHM_LANE_CACHE:-/var/cache/torchshm}
VENDOR=${TORCHSHM_VENDOR:-$(cd "$REPO/.." && pwd)/shared/vendor}

log() { printf '[debian %s lane] %s\n' "${LANE_RELEASE:-$RELEASE}" "$*" >&2; }

host_release() { cut -d. -f1 /etc/debian_version 2>/dev/null; }

# Refuses to delete anything that still has a mount under it.
remove_tree() {
    local dir=$1
    if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' \
        /proc/self/mountinfo; then
        log "not removing $dir: something is mounted under it"
        return 1
    fi
    rm -rf --one-file-system -- "$dir"
}

# The processes still running inside the lane root in this mount namespace
# (daemons the lane started, e.g. a fork server), not this script's own.
lane_processes() {
    local ns pid
    ns=$(readlink /proc/$$/ns/mnt)
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [ "$pid" = $$ ] || [ "$pid" = "$BASHPID" ] && continue
        [ "$(readlink "/proc/$pid/ns/mnt" 2>/dev/null)" = "$ns" ] || continue
        [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$1" ] || continue
        echo "$pid"
    done
}

# Ends them, so that the namespace and its mounts go away. First 20 s to
# exit on their own: torchshm's session reaper sweeps the session's leftover
# segments and exits once the session's processes are gone, and
# multiprocessing's resource tracker unlinks semaphores once its clients
# are. Then SIGTERM, and SIGKILL after 10 s more.
end_namespace_processes() {
    local pids pid tries
    for tries in $(seq 200); do
        pids=$(lane_processes "$1")
        [ -n "$pids" ] || return 0
        sleep 0.1
    done
    for pid in $pids; do
        log "ending leftover process $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-100))"
        kill -TERM "$pid" 2>/dev/null || true
    done
    for tries in $(seq 100); do
        pids=$(lane_processes "$1")
        [ -n "$pids" ] || return 0
        sleep 0.1
    done
    for pid in $pids; do
        kill -KILL "$pid" 2>/dev/null || true
    done
}

bind_system() {  # bind_system ROOT
    local root=$1
    mount --bind /proc "$root/proc"
    mount --bind /sys "$root/sys"
    mount --bind /dev "$root/dev"
    mount --bind /dev/shm "$root/dev/shm"
}

chroot_run() {  # chroot_run ROOT COMMAND...: a clean environment inside ROOT
    local root=$1
    shift
    chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        DEBIAN_FRONTEND=noninteractive "$@"
}

# --- stage 1 (in its own namespace): debootstrap into DIR and install ---------
inside_bootstrap() {
    local dir=$1
    mount --make-rprivate /
    debootstrap --variant=minbase "$SUITE" "$dir" >&2
    bind_system "$dir"
    # Name resolution for apt, without copying the host's file into the root.
    touch "$dir/etc/resolv.conf"
    mount --bind /etc/resolv.conf "$dir/etc/resolv.conf"
    # No service starts inside the root.
    printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
    chmod +x "$dir/usr/sbin/policy-rc.d"
    chroot_run "$dir" apt-get update -qq
    chroot_run "$dir" apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    chroot_run "$dir" apt-get clean
    mkdir -p "$dir/lane"
    printf '%s\n' "${PACKAGES[@]}" >"$dir/lane-packages.txt"
    end_namespace_processes "$dir"
}

ensure_root() {
    if [ -d "$ROOT" ]; then
        log "using cached $SUITE root $ROOT"
        return
    fi
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
    if [ -d "$ROOT" ]; then  # another run built it meanwhile
        exec 9>&-
        return
    fi
    # Leftovers of a killed bootstrap (an exited namespace holds no mounts).
    local old
    for old in "$CACHE"/.build-*; do
        [ -e "$old" ] && remove_tree "$old"
    done
    local tmp start
    tmp=$(mktemp -d "$CACHE/.build-$SUITE-$HASH.XXXXXX")
    chmod 755 "$tmp"  # it becomes "/": mktemp made it 0700
    trap 'remove_tree "'"$tmp"'" || true' EXIT
    start=$SECONDS
    log "building the $SUITE root (debootstrap, then ${#PACKAGES[@]} packages) in $tmp"
    unshare --mount --propagation private -- "$SELF" __bootstrap "$tmp"
    mv -T "$tmp" "$ROOT"
    trap - EXIT
    log "built $ROOT in $((SECONDS - start)) s"
    # Roots for other package lists are stale now.
    for old in "$CACHE/$SUITE"-*; do
        [ "$old" = "$ROOT" ] || remove_tree "$old"
    done
    exec 9>&-
}

# --- stage 2 (in its own namespace): build torchshm and run the suite ---------
# ROOT is the cached root for a chroot, "/" on a host of the lane's release.
inside_test() {
    local root=$ROOT lane status=0
    mount --make-rprivate /
    if [ "$root" = / ]; then
        lane=$(mktemp -d /tmp/torchshm-debian"$LANE_RELEASE".XXXXXX)
    else
        lane=$root/lane
        # The root becomes a mount point of its own: inside the chroot, `unshare
        # -m` (tests/test_limits.py) can then make "/" private. Read-only: the
        # cache stays as built.
        mount --bind "$root" "$root"
        mount -o remount,bind,ro "$root"
        bind_system "$root"
        local d
        for d in tmp var/tmp root; do
            mount -t tmpfs -o mode=1777 tmpfs "$root/$d"
        done
    fi
    mount -t tmpfs -o mode=1777 tmpfs "$lane"
    mkdir -p "$lane/main" "$lane/shared"
    if [ -d "$VENDOR" ]; then
        mkdir -p "$lane/shared/vendor"
        mount --bind -o ro "$VENDOR" "$lane/shared/vendor"
        mount -o remount,bind,ro "$lane/shared/vendor"
    else
        log "no vendored torchdata at $VENDOR: its tests will skip"
    fi
    copy_sources "$lane/main"
    local inner=${lane#"${root%/}"}  # the lane's path as seen inside the root
    cat >"$lane/run.sh" <<'EOF2'
set -euo pipefail
cd "$LANE/main"
/usr/bin/python3 -m venv --system-site-packages "$LANE/venv"
start=$SECONDS
MAX_JOBS=$(nproc) "$LANE/venv/bin/python" -m pip install -q --no-build-isolation \
    --no-deps --no-index --no-cache-dir -e .
echo "[debian $LANE_RELEASE lane] built torchshm in $((SECONDS - start)) s" >&2
"$LANE/venv/bin/python" - <<'PY'
import os, sys, numpy, pandas, torch, xarray
print(f"[debian {os.environ['LANE_RELEASE']} lane] Python {sys.version.split()[0]},"
      f" torch {torch.__version__}, numpy {numpy.__version__},"
      f" pandas {pandas.__version__}, xarray {xarray.__version__}", file=sys.stderr)
PY
if [ -n "$LANE_COMMAND" ]; then
    PATH=$LANE/venv/bin:$PATH exec /bin/bash -c "$LANE_COMMAND"
fi
start=$SECONDS
status=0
# --lane debian12 or debian13: what this stack can change (Note [What each
# lane runs] in tests/conftest.py).
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
"$LANE/venv/bin/python" -m pytest -p no:cacheprovider --lane "debian$LANE_RELEASE" $PYTEST_ARGS || status=$?
echo "[debian $LANE_RELEASE lane] test suite: $((SECONDS - start)) s" >&2
exit $status
EOF2
    chroot_run "$root" LANE="$inner" LANE_RELEASE="$LANE_RELEASE" \
        PYTEST_ARGS="${PYTEST_ARGS:--q -n 2}" \
        LANE_COMMAND="${TORCHSHM_LANE_COMMAND:-}" /bin/bash "$inner/run.sh" || status=$?
    end_namespace_processes "$root"
    if [ "$root" = / ]; then  # the tmpfs goes with the namespace; its mount point stays
        umount -R "$lane" && rmdir "$lane" || log "could not remove $lane"
    fi
    return $status
}

copy_sources() {  # the files git would commit, as they are in the worktree
    local dest=$1
    if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        (cd "$REPO" && git ls-files -co --exclude-standard -z |
            while IFS= read -r -d '' f; do
                [ -f "$f" ] && printf '%s\0' "$f"
            done | tar --null -T - -cf -) | tar -xf - -C "$dest"
    else
        tar -C "$REPO" --exclude-vcs --exclude=./.venv --exclude=./build \
            --exclude='*.so' --exclude=__pycache__ --exclude=./torchshm/_build_info.json \
            -cf - . | tar -xf - -C "$dest"
    fi
}

case "$RELEASE" in
__bootstrap) inside_bootstrap "$2" ;;
__test) inside_test ;;
*)
    if [ "$(id -u)" != 0 ]; then
        log "needs root (apt, mounts; debootstrap and chroot on another release)"
        exit 1
    fi
    start=$SECONDS
    export LANE_RELEASE=$RELEASE SUITE
    if [ "$(host_release)" = "$RELEASE" ] && [ -z "${TORCHSHM_LANE_CHROOT:-}" ]; then
        log "on this Debian $RELEASE host"
        "$REPO/scripts/apt_install.sh" "${PACKAGES[@]}"
        export ROOT=/
    else
        HASH=$(printf '%s\n' "$SUITE" "$RECIPE_VERSION" "${PACKAGES[@]}" | sha256sum | cut -c1-16)
        export ROOT="$CACHE/$SUITE-$HASH"
        ensure_root
    fi
    if [ "$ACTION" = prepare ]; then
        log "prepared in $((SECONDS - start)) s"
        exit 0
    fi
    unshare --mount --propagation private -- "$SELF" __test
    log "lane wall time $((SECONDS - start)) s"
    ;;
esac
