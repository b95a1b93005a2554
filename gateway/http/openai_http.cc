// The OpenAI-compatible HTTP API. Each handler parses the JSON body strictly (wrong types and
// unsupported options get a 400 that names the field, rather than being silently ignored, since
// a client asking for n=3 or top_logprobs would otherwise get a different answer than it asked
// for), turns it into a GenerateRequest or ChatRequest, and calls the gateway's own gRPC API.
// Streams are forwarded as server-sent events. A client that goes away cancels its gRPC call,
// freeing its worker slot: when a write to it fails, or when its socket reports the hang-up
// (hangup_watch.h; this covers replies that are not streamed).
#include "gateway/http/openai_http.h"

#include <chrono>
#include <cstdint>
#include <ctime>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gateway/http/chat_page.h"
#include "gateway/http/hangup_watch.h"
#include "grpcpp/grpcpp.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "shared/metrics/metrics.h"

namespace pinfer::gateway {

namespace v1 = ::pinfer::v1;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// An error for the client: the HTTP status and OpenAI's error fields.
struct HttpError {
  int status;
  std::string message, type, param, code;
};

void SendError(httplib::Response& res, const HttpError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  res.status = e.status;
  res.set_content(json{{"error", err}}.dump(), "application/json");
}

HttpError BadRequest(std::string message, std::string param = "") {
  return {400, std::move(message), "invalid_request_error", std::move(param), ""};
}

HttpError Unsupported(const std::string& field, const std::string& why) {
  return {400, absl::StrCat("'", field, "' is not supported by this server: ", why),
          "invalid_request_error", field, "unsupported_parameter"};
}

// The HTTP status and error type for a gRPC status from the gateway.
HttpError FromGrpc(const grpc::Status& st) {
  const std::string msg = st.error_message();
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:  // e.g. the model has no chat template
      return {400, msg, "invalid_request_error", "", ""};
    case grpc::StatusCode::NOT_FOUND:
      return {404, msg, "invalid_request_error", "", "not_found"};
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return {429, msg, "rate_limit_error", "", "rate_limit_exceeded"};
    case grpc::StatusCode::UNAVAILABLE:
      return {503, msg, "server_error", "", "unavailable"};
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return {504, msg, "server_error", "", "timeout"};
    case grpc::StatusCode::UNIMPLEMENTED:
      return {501, msg, "server_error", "", "not_implemented"};
    case grpc::StatusCode::CANCELLED:
      return {499, msg, "server_error", "", "cancelled"};
    default:
      return {500, msg, "server_error", "", ""};
  }
}

std::string FinishReason(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_EOS:
    case v1::FINISH_REASON_STOP:
    case v1::FINISH_REASON_CANCELLED:
      return "stop";
    default:
      return "";
  }
}

// Constant time in the key's length, so the comparison does not reveal a matching prefix.
bool KeyMatches(const std::string& given, const std::string& want) {
  if (given.size() != want.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff |= given[i] ^ want[i];
  return diff == 0;
}

// The options both endpoints share, parsed from the body with their types checked.
struct Common {
  uint32_t max_tokens = 0;  // 0: the gateway's default
  v1::SamplingParams sampling;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, logprobs = false;
  bool ignore_eos = false;  // vLLM's extension, for benchmarks that need a fixed length
};

// Reads an optional number field; a wrong type is a 400 naming it.
bool GetNumber(const json& body, const char* key, double* out, HttpError* err) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_number()) {
    *err = BadRequest(absl::StrCat("'", key, "' must be a number"), key);
    return false;
  }
  *out = it->get<double>();
  return true;
}

