// The GpuWorker service's handlers (worker_service.h says what each does) and the ModelInfo it
// reports.
#include "gpu-worker/worker_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shared/chat/model_chat.h"
#include "shared/service/grpc_convert.h"
#include "shared/service/log.h"

namespace pinfer::gpuworker {
namespace {

std::string ActivationLabel(Activation a) {
  switch (a) {
    case Activation::kRelu:
      return "relu";
    case Activation::kSilu:
      return "silu";
    case Activation::kDRelu:
      return "drelu";
  }
  return "?";
}

}  // namespace

namespace wv1 = ::pinfer::worker::v1;

v1::ModelInfo BuildModelInfo(const State& s) {
  const ModelConfig& c = s.model->config;
  v1::ModelInfo info;
  info.set_architecture(c.architecture);
  info.set_model_path(s.model->source_path);
  info.set_context_length(c.max_context);
  info.set_vocab_size(c.vocab_size);
  info.set_hidden_size(c.hidden_size);
  info.set_num_layers(c.n_layers);
  info.set_ffn_size(c.ffn_size);
  info.set_activation(ActivationLabel(c.activation));
  info.set_weight_dtype(std::string(DTypeName(s.model->layers[0].gate.dtype)));
  info.set_max_new_tokens_limit(s.options.max_new_tokens_limit);
  info.set_bos_id(c.bos_id);
  info.set_eos_id(c.eos_id);
  v1::PlacementSummary* p = info.mutable_placement();
  const uint64_t total = static_cast<uint64_t>(c.n_layers) * c.ffn_size;
  p->set_gpu_neurons(s.backend->ffn_neurons());
  p->set_cpu_neurons(total - s.backend->ffn_neurons());
  p->set_gpu_bytes(s.backend->ffn_bytes());
  p->set_cpu_bytes(s.cold_bytes_estimate);
  p->set_gpu_dense_bytes(s.backend->dense_bytes());
  p->set_gpu_backend(s.backend->name());
  p->set_mode(s.options.sparse ? "sparse" : "exact");
  return info;
}

grpc::Status GpuWorkerService::Load(grpc::ServerContext*, const wv1::LoadRequest* req,
                                    wv1::LoadResponse* resp) {
  if (!req->model_path().empty() && req->model_path() != s_->options.model) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("this gpu-worker serves ", s_->options.model,
                                     "; start another worker for ", req->model_path()));
  }
  FillInfo(resp->mutable_info());
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::GetInfo(grpc::ServerContext*, const wv1::InfoRequest*,
                                       wv1::WorkerInfo* info) {
  FillInfo(info);
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::Check(grpc::ServerContext*, const wv1::CheckRequest*,
                                     wv1::CheckResponse* resp) {
  const std::string problem = s_->exchange->PeerProblem();
  resp->set_peer_alive(problem.empty());
  resp->set_state(CurrentState());
  resp->set_running_sequences(s_->scheduler->running());
  resp->set_message(problem);
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::Run(grpc::ServerContext* ctx, const wv1::RunRequest* req,
                                   grpc::ServerWriter<wv1::RunEvent>* writer) {
  SequenceOptions opts;
  const ModelConfig& c = s_->model->config;
  if (req->has_token_ids()) {
    opts.prompt.assign(req->token_ids().ids().begin(), req->token_ids().ids().end());
  } else if (req->has_chat()) {
    // The chat's prompt is the model's template rendered, with the special tokens it writes
    // (<|im_start|>, <s>...) tokenized as those tokens rather than as text.
    std::vector<chat::ChatMessage> messages;
    for (const auto& m : req->chat().messages()) messages.push_back({m.role(), m.content()});
    if (messages.empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a chat needs at least one message");
    }
    auto prompt = chat::RenderChatPrompt(s_->chat, messages, req->chat().add_generation_prompt());
    if (!prompt.ok()) return ToGrpcStatus(prompt.status());
    auto ids = chat::EncodeChatPrompt(s_->chat, *s_->model, *prompt);
    if (!ids.ok()) return ToGrpcStatus(ids.status());
    opts.prompt = std::move(*ids);
  } else {
    if (req->prompt().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty prompt");
    }
    auto ids = s_->model->tokenizer->Encode(req->prompt());
    if (!ids.ok()) return ToGrpcStatus(ids.status());
    if (c.add_bos) opts.prompt.push_back(c.bos_id);
    opts.prompt.insert(opts.prompt.end(), ids->begin(), ids->end());
  }
  opts.gen.max_new_tokens =
      static_cast<int>(std::min<uint32_t>(req->max_new_tokens(), static_cast<uint32_t>(INT32_MAX)));
  opts.gen.sampling = SamplingFromProto(req->sampling());
  opts.gen.stop.assign(req->stop().begin(), req->stop().end());
  opts.gen.stop_at_eos = !req->ignore_eos();
  opts.request_id = req->request_id();
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    opts.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       deadline - std::chrono::system_clock::now());
  }
  auto seq = s_->scheduler->Submit(std::move(opts));
  if (!seq.ok()) return ToGrpcStatus(seq.status());
  std::vector<SequenceEvent> events;
  for (;;) {
    events.clear();
    if (!(*seq)->WaitEvents(&events, std::chrono::milliseconds(50))) {
      if (ctx->IsCancelled()) {
        (*seq)->Cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller");
      }
      continue;
    }
    wv1::RunEvent out;
    bool final = false;
    for (SequenceEvent& e : events) {
      if (!e.status.ok()) return ToGrpcStatus(e.status);
      for (const GeneratedToken& t : e.tokens) {
        v1::Token* pt = out.add_tokens();
        pt->set_id(static_cast<uint32_t>(t.id));
        pt->set_text(t.text);
        pt->set_logprob(t.logprob);
      }
      if (e.prefill_seconds >= 0) out.set_prefill_seconds(e.prefill_seconds);
      out.set_prompt_tokens(e.prompt_tokens);
      out.set_cached_prompt_tokens(e.cached_prompt_tokens);
      out.set_generated_tokens(e.generated_tokens);
      if (e.final) {
        final = true;
        out.set_finish_reason(FinishReasonToProto(e.finish));
      }
    }
    if (!writer->Write(out)) {
      (*seq)->Cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
    }
    if (final) return grpc::Status::OK;
  }
}

