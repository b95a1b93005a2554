// One forward step (Forward): the per-layer GPU work (attention, predictors, the hot FFN rows, the
// dense layers with their norms fused into the products) queued on one stream, replayed as one
// captured CUDA graph per layer, or per step where no cold side interrupts it, and the output head
// with its greedy pick. Decode steps with a cold side queue each layer before the previous one's
// callback runs (RunLayersQueued), so the host's launches stay off the critical path. What the
// cold side does between a layer's publish and its contribution is backend_cold.cc's.
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

BackendStatus CudaBackend::Proj(const DeviceMatrix& w, const float* x, int n, float* y, int ldy,
                                const void* x_qx) {
  if (n <= kSmallBatch) {
    CUDA_RETURN_IF_ERROR(
        MatVecRows(w, nullptr, static_cast<int>(w.rows), nullptr, x, n, y, ldy, stream_, x_qx));
    return Ok();
  }
  const int rc = GemmXWt(cublas_, w, x, n, y, ldy, 0.f, gemm_, stream_);
  if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
  return Ok();
}

BackendStatus CudaBackend::ProjStacked(const DeviceMatrix& w,
                                       const std::vector<DeviceMatrix>& separate, const float* x,
                                       int n, float* y, int ldy, const void* x_qx) {
  if (separate.empty()) return Proj(w, x, n, y, ldy, x_qx);
  int64_t row0 = 0;
  for (const DeviceMatrix& part : separate) {
    BACKEND_RETURN_IF_ERROR(Proj(part, x, n, y + row0, ldy, x_qx));
    row0 += part.rows;
  }
  return Ok();
}

// Inside a stream capture a plain cudaEventRecord only orders streams; the External flag makes it
// a node that records the event on every replay, so the host can wait on it.
cudaError_t CudaBackend::RecordEvent(cudaEvent_t e, cudaStream_t s) {
  if (s == nullptr) s = stream_;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(s, &capturing);
  if (err != cudaSuccess) return err;
  if (capturing == cudaStreamCaptureStatusActive) {
    return cudaEventRecordWithFlags(e, s, cudaEventRecordExternal);
  }
  return cudaEventRecord(e, s);
}

BackendStatus CudaBackend::PrepareLayer(int l, const ForwardArgs& a) {
  const DeviceLayer& L = layers_[l];
  if (L.ffn == FfnPlacement::kNone) {
    return Error(Code::kFailedPrecondition, "layer " + std::to_string(l) + " is not on the GPU");
  }
  if (L.ffn == FfnPlacement::kDense) return Ok();
  const FfnMode mode = EffectiveMode(a);
  if (mode == FfnMode::kPredicted && L.fc1.data == nullptr) {
    return Error(Code::kFailedPrecondition, "layer " + std::to_string(l) + " has no predictor");
  }
  const int F = dims_.ffn, n_hot = L.n_hot + (UsesCache(L, a) ? L.n_cache : 0);
  if (mode == FfnMode::kGiven && L.n_cache > 0 && a.n > kSmallBatch && cache_loaded_) {
    // The cuBLAS path computes every row it holds; slots being loaded or holding evicted
    // neurons would be counted twice.
    return Error(Code::kFailedPrecondition,
                 "kGiven batches over " + std::to_string(kSmallBatch) +
                     " tokens cannot use the adaptive cache once slots are loaded");
  }
  if (mode == FfnMode::kGiven && n_hot > 0) {
    if (a.given_hot == nullptr || static_cast<int>(a.given_hot->size()) <= l) {
      return Error(Code::kInvalidArgument, "kGiven needs given_hot for every layer");
    }
    const std::vector<int32_t>& g = (*a.given_hot)[l];
    if (static_cast<int>(g.size()) > n_hot) {
      return Error(Code::kInvalidArgument, "given_hot lists more rows than the layer holds");
    }
    // Staged in pinned memory; the copy to the GPU (fixed size, so a graph can replay it) is
    // part of the layer's GPU work.
    int32_t* stage = given_host_ + static_cast<size_t>(l) * (F + 1);
    stage[0] = static_cast<int32_t>(g.size());
    std::memcpy(stage + 1, g.data(), g.size() * 4);
    counts_host_[2 * l] = static_cast<int32_t>(g.size());
  }
  if (mode == FfnMode::kGiven && a.cold != nullptr &&
      (a.given_cold == nullptr || static_cast<int>(a.given_cold->size()) <= l)) {
    return Error(Code::kInvalidArgument, "kGiven needs given_cold for every layer");
  }
  if (mode == FfnMode::kGiven && a.cold != nullptr && SharesCold(L, a)) {
    // The GPU's part of the given cold list, as positions in the pinned cold rows.
    const std::vector<int32_t>& g = (*a.given_cold)[l];
    int32_t* stage = given_cold_host_ + static_cast<size_t>(l) * (F + 1);
    const int n_gpu = GpuShare(static_cast<int>(g.size()));
    stage[0] = n_gpu;
    for (int i = 0; i < n_gpu; ++i) {
      auto it = std::lower_bound(L.cold_ids_host.begin(), L.cold_ids_host.end(), g[i]);
      if (it == L.cold_ids_host.end() || *it != g[i]) {
        return Error(Code::kInvalidArgument, "given_cold lists neuron " + std::to_string(g[i]) +
                                                 ", not a cold neuron of layer " +
                                                 std::to_string(l));
      }
      stage[1 + i] = static_cast<int32_t>(it - L.cold_ids_host.begin());
    }
  }
  if (a.n > kSmallBatch || n_hot == 0) counts_host_[2 * l] = n_hot;
  if (StreamsLayer(l, a)) counts_host_[2 * l + 1] = 0;
  return Ok();
}

