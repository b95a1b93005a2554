// The entry point of libpinfer_spm.so, the module that holds libsentencepiece.
//
// Why a separately loaded module: Debian's libsentencepiece carries its own copy of protobuf
// (3.14) and exports its symbols. In a process that also links the system libprotobuf (3.21; every
// gRPC process: the gateway and the workers) the two copies interpose each other and the process
// crashes while registering descriptors or aborts in protobuf's version check. Loaded with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND) (sentencepiece_loader.cc), sentencepiece binds to its own
// copy and nothing else sees it. Only this entry point is exported.
#include <string>

#include "shared/tokenizer/sentencepiece_wrapper.h"

extern "C" __attribute__((visibility("default"))) pinfer::spm::Processor* pinfer_spm_load(
    const std::string* model_proto, std::string* error) {
  return pinfer::spm::Processor::Load(*model_proto, error).release();
}
