// The memory plan and upload (Create): checks a ModelUpload's shapes, copies each layer's weights
// to the device (whole matrices, or a hot placement's rows only, stacked where one product reads
// them), rewrites block formats into the split layout the row kernels read, and sizes the scratch,
// streams, events and pinned staging from the largest shapes. Lanes (NewLane) share the weights
// and the KV cache and get only their own scratch, so the same sizing code (AllocateScratch) runs
// for both. Everything here runs once, before the first step; Release undoes it.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
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

namespace {

size_t HostRowBytes(HostType t, int64_t cols) { return WRowBytes(static_cast<WType>(t), cols); }

// fp32 copy of a small host vector (norm weights).
bool HostToFloat(const HostMatrix& m, std::vector<float>* out) {
  const int64_t n = m.rows * m.cols;
  out->resize(n);
  const auto* u16 = static_cast<const uint16_t*>(m.data);
  switch (m.type) {
    case HostType::kF32:
      std::memcpy(out->data(), m.data, n * 4);
      return true;
    case HostType::kF16:
      for (int64_t i = 0; i < n; ++i) (*out)[i] = pinfer::Fp16ToFp32(u16[i]);
      return true;
    case HostType::kBF16:
      for (int64_t i = 0; i < n; ++i) (*out)[i] = pinfer::Bf16ToFp32(u16[i]);
      return true;
    default:
      return false;
  }
}

}  // namespace

// Frees what Create, AllocateScratch and SetUpStreaming made (a lane: only its own).
void CudaBackend::Release() {
  if (device_name_.empty() && allocations_.empty()) return;
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (void* p : allocations_) cudaFree(p);
  for (void* p : host_allocations_) cudaFreeHost(p);
  if (repack_tmp_ != nullptr) cudaFree(repack_tmp_);
  repack_tmp_ = nullptr;
  allocations_.clear();
  host_allocations_.clear();
  streamer_.reset();
  for (auto* v : {&ev_x_, &ev_hot0_, &ev_hot1_, &ev_share_, &ev_attn0_, &ev_signal_}) {
    for (cudaEvent_t e : *v) cudaEventDestroy(e);
    v->clear();
  }
  if (ev_start_ != nullptr) cudaEventDestroy(ev_start_);
  if (ev_layers_end_ != nullptr) cudaEventDestroy(ev_layers_end_);
  for (cudaEvent_t e : ev_guess_) cudaEventDestroy(e);
  ev_guess_.clear();
  for (cudaEvent_t* e : {&ev_gfork_, &ev_gjoin_}) {
    if (*e != nullptr) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (guess_stream_ != nullptr) cudaStreamDestroy(guess_stream_);
  guess_stream_ = nullptr;
  if (ev_fork_ != nullptr) cudaEventDestroy(ev_fork_);
  if (ev_join_ != nullptr) cudaEventDestroy(ev_join_);
  if (publish_stream_ != nullptr) cudaStreamDestroy(publish_stream_);
  ev_fork_ = ev_join_ = nullptr;
  publish_stream_ = nullptr;
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cublas_ = nullptr;
}

// extra_rows: zeroed rows allocated after the uploaded ones (adaptive cache slots), not counted
// in out->rows.
BackendStatus CudaBackend::UploadMatrix(const HostMatrix& h, const std::vector<int32_t>* ids,
                                        const char* name, DeviceMatrix* out, int64_t extra_rows) {
  if (h.empty()) return Error(Code::kInvalidArgument, std::string("missing tensor ") + name);
  DeviceMatrix d;
  d.type = static_cast<WType>(h.type);
  d.cols = h.cols;
  d.rows = ids != nullptr ? static_cast<int64_t>(ids->size()) : h.rows;
  d.data = reinterpret_cast<const void*>(16);  // shape check only
  if (CheckMatrixShape(d) != cudaSuccess) {
    return Error(Code::kInvalidArgument, std::string(name) + ": " + std::to_string(h.cols) +
                                             " columns of type " + WTypeName(d.type) +
                                             " do not suit the GPU row kernels");
  }
  const size_t rb = HostRowBytes(h.type, h.cols);
  uint8_t* dev = nullptr;
  BACKEND_RETURN_IF_ERROR(Alloc(rb * (d.rows + extra_rows), &dev, /*weight=*/true));
  if (extra_rows > 0) CUDA_RETURN_IF_ERROR(cudaMemset(dev + rb * d.rows, 0, rb * extra_rows));
  if (allocate_only_) {
    // The bytes are what a real upload allocates; the split layout has the same size.
    d.data = dev;
    *out = d;
    return Ok();
  }
  if (ids == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpy(dev, h.data, rb * d.rows, cudaMemcpyHostToDevice));
  } else {
    // Gather the rows through a staging buffer, a few MB at a time.
    const size_t chunk_rows = std::max<size_t>(1, (64u << 20) / rb);
    std::vector<uint8_t> staging(std::min<size_t>(chunk_rows, d.rows) * rb);
    for (size_t r0 = 0; r0 < static_cast<size_t>(d.rows); r0 += chunk_rows) {
      const size_t nr = std::min<size_t>(chunk_rows, d.rows - r0);
      for (size_t i = 0; i < nr; ++i) {
        const int32_t id = (*ids)[r0 + i];
        if (id < 0 || id >= h.rows) {
          return Error(Code::kInvalidArgument,
                       std::string(name) + ": row id " + std::to_string(id) + " out of range");
        }
        std::memcpy(staging.data() + i * rb, static_cast<const uint8_t*>(h.data) + id * rb, rb);
      }
      CUDA_RETURN_IF_ERROR(
          cudaMemcpy(dev + r0 * rb, staging.data(), nr * rb, cudaMemcpyHostToDevice));
    }
  }
  d.data = dev;
  // Adaptive cache slots are loaded in GGUF's layout and rewritten into the split one
  // (ColdStreamer::LoadRows), so the slots take their share of the split layout too.
  BACKEND_RETURN_IF_ERROR(MaybeSplit(&d, extra_rows));
  *out = d;
  return Ok();
}

