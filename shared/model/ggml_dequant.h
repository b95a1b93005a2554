// Reading GGUF tensors whose ggml type the engine does not compute with.
//
// The kernels compute with F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K (PowerInfer's Q6_K
// output head included). Files made by llama.cpp-era tools carry a few more types in places where
// pinfer still has to load them: PowerInfer's `quantize` stores the predictors fc1/fc2 as Q5_0
// (every file type but Q4_0), and its other file types store weights as Q4_1/Q5_0/Q5_1. Such
// tensors are dequantized once at load into F32 memory the model owns: exact (the values ggml
// itself computes with), at four bytes a weight.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shared/model/gguf.h"
#include "shared/model/tensor.h"

namespace pinfer {

// True for the ggml types DequantizeGgmlRow handles beyond the engine dtypes (Q4_1, Q5_0, Q5_1).
bool IsDequantizableGgmlType(uint32_t type);

// Dequantizes `n` values (a whole number of the type's blocks) of ggml type `type` at `src`,
// following ggml's dequantize_row_* for that type. Engine dtypes work too.
absl::Status DequantizeGgmlRow(uint32_t type, const void* src, float* dst, int64_t n);

// Quantizes `n` fp32 values (a whole number of blocks) to ggml type `type`, following ggml's
// quantize_row_*_ref: the engine dtypes through QuantizeRow, and Q5_0 / Q5_1, which llama.cpp's
// K mixes use for rows that are not whole 256-value super-blocks. Other types: InvalidArgument.
absl::Status QuantizeGgmlRow(uint32_t type, const float* src, void* dst, int64_t n);

// The tensor `name` as the engine can compute with it: a view into the mapping for engine dtypes,
// else (dequantizable types) an F32 copy appended to `owned`. Other types: InvalidArgument.
absl::StatusOr<TensorView> GgufTensorForEngine(
    const GgufFile& f, const std::string& name,
    std::vector<std::shared_ptr<std::vector<uint8_t>>>* owned);

}  // namespace pinfer
