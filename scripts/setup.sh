#!/usr/bin/env bash
# Installs the Debian packages kvbridge's build and tests need. Idempotent: when everything is
# present it only checks (no apt-get update, no network). Assumes root (as in CI containers);
# uses sudo when run as another user and sudo exists.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libgtest-dev libgmock-dev libssl-dev liburing-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  python3 python3-venv
  iproute2 nftables procps
  xz-utils util-linux  # the GPU kit (benchmarks/gpu_kit.sh) and its check's mount namespace
  clang-format
  libucx-dev ucx-utils
  libibverbs-dev librdmacm-dev
  etcd-server libcivetweb-dev
  libtcmalloc-minimal4  # the daemons' allocator (csrc/tools/CMakeLists.txt)
  chromium  # renders the master's status page in StoreObs.StatusPageRendersNodesInChromium
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

as_root=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
  else
    echo "setup: missing packages (${missing[*]}) and not root; install them or rerun as root" >&2
    exit 1
  fi
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q
"${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: done"
