# The pinfer cpu-worker image: computes the cold FFN neurons' share of every layer, exchanging
# activations with its gpu-worker through a POSIX shared-memory segment, so it must share the
# gpu-worker's IPC namespace (compose: `ipc: service:gpu-worker`; Kubernetes: same Pod with an
# in-memory emptyDir on /dev/shm) and run as the same user (the segment is mode 0600). Control
# gRPC on 50053, /metrics on 9402.
#
# Multi-stage, non-root, base images as build arguments: see gateway.Dockerfile.
#
#   podman build -f deploy/docker/cpu-worker.Dockerfile -t pinfer/cpu-worker .
ARG BUILDER_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILDER_IMAGE} AS build
ARG PINFER_BUILD=source
COPY . /src
RUN /src/deploy/docker/build.sh "$PINFER_BUILD" /opt/pinfer pinfer-cpu-worker pinfer-health-probe

FROM ${RUNTIME_IMAGE}
RUN groupadd --system --gid 10001 pinfer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pinfer
COPY --from=build /opt/pinfer/lib/ /opt/pinfer/lib/
COPY --from=build /opt/pinfer/bin/pinfer-cpu-worker /opt/pinfer/bin/pinfer-health-probe /opt/pinfer/bin/
ENV LD_LIBRARY_PATH=/opt/pinfer/lib \
    PATH=/opt/pinfer/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 10001:10001
EXPOSE 50053 9402
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["pinfer-health-probe", "--addr", "127.0.0.1:50053", "--timeout", "4"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pinfer-cpu-worker"]
CMD ["--model", "/models/relu-llama-tiny", "--listen", "0.0.0.0:50053", "--metrics-port", "9402", \
     "--segment", "/pinfer-activations"]
