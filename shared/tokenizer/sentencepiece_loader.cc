// Processor::Load for everything outside libpinfer_spm.so: loads that module (see
// sentencepiece_module.cc for why sentencepiece lives in its own module) once, with RTLD_DEEPBIND
// so that sentencepiece uses its bundled protobuf and not the process's, and forwards to it.
//
// The module is looked for at $PINFER_SPM_MODULE, beside the executable, in ../lib/pinfer/ and
// ../lib/ relative to it, at the build tree path, and finally by name through the loader's path.
#include <dlfcn.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <vector>

#include "shared/tokenizer/sentencepiece_wrapper.h"

namespace pinfer::spm {
namespace {

using LoadFn = Processor* (*)(const std::string*, std::string*);

// AddressSanitizer and ThreadSanitizer refuse RTLD_DEEPBIND (google/sanitizers#611). Sanitizer
// builds (the fuzzers, PINFER_ASAN, PINFER_TSAN) therefore load the module without it; they are
// only safe in processes that do not also link the system protobuf.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kDeepBind = 0;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr int kDeepBind = 0;
#else
constexpr int kDeepBind = RTLD_DEEPBIND;
#endif
#else
constexpr int kDeepBind = RTLD_DEEPBIND;
#endif

LoadFn FindModule(std::string* error) {
  static std::once_flag once;
  static LoadFn fn = nullptr;
  static std::string load_error;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("PINFER_SPM_MODULE")) candidates.push_back(env);
    char self[4096];
    const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len > 0) {
      std::string dir(self, static_cast<size_t>(len));
      dir = dir.substr(0, dir.rfind('/'));
      candidates.push_back(dir + "/libpinfer_spm.so");
      candidates.push_back(dir + "/../lib/pinfer/libpinfer_spm.so");
      candidates.push_back(dir + "/../lib/libpinfer_spm.so");
    }
#ifdef PINFER_SPM_MODULE_PATH
    candidates.push_back(PINFER_SPM_MODULE_PATH);
#endif
    candidates.push_back("libpinfer_spm.so");
    for (const std::string& path : candidates) {
      if (path.find('/') != std::string::npos && ::access(path.c_str(), R_OK) != 0) continue;
      void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | kDeepBind);
      if (h == nullptr) {
        load_error += std::string(load_error.empty() ? "" : "; ") + ::dlerror();
        continue;
      }
      fn = reinterpret_cast<LoadFn>(::dlsym(h, "pinfer_spm_load"));
      if (fn != nullptr) return;
      load_error += "; " + path + " has no pinfer_spm_load";
    }
    load_error = "cannot load the sentencepiece module libpinfer_spm.so (set PINFER_SPM_MODULE): " +
                 load_error;
  });
  if (fn == nullptr) *error = load_error;
  return fn;
}

}  // namespace

std::unique_ptr<Processor> Processor::Load(const std::string& model_proto, std::string* error) {
  LoadFn fn = FindModule(error);
  if (fn == nullptr) return nullptr;
  return std::unique_ptr<Processor>(fn(&model_proto, error));
}

}  // namespace pinfer::spm
