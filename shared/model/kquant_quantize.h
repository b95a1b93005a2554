// ggml's reference quantizers for the K types (quantize_row_q4_K_ref, _q5_K_ref, _q6_K_ref in
// ggml-quants.c), so that `pinfer convert` writes the same blocks as llama.cpp's `quantize`
// without an importance matrix. The K blocks are not a plain min/max rounding: each sub-block's
// scale (and min) comes from a small search that lowers the weighted rounding error, and the
// bytes llama.cpp writes are what its users compare against.
#ifndef PINFER_SHARED_MODEL_KQUANT_QUANTIZE_H_
#define PINFER_SHARED_MODEL_KQUANT_QUANTIZE_H_

#include <cstdint>

#include "shared/model/tensor.h"

namespace pinfer {

// `n` values (a multiple of 256) into n / 256 blocks.
void QuantizeRowQ4K(const float* x, BlockQ4_K* y, int64_t n);
void QuantizeRowQ5K(const float* x, BlockQ5_K* y, int64_t n);
void QuantizeRowQ6K(const float* x, BlockQ6_K* y, int64_t n);

}  // namespace pinfer

#endif  // PINFER_SHARED_MODEL_KQUANT_QUANTIZE_H_