BackendStatus CudaBackend::LaunchLayer(int l, const ForwardArgs& a, float* exchange_x,
                                       const float* exchange_out, bool wait_cold) {
  BACKEND_RETURN_IF_ERROR(PrepareLayer(l, a));
  const DeviceLayer& L = layers_[l];
  const bool cold = CallsColdSide(l, a);
  const float* pend1 = pending1_;
  const float* pend2 = wait_cold ? ColdInput(exchange_out, a.n) : pending2_;
  auto enqueue = [&]() -> BackendStatus {
    if (wait_cold) BACKEND_RETURN_IF_ERROR(EnqueueColdWait(l - 1, exchange_out, a.n));
    return EnqueueLayer(l, a, pend1, pend2, cold, exchange_x);
  };
  if (use_graphs_ && a.n == 1) {
    // Decode steps replay one captured graph per layer: one launch instead of about twenty.
    const std::vector<int64_t> key = {
        l,
        a.seq,
        static_cast<int>(EffectiveMode(a)),
        a.run_predictors ? 1 : 0,
        pend1 != nullptr,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(pend2)),
        cold ? 1 : 0,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(cold ? exchange_x : nullptr)),
        collect_gpu_times_ ? 1 : 0,
        ObservesActive(a) ? 1 : 0,
        SharesCold(L, a) ? 1 : 0,
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(wait_cold ? exchange_out : nullptr)),
        GuessMade(l, a) ? 1 : 0,
        GuessMade(l + 1, a) ? 1 : 0};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      cudaGraph_t graph = nullptr;
      CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
      BackendStatus st = enqueue();
      cudaError_t end = cudaStreamEndCapture(stream_, &graph);
      if (!st.ok()) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        return st;
      }
      CUDA_RETURN_IF_ERROR(end);
      cudaGraphExec_t exec = nullptr;
      // Node priorities: the cold guess's branch keeps its stream's (ModelUpload::cold_guess).
      cudaError_t inst =
          cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
      cudaGraphDestroy(graph);
      CUDA_RETURN_IF_ERROR(inst);
      it = graphs_.emplace(key, exec).first;
    }
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
  } else {
    BACKEND_RETURN_IF_ERROR(enqueue());
  }
  pending1_ = hot_out_;
  pending2_ = nullptr;
  return Ok();
}

BackendStatus CudaBackend::RunLayer(int l, const ForwardArgs& a, float* exchange_x,
                                    float* exchange_out, int32_t* exchange_active) {
  BACKEND_RETURN_IF_ERROR(LaunchLayer(l, a, exchange_x, exchange_out, /*wait_cold=*/false));
  if (!CallsColdSide(l, a)) return Ok();
  return FinishCold(l, a, exchange_x, exchange_out, exchange_active, /*signal=*/false);
}

BackendStatus CudaBackend::RunLayersQueued(const ForwardArgs& a, int layer_end, float* exchange_x,
                                           float* exchange_out, int32_t* exchange_active) {
  // One layer ahead: the next layer is queued (waiting for this one's signal) before this one's
  // callback runs. Not more: a launch blocks once the device's queue is full, and with every
  // layer of a 40-layer step queued at once the host sat in a launch while the GPU waited for a
  // signal the host had not sent.
  guess_layer_ = -1;
  BackendStatus st = LaunchLayer(a.layer_begin, a, exchange_x, exchange_out, false);
  for (int l = a.layer_begin; st.ok() && l < layer_end; ++l) {
    const bool cold = CallsColdSide(l, a);
    if (l + 1 < layer_end) {
      const double t0 = Now();
      st = LaunchLayer(l + 1, a, exchange_x, exchange_out, cold);
      stats_.host_launch += Now() - t0;
    } else if (cold) {
      // The last contribution joins the residual after the loop (Forward).
      st = EnqueueColdWait(l, exchange_out, a.n);
      pending2_ = ColdInput(exchange_out, a.n);
    }
    int n_guess = 0;
    if (st.ok() && cold && GuessMade(l, a)) {
      // Made while the previous layer's cold part was computed: normally there already.
      const double tg = Now();
      const cudaError_t e = cudaEventSynchronize(ev_guess_[l]);
      stats_.guess_wait += Now() - tg;
      if (e == cudaSuccess) {
        n_guess = TakeGuess(l);
      } else {
        st = CudaError(e, "cudaEventSynchronize(ev_guess_[l])", __FILE__, __LINE__);
      }
    }
    if (st.ok() && cold) {
      const double t0 = Now();
      // Layer l's attention runs meanwhile (layer l + 1 is queued).
      ColdGuess guess;
      if (n_guess > 0) guess = {guess_ids_.data(), guess_first_.data(), n_guess};
      a.cold->Ahead(l, guess, [&] { return cudaEventQuery(ev_x_[l]) != cudaErrorNotReady; });
      stats_.cold_ahead += Now() - t0;
      st = FinishCold(l, a, exchange_x, exchange_out, exchange_active, /*signal=*/true);
    }
  }
  if (st.ok()) return st;
  // Release every wait the queued work may still hold, let it drain, and leave no signal behind
  // for the next step (a layer whose wait was never queued keeps its flag set until here).
  for (int l = 0; l < dims_.n_layers; ++l) __atomic_store_n(cold_ready_ + l, 1, __ATOMIC_RELEASE);
  cudaStreamSynchronize(stream_);
  for (int l = 0; l < dims_.n_layers; ++l) __atomic_store_n(cold_ready_ + l, 0, __ATOMIC_RELEASE);
  return st;
}

