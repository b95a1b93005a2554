# The pinfer gateway image: serves the public gRPC API (pinfer.v1.Inference, health, reflection)
# on 50051 and /metrics on 9400, and routes requests to gpu-worker/cpu-worker pairs.
#
# Multi-stage: the build stage compiles (PINFER_BUILD=source, the default) or copies a bundle made
# from an existing build (PINFER_BUILD=prebuilt, see build.sh and bundle.sh); the runtime stage is
# slim Debian with the binary, its libraries and nothing else, running as an unprivileged user.
# The base images are build arguments so that machines without a registry can substitute their
# own (tests/deploy/container_e2e_test.py uses a debootstrapped Debian).
#
#   podman build -f deploy/docker/gateway.Dockerfile -t pinfer/gateway .
ARG BUILDER_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILDER_IMAGE} AS build
ARG PINFER_BUILD=source
COPY . /src
RUN /src/deploy/docker/build.sh "$PINFER_BUILD" /opt/pinfer pinfer-gateway pinfer-health-probe

FROM ${RUNTIME_IMAGE}
RUN groupadd --system --gid 10001 pinfer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pinfer
COPY --from=build /opt/pinfer/lib/ /opt/pinfer/lib/
COPY --from=build /opt/pinfer/bin/pinfer-gateway /opt/pinfer/bin/pinfer-health-probe /opt/pinfer/bin/
ENV LD_LIBRARY_PATH=/opt/pinfer/lib \
    PATH=/opt/pinfer/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 10001:10001
EXPOSE 50051 9400
# SERVING only while at least one worker pair is healthy (the gateway's health service).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["pinfer-health-probe", "--addr", "127.0.0.1:50051", "--timeout", "4"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pinfer-gateway"]
CMD ["--listen", "0.0.0.0:50051", "--metrics-port", "9400", \
     "--workers", "gpu-worker:50052"]
