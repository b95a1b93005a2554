#!/bin/bash
# Why the cpu-worker's cold rows read at 32-41 GB/s where the CUDA bench's cold side reads the same
# kind of rows at 104 GB/s on a host of the same kind (issue 43, part 2; docs/benchmarks.md, "The
# product's layer exchange on the GPU host"). Runs, on the device, from the repository root with
# the service bundle unpacked as seventy_b_service_run.sh expects (.device/svc-slim.tar.xz):
#   0. the control: the CUDA bench's own cold op on this host (cuda_kernel_bench --sections=
#      bandwidths,pages,coldop on 12 layers of the 70B width), its CPU matrix-vector bandwidth and
#      scattered rows with 4 KiB and 2 MiB pages. Hosts of the kind differ (the 104 GB/s was
#      session 39's host, the 32-41 session 43's), so only figures of one call compare;
#   1. cold_rows_bench on a 12-layer file of the 70B width: the product's path, the partials left
#      unsummed (ways=parts) and every listed neuron's three rows (ways=silu), at 14, 8 and 1
#      threads, for a request of 442 listed neurons and one of 1100 (the service's size: it
#      computed 544-594 live neurons an exchange in session 43); the huge pages the store got;
#   2. the 70B service with its defaults, scraping the listed and computed cold neurons and the
#      GPU's share of them (--cold-gpu-share auto), then with that share off: the GPU's reads of
#      pinned host rows over PCIe take host memory bandwidth from the cpu-worker's own rows.
#
#   bench/cuda/device/cold_rows_run.sh OUT
set -u
out=$(realpath -m "${1:?output dir}") b=/tmp/s/svc
mkdir -p "$out" /tmp/s && { [ -d $b ] || tar -xJf .device/svc-slim.tar.xz -C /tmp/s; }
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|L3|NUMA node\(s\)"
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled); defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
( cb=/tmp/s/cudamod; export LD_LIBRARY_PATH=$cb/lib:$cb/bin:/usr/local/cuda/lib64
  echo "== cuda_kernel_bench control (the bench's cold op)"
  timeout 150 $cb/bin/cuda_kernel_bench --dtype=Q4_0 --sections=bandwidths,pages,coldop --layers=12 \
    --hidden=8192 --ffn=28672 --heads=64 --kv-heads=8 --threads=14 > "$out/kernel_bench_coldop.txt" 2>&1
  echo "rc=$?"; grep -vE "^matvec" "$out/kernel_bench_coldop.txt" | head -40 )
m=/tmp/cold-rows-12.gguf
LD_LIBRARY_PATH=$b/lib $b/bin/synthetic_pwri --out $m --vocab-gguf models/llama2-vocab/llama-2-tiny-random.gguf \
  --dtype q4_0 --rank 256 --layers 12 --hidden 8192 --ffn 28672 --heads 64 --kv-heads 8 2>&1 | tail -1
for n in 442 1100; do
  echo "== cold_rows_bench neurons=$n"
  LD_LIBRARY_PATH=$b/lib timeout 200 $b/bin/cold_rows_bench model=$m threads=14,8,1 layers=12 \
    requests=500 neurons=$n | tee "$out/cold_rows_$n.txt"
done
rm -f $m
g="--gpu-slots 2 --max-context 4096"
for run in "service:$g" "noshare:$g --cold-gpu-share off"; do
  name=${run%%:*}
  timeout 200 env REPEATS=3 GPU_FLAGS="${run#*:}" bench/cuda/device/seventy_b_service_run.sh \
    "$out/$name" > "$out/$name.log" 2>&1
  echo "== $name rc=$?"
  pkill -9 -f "pinfer-(gpu|cpu)-worker|pinfer-gateway"
  grep -E "^first token|^repeat|^peak|exchange_compute_seconds_(sum|count)|shm_wait_seconds_sum|neurons_(listed|computed)|cold_gpu_share" \
    "$out/$name/summary.txt"
  grep "cold rows:" "$out/$name/cpu-worker.log"
done
exit 0