BackendStatus CudaBackend::EnqueueLayer(int l, const ForwardArgs& a, const float* pend1,
                                        const float* pend2, bool cold, float* exchange_x) {
  const ModelDims& c = dims_;
  const DeviceLayer& L = layers_[l];
  const int n = a.n, H = c.hidden, F = c.ffn;
  const int64_t nh = static_cast<int64_t>(n) * H;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  const ActKind act = static_cast<ActKind>(c.activation);

  // Attention block; new keys and values go straight into the cache.
  const size_t slot = (static_cast<size_t>(L.kv_index) * max_seqs_ + a.seq) * max_ctx_;
  float* k_seq = k_cache_ + slot * kvdim;  // [max_ctx, kv_dim]
  float* v_seq = v_cache_ + slot * kvdim;
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_attn0_[l]));
  if (FusesNorms(L, n, pend2)) return EnqueueDenseLayerFused(l, pend1, k_seq, v_seq);
  // The previous layer's FFN output joins the residual inside this norm.
  if (pend1 != nullptr) {
    CUDA_RETURN_IF_ERROR(
        ResidualRmsNorm(x_, pend1, pend2, L.attn_norm, n, H, c.norm_eps, xb_, stream_, XbQx(n)));
  } else {
    CUDA_RETURN_IF_ERROR(RmsNorm(x_, L.attn_norm, n, H, c.norm_eps, xb_, stream_, XbQx(n)));
  }
  BACKEND_RETURN_IF_ERROR(ProjStacked(L.wqkv, L.wqkv_parts, xb_, n, qkv_, qdim + 2 * kvdim,
                                      XbQx(n)));  // [n, q + 2 kv]
  if (L.qkv_bias != nullptr) {
    CUDA_RETURN_IF_ERROR(AddRowBias(qkv_, L.qkv_bias, n, qdim + 2 * kvdim, stream_));
  }
  CUDA_RETURN_IF_ERROR(RopeQkvToCache(qkv_, n, c.n_heads, c.n_kv_heads, c.head_dim, positions_dev_,
                                      inv_freq_, c.rope_interleaved, q_, k_seq, v_seq,
                                      stream_));  // q: [n, q_dim]; k, v into the cache
  CUDA_RETURN_IF_ERROR(AttentionAt(q_, k_seq, v_seq, n, positions_dev_, max_ctx_, c.n_heads,
                                   c.n_kv_heads, c.head_dim, c.sliding_window, att_, stream_,
                                   AttQx(n)));                     // [n, q_dim]
  BACKEND_RETURN_IF_ERROR(Proj(L.wo, att_, n, xb_, H, AttQx(n)));  // xb: [n, hidden]

  // FFN block: x += attention output, xb = the FFN input.
  CUDA_RETURN_IF_ERROR(ResidualRmsNorm(x_, xb_, nullptr, L.ffn_norm, n, H, c.norm_eps, xb_, stream_,
                                       XbQx(n), L.pred_rms ? rms_ : nullptr));
  const bool early = cold && early_publish_;
  if (early) {
    // The cold side's input on its way to the host while the predictor runs.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_fork_, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(publish_stream_, ev_fork_, 0));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(exchange_x, xb_, nh * 4, cudaMemcpyDeviceToHost, publish_stream_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_join_, publish_stream_));
  }
  if (L.ffn == FfnPlacement::kDense) {
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
    BACKEND_RETURN_IF_ERROR(ProjStacked(L.gate_up, L.gate_up_parts, xb_, n, gate_, 2 * F,
                                        XbQx(n)));  // [n, 2 ffn]
    CUDA_RETURN_IF_ERROR(
        GatedActivationPacked(act, gate_, n, F, up_, stream_, UpQx(n)));  // [n, ffn]
    BACKEND_RETURN_IF_ERROR(Proj(L.down, up_, n, hot_out_, H, UpQx(n)));  // [n, hidden]
    if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
    return Ok();
  }

  // kGiven decode steps also address the adaptive cache slots after the hot rows.
  const bool use_cache = UsesCache(L, a);
  const int n_hot = L.n_hot + (use_cache ? L.n_cache : 0);
  const int n_cold = static_cast<int>(L.cold_ids_host.size());
  const DeviceMatrix& G = use_cache ? L.gate_c : L.gate;
  const DeviceMatrix& U = use_cache ? L.up_c : L.up;
  const DeviceMatrix& Dt = use_cache ? L.down_t_c : L.down_t;
  const bool small = n <= kSmallBatch;
  int32_t* hot_count = hot_list_;
  int32_t* hot_idx_ = hot_list_ + 1;
  int32_t* cold_count = cold_list_;
  int32_t* cold_idx_ = cold_list_ + 1;
  const FfnMode mode = EffectiveMode(a);

  // Predictors: scores: [n, ffn] = fc2(relu(fc1(x))).
  if (L.fc1.data != nullptr &&
      (mode == FfnMode::kPredicted || (mode == FfnMode::kGiven && a.run_predictors))) {
    const int rank = static_cast<int>(L.fc1.rows);
    BACKEND_RETURN_IF_ERROR(Proj(L.fc1, xb_, n, pred_h_, rank, XbQx(n)));
    CUDA_RETURN_IF_ERROR(Relu(pred_h_, static_cast<int64_t>(n) * rank, stream_));
    BACKEND_RETURN_IF_ERROR(Proj(L.fc2, pred_h_, n, scores_, F));
  }
  const float* score_scale = L.pred_rms ? rms_ : nullptr;  // [n] rms(residual), pre-norm scores
  // With the cache, the maps route a cached neuron to its slot and keep it off the cold list.
  auto compact_hot = [&]() -> BackendStatus {
    CUDA_RETURN_IF_ERROR(CompactActive(scores_, n, F, use_cache ? L.hot_map_c : L.hot_ids, n_hot,
                                       L.pred_cut, hot_idx_, hot_count, stream_, score_scale));
    if (ObservesActive(a)) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(observed_host_ + static_cast<size_t>(l) * (F + 1),
                                           hot_list_, (static_cast<size_t>(n_hot) + 1) * 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
    return Ok();
  };
  if (mode == FfnMode::kPredicted) {
    if (n_hot > 0 && !early) BACKEND_RETURN_IF_ERROR(compact_hot());
    if (cold) {
      CUDA_RETURN_IF_ERROR(CompactActive(scores_, n, F, use_cache ? L.cold_map_c : L.cold_ids,
                                         n_cold, L.pred_cut, cold_idx_, cold_count, stream_,
                                         score_scale));
      if (SharesCold(L, a)) {
        CUDA_RETURN_IF_ERROR(
            ShareOfCount(cold_count, share_dev_, kShareDen, cold_gpu_count_, stream_));
      }
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(cold_idx_host_, cold_idx_, n_cold * 4, cudaMemcpyDeviceToHost, stream_));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts_host_ + 2 * l + 1, cold_count, 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
  } else if (mode == FfnMode::kGiven && n_hot > 0) {
    const int32_t* stage = given_host_ + static_cast<size_t>(l) * (F + 1);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hot_list_, stage, (static_cast<size_t>(n_hot) + 1) * 4,
                                         cudaMemcpyHostToDevice, stream_));
  }

  // Publish the FFN input for the cold side before the hot work, so both run at once.
  if (cold) {
    if (early) {
      CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_join_, 0));
    } else {
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(exchange_x, xb_, nh * 4, cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_RETURN_IF_ERROR(RecordEvent(ev_x_[l]));
  }
  if (mode == FfnMode::kPredicted && n_hot > 0 && early) BACKEND_RETURN_IF_ERROR(compact_hot());
  if (GuessMade(l + 1, a)) {
    // The next layer's guess beside this layer's hot rows: x_ is final until the next layer.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_gfork_, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(guess_stream_, ev_gfork_, 0));
    CUDA_RETURN_IF_ERROR(
        RmsNorm(x_, layers_[l + 1].ffn_norm, 1, H, c.norm_eps, guess_x_, guess_stream_));
    BACKEND_RETURN_IF_ERROR(EnqueueGuessChain(l + 1, a));
  }

  // Hot rows.
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
  if (n_hot > 0) {
    if (small) {
      float* coef = nullptr;  // [n, n_hot] activations of the listed rows
      if (mode == FfnMode::kExact) {
        // The gate decides: every hot gate row, then up and down for the active ones only.
        CUDA_RETURN_IF_ERROR(
            MatVecRows(G, nullptr, n_hot, nullptr, xb_, n, gate_, n_hot, stream_, XbQx(n)));
        const float threshold = act == ActKind::kSilu ? -INFINITY : 0.f;
        CUDA_RETURN_IF_ERROR(CompactActive(gate_, n, n_hot, nullptr, n_hot, threshold, hot_idx_,
                                           hot_count, stream_));
        CUDA_RETURN_IF_ERROR(
            MatVecRows(U, hot_idx_, n_hot, hot_count, xb_, n, up_, n_hot, stream_, XbQx(n)));
        CUDA_RETURN_IF_ERROR(GatherGatedActivation(act, gate_, n_hot, hot_idx_, n_hot, hot_count,
                                                   up_, n_hot, n, stream_));
        coef = up_;
      } else {
        CUDA_RETURN_IF_ERROR(
            MatVecRows(G, hot_idx_, n_hot, hot_count, xb_, n, gate_, n_hot, stream_, XbQx(n)));
        CUDA_RETURN_IF_ERROR(
            MatVecRows(U, hot_idx_, n_hot, hot_count, xb_, n, up_, n_hot, stream_, XbQx(n)));
        // Elements past the count are stale and never read.
        CUDA_RETURN_IF_ERROR(
            GatedActivation(act, gate_, up_, static_cast<int64_t>(n) * n_hot, stream_));
        coef = gate_;
      }
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(hot_out_, 0, nh * 4, stream_));
      CUDA_RETURN_IF_ERROR(
          AccumulateRows(Dt, hot_idx_, n_hot, hot_count, coef, n_hot, n, hot_out_, stream_));
      if (mode != FfnMode::kGiven) {
        CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(counts_host_ + 2 * l, hot_count, 4, cudaMemcpyDeviceToHost, stream_));
      }
    } else {
      // Prompt batches: every hot row through cuBLAS (a superset of any active set).
      int rc = GemmXWt(cublas_, G, xb_, n, gate_, n_hot, 0.f, gemm_, stream_);
      if (rc == 0) rc = GemmXWt(cublas_, U, xb_, n, up_, n_hot, 0.f, gemm_, stream_);
      if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
      CUDA_RETURN_IF_ERROR(
          GatedActivation(act, gate_, up_, static_cast<int64_t>(n) * n_hot, stream_));
      rc = GemmAW(cublas_, Dt, gate_, n_hot, n, hot_out_, 0.f, gemm_, stream_);
      if (rc != 0) return Error(Code::kInternal, std::string("cuBLAS: ") + GemmErrorString(rc));
    }
  } else {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(hot_out_, 0, nh * 4, stream_));
  }
  if (StreamsLayer(l, a)) BACKEND_RETURN_IF_ERROR(StreamCold(l, n));
  if (cold && SharesCold(L, a)) {
    // The GPU's share of the cold neurons, rows read from pinned host memory over PCIe while the
    // callback computes the rest: gate and up products, activation, down rows into hot_out_.
    const int32_t* list = cold_idx_;
    const int32_t* count = cold_gpu_count_;
    if (mode == FfnMode::kGiven) {
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(cold_gpu_list_, given_cold_host_ + static_cast<size_t>(l) * (F + 1),
                          (static_cast<size_t>(n_cold) + 1) * 4, cudaMemcpyHostToDevice, stream_));
      list = cold_gpu_list_ + 1;
      count = cold_gpu_list_;
    }
    const ColdRows& R = L.cold_rows;
    const DeviceMatrix cg{R.type, R.rows, R.cols, R.gate};
    const DeviceMatrix cu{R.type, R.rows, R.cols, R.up};
    const DeviceMatrix cd{R.down_type, R.rows, R.cols, R.down_t};
    CUDA_RETURN_IF_ERROR(MatVecRows(cg, list, n_cold, count, xb_, 1, cold_gate_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(MatVecRows(cu, list, n_cold, count, xb_, 1, cold_up_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(GatedActivation(act, cold_gate_, cold_up_, n_cold, stream_));
    CUDA_RETURN_IF_ERROR(
        AccumulateRows(cd, list, n_cold, count, cold_gate_, n_cold, 1, hot_out_, stream_));
    CUDA_RETURN_IF_ERROR(RecordEvent(ev_share_[l]));
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
  if (GuessMade(l + 1, a)) {
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ev_gjoin_, 0));  // the branch forked here
  }
  return Ok();
}

BackendStatus CudaBackend::EnqueueDenseLayerFused(int l, const float* pend1, float* k_seq,
                                                  float* v_seq) {
  // EnqueueLayer's dense decode path with each norm inside the product that consumes it.
  const ModelDims& c = dims_;
  const DeviceLayer& L = layers_[l];
  const int H = c.hidden, F = c.ffn;
  // x_alt = x + the previous layer's FFN output; qkv: [1, q + 2 kv] = wqkv * norm(x_alt), and
  // RoPE and the cache write where the product writes its rows.
  if (RopeInProduct()) {
    RopeOut rope;
    rope.n_heads = c.n_heads;
    rope.n_kv_heads = c.n_kv_heads;
    rope.head_dim = c.head_dim;
    rope.positions = positions_dev_;
    rope.cos_sin = rope_cos_sin_;
    rope.interleaved = c.rope_interleaved;
    rope.q = q_;
    rope.k_cache = k_seq;
    rope.v_cache = v_seq;
    CUDA_RETURN_IF_ERROR(
        NormMatVecRope(L.wqkv, x_, pend1, nullptr, L.attn_norm, c.norm_eps, x_alt_, rope, stream_));
  } else {
    CUDA_RETURN_IF_ERROR(
        NormMatVec(L.wqkv, x_, pend1, nullptr, L.attn_norm, c.norm_eps, x_alt_, qkv_, stream_));
    CUDA_RETURN_IF_ERROR(RopeQkvToCache(qkv_, 1, c.n_heads, c.n_kv_heads, c.head_dim,
                                        positions_dev_, inv_freq_, c.rope_interleaved, q_, k_seq,
                                        v_seq, stream_));
  }
  CUDA_RETURN_IF_ERROR(AttentionAt(q_, k_seq, v_seq, 1, positions_dev_, max_ctx_, c.n_heads,
                                   c.n_kv_heads, c.head_dim, c.sliding_window, att_, stream_,
                                   AttQx(1)));
  BACKEND_RETURN_IF_ERROR(Proj(L.wo, att_, 1, xb_, H, AttQx(1)));  // xb: [1, hidden]
  // x = x_alt + attention output; gate: [1, 2 ffn] = gate_up * norm(x); up: [1, ffn] =
  // act(gate) * up, applied where the product writes its rows.
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot0_[l]));
  const ActKind act = static_cast<ActKind>(c.activation);
  if (ActivationInProduct()) {
    CUDA_RETURN_IF_ERROR(NormMatVecGated(L.gate_up, x_alt_, xb_, nullptr, L.ffn_norm, c.norm_eps,
                                         x_, act, up_, UpQx(1), stream_));
  } else {
    CUDA_RETURN_IF_ERROR(
        NormMatVec(L.gate_up, x_alt_, xb_, nullptr, L.ffn_norm, c.norm_eps, x_, gate_, stream_));
    CUDA_RETURN_IF_ERROR(GatedActivationPacked(act, gate_, 1, F, up_, stream_, UpQx(1)));
  }
  BACKEND_RETURN_IF_ERROR(Proj(L.down, up_, 1, hot_out_, H, UpQx(1)));  // [1, hidden]
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(RecordEvent(ev_hot1_[l]));
  return Ok();
}

