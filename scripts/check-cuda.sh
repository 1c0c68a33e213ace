#!/usr/bin/env bash
# Type-checks `--features cuda` (`cargo check`) where github.com cannot be reached.
#
# Burn's CUDA backend depends on cubecl-llvm, whose build script wants tracel's LLVM 23 bundle
# (downloaded from github.com on a first build, into $XDG_DATA_HOME/tracel). This script puts a
# stand-in bundle in a temporary folder: a marker that says "installed" and an `llvm-config`
# that is Debian's LLVM 14 (package llvm-14-dev), which is enough for cubecl-llvm's C++ shims
# to compile and for every crate to be checked. It is not enough to link a binary: LLVM 14
# lacks 16 of the LLVM-C functions cubecl-llvm calls (LLVMPointerTypeInContext, ...).
#
# bash scripts/check-cuda.sh         (LLVM_CONFIG=path/to/llvm-config to use another one)
set -euo pipefail
cd "$(dirname "$0")/.."

llvm_config=${LLVM_CONFIG:-/usr/lib/llvm-14/bin/llvm-config}
if [ ! -x "$llvm_config" ]; then
    echo "check-cuda: skipped: no $llvm_config (install llvm-14-dev, or set LLVM_CONFIG)"
    exit 0
fi
# The bundle's folder is named after the tracel-llvm-bundler version in Cargo.lock.
version=$(grep -A1 '^name = "tracel-llvm-bundler"$' Cargo.lock | sed -n 's/^version = "\(.*\)"$/\1/p')
if [ -z "$version" ]; then
    echo "check-cuda: tracel-llvm-bundler is not in Cargo.lock" >&2
    exit 1
fi

stand_in=$(mktemp -d)
trap 'rm -rf "$stand_in"' EXIT
bundle="$stand_in/tracel/tracel-llvm-$version"
mkdir -p "$bundle/bin"
touch "$bundle/.tracel-llvm-installed"
ln -s "$llvm_config" "$bundle/bin/llvm-config"

echo "check-cuda: cargo check --features cuda against $("$llvm_config" --version) standing in for LLVM $version"
XDG_DATA_HOME="$stand_in" cargo check --release --locked -p ember-cli --features cuda