// The matrix is on the device in GGUF's layout: copy it aside and rewrite it in place as the
// split layout (same bytes), which the matrix-vector kernels read with aligned 16-byte loads.
// extra_rows: slots after the rows, in the same allocation, which get zeros in the split layout
// (the scales of all rows, slots included, go after all the quants).
BackendStatus CudaBackend::MaybeSplit(DeviceMatrix* d, int64_t extra_rows) {
  if (!repack_ || (d->type != WType::kQ8_0 && d->type != WType::kQ4_0) || d->rows == 0) {
    return Ok();
  }
  const size_t bytes = d->bytes();
  if (repack_tmp_bytes_ < bytes) {
    if (repack_tmp_ != nullptr) cudaFree(repack_tmp_);
    repack_tmp_ = nullptr;
    repack_tmp_bytes_ = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&repack_tmp_, bytes));
    repack_tmp_bytes_ = bytes;
  }
  // The rows were uploaded with cudaMemcpy from pageable memory, which may return before its
  // DMA lands, and stream_ (non-blocking) does not wait for the legacy stream: without this the
  // copy below read half-uploaded rows now and then (QuantizedModelStepLogitsMatchCpuReference).
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(repack_tmp_, d->data, bytes, cudaMemcpyDeviceToDevice, stream_));
  DeviceMatrix src = *d, dst = *d;
  src.data = repack_tmp_;
  const size_t qrb = QuantRowBytes(d->type, d->cols), srb = d->row_bytes() - qrb;
  auto* base = static_cast<uint8_t*>(const_cast<void*>(d->data));
  dst.scales = base + qrb * (d->rows + extra_rows);
  CUDA_RETURN_IF_ERROR(RepackSplit(src, dst, 0, stream_));
  if (extra_rows > 0) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + qrb * d->rows, 0, qrb * extra_rows, stream_));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + qrb * (d->rows + extra_rows) + srb * d->rows, 0,
                                         srb * extra_rows, stream_));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  *d = dst;
  return Ok();
}