bool CudaBackend::UsesStepGraph(const ForwardArgs& a, int layer_end) const {
  if (!use_graphs_ || !step_graph_ || a.n != 1 || collect_gpu_times_ || a.hidden_in != nullptr ||
      a.hidden_out != nullptr) {
    return false;
  }
  for (int l = a.layer_begin; l < layer_end; ++l) {
    const DeviceLayer& L = layers_[l];
    if (L.ffn == FfnPlacement::kHot && a.cold != nullptr && !L.cold_ids_host.empty()) {
      return false;
    }
  }
  return true;
}

BackendStatus CudaBackend::RunStepGraph(const ForwardArgs& a, int layer_end, bool head) {
  for (int l = a.layer_begin; l < layer_end; ++l) BACKEND_RETURN_IF_ERROR(PrepareLayer(l, a));
  const std::vector<int64_t> key = {-1,
                                    a.seq,
                                    static_cast<int>(EffectiveMode(a)),
                                    a.run_predictors ? 1 : 0,
                                    a.layer_begin,
                                    layer_end,
                                    head ? 1 : 0};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    cudaGraph_t graph = nullptr;
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    BackendStatus st = EnqueueStep(a, layer_end, head);
    cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (!st.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return st;
    }
    CUDA_RETURN_IF_ERROR(end);
    cudaGraphExec_t exec = nullptr;
    cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_RETURN_IF_ERROR(inst);
    it = graphs_.emplace(key, exec).first;
  }
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
  return Ok();
}

