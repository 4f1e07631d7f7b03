# Shared by scripts/setup.sh and scripts/sglang-venv.sh (sourced, not run).

# One line saying what the script does next, prefixed with the script's name.
say() { printf '%s: %s\n' "${0##*/}" "$*"; }

die() { printf '%s: error: %s\n' "${0##*/}" "$*" >&2; exit 1; }

# The version constraints.txt (the verified versions, in the clone's root) pins
# distribution $1 to; dies when it pins none.
pinned() {
    local v
    v=$(sed -n "s/^$1==\([^ ;#]*\).*/\1/p" constraints.txt)
    [ -n "$v" ] || die "constraints.txt pins no version of $1"
    printf '%s\n' "$v"
}

# Install the Debian/Ubuntu packages named (apt-get), through sudo unless root. Callers
# pass only the packages they found missing; nothing is done when none is named.
apt_install() {
    [ "$#" -gt 0 ] || return 0
    command -v apt-get >/dev/null ||
        die "missing system packages: $*; this script installs them with apt-get (Debian/Ubuntu): install their equivalents and rerun"
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "installing $* needs root: rerun as root or install sudo"
        sudo=(sudo)
    fi
    say "installing system packages: $* (apt-get${sudo:+, with sudo})"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

has_lib() { { ldconfig -p 2>/dev/null || /sbin/ldconfig -p; } | grep -q "$1"; }

# The system packages of what is named (mooncake: the Mooncake wheels' RDMA libraries,
# also for TCP; sglang: the compiler and OpenSSL headers SGLang's page-hash extension is
# built with) that are missing, by what they provide, one per line.
missing_packages() {
    local what
    for what in "$@"; do
        case $what in
            mooncake)
                has_lib libibverbs.so.1 || echo libibverbs1
                has_lib librdmacm.so.1 || echo librdmacm1 ;;
            sglang)
                command -v g++ >/dev/null || echo g++
                [ -e /usr/include/openssl/sha.h ] || echo libssl-dev ;;
        esac
    done
}

# Die unless the filesystem that holds path $1 has $2 MB free; $3 names what needs them.
need_space() {
    local free
    free=$(df -Pm -- "$1" | awk 'NR == 2 {print $4}')
    [ -n "$free" ] || die "cannot tell the free space of $1 (df failed)"
    [ "$free" -ge "$2" ] ||
        die "$((free / 1024)) GB free on the filesystem of $(cd "$1" && pwd); $3 needs about $((($2 + 1023) / 1024)) GB there: free space there, or clone raykv to a filesystem with room"
}

# pip's temporary files (the wheels it unpacks, a package it moves aside while it
# replaces it: up to 3.9 GB at once in a set-up with engines) go to $TMPDIR, /tmp when it
# is unset: often a small tmpfs, or another disk than the venvs'. Unless TMPDIR is set,
# point it at .setup-tmp in the clone, on the venvs' filesystem that need_space checks.
# SETUP_TMP names that folder (empty: TMPDIR was set); the caller removes it at exit with
# drop_setup_tmp.
setup_tmp() {
    SETUP_TMP=
    [ -z "${TMPDIR:-}" ] || return 0
    SETUP_TMP="$PWD/.setup-tmp"
    mkdir -p "$SETUP_TMP"
    export TMPDIR="$SETUP_TMP"
}

drop_setup_tmp() { [ -z "${SETUP_TMP:-}" ] || rm -rf "$SETUP_TMP"; }