BackendStatus CudaBackend::UploadVector(const HostMatrix& h, int64_t expect, const char* name,
                                        float** out) {
  std::vector<float> v;
  if (h.empty() || h.rows * h.cols != expect || !HostToFloat(h, &v)) {
    return Error(Code::kInvalidArgument, std::string("bad vector ") + name);
  }
  BACKEND_RETURN_IF_ERROR(Alloc(v.size(), out, /*weight=*/true));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(*out, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return Ok();
}

BackendStatus CudaBackend::UploadStacked(const std::vector<const HostMatrix*>& parts,
                                         const char* name, DeviceMatrix* out,
                                         std::vector<DeviceMatrix>* separate) {
  DeviceMatrix d;
  d.type = static_cast<WType>(parts[0]->type);
  d.cols = parts[0]->cols;
  bool one_type = true;
  for (const HostMatrix* p : parts) {
    if (p->empty() || p->cols != d.cols) {
      return Error(Code::kInvalidArgument, std::string(name) + ": parts differ in width");
    }
    one_type = one_type && p->type == parts[0]->type;
    d.rows += p->rows;
  }
  separate->clear();
  if (!one_type) {
    for (const HostMatrix* p : parts) {
      separate->emplace_back();
      BACKEND_RETURN_IF_ERROR(UploadMatrix(*p, nullptr, name, &separate->back()));
    }
    *out = d;  // the stacked shape, no data
    return Ok();
  }
  d.data = reinterpret_cast<const void*>(16);
  if (CheckMatrixShape(d) != cudaSuccess) {
    return Error(Code::kInvalidArgument, std::string(name) + ": " + std::to_string(d.cols) +
                                             " columns of type " + WTypeName(d.type) +
                                             " do not suit the GPU row kernels");
  }
  const size_t rb = HostRowBytes(parts[0]->type, d.cols);
  uint8_t* dev = nullptr;
  BACKEND_RETURN_IF_ERROR(Alloc(rb * d.rows, &dev, /*weight=*/true));
  if (allocate_only_) {
    d.data = dev;
    *out = d;
    return Ok();
  }
  size_t off = 0;
  for (const HostMatrix* p : parts) {
    CUDA_RETURN_IF_ERROR(cudaMemcpy(dev + off, p->data, rb * p->rows, cudaMemcpyHostToDevice));
    off += rb * p->rows;
  }
  d.data = dev;
  BACKEND_RETURN_IF_ERROR(MaybeSplit(&d));
  *out = d;
  return Ok();
}

BackendStatus CudaBackend::Create(const ModelUpload& m) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_start = Clock::now();
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  dims_ = m.dims;
  const ModelDims& c = dims_;
  max_ctx_ = m.max_ctx;
  max_seqs_ = m.max_seqs;
  max_batch_ = m.max_batch;
  device_ = m.device;
  allocate_only_ = m.allocate_only;
  if (c.hidden <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 ||
      c.ffn <= 0 || c.vocab <= 0 || static_cast<int>(m.layers.size()) != c.n_layers ||
      static_cast<int>(c.inv_freq.size()) != c.head_dim / 2 || max_ctx_ <= 0 || max_seqs_ <= 0 ||
      max_batch_ <= 0) {
    return Error(Code::kInvalidArgument, "inconsistent model dimensions for the CUDA backend");
  }
  if (max_ctx_ > MaxAttentionContext()) {
    return Error(Code::kInvalidArgument, "context " + std::to_string(max_ctx_) +
                                             " exceeds the attention kernel's limit " +
                                             std::to_string(MaxAttentionContext()));
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    cudaGetLastError();
    return Error(Code::kUnavailable, "no CUDA device");
  }
  if (device_ < 0 || device_ >= n_dev) {
    return Error(Code::kInvalidArgument,
                 "CUDA device " + std::to_string(device_) + " of " + std::to_string(n_dev));
  }
  if (const char* g = std::getenv("PINFER_CUDA_GRAPHS")) use_graphs_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_REPACK")) repack_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_STEP_GRAPH")) step_graph_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_PDL")) SetProgrammaticLaunch(std::string(g) != "0");
  {
    double share = m.cold_gpu_share;
    share_adaptive_ = m.cold_gpu_share_adaptive;
    if (const char* g = std::getenv("PINFER_CUDA_COLD_GPU_SHARE")) {
      share_adaptive_ = std::string(g) == "auto";
      share = share_adaptive_ ? 0 : std::atof(g);
    }
    if (!(share >= 0 && share <= 1)) {
      return Error(Code::kInvalidArgument, "cold_gpu_share must be in [0, 1]");
    }
    share_num_ = static_cast<int>(share * kShareDen + 0.5);
    share_on_ = share_num_ > 0 || share_adaptive_;
  }
  guess_on_ = m.cold_guess;
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS")) guess_on_ = std::string(g) != "0";
  guess_recall_ = m.cold_guess_recall;
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS_RECALL")) guess_recall_ = std::atof(g);
  if (!(guess_recall_ >= 0 && guess_recall_ < 1) || !std::isfinite(m.cold_guess_shift)) {
    return Error(Code::kInvalidArgument,
                 "cold_guess_recall must be in [0, 1) and cold_guess_shift finite");
  }
  guess_initial_shift_ = static_cast<float>(m.cold_guess_shift);
  if (const char* g = std::getenv("PINFER_CUDA_COLD_GUESS_SHIFT")) {
    guess_initial_shift_ = static_cast<float>(std::atof(g));
  }
  if (const char* g = std::getenv("PINFER_CUDA_Q8X"))
    SetQuantizedActivations(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_PREFETCH")) SetWeightPrefetch(std::string(g) == "1");
  if (const char* g = std::getenv("PINFER_CUDA_QX_WARPS")) SetQuantWarps(std::atoi(g));
  if (const char* g = std::getenv("PINFER_CUDA_QX_ROWS")) SetQuantRowsPerWarp(std::atoi(g));
  if (const char* g = std::getenv("PINFER_CUDA_QX_SHAPE")) {
    SetQuantShapeBalanced(std::string(g) != "fixed");
  }
  if (const char* g = std::getenv("PINFER_CUDA_NORM_LOOP"))
    SetNormInRegisters(std::string(g) != "1");
  if (const char* g = std::getenv("PINFER_CUDA_NORM_VEC8")) SetNormVec8(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_REGS")) SetQuantRegs(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_EARLY")) SetQuantEarlyLoad(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_QX_PIPE")) SetQuantPipeline(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_LATE_TRIGGER")) {
    SetAttentionLateTrigger(std::string(g) == "1");
  }
  if (const char* g = std::getenv("PINFER_CUDA_LATE_X_FIRST")) {
    SetLateBlocksLoadXFirst(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_FUSED_NORM")) SetFusedNorm(std::string(g) != "0");
  if (const char* g = std::getenv("PINFER_CUDA_ROPE_IN_PRODUCT")) {
    SetRopeInProduct(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ACT_IN_PRODUCT")) {
    SetActivationInProduct(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_EARLY")) {
    SetAttentionEarlyLoad(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_ATTN_ONLINE")) {
    SetOnlineAttention(std::string(g) != "0");
  }
  if (const char* g = std::getenv("PINFER_CUDA_EARLY_PUBLISH")) {
    early_publish_ = std::string(g) != "0";
  }
  if (const char* g = std::getenv("PINFER_CUDA_ZERO_COPY_COLD")) {
    zero_copy_cold_ = std::string(g) == "1";
  }
  if (const char* g = std::getenv("PINFER_CUDA_PRELAUNCH")) prelaunch_ = std::string(g) != "0";
  if (const char* g = std::getenv("PINFER_CUDA_COLD_PARTS")) cold_parts_ = std::string(g) != "0";
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (cublasCreate(&cublas_) != CUBLAS_STATUS_SUCCESS) {
    return Error(Code::kInternal, "cublasCreate failed");
  }

  const double init_s = since(t_start);
  const Clock::time_point t_weights = Clock::now();
  const int H = c.hidden, B = max_batch_, F = c.ffn;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  BACKEND_RETURN_IF_ERROR(
      UploadMatrix(m.tok_embeddings, nullptr, "tok_embeddings", &tok_embeddings_));
  BACKEND_RETURN_IF_ERROR(UploadMatrix(m.output, nullptr, "output", &output_));
  BACKEND_RETURN_IF_ERROR(UploadVector(m.output_norm, H, "output_norm", &output_norm_));
  BACKEND_RETURN_IF_ERROR(Alloc(c.inv_freq.size(), &inv_freq_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_freq_, c.inv_freq.data(), c.inv_freq.size() * 4, cudaMemcpyHostToDevice));

  size_t w_half = GemmWeightScratchBytes(output_);
  int64_t widest =
      std::max<int64_t>({int64_t{H}, int64_t{2} * F, int64_t{qdim} + 2 * kvdim, int64_t{c.vocab}});
  layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerUpload& u = m.layers[l];
    DeviceLayer& d = layers_[l];
    d.ffn = u.ffn;
    if (u.ffn == FfnPlacement::kNone) continue;
    d.kv_index = kv_layers_++;
    BACKEND_RETURN_IF_ERROR(UploadVector(u.attn_norm, H, "attn_norm", &d.attn_norm));
    BACKEND_RETURN_IF_ERROR(UploadVector(u.ffn_norm, H, "ffn_norm", &d.ffn_norm));
    if (u.wq.rows != qdim || u.wk.rows != kvdim || u.wv.rows != kvdim || u.wo.rows != H ||
        u.wq.cols != H || u.wo.cols != qdim) {
      return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": attention shapes");
    }
    BACKEND_RETURN_IF_ERROR(
        UploadStacked({&u.wq, &u.wk, &u.wv}, "wq/wk/wv", &d.wqkv, &d.wqkv_parts));
    if (!u.bq.empty() || !u.bk.empty() || !u.bv.empty()) {
      // Qwen2: one bias row for the stacked projection's output, added after it.
      std::vector<float> bias, part;
      const std::pair<const HostMatrix*, int> parts[] = {
          {&u.bq, qdim}, {&u.bk, kvdim}, {&u.bv, kvdim}};
      for (const auto& [h, n] : parts) {
        if (h->empty() || h->rows * h->cols != n || !HostToFloat(*h, &part)) {
          return Error(Code::kInvalidArgument,
                       "layer " + std::to_string(l) +
                           ": q/k/v biases must all be given, sized q_dim, kv_dim, kv_dim");
        }
        bias.insert(bias.end(), part.begin(), part.end());
      }
      BACKEND_RETURN_IF_ERROR(Alloc(bias.size(), &d.qkv_bias, /*weight=*/true));
      CUDA_RETURN_IF_ERROR(
          cudaMemcpy(d.qkv_bias, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
    }
    BACKEND_RETURN_IF_ERROR(UploadMatrix(u.wo, nullptr, "wo", &d.wo));
    if (u.ffn == FfnPlacement::kDense) {
      if (u.gate.rows != F || u.up.rows != F || u.down.rows != H || u.down.cols != F) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
      }
      BACKEND_RETURN_IF_ERROR(
          UploadStacked({&u.gate, &u.up}, "gate/up", &d.gate_up, &d.gate_up_parts));
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.down, nullptr, "down", &d.down));
      d.n_hot = F;
      if (d.down.rows != H) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
      }
    } else {
      for (size_t i = 0; i < u.hot_ids.size(); ++i) {
        if (u.hot_ids[i] < 0 || u.hot_ids[i] >= F || (i > 0 && u.hot_ids[i] <= u.hot_ids[i - 1])) {
          return Error(Code::kInvalidArgument,
                       "layer " + std::to_string(l) + ": hot_ids must be ascending neuron ids");
        }
      }
      d.n_hot = static_cast<int>(u.hot_ids.size());
      d.n_cache = u.cache_rows;
      if (d.n_cache < 0 || d.n_hot + d.n_cache > F) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": " +
                                                 std::to_string(d.n_cache) +
                                                 " cache rows do not fit beside the hot rows");
      }
      if (d.n_hot > 0 || d.n_cache > 0) {
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.gate, &u.hot_ids, "gate", &d.gate, d.n_cache));
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.up, &u.hot_ids, "up", &d.up, d.n_cache));
        BACKEND_RETURN_IF_ERROR(UploadMatrix(u.down_t, &u.hot_ids, "down_t", &d.down_t, d.n_cache));
        if (u.gate.rows != F || u.down_t.rows != F || u.down_t.cols != H) {
          return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": FFN shapes");
        }
      }
      d.hot_ids_host = u.hot_ids;
      if (d.n_hot > 0) {
        BACKEND_RETURN_IF_ERROR(Alloc(d.n_hot, &d.hot_ids));
        CUDA_RETURN_IF_ERROR(
            cudaMemcpy(d.hot_ids, u.hot_ids.data(), d.n_hot * 4, cudaMemcpyHostToDevice));
      }
      for (auto [all, part] : {std::pair{&d.gate_c, &d.gate}, std::pair{&d.up_c, &d.up},
                               std::pair{&d.down_t_c, &d.down_t}}) {
        *all = *part;
        all->rows += d.n_cache;
      }
      std::vector<char> is_hot(F, 0);
      for (int32_t id : u.hot_ids) is_hot[id] = 1;
      for (int j = 0; j < F; ++j) {
        if (!is_hot[j]) d.cold_ids_host.push_back(j);
      }
      if (!d.cold_ids_host.empty()) {
        BACKEND_RETURN_IF_ERROR(Alloc(d.cold_ids_host.size(), &d.cold_ids));
        CUDA_RETURN_IF_ERROR(cudaMemcpy(d.cold_ids, d.cold_ids_host.data(),
                                        d.cold_ids_host.size() * 4, cudaMemcpyHostToDevice));
      }
      if (d.n_cache > 0) {
        std::vector<int32_t> hot_map = u.hot_ids;
        hot_map.resize(static_cast<size_t>(d.n_hot) + d.n_cache, -1);
        d.slot_neuron.assign(d.n_cache, -1);
        d.slot_loaded.assign(d.n_cache, -1);
        d.cold_map_host = d.cold_ids_host;
        BACKEND_RETURN_IF_ERROR(Alloc(hot_map.size(), &d.hot_map_c));
        CUDA_RETURN_IF_ERROR(
            cudaMemcpy(d.hot_map_c, hot_map.data(), hot_map.size() * 4, cudaMemcpyHostToDevice));
        if (!d.cold_ids_host.empty()) {
          BACKEND_RETURN_IF_ERROR(Alloc(d.cold_ids_host.size(), &d.cold_map_c));
          CUDA_RETURN_IF_ERROR(cudaMemcpy(d.cold_map_c, d.cold_ids_host.data(),
                                          d.cold_ids_host.size() * 4, cudaMemcpyHostToDevice));
        }
      }
    }
    if (!u.pred_fc1.empty()) {
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.pred_fc1, nullptr, "pred_fc1", &d.fc1));
      BACKEND_RETURN_IF_ERROR(UploadMatrix(u.pred_fc2, nullptr, "pred_fc2", &d.fc2));
      if (d.fc1.cols != H || d.fc2.rows != F || d.fc2.cols != d.fc1.rows) {
        return Error(Code::kInvalidArgument, "layer " + std::to_string(l) + ": predictor shapes");
      }
      max_rank_ = std::max<int>(max_rank_, static_cast<int>(d.fc1.rows));
      // The compaction keeps scores > cut; the next float below the threshold makes that
      // score >= threshold, the CPU predictors' rule.
      d.pred_cut = std::nextafter(u.pred_threshold, -INFINITY);
      d.pred_rms = u.pred_scores_times_rms;
    }
    for (const DeviceMatrix* w :
         {&d.wqkv, &d.wo, &d.gate_up, &d.gate, &d.up, &d.down, &d.down_t, &d.fc1, &d.fc2}) {
      if (w->data != nullptr) w_half = std::max(w_half, GemmWeightScratchBytes(*w));
    }
    for (const auto* parts : {&d.wqkv_parts, &d.gate_up_parts}) {
      for (const DeviceMatrix& w : *parts) w_half = std::max(w_half, GemmWeightScratchBytes(w));
    }
  }
  widest = std::max<int64_t>(widest, max_rank_);
  const double weights_s = since(t_weights);
  const size_t weights_bytes = device_bytes_;
  const Clock::time_point t_stream = Clock::now();
  bool any_cache = false;
  for (const LayerUpload& u : m.layers) any_cache = any_cache || u.cache_rows > 0;
  if ((m.stream_cold && B > kSmallBatch) || any_cache || share_on_) {
    BACKEND_RETURN_IF_ERROR(SetUpStreaming(m, m.stream_cold && B > kSmallBatch));
    for (const DeviceLayer& d : layers_) {
      if (d.cold_rows.rows == 0) continue;
      for (int m : {0, 2}) {  // gate's and up's type, down_t's
        const DeviceMatrix chunk{d.cold_rows.type_of(m), streamer_->chunk_rows(), H,
                                 d.cold_rows.gate};
        w_half = std::max(w_half, GemmWeightScratchBytes(chunk));
      }
    }
  }

  const double stream_s = since(t_stream);
  const Clock::time_point t_rest = Clock::now();
  // The KV cache, shared with every lane (NewLane); then this backend's own scratch.
  const size_t kv = static_cast<size_t>(kv_layers_) * max_seqs_ * max_ctx_ * kvdim;
  BACKEND_RETURN_IF_ERROR(Alloc(kv, &k_cache_));
  BACKEND_RETURN_IF_ERROR(Alloc(kv, &v_cache_));
  widest_ = widest;
  w_half_ = w_half;
  BACKEND_RETURN_IF_ERROR(AllocateScratch());
  if (repack_tmp_ != nullptr) CUDA_RETURN_IF_ERROR(cudaFree(repack_tmp_));
  repack_tmp_ = nullptr;
  repack_tmp_bytes_ = 0;
  char times[320];
  std::snprintf(times, sizeof(times),
                "device and cuBLAS %.2f s; weights %.2f s (%.1f MiB on the device); streamer "
                "%.2f s (pinned cold rows: %.1f MiB, %.2f s allocating, %.2f s copying); KV cache "
                "and scratch %.2f s",
                init_s, weights_s, weights_bytes / 1048576.0, stream_s,
                streamer_ ? streamer_->pinned_bytes() / 1048576.0 : 0.0,
                streamer_ ? streamer_->pin_alloc_s() : 0.0,
                streamer_ ? streamer_->pin_copy_s() : 0.0, since(t_rest));
  create_times_ = times;
  return Ok();
}