BackendStatus CudaBackend::EnqueueStep(const ForwardArgs& a, int layer_end, bool head) {
  const int H = dims_.hidden;
  CUDA_RETURN_IF_ERROR(Embed(tok_embeddings_, tokens_dev_, 1, x_, stream_));  // x: [1, hidden]
  const float* pend = nullptr;
  for (int l = a.layer_begin; l < layer_end; ++l) {
    BACKEND_RETURN_IF_ERROR(EnqueueLayer(l, a, pend, nullptr, /*cold=*/false, nullptr));
    pend = hot_out_;
  }
  if (head && x_alt_ != nullptr && NormMatVecFits(output_)) {
    // Nothing reads the residual after the step graph (it has no hidden_out), so it is not kept.
    CUDA_RETURN_IF_ERROR(NormMatVec(output_, x_, pend, nullptr, output_norm_, dims_.norm_eps,
                                    nullptr, logits_, stream_));  // [1, vocab]
    return Ok();
  }
  if (pend != nullptr) CUDA_RETURN_IF_ERROR(AddInPlace(x_, pend, H, stream_));
  if (head) {
    CUDA_RETURN_IF_ERROR(RmsNorm(x_, output_norm_, 1, H, dims_.norm_eps, xb_, stream_, XbQx(1)));
    BACKEND_RETURN_IF_ERROR(Proj(output_, xb_, 1, logits_, dims_.vocab, XbQx(1)));  // [1, vocab]
  }
  return Ok();
}

