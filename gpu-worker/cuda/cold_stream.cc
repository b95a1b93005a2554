// Streamed cold rows: see cold_stream.h for why and how.
#include "gpu-worker/cuda/cold_stream.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "gpu-worker/cuda/gather_rows.h"
#include "shared/util/ranges_on_threads.h"

namespace pinfer {
namespace cuda {
namespace {

int CodeOf(cudaError_t e) { return e == cudaSuccess ? 0 : 1000 + static_cast<int>(e); }

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Threads for PinRows' copy: PINFER_CUDA_PIN_THREADS, else the machine's (at most 16).
int PinThreads() {
  if (const char* v = std::getenv("PINFER_CUDA_PIN_THREADS")) return std::max(1, std::atoi(v));
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
}

}  // namespace

ColdStreamer::~ColdStreamer() {
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  for (uint8_t* p : slots_) cudaFree(p);
  for (cudaEvent_t e : copied_) cudaEventDestroy(e);
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
  for (void* p : pinned_) cudaFreeHost(p);
  if (order_ != nullptr) cudaEventDestroy(order_);
  if (stage_host_ != nullptr) cudaFreeHost(stage_host_);
  if (stage_dev_ != nullptr) cudaFree(stage_dev_);
  if (gathered_ != nullptr) cudaFree(gathered_);
  if (loaded_ != nullptr) cudaEventDestroy(loaded_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
}

cudaError_t ColdStreamer::Init(int chunk_rows, int slots, size_t max_row_bytes,
                               size_t* device_bytes) {
  chunk_rows_ = std::max(1, chunk_rows);
  slot_part_bytes_ = static_cast<size_t>(chunk_rows_) * max_row_bytes;
  *device_bytes = 0;
  cudaError_t e0 = cudaEventCreateWithFlags(&order_, cudaEventDisableTiming);
  if (e0 == cudaSuccess) e0 = cudaEventCreateWithFlags(&loaded_, cudaEventDisableTiming);
  if (e0 != cudaSuccess) return e0;
  for (int s = 0; s < slots; ++s) {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, 3 * slot_part_bytes_);
    if (e != cudaSuccess) return e;
    slots_.push_back(static_cast<uint8_t*>(p));
    *device_bytes += 3 * slot_part_bytes_;
    cudaEvent_t a = nullptr, b = nullptr;
    if ((e = cudaEventCreateWithFlags(&a, cudaEventDisableTiming)) != cudaSuccess) return e;
    copied_.push_back(a);
    if ((e = cudaEventCreateWithFlags(&b, cudaEventDisableTiming)) != cudaSuccess) return e;
    free_.push_back(b);
  }
  return cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking);
}

cudaError_t ColdStreamer::PinRows(WType type, WType down_type, int64_t cols, const void* gate,
                                  const void* up, const void* down_t,
                                  const std::vector<int32_t>& ids, ColdRows* out) {
  ColdRows r;
  r.type = type;
  r.down_type = down_type;
  r.cols = cols;
  r.rows = static_cast<int64_t>(ids.size());
  // gate's rows, then up's (as many bytes), then down_t's.
  const size_t part = r.row_bytes() * ids.size(), total = r.bytes();
  if (ids.empty()) {
    *out = r;
    return cudaSuccess;
  }
  void* p = nullptr;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  // Pinned (page-locked) so that cudaMemcpyAsync is a real DMA overlapped with compute.
  cudaError_t e = cudaMallocHost(&p, total);
  if (e != cudaSuccess) return e;
  pinned_.push_back(p);
  const Clock::time_point t1 = Clock::now();
  uint8_t* dst = static_cast<uint8_t*>(p);
  const void* src[3] = {gate, up, down_t};
  // The sources are the model's file mapping, whose page faults held one thread near 1 GB/s (the
  // cpu-worker's copy of the same 19.7 GB of a 70B's rows took 18 s); threads take them in
  // parallel, each its range of the rows of all three matrices.
  auto copy = [&](size_t i0, size_t i1) {
    for (int m = 0; m < 3; ++m) {
      const size_t rb = r.row_bytes_of(m);
      for (size_t i = i0; i < i1; ++i) {
        std::memcpy(dst + m * part + i * rb, static_cast<const uint8_t*>(src[m]) + ids[i] * rb, rb);
      }
    }
  };
  // (From 256 rows: the backend tests' tiny model, 768 cold rows a layer, takes this path too.)
  RunRangesOnThreads(ids.size(), ids.size() >= 256 ? PinThreads() : 1, copy);
  pin_alloc_s_ += std::chrono::duration<double>(t1 - t0).count();
  pin_copy_s_ += std::chrono::duration<double>(Clock::now() - t1).count();
  pinned_bytes_ += total;
  r.gate = dst;
  r.up = dst + part;
  r.down_t = dst + 2 * part;
  *out = r;
  return cudaSuccess;
}

cudaError_t ColdStreamer::Copy(const ColdRows& rows, int64_t r0, int64_t count, uint8_t* slot) {
  const uint8_t* src[3] = {rows.gate, rows.up, rows.down_t};
  for (int m = 0; m < 3; ++m) {
    const size_t rb = rows.row_bytes_of(m);
    cudaError_t e = cudaMemcpyAsync(slot + m * slot_part_bytes_, src[m] + r0 * rb, count * rb,
                                    cudaMemcpyHostToDevice, copy_stream_);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

int ColdStreamer::Products(cublasHandle_t h, const ColdRows& rows, int64_t r0, int64_t count,
                           uint8_t* slot, const StreamTarget& t, const GemmScratch& scratch,
                           cudaStream_t stream) {
  (void)r0;
  const int c = static_cast<int>(count);
  const DeviceMatrix gate{rows.type, count, rows.cols, slot};
  const DeviceMatrix up{rows.type, count, rows.cols, slot + slot_part_bytes_};
  const DeviceMatrix down_t{rows.down_type, count, rows.cols, slot + 2 * slot_part_bytes_};
  int rc = GemmXWt(h, gate, t.x, t.n, t.gate, c, 0.f, scratch, stream);  // [n, c]
  if (rc == 0) rc = GemmXWt(h, up, t.x, t.n, t.up, c, 0.f, scratch, stream);
  if (rc == 0) {
    rc = CodeOf(GatedActivation(t.act, t.gate, t.up, static_cast<int64_t>(t.n) * c, stream));
  }
  // out: [n, cols] += act: [n, c] @ down_t rows
  if (rc == 0) rc = GemmAW(h, down_t, t.gate, c, t.n, t.out, 1.f, scratch, stream);
  return rc;
}

int ColdStreamer::Run(cublasHandle_t h, const ColdRows& rows, const StreamTarget& t,
                      const GemmScratch& scratch, cudaStream_t stream) {
  if (!ready()) return CodeOf(cudaErrorNotReady);
  if (rows.max_row_bytes() * chunk_rows_ > slot_part_bytes_) return CodeOf(cudaErrorInvalidValue);
  for (int64_t r0 = 0; r0 < rows.rows; r0 += chunk_rows_) {
    const int64_t count = std::min<int64_t>(chunk_rows_, rows.rows - r0);
    const int s = next_;
    next_ = (next_ + 1) % static_cast<int>(slots_.size());
    // The slot's previous products must be done before it is overwritten.
    cudaError_t e = cudaStreamWaitEvent(copy_stream_, free_[s], 0);
    if (e == cudaSuccess) e = Copy(rows, r0, count, slots_[s]);
    if (e == cudaSuccess) e = cudaEventRecord(copied_[s], copy_stream_);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, copied_[s], 0);
    if (e != cudaSuccess) return CodeOf(e);
    const int rc = Products(h, rows, r0, count, slots_[s], t, scratch, stream);
    if (rc != 0) return rc;
    e = cudaEventRecord(free_[s], stream);
    if (e != cudaSuccess) return CodeOf(e);
  }
  return 0;
}

cudaError_t ColdStreamer::LoadRows(const ColdRows& rows, const std::vector<int64_t>& cold_index,
                                   const std::vector<int32_t>& slots, int64_t row0,
                                   const DeviceMatrix dst[3], cudaStream_t after) {
  if (!ready()) return cudaErrorNotReady;
  if (slots.empty()) return cudaSuccess;
  const bool split = dst[0].split();
  for (int m = 0; m < 3; ++m) {
    if (dst[m].split() != split || dst[m].type != rows.type_of(m) ||
        dst[m].row_bytes() != rows.row_bytes_of(m)) {
      return cudaErrorInvalidValue;
    }
  }
  const size_t n = slots.size();
  // Split destinations take two index arrays: the gather's (row i of the gathered buffer) and
  // the repack's (row row0 + slots[i] of the matrix).
  const size_t per_row = split ? 4 : 2;
  // The index pairs of the loads in flight share one pinned staging area, reused from the start
  // once they have all landed (or after waiting for them when it is full). So does the gathered
  // buffer, which only grows once they have landed.
  bool landed = false;
  cudaError_t e = RowsLanded(/*wait=*/false, &landed);
  if (e != cudaSuccess) return e;
  if (landed) stage_used_ = 0;
  size_t need = stage_used_ + per_row * n;
  const size_t gathered = split ? n * (2 * rows.row_bytes() + rows.down_row_bytes()) : 0;
  if ((need > stage_capacity_ || gathered > gathered_bytes_) && !landed) {
    if ((e = RowsLanded(/*wait=*/true, &landed)) != cudaSuccess) return e;
    stage_used_ = 0;
    need = per_row * n;
  }
  if (need > stage_capacity_) {
    if (stage_host_ != nullptr) cudaFreeHost(stage_host_);
    if (stage_dev_ != nullptr) cudaFree(stage_dev_);
    stage_host_ = nullptr;
    stage_dev_ = nullptr;
    stage_capacity_ = std::max<size_t>(need, 1 << 16);
    e = cudaMallocHost(&stage_host_, stage_capacity_ * sizeof(int64_t));
    if (e == cudaSuccess) e = cudaMalloc(&stage_dev_, stage_capacity_ * sizeof(int64_t));
    if (e != cudaSuccess) return e;
  }
  if (gathered > gathered_bytes_) {
    if (gathered_ != nullptr) cudaFree(gathered_);
    gathered_ = nullptr;
    gathered_bytes_ = 0;
    e = cudaMalloc(reinterpret_cast<void**>(&gathered_), gathered);
    if (e != cudaSuccess) return e;
    gathered_bytes_ = gathered;
  }
  int64_t* host = static_cast<int64_t*>(stage_host_) + stage_used_;
  int64_t* dev = static_cast<int64_t*>(stage_dev_) + stage_used_;
  for (size_t i = 0; i < n; ++i) {
    host[2 * i] = cold_index[i];
    host[2 * i + 1] = split ? static_cast<int64_t>(i) : row0 + slots[i];
    if (split) host[2 * (n + i) + 1] = row0 + slots[i];
  }
  stage_used_ = need;
  const uint8_t* src[3] = {rows.gate, rows.up, rows.down_t};
  const uint8_t* src_dev[3];
  for (int m = 0; m < 3; ++m) {
    void* p = nullptr;
    e = cudaHostGetDevicePointer(&p, const_cast<uint8_t*>(src[m]), 0);
    if (e != cudaSuccess) return e;
    src_dev[m] = static_cast<const uint8_t*>(p);
  }
  uint8_t* into[3];
  for (int m = 0; m < 3; ++m) {  // gathered: gate's n rows, up's, down_t's (gate's and up's alike)
    into[m] = split ? gathered_ + m * n * rows.row_bytes()
                    : static_cast<uint8_t*>(const_cast<void*>(dst[m].data));
  }
  const size_t row_bytes[3] = {rows.row_bytes_of(0), rows.row_bytes_of(1), rows.row_bytes_of(2)};
  e = cudaEventRecord(order_, after);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(copy_stream_, order_, 0);
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(dev, host, per_row * n * sizeof(int64_t), cudaMemcpyHostToDevice,
                        copy_stream_);
  }
  if (e == cudaSuccess) {
    e = GatherRows(src_dev, dev, static_cast<int>(n), row_bytes, into, copy_stream_);
  }
  for (int m = 0; m < 3 && split && e == cudaSuccess; ++m) {
    DeviceMatrix from{rows.type_of(m), static_cast<int64_t>(n), rows.cols, into[m]};
    e = RepackSplitRows(from, dst[m], dev + 2 * n, copy_stream_);
  }
  if (e == cudaSuccess) e = cudaEventRecord(loaded_, copy_stream_);
  if (e == cudaSuccess) load_pending_ = true;
  return e;
}

cudaError_t ColdStreamer::RowsLanded(bool wait, bool* landed) {
  *landed = true;
  if (!load_pending_) return cudaSuccess;
  cudaError_t e = wait ? cudaEventSynchronize(loaded_) : cudaEventQuery(loaded_);
  if (e == cudaErrorNotReady) {
    *landed = false;
    return cudaSuccess;
  }
  if (e == cudaSuccess) load_pending_ = false;
  return e;
}

int ColdStreamer::Calibrate(cublasHandle_t h, const ColdRows& rows, const StreamTarget& t,
                            const GemmScratch& scratch, cudaStream_t stream, double* copy_s,
                            double* compute_s, double* overlapped_s) {
  if (!ready()) return CodeOf(cudaErrorNotReady);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaError_t e = cudaEventCreate(&e0);
  if (e == cudaSuccess) e = cudaEventCreate(&e1);
  if (e != cudaSuccess) return CodeOf(e);
  int rc = 0;
  // Second of two repetitions of each part, so that cuBLAS's first-call set-up is not counted.
  for (int rep = 0; rep < 2 && rc == 0; ++rep) {
    // Copies alone.
    e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = cudaEventRecord(e0, copy_stream_);
    for (int64_t r0 = 0; r0 < rows.rows && e == cudaSuccess; r0 += chunk_rows_) {
      const int64_t count = std::min<int64_t>(chunk_rows_, rows.rows - r0);
      e = Copy(rows, r0, count, slots_[(r0 / chunk_rows_) % slots_.size()]);
    }
    if (e == cudaSuccess) e = cudaEventRecord(e1, copy_stream_);
    if (e == cudaSuccess) e = cudaEventSynchronize(e1);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    if (e != cudaSuccess) rc = CodeOf(e);
    *copy_s = ms * 1e-3;
    // Products alone, on rows already in slot 0 (same row count, same shapes).
    if (rc == 0) rc = CodeOf(cudaEventRecord(e0, stream));
    for (int64_t r0 = 0; r0 < rows.rows && rc == 0; r0 += chunk_rows_) {
      const int64_t count = std::min<int64_t>(chunk_rows_, rows.rows - r0);
      rc = Products(h, rows, r0, count, slots_[0], t, scratch, stream);
    }
    if (rc == 0) rc = CodeOf(cudaEventRecord(e1, stream));
    if (rc == 0) rc = CodeOf(cudaEventSynchronize(e1));
    if (rc == 0) rc = CodeOf(cudaEventElapsedTime(&ms, e0, e1));
    *compute_s = ms * 1e-3;
    // Both, as Forward runs them (host clock: includes the enqueueing).
    if (rc == 0) rc = CodeOf(cudaDeviceSynchronize());
    const double t0 = Now();
    if (rc == 0) rc = Run(h, rows, t, scratch, stream);
    if (rc == 0) rc = CodeOf(cudaStreamSynchronize(stream));
    *overlapped_s = Now() - t0;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return rc;
}

}  // namespace cuda
}  // namespace pinfer
