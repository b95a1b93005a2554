# The pinfer gpu-worker image: embeddings, attention, KV caches, norms, hot FFN neurons and the
# output head, on a GPU through the CUDA module (libpinfer_cuda.so), or on the CPU when the
# container has no usable GPU (it says so in its log and in pinfer_worker_gpu_available). It
# creates the shared-memory activation segment its cpu-worker attaches to. Control gRPC on 50052,
# /metrics on 9401.
#
# By default the build stage is Debian 12 with NVIDIA's CUDA 13 toolkit for Debian (PINFER_CUDA=1)
# and the runtime stage NVIDIA's CUDA runtime image, which supplies cudart and cuBLAS (the driver
# comes from the NVIDIA container toolkit). The bundle from build.sh needs only glibc >= 2.36,
# which Ubuntu 24.04 has. For a CPU-only image (deploy/compose/docker-compose.cpu.yml):
#   --build-arg RUNTIME_IMAGE=debian:bookworm-slim --build-arg PINFER_CUDA=0
#
# Multi-stage, non-root, base images as build arguments: see gateway.Dockerfile.
#
#   podman build -f deploy/docker/gpu-worker.Dockerfile -t pinfer/gpu-worker .
ARG BUILDER_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

FROM ${BUILDER_IMAGE} AS build
ARG PINFER_BUILD=source
ARG PINFER_CUDA=1
COPY . /src
RUN PINFER_CUDA="$PINFER_CUDA" /src/deploy/docker/build.sh "$PINFER_BUILD" /opt/pinfer \
      pinfer-gpu-worker pinfer-health-probe

FROM ${RUNTIME_IMAGE}
RUN groupadd --system --gid 10001 pinfer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pinfer
COPY --from=build /opt/pinfer/ /opt/pinfer/
# /usr/local/nvidia/* is where the NVIDIA container toolkit may mount the driver libraries.
ENV LD_LIBRARY_PATH=/opt/pinfer/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
    PATH=/opt/pinfer/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 50052 9401
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["pinfer-health-probe", "--addr", "127.0.0.1:50052", "--timeout", "4"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pinfer-gpu-worker"]
CMD ["--model", "/models/relu-llama-tiny", "--listen", "0.0.0.0:50052", "--metrics-port", "9401", \
     "--segment", "/pinfer-activations"]