BackendStatus CudaBackend::Forward(const ForwardArgs& a) {
  if (allocate_only_) return AllocateOnlyError();
  const double t_start = Now();
  stats_ = ForwardStats{};
  const ModelDims& c = dims_;
  const int n = a.n, H = c.hidden;
  const int layer_end = a.layer_end < 0 ? c.n_layers : a.layer_end;
  if (n <= 0 || n > max_batch_) {
    return Error(Code::kInvalidArgument, "batch of " + std::to_string(n) + " tokens (max " +
                                             std::to_string(max_batch_) + ")");
  }
  if (a.seq < 0 || a.seq >= max_seqs_) {
    return Error(Code::kInvalidArgument, "sequence slot " + std::to_string(a.seq));
  }
  if (a.pos0 < 0 || a.pos0 + n > max_ctx_) {
    return Error(Code::kOutOfRange, "positions " + std::to_string(a.pos0) + ".." +
                                        std::to_string(a.pos0 + n - 1) + " exceed the context of " +
                                        std::to_string(max_ctx_));
  }
  if (a.layer_begin < 0 || a.layer_begin > layer_end || layer_end > c.n_layers) {
    return Error(Code::kInvalidArgument, "bad layer range");
  }
  if (a.hidden_in == nullptr) {
    if (a.tokens == nullptr) return Error(Code::kInvalidArgument, "no tokens");
    for (int t = 0; t < n; ++t) {
      if (a.tokens[t] < 0 || a.tokens[t] >= c.vocab) {
        return Error(Code::kInvalidArgument,
                     "token id " + std::to_string(a.tokens[t]) + " out of range");
      }
    }
  }
  if (a.logits_mode == LogitsMode::kGreedy && a.greedy == nullptr) {
    return Error(Code::kInvalidArgument, "kGreedy logits without a place for the pick");
  }
  if ((a.mode == FfnMode::kDense) && a.cold != nullptr) {
    return Error(Code::kInvalidArgument, "kDense mode has no cold side");
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  float* exchange_x = a.exchange_x != nullptr ? a.exchange_x : x_host_;
  float* exchange_out = a.exchange_out != nullptr ? a.exchange_out : out_host_;
  int32_t* exchange_active = a.exchange_active != nullptr ? a.exchange_active : active_host_;

  for (int t = 0; t < n; ++t) {
    tokens_host_[t] = a.tokens != nullptr ? a.tokens[t] : 0;
    tokens_host_[max_batch_ + t] = a.pos0 + t;
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_dev_, tokens_host_, 2 * max_batch_ * 4,
                                       cudaMemcpyHostToDevice, stream_));
  // The cosines and sines for the q/k/v products that apply RoPE themselves, in decode steps of
  // models whose layers can fold their small kernels (FusesNorms needs x_alt_).
  if (n == 1 && x_alt_ != nullptr && RopeInProduct()) {
    CUDA_RETURN_IF_ERROR(RopeTable(positions_dev_, inv_freq_, c.head_dim, rope_cos_sin_, stream_));
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_start_, stream_));
  const bool greedy = a.logits_mode == LogitsMode::kGreedy;
  const bool head =
      layer_end == c.n_layers &&
      (greedy ? a.greedy != nullptr : a.logits_mode != LogitsMode::kNone && a.logits != nullptr);
  const bool step_graph = UsesStepGraph(a, layer_end);
  // x: [n, hidden] (the step graph starts with the embedding)
  if (a.hidden_in != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x_, a.hidden_in, static_cast<size_t>(n) * H * 4,
                                         cudaMemcpyHostToDevice, stream_));
  } else if (!step_graph) {
    CUDA_RETURN_IF_ERROR(Embed(tok_embeddings_, tokens_dev_, n, x_, stream_));
  }
  pending1_ = pending2_ = nullptr;
  gpu_first_ = cpu_first_ = 0;
  if (ObservesActive(a)) {
    a.active_out->resize(c.n_layers);
    for (std::vector<int32_t>& v : *a.active_out) v.clear();
  }
  if (step_graph) {
    BackendStatus st = RunStepGraph(a, layer_end, head);
    if (!st.ok()) {
      cudaStreamSynchronize(stream_);
      return st;
    }
  }
  // Decode steps with a cold side queue each layer ahead of the callbacks (prelaunch_).
  const bool queued = !step_graph && prelaunch_ && n == 1 && a.cold != nullptr;
  if (queued) {
    BackendStatus st = RunLayersQueued(a, layer_end, exchange_x, exchange_out, exchange_active);
    if (!st.ok()) return st;  // (it has drained the stream)
  }
  for (int l = a.layer_begin; l < layer_end && !step_graph && !queued; ++l) {
    BackendStatus st = RunLayer(l, a, exchange_x, exchange_out, exchange_active);
    if (!st.ok()) {
      cudaStreamSynchronize(stream_);
      return st;
    }
  }
  if (pending1_ != nullptr) {  // the last layer's FFN output
    if (pending2_ != nullptr) {
      CUDA_RETURN_IF_ERROR(
          Add2InPlace(x_, pending1_, pending2_, static_cast<int64_t>(n) * H, stream_));
    } else {
      CUDA_RETURN_IF_ERROR(AddInPlace(x_, pending1_, static_cast<int64_t>(n) * H, stream_));
    }
    pending1_ = pending2_ = nullptr;
  }
  if (collect_gpu_times_) CUDA_RETURN_IF_ERROR(cudaEventRecord(ev_layers_end_, stream_));
  if (a.hidden_out != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.hidden_out, x_, static_cast<size_t>(n) * H * 4,
                                         cudaMemcpyDeviceToHost, stream_));
  }
  if (head) {
    const int first = a.logits_mode == LogitsMode::kAll ? 0 : n - 1;
    const int count = n - first;
    if (!step_graph) {  // (the step graph ends with these two)
      CUDA_RETURN_IF_ERROR(RmsNorm(x_ + static_cast<size_t>(first) * H, output_norm_, count, H,
                                   c.norm_eps, xb_, stream_, XbQx(count)));
      BACKEND_RETURN_IF_ERROR(
          Proj(output_, xb_, count, logits_, c.vocab, XbQx(count)));  // [count, vocab]
    }
    if (greedy) {
      // The pick reads the logits where the head wrote them; only its 8 bytes cross PCIe.
      CUDA_RETURN_IF_ERROR(
          GreedyPick(logits_, c.vocab, &pick_dev_->token, &pick_dev_->logprob, stream_));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pick_host_, pick_dev_, sizeof(GreedyResult),
                                           cudaMemcpyDeviceToHost, stream_));
    } else {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.logits, logits_,
                                           static_cast<size_t>(count) * c.vocab * 4,
                                           cudaMemcpyDeviceToHost, stream_));
    }
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (head && greedy) *a.greedy = *pick_host_;
  for (int l = a.layer_begin; l < layer_end; ++l) {
    if (layers_[l].ffn == FfnPlacement::kHot) stats_.hot_rows_computed += counts_host_[2 * l];
  }
  stats_.cold_gpu_share = static_cast<double>(share_num_) / kShareDen;
  if (share_adaptive_ && gpu_first_ + cpu_first_ > 0) {
    // Nothing reads the share between steps, so it changes here.
    share_num_ = gpu_first_ > cpu_first_ ? std::min(kShareDen, share_num_ + kShareStep)
                                         : std::max(0, share_num_ - kShareStep);
    *share_dev_ = share_num_;
  }
  if (ObservesActive(a)) {
    // The hot lists (local rows) in global ids, joined with the cold ones FinishCold kept.
    for (int l = a.layer_begin; l < layer_end; ++l) {
      const DeviceLayer& L = layers_[l];
      if (L.ffn != FfnPlacement::kHot) continue;
      const int n_hot = L.n_hot + (UsesCache(L, a) ? L.n_cache : 0);
      if (n_hot == 0) continue;
      const int32_t* obs = observed_host_ + static_cast<size_t>(l) * (c.ffn + 1);
      std::vector<int32_t>& out = (*a.active_out)[l];
      for (int i = 0; i < obs[0]; ++i) {
        const int32_t local = obs[1 + i];
        out.push_back(local < L.n_hot ? L.hot_ids_host[local] : L.slot_neuron[local - L.n_hot]);
      }
      std::sort(out.begin(), out.end());
    }
  }
  if (collect_gpu_times_) {
    for (int l = a.layer_begin; l < layer_end; ++l) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, ev_hot0_[l], ev_hot1_[l]) == cudaSuccess) {
        stats_.gpu_hot_ffn += ms * 1e-3;
      }
      if (CallsColdSide(l, a) && cudaEventElapsedTime(&ms, ev_attn0_[l], ev_x_[l]) == cudaSuccess) {
        stats_.gpu_attention += ms * 1e-3;
      }
      // Queued layers only: the signal's event is recorded where the next layer waits for it.
      if (queued && CallsColdSide(l, a) && l + 1 < layer_end) {
        if (cudaEventElapsedTime(&ms, ev_x_[l], ev_signal_[l]) == cudaSuccess) {
          stats_.gpu_cold_gap += ms * 1e-3;
        }
        if (cudaEventElapsedTime(&ms, ev_signal_[l], ev_attn0_[l + 1]) == cudaSuccess) {
          stats_.gpu_cold_in += ms * 1e-3;
        }
      }
    }
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ev_start_, ev_layers_end_) == cudaSuccess) {
      stats_.gpu_layers = ms * 1e-3;
    }
    cudaGetLastError();
  }
  stats_.total = Now() - t_start;
  return Ok();
}

}  // namespace cuda
}  // namespace pinfer
