// The exchange with the cold side (the cpu-worker, through the ColdFfn callback): after a layer
// publishes its FFN input, FinishCold waits for it, hands the cold list to the callback and
// brings the contribution back (copied up, read in place, or summed on the GPU from the callback's
// partial sums), or signals the already queued next layer. Beside it: the next layer's cold-row
// guess, made on a high-priority stream and handed to the cpu-worker ahead of time (Ahead) and
// scored against the actual list, and prompt batches whose cold rows are streamed over PCIe to
// the GPU instead (ColdPath::kStream). Kept apart from the step because this is where the host
// waits, and every microsecond here is on the critical path of a decode token.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu-worker/cuda/backend_internal.h"
#include "gpu-worker/cuda/cold_stream.h"
#include "gpu-worker/cuda/gemm.h"
#include "gpu-worker/cuda/kernels.h"
#include "shared/util/half.h"

namespace pinfer {
namespace cuda {

BackendStatus CudaBackend::EnqueueColdWait(int l, const float* exchange_out, int n) {
  if (ColdParts(exchange_out, n)) {
    // The signal's value is the callback's part count (FinishCold).
    CUDA_RETURN_IF_ERROR(WaitHostFlag(cold_ready_ + l, stream_, parts_count_dev_));
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_signal_[l]));
    CUDA_RETURN_IF_ERROR(
        SumParts(exchange_out, dims_.hidden, parts_count_dev_, 0, cold_in_, stream_));
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(WaitHostFlag(cold_ready_ + l, stream_));
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_signal_[l]));
  const float* in = ColdInput(exchange_out, n);
  if (in != exchange_out) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(cold_in_, exchange_out,
                                         static_cast<size_t>(n) * dims_.hidden * 4,
                                         cudaMemcpyHostToDevice, stream_));
  }
  return Ok();
}

BackendStatus CudaBackend::EnqueueGuessChain(int l, const ForwardArgs& a) {
  const DeviceLayer& L = layers_[l];
  const int F = dims_.ffn;
  const int n_cold = static_cast<int>(L.cold_ids_host.size());
  const int rank = static_cast<int>(L.fc1.rows);
  CUDA_RETURN_IF_ERROR(
      MatVecRows(L.fc1, nullptr, rank, nullptr, guess_x_, 1, guess_h_, rank, guess_stream_));
  CUDA_RETURN_IF_ERROR(Relu(guess_h_, rank, guess_stream_));
  CUDA_RETURN_IF_ERROR(MatVecRows(L.fc2, nullptr, F, nullptr, guess_h_, 1, guess_scores_, F,
                                  guess_stream_));  // [ffn]
  CUDA_RETURN_IF_ERROR(CompactActive(
      guess_scores_, 1, F, UsesCache(L, a) ? L.cold_map_c : L.cold_ids, n_cold, L.pred_cut,
      guess_list_ + 1, guess_list_, guess_stream_, nullptr, guess_shift_ + l,
      /*mark_unshifted=*/true));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(guess_host_ + static_cast<size_t>(l) * (F + 1), guess_list_,
                                       (static_cast<size_t>(n_cold) + 1) * 4,
                                       cudaMemcpyDeviceToHost, guess_stream_));
  CUDA_RETURN_IF_ERROR(RecordEvent(ev_guess_[l], guess_stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_gjoin_, guess_stream_));
  return Ok();
}

int CudaBackend::TakeGuess(int l) {
  const DeviceLayer& L = layers_[l];
  const int32_t* slot = guess_host_ + static_cast<size_t>(l) * (dims_.ffn + 1);
  const int count = std::clamp(slot[0], 0, static_cast<int>(L.cold_ids_host.size()));
  if (++guess_epoch_ == 0) {  // wrapped: old marks could read as current
    std::fill(guess_mark_.begin(), guess_mark_.end(), 0);
    guess_epoch_ = 1;
  }
  guess_ids_.resize(count);
  guess_first_.resize(count);
  for (int i = 0; i < count; ++i) {
    const uint32_t entry = static_cast<uint32_t>(slot[1 + i]);
    const int32_t id = L.cold_ids_host[entry & ~kAboveBit];
    guess_ids_[i] = id;
    guess_mark_[id] = guess_epoch_;
    guess_first_[i] = (entry & kAboveBit) != 0;
    stats_.guess_first += guess_first_[i];
  }
  guess_layer_ = l;
  stats_.guess_rows += count;
  return count;
}

void CudaBackend::ScoreGuess(int l, const int32_t* actual, int count, bool adapt) {
  guess_layer_ = -1;
  int hits = 0;
  for (int i = 0; i < count; ++i) hits += guess_mark_[actual[i]] == guess_epoch_;
  stats_.guess_hits += hits;
  stats_.guess_actual += count;
  if (!adapt || count == 0) return;
  // Stochastic quantile tracking: a missed neuron raises the cut's shift by kEta * recall, a held
  // one lowers it by kEta * (1 - recall), so it rests where the guess holds `recall` of the list.
  constexpr double kEta = 0.1, kMaxShift = 30;
  const double r = guess_recall_, miss = static_cast<double>(count - hits) / count;
  const double step = kEta * (miss * r - (1 - miss) * (1 - r));
  guess_shift_[l] = static_cast<float>(std::clamp(guess_shift_[l] + step, -kMaxShift, kMaxShift));
}

