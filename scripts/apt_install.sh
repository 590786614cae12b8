#!/bin/bash
# Installs with apt only the Debian packages named that are missing: the
# Makefile's host dependencies and a Debian lane's on a host of its release.
set -euo pipefail
missing=()
for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' ||
        missing+=("$p")
done
if [ "${#missing[@]}" != 0 ]; then
    echo "installing Debian packages: ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi
