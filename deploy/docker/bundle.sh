#!/bin/sh
# Copies pinfer binaries and the shared libraries they need into a self-contained tree:
#   OUT/bin/  the executables
#   OUT/lib/  the modules pinfer loads with dlopen (libpinfer_spm.so, the sentencepiece
#             tokenizer; libpinfer_cuda.so, the gpu-worker's CUDA backend), which the loaders
#             find in ../lib beside the executable or through LD_LIBRARY_PATH, and every shared
#             library of the ldd closure except the C/C++ runtime and CUDA
# Images then only need a glibc at least as new as the build machine's (Debian 12: 2.36), so the
# same bundle runs on debian:bookworm-slim and on NVIDIA's Ubuntu 24.04 CUDA runtime images, and
# the CI build can be copied into images ("prebuilt") instead of compiling inside a container.
# The C runtime, libstdc++ and libgcc_s come from the image; CUDA libraries come from the CUDA
# runtime image and the driver (NVIDIA container toolkit), never from the bundle.
#
# usage: bundle.sh OUT_DIR FILE...     (FILE: an executable or a module, *.so)
set -eu
if [ $# -lt 2 ]; then
  echo "usage: bundle.sh OUT_DIR FILE..." >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libcudart\.so|libcublas\.so|libcublasLt\.so|libnvidia)'
for f in "$@"; do
  case "$f" in
    *.so) cp -L "$f" "$out/lib/" ;;
    *) cp -L "$f" "$out/bin/" ;;
  esac
  # ldd lines: "libfoo.so.1 => /path/libfoo.so.1 (0x...)"; libraries that are not found are an
  # error here rather than a broken image later (CUDA ones excepted: the image provides them).
  ldd "$f" | while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    if echo "$name" | grep -Eq "$skip"; then continue; fi
    if [ "$path" = "not" ]; then
      echo "bundle.sh: $f needs $name, which is not installed" >&2
      exit 1
    fi
    cp -Ln "$path" "$out/lib/$name"
  done
done
