#!/usr/bin/env bash
# Installs what building and testing rlhost needs, from Debian packages only.
# Idempotent: installs only what is missing, so a warm machine pays nothing.
set -euo pipefail
PKGS=(cmake ninja-build ccache g++ clang-14 libclang-rt-14-dev pkg-config
      libboost-dev libboost-program-options-dev libyaml-cpp-dev nlohmann-json3-dev
      libopenblas-dev libpcre2-dev libutf8proc-dev libgtest-dev libgmock-dev
      abigail-tools python3 python3-jinja2 python3-sympy python3-protobuf python3-yaml
      python3-pytest python3-venv python3-setuptools python3-pip
      libopenmpi-dev openmpi-bin
      python3-numpy python3-torch)  # the Python package's DLPack tests hand tensors to both
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