BackendStatus CudaBackend::FinishCold(int l, const ForwardArgs& a, float* exchange_x,
                                      float* exchange_out, int32_t* exchange_active, bool signal) {
  // The cold side runs while the GPU works on the hot rows.
  const DeviceLayer& L = layers_[l];
  const int n = a.n;
  const int64_t nh = static_cast<int64_t>(n) * dims_.hidden;
  const FfnMode mode = EffectiveMode(a);
  double t0 = Now();
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev_x_[l]));
  double t1 = Now();
  stats_.wait_for_x += t1 - t0;
  ColdRequest req;
  req.layer = l;
  req.n = n;
  req.x = exchange_x;
  req.out = exchange_out;
  const bool parts_mode = ColdParts(exchange_out, n);
  int parts = 0;
  if (parts_mode) {
    req.max_parts = kMaxColdParts;
    req.parts = &parts;
  }
  // With cold_gpu_share the GPU has taken the first GpuShare(count) neurons of the list.
  const bool shared = SharesCold(L, a);
  if (mode == FfnMode::kPredicted) {
    const int count = counts_host_[2 * l + 1];
    for (int i = 0; i < count; ++i) exchange_active[i] = L.cold_ids_host[cold_idx_host_[i]];
    if (ObservesActive(a)) (*a.active_out)[l].assign(exchange_active, exchange_active + count);
    if (guess_layer_ == l) ScoreGuess(l, exchange_active, count, guess_recall_ > 0);
    const int n_gpu = shared ? GpuShare(count) : 0;
    req.active = exchange_active + n_gpu;
    req.n_active = count - n_gpu;
    stats_.cold_rows_gpu += n_gpu;
  } else if (mode == FfnMode::kGiven) {
    const std::vector<int32_t>& g = (*a.given_cold)[l];
    // Given lists are not the predictors' choice: the guess is scored, its shift kept.
    if (guess_layer_ == l) ScoreGuess(l, g.data(), static_cast<int>(g.size()), false);
    const int n_gpu = shared ? GpuShare(static_cast<int>(g.size())) : 0;
    req.active = g.data() + n_gpu;
    req.n_active = static_cast<int>(g.size()) - n_gpu;
    stats_.cold_rows_gpu += n_gpu;
  }
  stats_.cold_rows_requested += req.n_active;
  BackendStatus st = a.cold->Run(req);
  stats_.cold_callback += Now() - t1;
  if (!st.ok()) return st;
  if (parts < 0 || parts > kMaxColdParts) {
    return Error(Code::kInternal, "cold side reported " + std::to_string(parts) +
                                      " partial sums; at most " + std::to_string(kMaxColdParts));
  }
  const int count = std::max(parts, 1);  // 0: the callback wrote the sum (one part)
  if (shared) {
    const cudaError_t q = cudaEventQuery(ev_share_[l]);
    if (q == cudaSuccess) {
      ++gpu_first_;
    } else if (q == cudaErrorNotReady) {
      ++cpu_first_;
    } else {
      CUDA_RETURN_IF_ERROR(q);
    }
  }
  if (signal) {
    // The callback's writes to exchange_out happen before the flag (release), and the GPU reads
    // them only after it sees the flag. The flag carries the part count (1 without parts).
    __atomic_store_n(cold_ready_ + l, count, __ATOMIC_RELEASE);
    return Ok();
  }
  if (parts_mode) {
    CUDA_RETURN_IF_ERROR(SumParts(exchange_out, dims_.hidden, nullptr, count, cold_in_, stream_));
    pending2_ = cold_in_;
    return Ok();
  }
  // A single token's cold contribution (one row) may be read by the next kernel straight from
  // the pinned exchange buffer over PCIe (zero-copy); batches are copied up first.
  if (ColdInput(exchange_out, n) == exchange_out) {
    pending2_ = exchange_out;
    return Ok();
  }
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(cold_in_, exchange_out, nh * 4, cudaMemcpyHostToDevice, stream_));
  pending2_ = cold_in_;
  return Ok();
}

// Whether kernels can read this pinned host pointer as it is (mapped, same address).
bool CudaBackend::DeviceReadable(const void* p) {
  if (p == readable_ptr_) return true;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer != p) return false;
  readable_ptr_ = p;
  return true;
}

