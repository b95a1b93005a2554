set -e
O=/tmp/orig
F="-I$O -I/work/main -O3 -DNDEBUG -std=gnu++20 -Dpinfer=pinfer_orig -w"
A512="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c"
g++ $F -c $O/shared/engine/ops_simd.cc -o $O/o_ops.o &
g++ $F -c $O/shared/engine/kernels_scalar.cc -o $O/o_sc.o &
wait
g++ $F -mavx2 -mfma -mf16c -c $O/shared/engine/kernels_avx2.cc -o $O/o_avx2.o &
g++ $F $A512 -c $O/shared/engine/kernels_avx512.cc -o $O/o_avx512.o &
wait
g++ $F -c /work/main/shared/model/tensor.cc -o $O/o_tensor.o &
g++ $F -c /work/main/shared/util/thread_pool.cc -o $O/o_tp.o &
wait
