#!/usr/bin/env bash
# A valkey-server 9 (I/O threads that write large replies straight from the stored
# value: docs/scale.md, Valkey) that runs on a machine without internet, apt, or a
# glibc as new as it needs: Debian's packages of it and of every library it loads,
# glibc's loader included, unpacked into a folder with a wrapper that starts it
# through that loader.
#
#   scripts/valkey_for_device.sh [DIR] [SUITE]   # DIR: default .dev/valkey (git-ignored); SUITE: forky
#   DIR/valkey-server --version
#   python bench/bench_tiers.py --redis-server DIR/valkey-server --redis-io-threads 8 \
#       --redis-read-connections 4 --redis-option min-io-threads-avoid-copy-reply 2
#
# Needs curl and xz on this machine (not on the one it runs on).
set -euo pipefail
dir=$(realpath -m "${1:-.dev/valkey}")
suite=${2:-forky}
mirror=http://deb.debian.org/debian
pkgs="valkey-server valkey-tools libc6 libgcc-s1 libstdc++6 libatomic1 libjemalloc2 liblzf1 libssl3t64
      libsystemd0 libzstd1 zlib1g libcap2 libgcrypt20 libgpg-error0 liblz4-1 libxxhash0 liblzma5"
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/root"
index="$dir/debs/Packages"
curl -fsS "$mirror/dists/$suite/main/binary-amd64/Packages.xz" | xz -dc > "$index"
for p in $pkgs; do
    f=$(awk -v P="$p" '$0 == "Package: " P {hit = 1} hit && /^Filename:/ {print $2; exit}' "$index")
    [ -n "$f" ] || { echo "no package $p in $suite" >&2; exit 1; }
    curl -fsS -o "$dir/debs/$(basename "$f")" "$mirror/$f"
    dpkg -x "$dir/debs/$(basename "$f")" "$dir/root"
done
echo "Debian $suite: $(cd "$dir/debs" && ls *.deb | tr '\n' ' ')" > "$dir/SOURCE"
rm -rf "$dir/debs" "$dir/root/usr/share" "$dir/root/usr/lib/x86_64-linux-gnu/gconv" "$dir/root/etc"
cat > "$dir/valkey-server" <<'WRAP'
#!/bin/sh
# valkey-server from the unpacked packages next to this file, run by their own glibc's
# loader (scripts/valkey_for_device.sh). Valkey picks its mode by the program's name.
here=$(dirname "$(readlink -f "$0")")
lib="$here/root/usr/lib/x86_64-linux-gnu"
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$here/root/usr/bin/valkey-server" "$@"
WRAP
chmod +x "$dir/valkey-server"
env -i "$dir/valkey-server" --version
