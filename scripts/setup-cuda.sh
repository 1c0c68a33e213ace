#!/usr/bin/env bash
# Prepares (and with --build, runs) the `--features cuda` build where only the package
# registries answer.
#
# Burn's CUDA backend depends on cubecl-llvm, whose build script (tracel-llvm-bundler) downloads
# tracel's LLVM 23 bundle from github.com into $XDG_DATA_HOME/tracel/ unless that folder already
# holds a marker `.tracel-llvm-installed`; it then asks the folder's `bin/llvm-config
# --link-static` how to compile and link against LLVM. Debian's LLVM 22 (llvm-22-dev) has every
# LLVM-C function cubecl-llvm and pliron-llvm call, and the NVPTX target. This script:
#   1. installs llvm-22-dev, libzstd-dev and zlib1g-dev with apt if missing;
#   2. makes a bundle folder under target/cuda-llvm/ (never the user's own XDG_DATA_HOME): the
#      marker and an `llvm-config` wrapper around Debian's, which
#      - prints library paths as -l<name> (Debian's --system-libs names
#        /usr/lib/x86_64-linux-gnu/libz3.so, which the bundler would turn into `-llibz3`),
#      - drops -lPolly -lPollyISL (Debian ships no static Polly; ember does not use it);
#   3. prints the build command, or with --build runs it (into target/cuda/, so the default
#      build's target/release/ember stays the CPU one) and writes a stripped, xz-compressed copy
#      of the binary for carrying to a GPU machine (target/cuda/release/ember-cuda.xz).
#
#   bash scripts/setup-cuda.sh            # prepare, print the command
#   bash scripts/setup-cuda.sh --build    # prepare and build
#
# CUDARC_CUDA_VERSION (default 13000) is the CUDA API version cudarc binds against (there is no
# nvcc on a build machine without the toolkit); a driver that supports that CUDA version or a
# newer one runs the binary. LLVM_CONFIG overrides Debian's llvm-config; CARGO_TARGET_DIR
# overrides target/cuda. FEATURES (default `cuda`) names the cargo features: `cuda-nvrtc` builds
# the binary whose kernels go through NVRTC (README, "Devices").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

llvm_config=${LLVM_CONFIG:-/usr/lib/llvm-22/bin/llvm-config}
packages="llvm-22-dev libzstd-dev zlib1g-dev"

missing_packages() {
    [ -x "$llvm_config" ] || return 0
    for header in /usr/include/zstd.h /usr/include/zlib.h; do
        [ -f "$header" ] || return 0
    done
    return 1
}

if missing_packages; then
    if [ -n "${LLVM_CONFIG:-}" ]; then
        echo "setup-cuda: LLVM_CONFIG=$LLVM_CONFIG is not an executable llvm-config" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null; then
        echo "setup-cuda: needs $packages (Debian 12's bookworm-security has llvm-22-dev); no apt-get here" >&2
        exit 1
    fi
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    echo "setup-cuda: installing $packages"
    $sudo apt-get install -y --no-install-recommends $packages \
        || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends $packages; }
fi
if ! "$llvm_config" --targets-built | grep -qw NVPTX; then
    echo "setup-cuda: $llvm_config was built without the NVPTX target" >&2
    exit 1
fi

# The bundle's folder is named after the tracel-llvm-bundler version in Cargo.lock.
version=$(grep -A1 '^name = "tracel-llvm-bundler"$' Cargo.lock | sed -n 's/^version = "\(.*\)"$/\1/p')
if [ -z "$version" ]; then
    echo "setup-cuda: tracel-llvm-bundler is not in Cargo.lock" >&2
    exit 1
fi
data_home="$root/target/cuda-llvm"
bundle="$data_home/tracel/tracel-llvm-$version"
mkdir -p "$bundle/bin"
cat >"$bundle/bin/llvm-config.new" <<EOF
#!/usr/bin/env bash
# Written by ember's scripts/setup-cuda.sh: Debian's LLVM ($("$llvm_config" --version)) standing in
# for tracel's LLVM $version bundle.
set -euo pipefail
out=\$("$llvm_config" "\$@")
words=()
for word in \$out; do
    case "\$word" in
        -lPolly | -lPollyISL) ;;
        /*.so | /*.so.* | /*.a)
            name=\${word##*/lib}
            words+=("-l\${name%%.*}") ;;
        *) words+=("\$word") ;;
    esac
done
echo "\${words[*]}"
EOF
chmod +x "$bundle/bin/llvm-config.new"
mv "$bundle/bin/llvm-config.new" "$bundle/bin/llvm-config"
# Touched only when missing: the bundler's build script watches the marker, and a new timestamp
# would rebuild cubecl-llvm and everything above it (about 9 minutes on 2 cores).
[ -e "$bundle/.tracel-llvm-installed" ] || touch "$bundle/.tracel-llvm-installed"

export XDG_DATA_HOME="$data_home"
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/cuda}
command=(cargo build --release --locked -p ember-cli --features "${FEATURES:-cuda}")
echo "setup-cuda: LLVM $("$llvm_config" --version) stands in for tracel-llvm $version in $bundle"
if [ "${1:-}" != "--build" ]; then
    echo "setup-cuda: build with"
    echo "  XDG_DATA_HOME=$XDG_DATA_HOME CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION \\"
    echo "  CARGO_TARGET_DIR=$CARGO_TARGET_DIR ${command[*]}"
    exit 0
fi

start=$(date +%s)
"${command[@]}"
binary="$CARGO_TARGET_DIR/release/ember"
echo "setup-cuda: built $binary in $(( $(date +%s) - start )) s ($(du -h "$binary" | cut -f1))"
packed="$CARGO_TARGET_DIR/release/ember-cuda.xz"
strip -o "$binary.stripped" "$binary"
xz -T0 -6 -c "$binary.stripped" >"$packed.new"
mv "$packed.new" "$packed"
echo "setup-cuda: stripped $(du -h "$binary.stripped" | cut -f1), compressed $packed $(du -h "$packed" | cut -f1)"
echo "setup-cuda: on the GPU machine: xz -d <ember-cuda.xz >ember && chmod +x ember && ./ember train --device cuda ..."
rm -f "$binary.stripped"
