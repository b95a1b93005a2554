// The gpu-worker's start-up steps (startup.h says what each sets and when it fails). They log
// what they decide: the placement's source, the VRAM plan against what was allocated, the backend
// in use and the options the CPU backend ignores.
#include "gpu-worker/startup.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "shared/chat/model_chat.h"
#include "shared/service/ffn_split.h"
#include "shared/service/log.h"
#include "shared/sparse/auto_prepare.h"
#include "shared/sparse/prepared_model.h"
#include "shared/sparse/profiler.h"
#include "shared/util/status_macros.h"

namespace pinfer::gpuworker {
namespace {

CudaBackendOptions CudaOptions(const State& s) {
  CudaBackendOptions cbo;
  cbo.slots = s.options.gpu_slots;
  cbo.max_ctx = s.model->config.max_context;
  cbo.device = s.options.cuda_device;
  cbo.gpu_timing = s.options.gpu_timing;
  if (s.options.sparse) cbo.predictors = s.service_model.predictors();
  cbo.cold_prefill = s.cold_prefill;
  cbo.stream_chunk_rows = s.options.stream_chunk_rows;
  cbo.stream_slots = s.options.stream_slots;
  cbo.adaptive_cache_rows = s.options.adaptive_cache_rows;
  cbo.cache_background = s.options.adaptive_cache_thread;
  cbo.cold_gpu_share = s.options.cold_gpu_share;
  cbo.cold_gpu_share_auto = s.options.cold_gpu_share_auto;
  cbo.decode_lanes = s.options.decode_lanes;
  cbo.cold_guess = s.options.cold_guess;
  return cbo;
}

// The placement for --vram-budget: the activation profile of a prepared model, else one measured
// now on the bundled calibration text; with a GPU, the CUDA module's own footprint (measured by
// creating it once without FFN rows) replaces the generic byte formulas, so that the plan is what
// this process allocates. Without a GPU the generic accounting decides which neurons the CPU
// backend computes here, as they would be on a GPU of that size.
absl::StatusOr<PlacementPlan> PlanForBudget(const State& s) {
  const Options& o = s.options;
  const Model& model = *s.model;
  ActivationProfile profile;
  if (s.service_model.prepared != nullptr &&
      !s.service_model.prepared->activation_frequency.empty()) {
    ASSIGN_OR_RETURN(profile, StoredProfile(*s.service_model.prepared));
    Log("placement from the prepared model's activation profile (%lld tokens)",
        static_cast<long long>(profile.tokens));
  } else {
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                     TokenizeCalibrationText(model, BundledCalibrationText()));
    ProfileOptions po;
    po.window = std::min(512, model.config.max_context);
    po.keep_inputs = false;
    po.max_tokens = 16384;  // plenty for a frequency ranking, bounded start-up time
    if (const char* env = std::getenv("PINFER_AUTO_PREPARE_MAX_TOKENS")) {
      po.max_tokens = std::max(1, std::atoi(env));
    }
    Log("profiling up to %lld tokens of the bundled calibration text for the placement (prepare "
        "the model with `pinfer prepare` to skip this)",
        static_cast<long long>(std::min<int64_t>(po.max_tokens, tokens.size())));
    ASSIGN_OR_RETURN(ProfileResult r, ProfileActivations(model, *s.ops, tokens, po));
    profile = std::move(r.profile);
  }
  PlacementOptions po;
  po.vram_budget = o.vram_budget;
  po.context = model.config.max_context * o.gpu_slots;
  po.max_batch = o.max_batch_tokens;
  if (s.gpu.available) {
    ASSIGN_OR_RETURN(CudaFootprint f,
                     MeasureCudaFootprint(model, o.max_batch_tokens, s.gpu.module, CudaOptions(s)));
    Log("the CUDA backend holds %s before any FFN row", MiB(f.fixed_bytes).c_str());
    po.measured_fixed_bytes = f.fixed_bytes;
    po.backend_neuron_bytes = std::move(f.neuron_bytes);
    po.cache_bytes = AdaptiveCacheBytes(model, o.adaptive_cache_rows);
  }
  return PlanPlacement(model, profile, s.options.sparse ? s.service_model.predictors() : nullptr,
                       po);
}

}  // namespace

