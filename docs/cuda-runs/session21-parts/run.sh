#!/bin/bash
# Session 21, first call: 40e9f3f (each SparseFfnToken part quantizes x itself) had run only on
# the Debian machine. The same scripts as session20-parts on a bundle of eaf1645: the 13B shape with
# the cpu-worker's op (base) against the bench's equal shares (COLD_DEAL=static), then the whole
# service with the cpu-worker sleeping (--spin-us 0) and polling (default), then the cold side alone.
# Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
bash docs/cuda-runs/session20-dynamic/run.sh $out
bash docs/cuda-runs/session20-service/run.sh $out