BackendStatus CudaBackend::AllocateScratch() {
  const ModelDims& c = dims_;
  const int H = c.hidden, B = max_batch_, F = c.ffn;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  const int64_t widest = widest_;
  const size_t w_half = w_half_;
  const char* attn_qx = std::getenv("PINFER_CUDA_ATTN_QX");  // 0: off (benchmarks)
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (stream_ == nullptr) {  // a lane's (Create made the first backend's for its uploads)
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  if (cublas_ == nullptr && cublasCreate(&cublas_) != CUBLAS_STATUS_SUCCESS) {
    return Error(Code::kInternal, "cublasCreate failed");
  }
  BACKEND_RETURN_IF_ERROR(Alloc(2 * c.inv_freq.size(), &rope_cos_sin_));
  const size_t bh = static_cast<size_t>(B) * H, bf = static_cast<size_t>(B) * F;
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &x_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &xb_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * qdim, &q_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * qdim, &att_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &hot_out_));
  BACKEND_RETURN_IF_ERROR(Alloc(bh, &cold_in_));
  BACKEND_RETURN_IF_ERROR(Alloc(1, &parts_count_dev_));
  BACKEND_RETURN_IF_ERROR(Alloc(2 * bf, &gate_));  // also [n, 2 ffn] stacked gate/up outputs
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * (qdim + 2 * kvdim), &qkv_));
  BACKEND_RETURN_IF_ERROR(Alloc(bf, &up_));
  for (const DeviceLayer& L : layers_) {
    for (const DeviceMatrix* m : {&L.wqkv, &L.wo, &L.gate_up, &L.down, &L.gate, &L.up, &L.fc1}) {
      qx_on_ = qx_on_ || m->split() || IsKQuant(m->type);
    }
    for (const auto* parts : {&L.wqkv_parts, &L.gate_up_parts}) {
      for (const DeviceMatrix& m : *parts) qx_on_ = qx_on_ || m.split() || IsKQuant(m.type);
    }
  }
  const char* producer_qx = std::getenv("PINFER_CUDA_PRODUCER_QX");  // 0: off (benchmarks)
  qx_on_ = qx_on_ && H % 32 == 0 && F % 32 == 0 &&
           (producer_qx == nullptr || std::string(producer_qx) != "0");
  if (qx_on_) {
    BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(H), &xb_qx_));
    BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(F), &up_qx_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(H), &x_alt_));
    if (qdim % 32 == 0 && (attn_qx == nullptr || std::string(attn_qx) != "0")) {
      BACKEND_RETURN_IF_ERROR(Alloc(kSmallBatch * QxBytes(qdim), &att_qx_));
    }
  }
  BACKEND_RETURN_IF_ERROR(Alloc(bf, &scores_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B), &rms_));
  if (max_rank_ > 0) BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * max_rank_, &pred_h_));
  BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(B) * c.vocab, &logits_));
  BACKEND_RETURN_IF_ERROR(Alloc(1, &pick_dev_));
  BACKEND_RETURN_IF_ERROR(AllocHost(1, &pick_host_));
  BACKEND_RETURN_IF_ERROR(Alloc(2 * static_cast<size_t>(B), &tokens_dev_));
  positions_dev_ = tokens_dev_ + B;
  BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &hot_list_));
  BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &cold_list_));
  if (share_on_) {
    BACKEND_RETURN_IF_ERROR(AllocHost(1, &share_dev_));
    *share_dev_ = share_num_;
    ev_share_.resize(c.n_layers);
    for (cudaEvent_t& e : ev_share_) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    BACKEND_RETURN_IF_ERROR(Alloc(1, &cold_gpu_count_));
    BACKEND_RETURN_IF_ERROR(Alloc(F + 1, &cold_gpu_list_));
    BACKEND_RETURN_IF_ERROR(Alloc(F, &cold_gate_));
    BACKEND_RETURN_IF_ERROR(Alloc(F, &cold_up_));
    BACKEND_RETURN_IF_ERROR(
        AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &given_cold_host_));
  }
  // cuBLAS scratch only where batches can exceed the matrix-vector path.
  if (B > kSmallBatch) {
    gemm_.w_half_bytes = w_half;
    if (w_half > 0) {
      uint8_t* p = nullptr;
      BACKEND_RETURN_IF_ERROR(Alloc(w_half, &p));
      gemm_.w_half = p;
    }
    gemm_.x_half_bytes = 2 * static_cast<size_t>(B) * widest * 2;  // hi and lo halves
    uint8_t* p = nullptr;
    BACKEND_RETURN_IF_ERROR(Alloc(gemm_.x_half_bytes, &p));
    gemm_.x_half = p;
  }

  BACKEND_RETURN_IF_ERROR(AllocHost(2 * static_cast<size_t>(B), &tokens_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &given_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * 2, &counts_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(F, &cold_idx_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(bh, &x_host_));
  // Room for a single token's kMaxColdParts partial sums (ColdParts) as well as a batch.
  BACKEND_RETURN_IF_ERROR(
      AllocHost(std::max(bh, static_cast<size_t>(kMaxColdParts) * H), &out_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(F, &active_host_));
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers), &cold_ready_));
  std::fill(cold_ready_, cold_ready_ + c.n_layers, 0);
  BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &observed_host_));

  for (auto* v : {&ev_x_, &ev_hot0_, &ev_hot1_, &ev_attn0_, &ev_signal_}) {
    v->resize(c.n_layers);
    for (cudaEvent_t& e : *v) CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev_start_));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev_layers_end_));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&publish_stream_, cudaStreamNonBlocking));
  if (guess_on_ && max_rank_ > 0) {
    BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers), &guess_shift_));
    std::fill(guess_shift_, guess_shift_ + c.n_layers, guess_initial_shift_);
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(H), &guess_x_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(max_rank_), &guess_h_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(F), &guess_scores_));
    BACKEND_RETURN_IF_ERROR(Alloc(static_cast<size_t>(F) + 1, &guess_list_));
    BACKEND_RETURN_IF_ERROR(AllocHost(static_cast<size_t>(c.n_layers) * (F + 1), &guess_host_));
    guess_ids_.reserve(F);
    guess_mark_.assign(F, 0);
    ev_guess_.resize(c.n_layers);
    for (cudaEvent_t& e : ev_guess_) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    for (cudaEvent_t* e : {&ev_gfork_, &ev_gjoin_}) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    int least = 0, greatest = 0;
    CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&guess_stream_, cudaStreamNonBlocking, greatest));
  } else {
    guess_on_ = false;  // no predictors to guess with
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Ok();
}

