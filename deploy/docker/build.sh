#!/bin/sh
# The build stage of every pinfer image (deploy/docker/*.Dockerfile) runs this script with the
# build context at /src. It leaves a self-contained tree at OUT (see bundle.sh) either way:
#   source:   installs Debian 12's build dependencies, compiles the given targets and the
#             sentencepiece module (libpinfer_spm.so, loaded at run time), bundles them.
#             With PINFER_CUDA=1 it also installs NVIDIA's CUDA 13 toolkit for Debian 12 and
#             builds libpinfer_cuda.so (the gpu-worker image).
#   prebuilt: the context already holds a bundle in prebuilt/ (made on the host with bundle.sh
#             from a normal build, e.g. CI's), which is copied as is. No compiler, no network.
#
# usage: build.sh source|prebuilt OUT TARGET...
set -eu
mode=$1
out=$2
shift 2

case "$mode" in
  prebuilt)
    if [ ! -d /src/prebuilt/bin ]; then
      echo "build.sh: PINFER_BUILD=prebuilt but the build context has no prebuilt/bin" >&2
      exit 1
    fi
    # The bundle may hold every binary; the image gets the libraries and modules, and the
    # requested executables. The CUDA module only goes where it is asked for (PINFER_CUDA=1).
    mkdir -p "$out/bin"
    cp -a /src/prebuilt/lib "$out/"
    if [ "${PINFER_CUDA:-0}" != 1 ]; then rm -f "$out/lib/libpinfer_cuda.so"; fi
    for t in "$@"; do
      [ -x "/src/prebuilt/bin/$t" ] || { echo "build.sh: prebuilt/bin/$t is missing" >&2; exit 1; }
      cp -a "/src/prebuilt/bin/$t" "$out/bin/"
    done
    ;;
  source)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # GoogleTest and python3 only because the top-level CMakeLists configures the tests; none is
    # built here.
    apt-get install -y -qq --no-install-recommends \
      build-essential cmake ninja-build pkg-config ca-certificates wget \
      libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
      prometheus-cpp-dev libsentencepiece-dev libre2-dev nlohmann-json3-dev \
      libgtest-dev libgmock-dev python3 >/dev/null
    cuda_flag=-DPINFER_CUDA=OFF
    targets="$* pinfer_spm"
    if [ "${PINFER_CUDA:-0}" = 1 ]; then
      wget -q -O /tmp/cuda-keyring.deb \
        https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb
      dpkg -i /tmp/cuda-keyring.deb >/dev/null
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends cuda-nvcc-13-0 cuda-cudart-dev-13-0 \
        libcublas-dev-13-0 >/dev/null
      cuda_flag="-DPINFER_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
      targets="$targets pinfer_cuda"
    fi
    # shellcheck disable=SC2086  # cuda_flag and targets are word lists on purpose
    cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release $cuda_flag >/dev/null
    # shellcheck disable=SC2086
    cmake --build /build --target $targets
    files=""
    for t in $targets; do
      if [ "$t" = pinfer_cuda ] || [ "$t" = pinfer_spm ]; then
        f=$(find /build -name "lib$t.so" -type f | head -n 1)
      else
        f=$(find /build -name "$t" -type f -perm -u+x | head -n 1)
      fi
      [ -n "$f" ] || { echo "build.sh: built $t but cannot find it" >&2; exit 1; }
      files="$files $f"
    done
    # shellcheck disable=SC2086
    /src/deploy/docker/bundle.sh "$out" $files
    ;;
  *)
    echo "build.sh: PINFER_BUILD must be source or prebuilt, not '$mode'" >&2
    exit 2
    ;;
esac
