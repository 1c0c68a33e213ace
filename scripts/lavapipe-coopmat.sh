#!/usr/bin/env bash
# Runs a command (a `cargo test`) with Mesa's lavapipe that has cooperative matrices, so that
# ember's tensor-core kernels (CubeCL's `cmma`, SPIR-V cooperative matrices under `--features
# vulkan`) run without a GPU.
#
# Debian 12's lavapipe (Mesa 22.3) has no cooperative matrices; Mesa 26's (Debian 13
# trixie-backports) offers 8x8x8 f16 fragments where LLVM has 256-bit vectors (AVX2). This
# script unpacks that driver and the Debian 13 libraries it needs under
# target/lavapipe-coopmat/ (nothing is installed, no root needed; about 60 MB, downloaded
# once from the Debian archive), then runs the command with cargo's test runner set to
# Debian 13's dynamic loader and those libraries, the Vulkan loader pointed at that driver
# alone, and EMBER_REQUIRE_MMA=1 (a test that finds no f16 fragments then fails instead of
# skipping).
#
#   bash scripts/lavapipe-coopmat.sh cargo test --release -p ember-kernels \
#       --features wgpu,vulkan --lib tests_mma
#
# DEBIAN_MIRROR overrides http://deb.debian.org/debian.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)/target/lavapipe-coopmat
tree=$root/tree
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# mesa-vulkan-drivers from trixie-backports; the rest from trixie: the driver's libraries,
# LLVM 19's, and the C and C++ runtimes the loader brings.
packages="mesa-vulkan-drivers libvulkan1 libc6 libgcc-s1 libstdc++6 libllvm19 libz3-4 libxml2
liblzma5 libedit2 libtinfo6 libbsd0 libmd0 libffi8 libexpat1 libelf1t64 libzstd1 zlib1g libdrm2
libdrm-amdgpu1 libdisplay-info2 libpng16-16t64 libwayland-client0 libx11-xcb1 libx11-6 libxau6
libxdmcp6 libxcb1 libxcb-dri3-0 libxcb-present0 libxcb-randr0 libxcb-shm0 libxcb-sync1
libxcb-xfixes0 libxshmfence1"

download() {
    if command -v curl >/dev/null; then
        curl -fsSL --retry 3 -o "$2" "$1"
    else
        wget -q -O "$2" "$1"
    fi
}

# The pool path of package $1 in the (decompressed) index $2.
pool_path() {
    awk -v name="$1" '
        $1 == "Package:" { hit = ($2 == name) }
        hit && $1 == "Filename:" { print $2; exit }' "$2"
}

if [ ! -e "$root/.unpacked" ]; then
    rm -rf "$root"
    mkdir -p "$root/debs" "$tree"
    for suite in trixie trixie-backports; do
        download "$mirror/dists/$suite/main/binary-amd64/Packages.xz" "$root/$suite.xz"
        xz -d "$root/$suite.xz"
    done
    for package in $packages; do
        index=$root/trixie
        [ "$package" = mesa-vulkan-drivers ] && index=$root/trixie-backports
        path=$(pool_path "$package" "$index")
        if [ -z "$path" ]; then
            echo "lavapipe-coopmat: $package is not in $(basename "$index")" >&2
            exit 1
        fi
        deb=$root/debs/$(basename "$path")
        download "$mirror/$path" "$deb"
        dpkg-deb -x "$deb" "$tree"
        rm "$deb"
    done
    rm "$root/trixie" "$root/trixie-backports"
    touch "$root/.unpacked"
fi

libs=$tree/usr/lib/x86_64-linux-gnu
icd=$root/lvp_icd.json
cat >"$icd" <<EOF
{
    "file_format_version": "1.0.1",
    "ICD": { "library_path": "$libs/libvulkan_lvp.so", "api_version": "1.4.0" }
}
EOF
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$libs/ld-linux-x86-64.so.2 --library-path $libs"
export VK_ICD_FILENAMES=$icd VK_DRIVER_FILES=$icd
export EMBER_REQUIRE_MMA=1
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
exec "$@"