std::optional<HttpError> ParseCommon(const json& body, bool chat, Common* c) {
  HttpError err{0, "", "", "", ""};
  double v;
  // OpenAI's default temperature is 1 (the proto's 0 would mean greedy).
  c->sampling.set_temperature(1.0f);
  if (GetNumber(body, "temperature", &v, &err)) {
    if (v < 0 || v > 2) return BadRequest("'temperature' must be between 0 and 2", "temperature");
    c->sampling.set_temperature(static_cast<float>(v));
  }
  if (err.status) return err;
  if (GetNumber(body, "top_p", &v, &err)) {
    if (v <= 0 || v > 1) return BadRequest("'top_p' must be in (0, 1]", "top_p");
    if (v < 1) c->sampling.set_top_p(static_cast<float>(v));
  }
  if (err.status) return err;
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (GetNumber(body, key, &v, &err)) {
      if (!body[key].is_number_integer() || v < 1 || v > 1e7) {
        return BadRequest(absl::StrCat("'", key, "' must be a positive integer"), key);
      }
      c->max_tokens = static_cast<uint32_t>(v);
    }
    if (err.status) return err;
  }
  if (GetNumber(body, "seed", &v, &err)) {
    if (!body["seed"].is_number_integer()) return BadRequest("'seed' must be an integer", "seed");
    c->sampling.set_seed(body["seed"].is_number_unsigned()
                             ? body["seed"].get<uint64_t>()
                             : static_cast<uint64_t>(body["seed"].get<int64_t>()));
  }
  if (err.status) return err;
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (GetNumber(body, key, &v, &err) && v != 0) {
      return Unsupported(key, "only 0 (no penalty) is implemented");
    }
    if (err.status) return err;
  }
  if (GetNumber(body, "n", &v, &err) && v != 1) return Unsupported("n", "one choice per request");
  if (err.status) return err;
  if (GetNumber(body, "best_of", &v, &err) && v != 1) return Unsupported("best_of", "n=1 only");
  if (err.status) return err;
  if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      c->stop.push_back(it->get<std::string>());
    } else if (it->is_array() && it->size() <= 4) {
      for (const json& s : *it) {
        if (!s.is_string())
          return BadRequest("'stop' must be a string or a list of strings", "stop");
        c->stop.push_back(s.get<std::string>());
      }
    } else {
      return BadRequest("'stop' must be a string or a list of up to 4 strings", "stop");
    }
  }
  if (auto it = body.find("stream"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return BadRequest("'stream' must be a boolean", "stream");
    c->stream = it->get<bool>();
  }
  if (auto it = body.find("ignore_eos"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return BadRequest("'ignore_eos' must be a boolean", "ignore_eos");
    c->ignore_eos = it->get<bool>();
  }
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return BadRequest("'stream_options' must be an object", "stream_options");
    if (auto u = it->find("include_usage"); u != it->end() && !u->is_null()) {
      if (!u->is_boolean()) {
        return BadRequest("'stream_options.include_usage' must be a boolean", "stream_options");
      }
      c->include_usage = u->get<bool>();
    }
  }
  if (auto it = body.find("logit_bias"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return BadRequest("'logit_bias' must be an object", "logit_bias");
    if (!it->empty()) return Unsupported("logit_bias", "no logit bias is implemented");
  }
  if (auto it = body.find("logprobs"); it != body.end() && !it->is_null()) {
    if (chat) {
      if (!it->is_boolean()) return BadRequest("'logprobs' must be a boolean", "logprobs");
      c->logprobs = it->get<bool>();
    } else {
      // The completions API's logprobs is the number of alternatives; only the sampled token's
      // own log-probability is known.
      if (!it->is_number_integer()) return BadRequest("'logprobs' must be an integer", "logprobs");
      if (it->get<int64_t>() != 0) {
        return Unsupported("logprobs", "only 0 (the sampled tokens' own log-probabilities)");
      }
      c->logprobs = true;
    }
  }
  if (auto it = body.find("top_logprobs"); it != body.end() && !it->is_null()) {
    if (!it->is_number_integer())
      return BadRequest("'top_logprobs' must be an integer", "top_logprobs");
    if (it->get<int64_t>() != 0) return Unsupported("top_logprobs", "no alternatives are kept");
  }
  for (const char* key : {"tools", "functions"}) {
    if (auto it = body.find(key);
        it != body.end() && !it->is_null() && !(it->is_array() && it->empty())) {
      return Unsupported(key, "no tool calling");
    }
  }
  if (auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    if (!it->is_object() || it->value("type", "") != "text") {
      return Unsupported("response_format", "only {\"type\": \"text\"}");
    }
  }
  if (auto it = body.find("echo"); it != body.end() && it->is_boolean() && it->get<bool>()) {
    return Unsupported("echo", "the prompt is not echoed");
  }
  if (auto it = body.find("suffix"); it != body.end() && !it->is_null()) {
    return Unsupported("suffix", "no insertion");
  }
  return std::nullopt;
}

std::string Sse(const json& j) { return absl::StrCat("data: ", j.dump(), "\n\n"); }

json TokenLogprobs(const v1::GenerateResponse& r, bool chat) {
  json out = json::array();
  for (const v1::Token& t : r.tokens()) {
    if (chat) {
      json bytes = json::array();
      for (unsigned char ch : t.text()) bytes.push_back(static_cast<int>(ch));
      out.push_back({{"token", t.text()},
                     {"logprob", t.logprob()},
                     {"bytes", bytes},
                     {"top_logprobs", json::array()}});
    } else {
      out.push_back(t.logprob());
    }
  }
  return out;
}

// Routes for the metrics' path label; anything else is "other" so that scanners probing random
// paths cannot grow the label set.
std::string PathLabel(const std::string& path) {
  static const char* const kKnown[] = {
      "/", "/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/pinfer/info"};
  for (const char* k : kKnown) {
    if (path == k) return k;
  }
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

// When the request being handled on this thread arrived; unset for requests httplib rejects
// before routing (oversized or malformed), which are counted without a latency.
thread_local std::optional<Clock::time_point> request_start;

constexpr int kHttpThreads = 96;

}  // namespace

struct OpenAiHttpServer::Impl {
  HttpOptions options;
  std::unique_ptr<v1::Inference::Stub> stub;
  prometheus::Family<prometheus::Counter>* requests = nullptr;
  prometheus::Family<prometheus::Histogram>* latency = nullptr;
  std::atomic<bool>* stopped = nullptr;

  absl::Mutex mu;
  // The served model, fetched on first use: workers may come up after the gateway.
  std::optional<v1::ModelInfo> info ABSL_GUARDED_BY(mu);

  // The model's info (cached once a worker answered).
  grpc::Status ModelInfo(v1::ModelInfo* out) {
    {
      absl::MutexLock l(&mu);
      if (info.has_value()) {
        *out = *info;
        return grpc::Status::OK;
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status st = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), out);
    if (st.ok()) {
      absl::MutexLock l(&mu);
      info = *out;
    }
    return st;
  }

  // The id clients name the model by: the model directory's (or file's) base name.
  static std::string ModelId(const v1::ModelInfo& info) {
    std::string p = info.model_path();
    while (!p.empty() && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    std::string id = slash == std::string::npos ? p : p.substr(slash + 1);
    return id.empty() ? "pinfer" : id;
  }

  // Checks the body's "model" against the served one (absent is accepted). Returns the id.
  std::optional<HttpError> CheckModel(const json& body, std::string* id) {
    v1::ModelInfo mi;
    grpc::Status st = ModelInfo(&mi);
    if (!st.ok()) return FromGrpc(st);
    *id = ModelId(mi);
    auto it = body.find("model");
    if (it == body.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) return BadRequest("'model' must be a string", "model");
    const std::string want = it->get<std::string>();
    if (!want.empty() && want != *id) {
      return HttpError{
          404,
          absl::StrCat("The model '", want, "' does not exist; this server serves '", *id, "'"),
          "invalid_request_error", "model", "model_not_found"};
    }
    return std::nullopt;
  }

  bool Authorized(const httplib::Request& req) {
    if (options.api_key.empty()) return true;
    const std::string h = req.get_header_value("Authorization");
    constexpr char kBearer[] = "Bearer ";
    if (h.rfind(kBearer, 0) != 0) return false;
    return KeyMatches(h.substr(sizeof(kBearer) - 1), options.api_key);
  }

  // Parses the body as a JSON object.
  std::optional<HttpError> ParseBody(const httplib::Request& req, json* body) {
    *body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body->is_discarded()) {
      return BadRequest("We could not parse the JSON body of your request.");
    }
    if (!body->is_object()) return BadRequest("The request body must be a JSON object.");
    return std::nullopt;
  }

  void HandleModels(const httplib::Request& req, httplib::Response& res) {
    v1::ModelInfo mi;
    grpc::Status st = ModelInfo(&mi);
    if (!st.ok()) return SendError(res, FromGrpc(st));
    json model = {{"id", ModelId(mi)}, {"object", "model"}, {"created", 0}, {"owned_by", "pinfer"}};
    if (req.matches.size() > 1) {
      if (req.matches[1] != ModelId(mi)) {
        return SendError(
            res, {404, absl::StrCat("The model '", req.matches[1].str(), "' does not exist"),
                  "invalid_request_error", "model", "model_not_found"});
      }
      return res.set_content(model.dump(), "application/json");
    }
    res.set_content(json{{"object", "list"}, {"data", json::array({model})}}.dump(),
                    "application/json");
  }

  void HandleInfo(httplib::Response& res) {
    v1::ModelInfo mi;
    grpc::Status st = ModelInfo(&mi);
    if (!st.ok()) return SendError(res, FromGrpc(st));
    const v1::PlacementSummary& p = mi.placement();
    const double total = static_cast<double>(p.gpu_neurons() + p.cpu_neurons());
    json j = {{"model", ModelId(mi)},
              {"architecture", mi.architecture()},
              {"context_length", mi.context_length()},
              {"num_layers", mi.num_layers()},
              {"ffn_size", mi.ffn_size()},
              {"activation", mi.activation()},
              {"weight_dtype", mi.weight_dtype()},
              {"max_new_tokens_limit", mi.max_new_tokens_limit()},
              {"placement",
               {{"gpu_neurons", p.gpu_neurons()},
                {"cpu_neurons", p.cpu_neurons()},
                {"gpu_share", total > 0 ? p.gpu_neurons() / total : 0.0},
                {"gpu_bytes", p.gpu_bytes()},
                {"cpu_bytes", p.cpu_bytes()},
                {"gpu_backend", p.gpu_backend()},
                {"mode", p.mode()}}}};
    res.set_content(j.dump(), "application/json");
  }

  void HandleHealth(httplib::Response& res) {
    v1::ModelInfo mi;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    // GetModelInfo answers only with a healthy worker, which is what /health should say.
    grpc::Status st = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &mi);
    if (!st.ok()) return SendError(res, FromGrpc(st));
    res.set_content(R"({"status":"ok"})", "application/json");
  }

  // Both generation endpoints: `chat` picks the RPC and the response shape.
  void HandleGenerate(const httplib::Request& req, httplib::Response& res, bool chat) {
    json body;
    if (auto e = ParseBody(req, &body)) return SendError(res, *e);
    Common c;
    if (auto e = ParseCommon(body, chat, &c)) return SendError(res, *e);
    v1::GenerateRequest greq;
    v1::ChatRequest creq;
    if (chat) {
      auto it = body.find("messages");
      if (it == body.end() || !it->is_array() || it->empty()) {
        return SendError(res, BadRequest("'messages' must be a non-empty list", "messages"));
      }
      for (const json& m : *it) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
          return SendError(res, BadRequest("each message needs a string 'role'", "messages"));
        }
        v1::ChatMessage* cm = creq.add_messages();
        cm->set_role(m["role"].get<std::string>());
        const json& content = m.contains("content") ? m["content"] : json(nullptr);
        if (content.is_string()) {
          cm->set_content(content.get<std::string>());
        } else if (content.is_array()) {
          // The parts form: text parts are concatenated; images are not understood.
          std::string text;
          for (const json& part : content) {
            if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
                !part["text"].is_string()) {
              return SendError(res, Unsupported("messages", "only text content parts"));
            }
            text += part["text"].get<std::string>();
          }
          cm->set_content(text);
        } else if (!content.is_null()) {
          return SendError(
              res,
              BadRequest("a message's 'content' must be a string or a list of parts", "messages"));
        }
      }
      creq.set_max_new_tokens(c.max_tokens);
      *creq.mutable_sampling() = c.sampling;
      for (const std::string& s : c.stop) creq.add_stop(s);
      creq.set_ignore_eos(c.ignore_eos);
    } else {
      auto it = body.find("prompt");
      if (it == body.end() || it->is_null()) {
        return SendError(res, BadRequest("'prompt' is required", "prompt"));
      }
      const json* p = &*it;
      if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
        p = &(*p)[0];  // one prompt in a list
      }
      if (p->is_string()) {
        greq.set_prompt(p->get<std::string>());
      } else if (p->is_array() && !p->empty()) {
        for (const json& id : *p) {
          if (!id.is_number_unsigned() || id.get<uint64_t>() > UINT32_MAX) {
            return SendError(res, BadRequest("'prompt' must be a string, a list of one string or a "
                                             "list of token ids",
                                             "prompt"));
          }
          greq.mutable_token_ids()->add_ids(id.get<uint32_t>());
        }
      } else {
        return SendError(res, p->is_array() && p->size() > 1
                                  ? Unsupported("prompt", "one prompt per request")
                                  : BadRequest("'prompt' must be a string or token ids", "prompt"));
      }
      greq.set_max_new_tokens(c.max_tokens);
      *greq.mutable_sampling() = c.sampling;
      for (const std::string& s : c.stop) greq.add_stop(s);
      greq.set_ignore_eos(c.ignore_eos);
    }
    std::string model_id;
    if (auto e = CheckModel(body, &model_id)) return SendError(res, *e);

    // The call's state outlives this handler when streaming (the content provider reads on).
    struct Call {
      grpc::ClientContext ctx;
      std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
      v1::GenerateResponse first;
      bool have_first = false;
      std::unique_ptr<HangupWatch> watch;  // last: it ends before `ctx`, which it cancels
    };
    auto call = std::make_shared<Call>();
    // A client that hangs up while its request is queued, in prefill or (not streaming) being
    // generated writes nothing that could fail, so its socket is watched for the hang-up.
    if (std::optional<int> fd =
            FindConnectedSocket(req.local_addr, req.local_port, req.remote_addr, req.remote_port)) {
      call->watch = std::make_unique<HangupWatch>(*fd, [c = call.get()] { c->ctx.TryCancel(); });
    }
    if (chat) {
      call->reader = stub->Chat(&call->ctx, creq);
    } else {
      call->reader = stub->Generate(&call->ctx, greq);
    }
    // The first message decides between a stream and an error status: admission failures
    // (queue full, no worker, bad arguments) come before any token.
    call->have_first = call->reader->Read(&call->first);
    if (!call->have_first) {
      grpc::Status st = call->reader->Finish();
      if (!st.ok()) return SendError(res, FromGrpc(st));
    }
    const std::string id =
        absl::StrFormat("%s-%016x", chat ? "chatcmpl" : "cmpl",
                        static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
    const int64_t created = static_cast<int64_t>(std::time(nullptr));
    const std::string object = chat ? "chat.completion" : "text_completion";

    auto usage_json = [](const v1::Usage& u) {
      return json{{"prompt_tokens", u.prompt_tokens()},
                  {"completion_tokens", u.generated_tokens()},
                  {"total_tokens", u.prompt_tokens() + u.generated_tokens()},
                  {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens()}}}};
    };

    if (!c.stream) {
      std::string text;
      json logprobs = json::array();
      v1::Usage usage;
      std::string finish;
      v1::GenerateResponse r;
      bool more = call->have_first;
      if (more) r = call->first;
      while (more) {
        for (const v1::Token& t : r.tokens()) text += t.text();
        if (c.logprobs) {
          for (json& l : TokenLogprobs(r, chat)) logprobs.push_back(std::move(l));
        }
        if (r.has_usage()) usage = r.usage();
        if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
          finish = FinishReason(r.finish_reason());
        }
        more = call->reader->Read(&r);
      }
      if (call->have_first) {
        grpc::Status st = call->reader->Finish();
        if (!st.ok()) return SendError(res, FromGrpc(st));
      }
      json choice = {{"index", 0},
                     {"finish_reason", finish.empty() ? json(nullptr) : json(finish)}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
        choice["logprobs"] = c.logprobs ? json{{"content", logprobs}} : json(nullptr);
      } else {
        choice["text"] = text;
        choice["logprobs"] = c.logprobs ? json{{"token_logprobs", logprobs}} : json(nullptr);
      }
      json out = {{"id", id},
                  {"object", object},
                  {"created", created},
                  {"model", model_id},
                  {"choices", json::array({choice})},
                  {"usage", usage_json(usage)}};
      return res.set_content(out.dump(), "application/json");
    }

    // Streaming: one SSE event per gRPC message.
    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    std::atomic<bool>* stopped_flag = stopped;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");  // proxies such as nginx must not buffer SSE
    res.set_chunked_content_provider(
        "text/event-stream", [call, c, chat, id, created, model_id, chunk_object, usage_json,
                              stopped_flag](size_t, httplib::DataSink& sink) {
          auto base = [&] {
            return json{
                {"id", id}, {"object", chunk_object}, {"created", created}, {"model", model_id}};
          };
          auto write = [&](const std::string& s) {
            if (stopped_flag->load() || !sink.write(s.data(), s.size())) {
              call->ctx.TryCancel();  // the client is gone: free the worker slot
              return false;
            }
            return true;
          };
          if (chat) {
            // OpenAI's streams open with the role.
            json j = base();
            j["choices"] = json::array({{{"index", 0},
                                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                                         {"logprobs", nullptr},
                                         {"finish_reason", nullptr}}});
            if (c.include_usage) j["usage"] = nullptr;
            if (!write(Sse(j))) return false;
          }
          v1::Usage usage;
          v1::GenerateResponse r;
          bool more = call->have_first;
          if (more) r = call->first;
          while (more) {
            if (r.has_usage()) usage = r.usage();
            std::string text;
            for (const v1::Token& t : r.tokens()) text += t.text();
            const std::string finish = FinishReason(r.finish_reason());
            if (!text.empty() || !finish.empty()) {
              json choice = {{"index", 0},
                             {"finish_reason", finish.empty() ? json(nullptr) : json(finish)}};
              json lp = c.logprobs && r.tokens_size() > 0 ? TokenLogprobs(r, chat) : json(nullptr);
              if (chat) {
                choice["delta"] = text.empty() ? json::object() : json{{"content", text}};
                choice["logprobs"] = lp.is_null() ? lp : json{{"content", lp}};
              } else {
                choice["text"] = text;
                choice["logprobs"] = lp.is_null() ? lp : json{{"token_logprobs", lp}};
              }
              json j = base();
              j["choices"] = json::array({choice});
              if (c.include_usage) j["usage"] = nullptr;
              if (!write(Sse(j))) return false;
            }
            more = call->reader->Read(&r);
          }
          grpc::Status st = call->have_first ? call->reader->Finish() : grpc::Status::OK;
          if (!st.ok()) {
            // Headers are gone already: the error travels as an event, as OpenAI's do.
            const HttpError e = FromGrpc(st);
            json err = {{"error",
                         {{"message", e.message},
                          {"type", e.type},
                          {"param", nullptr},
                          {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
            if (!write(Sse(err))) return false;
          } else if (c.include_usage) {
            json j = base();
            j["choices"] = json::array();
            j["usage"] = usage_json(usage);
            if (!write(Sse(j))) return false;
          }
          if (!write("data: [DONE]\n\n")) return false;
          sink.done();
          return true;
        });
  }
};

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    const HttpOptions& options, std::shared_ptr<grpc::Channel> channel,
    prometheus::Registry* registry) {
  std::unique_ptr<OpenAiHttpServer> s(new OpenAiHttpServer());
  s->impl_ = std::make_unique<Impl>();
  Impl* impl = s->impl_.get();
  impl->options = options;
  impl->stub = v1::Inference::NewStub(channel);
  impl->stopped = &s->stopped_;
  if (registry != nullptr) {
    impl->requests = &prometheus::BuildCounter()
                          .Name("pinfer_http_requests_total")
                          .Help("HTTP API requests by route and status code")
                          .Register(*registry);
    impl->latency = &prometheus::BuildHistogram()
                         .Name("pinfer_http_request_duration_seconds")
                         .Help("HTTP API requests from arrival to the end of the response")
                         .Register(*registry);
  }
  s->server_ = std::make_unique<httplib::Server>();
  httplib::Server& srv = *s->server_;
  srv.set_payload_max_length(options.max_body_bytes);
  // Generations stream for as long as they take; httplib's 5 s write timeout is per write. A
  // client that sends its request slowly holds a thread for at most the read timeout.
  srv.set_read_timeout(10, 0);
  // Each streaming response holds a thread for its whole generation, so there must be at least
  // as many as the gateway runs and queues (httplib's default is about the core count).
  srv.new_task_queue = [] { return new httplib::ThreadPool(kHttpThreads); };
  srv.set_pre_routing_handler([impl](const httplib::Request& req, httplib::Response& res) {
    request_start = Clock::now();
    if (req.path.rfind("/v1/", 0) == 0 && !impl->Authorized(req)) {
      SendError(res, {401,
                      impl->options.api_key.empty()
                          ? ""
                          : "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                      "invalid_request_error", "", "invalid_api_key"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Unknown paths, oversized bodies and other errors httplib answers itself get the error
  // object too (unless a handler already wrote one).
  srv.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      SendError(res, {404, absl::StrCat("Unknown request URL: ", req.method, " ", req.path),
                      "invalid_request_error", "", "unknown_url"});
    } else if (res.status == 413) {
      SendError(res, {413, "The request body is too large.", "invalid_request_error", "",
                      "request_too_large"});
    } else {
      SendError(res, {res.status, absl::StrCat("HTTP status ", res.status), "invalid_request_error",
                      "", ""});
    }
  });
  srv.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        SendError(res, {500, what, "server_error", "", ""});
      });
  srv.set_logger([impl](const httplib::Request& req, const httplib::Response& res) {
    if (impl->requests == nullptr) return;
    const std::string path = PathLabel(req.path);
    impl->requests->Add({{"path", path}, {"code", std::to_string(res.status)}}).Increment();
    if (request_start.has_value()) {
      impl->latency->Add({{"path", path}}, metrics::LatencyBuckets())
          .Observe(std::chrono::duration<double>(Clock::now() - *request_start).count());
      request_start.reset();
    }
  });

  srv.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kChatPageHtml, "text/html; charset=utf-8");
  });
  srv.Get("/health",
          [impl](const httplib::Request&, httplib::Response& res) { impl->HandleHealth(res); });
  srv.Get("/v1/models", [impl](const httplib::Request& req, httplib::Response& res) {
    impl->HandleModels(req, res);
  });
  srv.Get(R"(/v1/models/([^/]+))", [impl](const httplib::Request& req, httplib::Response& res) {
    impl->HandleModels(req, res);
  });
  srv.Get("/v1/pinfer/info",
          [impl](const httplib::Request&, httplib::Response& res) { impl->HandleInfo(res); });
  srv.Post("/v1/completions", [impl](const httplib::Request& req, httplib::Response& res) {
    impl->HandleGenerate(req, res, /*chat=*/false);
  });
  srv.Post("/v1/chat/completions", [impl](const httplib::Request& req, httplib::Response& res) {
    impl->HandleGenerate(req, res, /*chat=*/true);
  });

  const int port = options.port == 0
                       ? srv.bind_to_any_port(options.host)
                       : (srv.bind_to_port(options.host, options.port) ? options.port : -1);
  if (port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for HTTP on ", options.host, ":", options.port));
  }
  s->port_ = port;
  s->thread_ = std::thread([&srv] { srv.listen_after_bind(); });
  return s;
}

void OpenAiHttpServer::Stop() {
  if (stopped_.exchange(true)) return;
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

}  // namespace pinfer::gateway