// Streamed cold rows (ColdPath::kStream): the pinned copies, the slots and the per-layer call.
BackendStatus CudaBackend::SetUpStreaming(const ModelUpload& m, bool slots) {
  streamer_ = std::make_unique<ColdStreamer>();
  size_t max_rb = 0;
  for (int l = 0; l < dims_.n_layers; ++l) {
    const LayerUpload& u = m.layers[l];
    DeviceLayer& d = layers_[l];
    if (d.ffn != FfnPlacement::kHot || d.cold_ids_host.empty()) continue;
    // down_t may have a type of its own (a K mix's more-bits layers), gate and up may not: the
    // two are read as one pair of products over the same chunk.
    if (u.gate.type != u.up.type || u.down_t.empty()) {
      return Error(Code::kInvalidArgument, "layer " + std::to_string(l) +
                                               ": streamed cold rows need gate and up of one "
                                               "type and down_t");
    }
    const WType type = static_cast<WType>(u.gate.type),
                down_type = static_cast<WType>(u.down_t.type);
    if (allocate_only_) {
      // Host memory only: the shape sizes the slots, no row is copied.
      d.cold_rows = ColdRows{type, static_cast<int64_t>(d.cold_ids_host.size()), dims_.hidden};
      d.cold_rows.down_type = down_type;
    } else {
      CUDA_RETURN_IF_ERROR(streamer_->PinRows(type, down_type, dims_.hidden, u.gate.data, u.up.data,
                                              u.down_t.data, d.cold_ids_host, &d.cold_rows));
    }
    max_rb = std::max(max_rb, d.cold_rows.max_row_bytes());
  }
  if (max_rb == 0) return Ok();  // no cold rows anywhere
  const int chunk = std::min(std::max(1, m.stream_chunk_rows), dims_.ffn);
  size_t bytes = 0;
  cudaError_t e = streamer_->Init(chunk, slots ? std::max(1, m.stream_slots) : 0, max_rb, &bytes);
  device_bytes_ += bytes;
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Error(Code::kResourceExhausted, "streaming slots of " + std::to_string(bytes) +
                                               " bytes: " + cudaGetErrorString(e));
  }
  return Ok();
}

bool CudaBackend::StreamsLayer(int l, const ForwardArgs& a) const {
  if (streamer_ == nullptr || !streamer_->has_slots() || a.n <= kSmallBatch) return false;
  const DeviceLayer& L = layers_[l];
  if (L.ffn != FfnPlacement::kHot || L.cold_rows.rows == 0) return false;
  const ColdPath path = a.cold_paths != nullptr && static_cast<int>(a.cold_paths->size()) > l
                            ? (*a.cold_paths)[l]
                            : a.cold_path;
  return path == ColdPath::kStream;
}

BackendStatus CudaBackend::StreamCold(int l, int n) {
  const DeviceLayer& L = layers_[l];
  StreamTarget t;
  t.x = xb_;
  t.n = n;
  t.out = hot_out_;
  t.gate = gate_;
  t.up = up_;
  t.act = static_cast<ActKind>(dims_.activation);
  const int rc = streamer_->Run(cublas_, L.cold_rows, t, gemm_, stream_);
  if (rc != 0)
    return Error(Code::kInternal, std::string("streamed cold rows: ") + GemmErrorString(rc));
  stats_.streamed_layers += 1;
  stats_.streamed_bytes += static_cast<double>(L.cold_rows.bytes());
  return Ok();
}

BackendStatus CudaBackend::CalibrateStreaming(int layer, int n, StreamCalibration* out) {
  if (allocate_only_) return AllocateOnlyError();
  if (streamer_ == nullptr || !streamer_->has_slots()) {
    return Error(Code::kFailedPrecondition, "the backend was created without stream_cold");
  }
  if (layer < 0 || layer >= dims_.n_layers || layers_[layer].cold_rows.rows == 0) {
    return Error(Code::kInvalidArgument, "layer " + std::to_string(layer) + " has no cold rows");
  }
  if (n <= kSmallBatch || n > max_batch_) {
    return Error(Code::kInvalidArgument, "streaming needs " + std::to_string(kSmallBatch + 1) +
                                             ".." + std::to_string(max_batch_) + " tokens");
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const ColdRows& rows = layers_[layer].cold_rows;
  // A non-zero FFN input (zeros can run faster than real data).
  std::vector<float> x(static_cast<size_t>(n) * dims_.hidden);
  uint32_t s = 12345;
  for (float& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(s >> 8) % 2001 - 1000) * 1e-3f;
  }
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(xb_, x.data(), x.size() * 4, cudaMemcpyHostToDevice, stream_));
  StreamTarget t;
  t.x = xb_;
  t.n = n;
  t.out = hot_out_;
  t.gate = gate_;
  t.up = up_;
  t.act = static_cast<ActKind>(dims_.activation);
  StreamCalibration c;
  c.n = n;
  c.rows = rows.rows;
  c.bytes = static_cast<double>(rows.bytes());
  c.flops = 2.0 * n * rows.rows * 3.0 * dims_.hidden;
  const int rc = streamer_->Calibrate(cublas_, rows, t, gemm_, stream_, &c.copy_s, &c.compute_s,
                                      &c.overlapped_s);
  if (rc != 0) return Error(Code::kInternal, std::string("calibration: ") + GemmErrorString(rc));
  *out = c;
  return Ok();
}

}  // namespace cuda
}  // namespace pinfer