std::string MiB(uint64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

GpuProbe ProbeGpu(const Options& o) {
  GpuProbe p;
  if (o.backend == "cpu") {
    p.reason = "--backend cpu";
    return p;
  }
  std::vector<std::string> candidates;
  if (!o.cuda_module.empty()) candidates.push_back(o.cuda_module);
  if (const char* env = std::getenv("PINFER_CUDA_MODULE")) candidates.push_back(env);
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len > 0) {
    std::string dir(self, len);
    dir = dir.substr(0, dir.rfind('/'));
    candidates.push_back(dir + "/libpinfer_cuda.so");
    candidates.push_back(dir + "/../gpu-worker/cuda/libpinfer_cuda.so");
  }
  candidates.push_back("libpinfer_cuda.so");
  std::string errors;
  for (const std::string& path : candidates) {
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", ::dlerror());
      continue;
    }
    using CountFn = int (*)();
    auto count = reinterpret_cast<CountFn>(::dlsym(h, "pinfer_cuda_device_count"));
    const int n = count != nullptr ? count() : 0;
    if (n > 0) {
      p.available = true;
      p.module = path;
      p.reason = absl::StrCat(n, " CUDA device(s) via ", path);
    } else {
      p.reason = absl::StrCat(path, " loaded but reports no CUDA device");
    }
    ::dlclose(h);
    return p;
  }
  p.reason = absl::StrCat("no CUDA module could be loaded (", errors, ")");
  return p;
}

bool DecideColdPrefill(State& s) {
  const Options& o = s.options;
  s.cold_prefill = o.cold_prefill;
  if (s.gpu.available && s.cold_prefill != ColdPrefill::kCpu) {
    const std::string problem = ColdStreamingProblem(*s.model);
    if (!problem.empty()) {
      if (o.cold_prefill_given && o.cold_prefill == ColdPrefill::kStream) {
        Log("--cold-prefill stream: cannot stream this model's cold rows: %s", problem.c_str());
        return false;
      }
      Log("cold prefill: the cpu-worker computes every cold row (%s)", problem.c_str());
      s.cold_prefill = ColdPrefill::kCpu;
    }
  }
  return true;
}

bool ChoosePlacement(State& s) {
  const Options& o = s.options;
  const ModelConfig& c = s.model->config;
  if (s.gpu.available) {
    if (absl::Status st = CudaModuleComputes(*s.model); !st.ok()) {
      if (o.backend == "cuda") {
        Log("cannot start the CUDA backend: %s", st.ToString().c_str());
        return false;
      }
      s.gpu.available = false;
      s.gpu.reason = std::string(st.message());
    }
  }
  // Placement: a PowerInfer GPU index (given, or beside the model as `pinfer prepare` and
  // PowerInfer write it), else a fixed fraction of every layer.
  std::string index_path = o.placement;
  if (index_path.empty() && !o.hot_fraction_given && o.vram_budget == 0) {
    const std::string beside = GpuIndexPath(o.model);
    if (::access(beside.c_str(), R_OK) == 0) index_path = beside;
  }
  if (o.vram_budget > 0) {
    absl::StatusOr<PlacementPlan> plan = PlanForBudget(s);
    if (!plan.ok()) {
      Log("cannot place the model in a VRAM budget of %s: %s", MiB(o.vram_budget).c_str(),
          plan.status().ToString().c_str());
      return false;
    }
    s.vram_plan = std::move(*plan);
    s.placement.hot = s.vram_plan->hot;
    for (absl::string_view line : absl::StrSplit(s.vram_plan->Summary(), '\n')) {
      if (!line.empty()) Log("placement: %s", std::string(line).c_str());
    }
  } else if (!index_path.empty()) {
    auto index = ReadGpuIndex(index_path, c.n_layers, c.ffn_size);
    if (!index.ok()) {
      Log("cannot use the placement %s: %s", index_path.c_str(), index.status().ToString().c_str());
      return false;
    }
    s.placement.hot = index->gpu_bucket;
    Log("placement from %s", index_path.c_str());
  } else {
    s.placement = Placement::FixedFraction(c, o.hot_fraction);
  }
  return true;
}

bool CreateExchange(State& s) {
  const Options& o = s.options;
  const ModelConfig& c = s.model->config;
  shm::Geometry g;
  g.n_layers = c.n_layers;
  g.hidden = c.hidden_size;
  g.ffn = c.ffn_size;
  g.max_tokens = o.max_batch_tokens;
  g.fingerprint = ModelFingerprint(*s.model);
  const std::string segment_name = o.segment.empty() ? shm::UniqueSegmentName() : o.segment;
  auto segment = shm::Segment::Create(segment_name, g);
  if (!segment.ok()) {
    Log("cannot create the activation segment: %s", segment.status().ToString().c_str());
    return false;
  }
  for (int l = 0; l < c.n_layers; ++l) {
    s.placement.ToBitmap(l, c.ffn_size, (*segment)->hot_bitmap(l));
  }
  shm::ChannelOptions co;
  co.exchange_timeout_ns = o.exchange_timeout_ms * 1'000'000;
  co.liveness_ns = o.liveness_ms * 1'000'000;
  co.spin_ns = o.exchange_spin_us * 1'000;
  s.exchange = std::make_unique<shm::ExchangeClient>(std::move(*segment), co);
  Log("activation segment %s (%zu bytes, up to %d tokens per exchange)", segment_name.c_str(),
      s.exchange->segment().size(), o.max_batch_tokens);
  return true;
}