grpc::Status GpuWorkerService::Cancel(grpc::ServerContext*, const wv1::CancelRequest* req,
                                      wv1::CancelResponse* resp) {
  resp->set_found(s_->scheduler->CancelById(req->request_id()));
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::Drain(grpc::ServerContext*, const wv1::DrainRequest*,
                                     wv1::DrainResponse* resp) {
  s_->scheduler->Drain();
  resp->set_running_sequences(s_->scheduler->running());
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* req,
                                        v1::TokenizeResponse* resp) {
  const ModelConfig& c = s_->model->config;
  auto ids = s_->model->tokenizer->Encode(req->text());
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  if (req->add_bos() && c.add_bos) {
    resp->add_ids(c.bos_id);
    resp->add_pieces(s_->model->tokenizer->TokenBytes(c.bos_id));
  }
  for (int32_t id : *ids) {
    resp->add_ids(static_cast<uint32_t>(id));
    resp->add_pieces(s_->model->tokenizer->TokenBytes(id));
  }
  return grpc::Status::OK;
}

grpc::Status GpuWorkerService::Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* req,
                                          v1::DetokenizeResponse* resp) {
  std::vector<int32_t> ids;
  for (uint32_t id : req->ids()) {
    if (id >= static_cast<uint32_t>(s_->model->config.vocab_size)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("token id ", id, " is outside the vocabulary"));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  resp->set_text(s_->model->tokenizer->Decode(ids));
  return grpc::Status::OK;
}

wv1::WorkerState GpuWorkerService::CurrentState() const {
  if (s_->scheduler->draining()) return wv1::WORKER_STATE_DRAINING;
  if (!s_->exchange->PeerReady()) return wv1::WORKER_STATE_WAITING_FOR_PEER;
  return wv1::WORKER_STATE_READY;
}

void GpuWorkerService::FillInfo(wv1::WorkerInfo* info) {
  info->set_role("gpu-worker");
  info->set_state(CurrentState());
  info->set_segment(s_->exchange->segment().name());
  *info->mutable_model() = BuildModelInfo(*s_);
  info->set_resident_bytes(ResidentBytes());
  info->set_ffn_row_bytes(s_->backend->ffn_bytes());
  info->set_ffn_neurons(s_->backend->ffn_neurons());
  info->set_backend(s_->backend->name());
  info->set_pid(static_cast<uint32_t>(::getpid()));
}

}  // namespace pinfer::gpuworker
