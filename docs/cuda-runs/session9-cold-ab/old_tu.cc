// Compiled with -Dpinfer=pinfer_orig against the original sources: the original SimdOps.
#include <cstdlib>

#include "shared/engine/ops.h"
#include "shared/engine/row_kernels.h"
void* OrigMakeOps() {
  return getenv("AVX2") ? pinfer::NewSimdOpsWithKernels(nullptr, pinfer::RowKernelsAvx2()).release()
                        : pinfer::NewSimdOps(nullptr).release();
}
const char* OrigName(void* ops) { return static_cast<pinfer::CpuOps*>(ops)->name().data(); }
int OrigSparse(void* ops, const void* gate, const void* up, const void* down_t, const int32_t* rows,
               int n, const float* x, float* a, float* out) {
  return static_cast<pinfer::CpuOps*>(ops)->SparseFfnToken(
      *static_cast<const pinfer::TensorView*>(gate), *static_cast<const pinfer::TensorView*>(up),
      *static_cast<const pinfer::TensorView*>(down_t), rows, n, pinfer::Activation::kSilu, x,
      nullptr, a, out);
}