namespace {

// Reads the Chat RPC's template (--chat-template, else the model's own) and the tokenizer's
// special tokens. A template that does not parse only warns: the worker still serves Generate,
// and each Chat answers the parse error.
void LoadChat(State& s) {
  auto chat = chat::LoadModelChat(*s.model, s.options.chat_template);
  if (!chat.ok()) {
    s.chat.template_error = chat.status();
    Log("warning: Chat is unavailable: %s", chat.status().ToString().c_str());
    return;
  }
  s.chat = std::move(*chat);
  if (!s.chat.template_error.ok()) {
    Log("warning: the chat template does not parse, Chat requests will fail: %s",
        s.chat.template_error.ToString().c_str());
  } else if (s.chat.chat_template) {
    Log("chat template from %s", s.chat.template_origin.c_str());
  } else {
    Log("the model has no chat template: Chat needs --chat-template FILE");
  }
}

}  // namespace

bool CreateBackend(State& s) {
  LoadChat(s);  // start-up's last step before serving, with the model's files still at hand
  const Options& o = s.options;
  const ModelConfig& c = s.model->config;
  if (s.gpu.available) {
    auto cuda =
        NewCudaBackend(*s.model, s.placement, s.exchange.get(), s.gpu.module, CudaOptions(s));
    if (cuda.ok()) {
      s.backend = std::move(*cuda);
      Log("computing the gpu-worker's share on the GPU (%s)", s.gpu.reason.c_str());
    } else if (o.backend == "cuda") {
      Log("cannot start the CUDA backend: %s", cuda.status().ToString().c_str());
      return false;
    } else {
      s.gpu.available = false;
      s.gpu.reason = absl::StrCat("the CUDA backend failed: ", cuda.status().ToString());
    }
  }
  if (s.backend == nullptr) {
    Log("no usable GPU (%s): computing the gpu-worker's share on the CPU with %d thread(s)",
        s.gpu.reason.c_str(), o.threads);
    if (o.cold_prefill_given) {
      Log("--cold-prefill %s ignored: the CPU backend sends every cold row to the cpu-worker",
          ColdPrefillName(o.cold_prefill));
    }
    if (o.adaptive_cache_rows > 0) {
      Log("--adaptive-cache-rows %d ignored: the CPU backend has no device memory to cache in",
          o.adaptive_cache_rows);
    }
    if (o.decode_lanes_given) {
      Log("--decode-lanes %d ignored: the CPU backend computes a decode batch in one pass",
          o.decode_lanes);
    }
    auto backend = NewCpuBackend(*s.model, *s.ops, s.placement, s.exchange.get(),
                                 o.sparse ? s.service_model.predictors() : nullptr, s.pool.get());
    if (!backend.ok()) {
      Log("cannot build the backend: %s", backend.status().ToString().c_str());
      return false;
    }
    s.backend = std::move(*backend);
  }
  if (s.vram_plan.has_value() && s.backend->device_bytes() > 0) {
    const double plan = static_cast<double>(s.vram_plan->gpu_bytes());
    const double actual = static_cast<double>(s.backend->device_bytes());
    Log("VRAM: planned %s, allocated %s (%+.2f%%)%s", MiB(s.vram_plan->gpu_bytes()).c_str(),
        MiB(s.backend->device_bytes()).c_str(), 100 * (actual / plan - 1),
        std::abs(actual / plan - 1) > 0.05 ? ": more than 5% off the plan" : "");
  }
  // Building the hot rows read the whole down matrices; drop those pages, what we use comes back.
  ReleaseMappedPages(*s.model);
  {
    const uint64_t total = static_cast<uint64_t>(c.n_layers) * c.ffn_size;
    const uint64_t per_neuron = s.backend->ffn_neurons() > 0
                                    ? s.backend->ffn_bytes() / s.backend->ffn_neurons()
                                    : 3 * RowBytes(s.model->layers[0].gate.dtype, c.hidden_size);
    s.cold_bytes_estimate = (total - s.backend->ffn_neurons()) * per_neuron;
  }
  Log("placement: %zu of %zu FFN neurons hot (%.1f MiB of rows here), %s mode",
      static_cast<size_t>(s.backend->ffn_neurons()), static_cast<size_t>(c.n_layers) * c.ffn_size,
      s.backend->ffn_bytes() / 1048576.0, o.sparse ? "sparse (predictors)" : "exact");
  return true;
}

}  // namespace pinfer::gpuworker
