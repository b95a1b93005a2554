# A Prometheus image for the containerised end-to-end test, which has no registry to pull the
# official prom/prometheus from: the test's debootstrapped Debian base plus the host's Debian
# Prometheus binary (Go, linked only against glibc). Same entrypoint, user and data directory as
# the official image, so deploy/compose's `command:` works with either.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY prometheus /bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown 65534:65534 /prometheus
USER 65534:65534
EXPOSE 9090
WORKDIR /prometheus
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