BackendStatus CudaBackend::NewLane(Backend** out) {
  *out = nullptr;
  if (is_lane_) {
    return Error(Code::kFailedPrecondition,
                 "a lane makes no lanes: ask the backend it came from, which counts them");
  }
  if (lanes_made_ + 1 >= kMaxLanes) {
    return Error(Code::kResourceExhausted,
                 "at most " + std::to_string(kMaxLanes) + " lanes share a model's weights");
  }
  for (const DeviceLayer& L : layers_) {
    if (L.n_cache > 0) {
      return Error(Code::kFailedPrecondition,
                   "a model with adaptive cache rows has no lanes: SetCacheSlots changes what "
                   "every lane's steps read");
    }
  }
  auto lane = std::make_unique<CudaBackend>();
  BACKEND_RETURN_IF_ERROR(lane->InitLane(*this));
  *out = lane.release();
  ++lanes_made_;
  return Ok();
}

BackendStatus CudaBackend::InitLane(const CudaBackend& base) {
  is_lane_ = true;
  dims_ = base.dims_;
  max_ctx_ = base.max_ctx_;
  max_seqs_ = base.max_seqs_;
  // Lanes take decode steps: scratch for the matrix-vector path's 8 tokens only (no cuBLAS
  // scratch): about 1 MB with a 32,000-token vocabulary, where 128 tokens' logits alone take 16.
  max_batch_ = std::min(base.max_batch_, kSmallBatch);
  device_ = base.device_;
  device_name_ = base.device_name_;
  allocate_only_ = base.allocate_only_;
  // Shared: the weights (device pointers in these structs, owned by base), the KV cache, and the
  // pinned cold rows of the GPU's cold share.
  tok_embeddings_ = base.tok_embeddings_;
  output_ = base.output_;
  output_norm_ = base.output_norm_;
  inv_freq_ = base.inv_freq_;
  layers_ = base.layers_;
  kv_layers_ = base.kv_layers_;
  k_cache_ = base.k_cache_;
  v_cache_ = base.v_cache_;
  max_rank_ = base.max_rank_;
  widest_ = base.widest_;
  w_half_ = base.w_half_;
  // The settings Create read.
  use_graphs_ = base.use_graphs_;
  step_graph_ = base.step_graph_;
  early_publish_ = base.early_publish_;
  zero_copy_cold_ = base.zero_copy_cold_;
  cold_parts_ = base.cold_parts_;
  prelaunch_ = base.prelaunch_;
  collect_gpu_times_ = base.collect_gpu_times_;
  share_on_ = base.share_on_;
  share_adaptive_ = base.share_adaptive_;
  share_num_ = base.share_num_;
  guess_on_ = base.guess_on_;
  guess_recall_ = base.guess_recall_;
  guess_initial_shift_ = base.guess_initial_shift_;
  return AllocateScratch();
}

}  // namespace cuda
}  // namespace pinfer
