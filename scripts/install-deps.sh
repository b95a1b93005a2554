#!/usr/bin/env bash
# Installs the Debian 12 packages pinfer builds and tests with (see the README's dependency table).
# Safe to run repeatedly; needs root (or sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  prometheus-cpp-dev libsentencepiece-dev libre2-dev nlohmann-json3-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy python3-yaml
  clang libclang-rt-14-dev
  # the chat page's browser test (tests/http; headless, driven by npm puppeteer-core)
  chromium
  # monitoring and containerised end-to-end tests (deploy/)
  prometheus podman runc catatonit debootstrap docker-compose containernetworking-plugins
  golang-github-containernetworking-plugin-dnsname iptables
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
