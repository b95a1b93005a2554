// Conversions at the RPC edges: absl::Status <-> grpc::Status (the code numbering is the same,
// the types are not), the proto sampling parameters and finish reasons <-> the engine's, and the
// bounded label values used in metrics.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "pinfer/v1/inference.pb.h"
#include "shared/engine/generator.h"
#include "shared/engine/sampler.h"

namespace pinfer {

grpc::Status ToGrpcStatus(const absl::Status& st);
absl::Status FromGrpcStatus(const grpc::Status& st);

// Proto3 cannot tell "unset" from 0, so 0 turns top_p and repetition_penalty off (1), as the
// proto's comments document.
SamplingParams SamplingFromProto(const v1::SamplingParams& p);
void SamplingToProto(const SamplingParams& s, v1::SamplingParams* p);

v1::FinishReason FinishReasonToProto(FinishReason r);
// "length", "eos", "stop", "cancelled" (metric label values).
const char* FinishReasonLabel(v1::FinishReason r);
// "OK", "INVALID_ARGUMENT", ... (metric label values).
const char* StatusCodeLabel(grpc::StatusCode code);

}  // namespace pinfer
