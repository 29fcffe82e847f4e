#!/usr/bin/env bash
# A redis-server that runs on a machine without internet or apt (the GPU box):
# the Debian packages downloaded here (apt-get download: no root, no install)
# and unpacked into a folder with a wrapper that finds their libraries.
#
#   scripts/redis_for_device.sh [DIR]      # DIR: default .dev/redis (git-ignored)
#   DIR/redis-server --version             # the wrapper: the binary, LD_LIBRARY_PATH set
#   python bench/bench_tiers.py --redis-server DIR/redis-server
#
# The folder travels with the working tree (the device tool's `carry`); the
# packages must match the box's Debian release (this machine's: see DIR/SOURCE).
set -euo pipefail
dir=$(realpath -m "${1:-.dev/redis}")
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/root"
cd "$dir/debs"
apt-get download redis-server redis-tools libjemalloc2 liblzf1 libatomic1 2>/dev/null
for deb in *.deb; do dpkg -x "$deb" "$dir/root"; done
. /etc/os-release
echo "$PRETTY_NAME: $(ls "$dir/debs" | tr '\n' ' ')" > "$dir/SOURCE"
rm -rf "$dir/debs"
cat > "$dir/redis-server" <<'WRAP'
#!/bin/sh
# redis-server from the unpacked packages next to this file (scripts/redis_for_device.sh).
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    exec "$here/root/usr/bin/redis-server" "$@"   # a link: redis picks its mode by this name
WRAP
chmod +x "$dir/redis-server"
env -i "$dir/redis-server" --version
