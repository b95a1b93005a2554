// Cold FFN rows streamed to the GPU for prompt batches (ColdPath::kStream in backend.h).
//
// For a batch of hundreds of tokens nearly every cold neuron is active for some token, and the
// CPU's cost grows with the tokens while streaming the rows costs the same for any batch: the
// rows cross PCIe once and the tensor cores finish the products long before the next chunk has
// arrived. So a ColdStreamer keeps each layer's cold rows (gate, up, down_t) in pinned host
// memory, compact and in cold-id order, and per layer copies them in chunks into a ring of device
// slots on its own copy stream while the compute stream multiplies the previous chunk through
// cuBLAS (gemm.h), accumulating into the FFN output. Events order each chunk's products after its
// copy and the next copy into a slot after the products that read it, so with two slots the copy
// engine never waits for the tensor cores unless the products are the slower part.
//
// Kept out of the backend's files (backend_*.cc) so that the backend only holds a ColdStreamer and
// calls Run.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"

namespace pinfer {
namespace cuda {

// One layer's cold rows in pinned host memory: three [rows, cols] matrices, gate and up of one
// type and down_t of its own (llama.cpp's K mixes give half of the layers' ffn_down more bits:
// Q6_K under Q4_K gate and up rows in Q4_K_M).
struct ColdRows {
  WType type = WType::kF32;  // gate's and up's
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down_t = nullptr;
  WType down_type = WType::kF32;
  size_t row_bytes() const { return WRowBytes(type, cols); }
  size_t down_row_bytes() const { return WRowBytes(down_type, cols); }
  // Matrix m's (0 gate, 1 up, 2 down_t).
  WType type_of(int m) const { return m == 2 ? down_type : type; }
  size_t row_bytes_of(int m) const { return m == 2 ? down_row_bytes() : row_bytes(); }
  size_t max_row_bytes() const {
    return row_bytes() > down_row_bytes() ? row_bytes() : down_row_bytes();
  }
  size_t bytes() const { return (2 * row_bytes() + down_row_bytes()) * static_cast<size_t>(rows); }
};

// What a streamed layer writes into: the FFN input and the output it adds to, plus scratch of
// at least [n, chunk_rows] floats each for the gate and up products.
struct StreamTarget {
  const float* x = nullptr;  // [n, cols] FFN input (device)
  int n = 0;
  float* out = nullptr;   // [n, cols] += the cold rows' contribution (device)
  float* gate = nullptr;  // scratch
  float* up = nullptr;    // scratch
  ActKind act = ActKind::kRelu;
};

class ColdStreamer {
 public:
  ColdStreamer() = default;
  ~ColdStreamer();
  ColdStreamer(const ColdStreamer&) = delete;
  ColdStreamer& operator=(const ColdStreamer&) = delete;

  // Allocates `slots` device buffers of chunk_rows neurons of max_row_bytes each (times three;
  // none for slots = 0, for cache loads only) and the copy stream. Returns the device bytes
  // allocated in *device_bytes.
  cudaError_t Init(int chunk_rows, int slots, size_t max_row_bytes, size_t* device_bytes);
  bool ready() const { return copy_stream_ != nullptr; }
  bool has_slots() const { return ready() && !slots_.empty(); }
  int chunk_rows() const { return chunk_rows_; }

  // Pinned host copy of rows `ids` of three host matrices (row-major): gate and up of `type`,
  // down_t of `down_type`. The memory stays owned by the streamer.
  cudaError_t PinRows(WType type, WType down_type, int64_t cols, const void* gate, const void* up,
                      const void* down_t, const std::vector<int32_t>& ids, ColdRows* out);
  // PinRows' totals so far: seconds in cudaMallocHost, seconds copying, bytes pinned.
  double pin_alloc_s() const { return pin_alloc_s_; }
  double pin_copy_s() const { return pin_copy_s_; }
  size_t pinned_bytes() const { return pinned_bytes_; }

  // Enqueues the copies and products of every chunk of `rows`; on `stream` afterwards the
  // contribution is in target.out. Returns 0 or a GemmXWt/GemmAW code (cudaError_t + 1000 for
  // CUDA errors, as gemm.h).
  int Run(cublasHandle_t h, const ColdRows& rows, const StreamTarget& target,
          const GemmScratch& scratch, cudaStream_t stream);

  // Adaptive cache loads: rows cold_index[i] of `rows` into row row0 + slots[i] of the three
  // device matrices dst (gate, up, down_t), gathered by one kernel straight from the pinned rows
  // (gather_rows.h), on the copy stream after the work queued on `after` so far. Matrices in the
  // split layout (Q8_0 / Q4_0, DeviceMatrix::split) get the rows gathered into a device buffer
  // first and rewritten into their slots from there (RepackSplitRows). RowsLanded reports (or
  // waits for) the last load's completion. Loads of several layers can be queued back to back;
  // they share one index staging area until RowsLanded says they have landed.
  cudaError_t LoadRows(const ColdRows& rows, const std::vector<int64_t>& cold_index,
                       const std::vector<int32_t>& slots, int64_t row0, const DeviceMatrix dst[3],
                       cudaStream_t after);
  cudaError_t RowsLanded(bool wait, bool* landed);

  // Timings of the parts for the cost model: the copies alone, the products alone on slot 0 (the
  // same row count), and Run itself. Uses target's buffers; leaves garbage in target.out.
  int Calibrate(cublasHandle_t h, const ColdRows& rows, const StreamTarget& target,
                const GemmScratch& scratch, cudaStream_t stream, double* copy_s, double* compute_s,
                double* overlapped_s);

 private:
  int Products(cublasHandle_t h, const ColdRows& rows, int64_t r0, int64_t count, uint8_t* slot,
               const StreamTarget& target, const GemmScratch& scratch, cudaStream_t stream);
  cudaError_t Copy(const ColdRows& rows, int64_t r0, int64_t count, uint8_t* slot);

  int chunk_rows_ = 0;
  size_t slot_part_bytes_ = 0;  // one matrix's share of a slot
  std::vector<uint8_t*> slots_;
  std::vector<cudaEvent_t> copied_, free_;
  int next_ = 0;
  cudaStream_t copy_stream_ = nullptr;
  std::vector<void*> pinned_;
  double pin_alloc_s_ = 0, pin_copy_s_ = 0;
  size_t pinned_bytes_ = 0;
  cudaEvent_t order_ = nullptr, loaded_ = nullptr;
  bool load_pending_ = false;
  void* stage_host_ = nullptr;  // pinned [stage_capacity_] int64 index pairs of cache loads
  void* stage_dev_ = nullptr;
  size_t stage_capacity_ = 0, stage_used_ = 0;
  // Device [3][rows] of a load in GGUF's layout, for split destinations.
  uint8_t* gathered_ = nullptr;
  size_t gathered_bytes_ = 0;
};

}  // namespace cuda
}  // namespace pinfer
