// The GGUF reader and writer: llama.cpp's own files parse, the writer reproduces a file written by
// llama.cpp byte for byte, and every malformed or truncated file gives its specific error.
// Malformed files are built byte by byte with a small independent encoder (RawGguf), so each
// corruption is exactly the one named.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shared/engine/ops.h"
#include "shared/engine/transformer.h"
#include "shared/model/gguf.h"
#include "shared/model/model.h"
#include "shared/util/half.h"

namespace pinfer {
namespace {

using ::testing::HasSubstr;

const std::string kModels = PINFER_MODELS_DIR;

// A GGUF encoder independent of GgufWriter, able to write anything (including nonsense).
class RawGguf {
 public:
  RawGguf& Bytes(absl::string_view b) {
    out_.append(b.data(), b.size());
    return *this;
  }
  RawGguf& U32(uint32_t v) { return Put(v); }
  RawGguf& U64(uint64_t v) { return Put(v); }
  RawGguf& F32(float v) { return Put(v); }
  RawGguf& Str(absl::string_view s) { return U64(s.size()).Bytes(s); }
  RawGguf& Header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return Bytes("GGUF").U32(version).U64(n_tensors).U64(n_kv);
  }
  RawGguf& KvU32(absl::string_view key, uint32_t v) { return Str(key).U32(4).U32(v); }
  RawGguf& KvStr(absl::string_view key, absl::string_view v) { return Str(key).U32(8).Str(v); }
  RawGguf& TensorInfo(absl::string_view name, std::vector<uint64_t> ne, uint32_t type,
                      uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) U64(d);
    return U32(type).U64(offset);
  }
  RawGguf& PadTo(size_t alignment) {
    out_.resize((out_.size() + alignment - 1) / alignment * alignment, '\0');
    return *this;
  }
  RawGguf& Zeros(size_t n) {
    out_.append(n, '\0');
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  template <typename T>
  RawGguf& Put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out_.append(b, sizeof(T));
    return *this;
  }
  std::string out_;
};

absl::StatusOr<std::unique_ptr<GgufFile>> ParseString(const std::string& bytes) {
  auto keep = std::make_shared<std::string>(bytes);
  return GgufFile::Parse(reinterpret_cast<const uint8_t*>(keep->data()), keep->size(), "test.gguf",
                         keep);
}

void ExpectParseError(const std::string& bytes, absl::string_view message) {
  auto f = ParseString(bytes);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(std::string(f.status().message()), HasSubstr(std::string(message)));
}

std::string TempPath(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/gguf_file_test";
  std::filesystem::create_directories(dir);
  return dir + "/" + name;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

// ---------------------------------------------------------------------------------------------
// Files written by llama.cpp.

TEST(GgufReaderTest, ParsesLlamaCppFiles) {
  auto f = GgufFile::Open(kModels + "/stories260K/stories260K.gguf");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->magic(), "GGUF");
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ((*f)->alignment(), 32u);
  EXPECT_EQ((*f)->metadata().size(), 19u);
  EXPECT_EQ((*f)->tensors().size(), 48u);
  EXPECT_EQ(*(*f)->GetString("general.architecture"), "llama");
  EXPECT_EQ(*(*f)->GetU32("llama.embedding_length"), 64u);
  EXPECT_FLOAT_EQ(*(*f)->GetF32("llama.attention.layer_norm_rms_epsilon"), 1e-5f);
  auto tokens = (*f)->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  auto types = (*f)->GetI32Array("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ((*types)[0], 2);
  // seperator_token_id is stored as uint32 0xffffffff: fine as u32, out of range as i32.
  EXPECT_EQ(*(*f)->GetU32("tokenizer.ggml.seperator_token_id"), 0xffffffffu);
  EXPECT_FALSE((*f)->GetI32("tokenizer.ggml.seperator_token_id").ok());

  const GgufTensorInfo* t = (*f)->FindTensor("blk.0.ffn_gate.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ne, (std::vector<int64_t>{64, 172}));  // innermost first, as stored
  EXPECT_EQ(t->nbytes, 64u * 172 * 4);
  auto view = (*f)->GetTensor("blk.0.ffn_gate.weight");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->shape, (std::vector<int64_t>{172, 64}));  // outermost first
  EXPECT_EQ(view->dtype, DType::kF32);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view->data) % 32, 0u);

  auto f16 = GgufFile::Open(kModels + "/llama2-vocab/llama-2-tiny-random.gguf");
  ASSERT_TRUE(f16.ok()) << f16.status();
  auto emb = (*f16)->GetTensor("token_embd.weight");
  ASSERT_TRUE(emb.ok());
  EXPECT_EQ(emb->dtype, DType::kF16);
  EXPECT_EQ(emb->shape, (std::vector<int64_t>{32000, 8}));

  auto vocab = GgufFile::Open(kModels + "/llama3-vocab/ggml-vocab-llama-bpe.gguf");
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  EXPECT_TRUE((*vocab)->tensors().empty());
  auto merges = (*vocab)->GetStringArray("tokenizer.ggml.merges");
  ASSERT_TRUE(merges.ok());
  EXPECT_EQ(merges->size(), 280147u);
}

// Re-writing llama.cpp's file from its parsed contents must give the same bytes: the writer's
// layout (key/values, tensor infos, alignment padding, offsets) is ggml's.
TEST(GgufWriterTest, ReproducesLlamaCppFileByteForByte) {
  const std::string path = kModels + "/stories260K/stories260K.gguf";
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  GgufWriter w;
  for (const GgufKeyValue& kv : (*f)->metadata()) w.SetValue(kv.key, kv.value);
  for (const GgufTensorInfo& t : (*f)->tensors()) {
    ASSERT_TRUE(w.AddTensor(t.name, static_cast<GgmlType>(t.type), t.shape(),
                            std::string(reinterpret_cast<const char*>(t.data), t.nbytes))
                    .ok());
  }
  auto bytes = w.WriteToString();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  std::ifstream in(path, std::ios::binary);
  std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes->size(), original.size());
  EXPECT_TRUE(*bytes == original);
}

TEST(GgufWriterTest, RoundTripsEveryValueType) {
  GgufWriter w;
  w.SetString("s", "h\xC3\xA9llo");
  w.SetU32("u32", 4000000000u);
  w.SetI32("i32", -7);
  w.SetU64("u64", 1ull << 40);
  w.SetF32("f32", 0.25f);
  w.SetBool("b", true);
  w.SetStringArray("sa", {"a", "", "ccc"});
  w.SetF32Array("fa", {1.5f, -2.f});
  w.SetI32Array("ia", {-1, 0, 2147483647});
  w.SetU32("u32", 5);  // replaces, keeps position
  std::string data(64 * 4, '\0');
  for (int i = 0; i < 64; ++i) {
    float v = static_cast<float>(i);
    std::memcpy(&data[i * 4], &v, 4);
  }
  ASSERT_TRUE(w.AddTensor("a", GgmlType::kF32, {2, 32}, data).ok());
  ASSERT_TRUE(w.AddTensor("b", GgmlType::kQ8_0, {3, 64}, std::string(3 * 2 * 34, '\x01')).ok());
  ASSERT_TRUE(w.AddTensor("c", GgmlType::kI32, {5}, std::string(20, '\x02')).ok());
  auto bytes = w.WriteToString();
  ASSERT_TRUE(bytes.ok());
  auto f = ParseString(*bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*(*f)->GetString("s"), "h\xC3\xA9llo");
  EXPECT_EQ(*(*f)->GetU32("u32"), 5u);
  EXPECT_EQ((*f)->metadata()[1].key, "u32");
  EXPECT_EQ(*(*f)->GetI32("i32"), -7);
  EXPECT_FALSE((*f)->GetU32("i32").ok());  // negative
  EXPECT_EQ(*(*f)->GetU64("u64"), 1ull << 40);
  EXPECT_FALSE((*f)->GetU32("u64").ok());  // out of range
  EXPECT_EQ(*(*f)->GetF32("f32"), 0.25f);
  EXPECT_EQ(*(*f)->GetBool("b"), true);
  EXPECT_EQ(*(*f)->GetStringArray("sa"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(*(*f)->GetF32Array("fa"), (std::vector<float>{1.5f, -2.f}));
  EXPECT_EQ(*(*f)->GetI32Array("ia"), (std::vector<int32_t>{-1, 0, 2147483647}));
  ASSERT_EQ((*f)->tensors().size(), 3u);
  EXPECT_EQ((*f)->data_offset() % 32, 0u);
  for (const GgufTensorInfo& t : (*f)->tensors()) EXPECT_EQ(t.offset % 32, 0u) << t.name;
  auto a = (*f)->GetTensor("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 32}));
  EXPECT_EQ(std::memcmp(a->data, data.data(), data.size()), 0);
  EXPECT_EQ((*f)->GetTensor("b")->dtype, DType::kQ8_0);
  // I32 tensors (PowerInfer's GPU index) are read raw, not as engine weights.
  auto c = (*f)->GetTensorOfType("c", GgmlType::kI32);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->nbytes, 20u);
  EXPECT_THAT((*f)->GetTensor("c").status().message(), HasSubstr("unsupported tensor type I32"));
  EXPECT_THAT((*f)->GetTensorOfType("a", GgmlType::kI32).status().message(),
              HasSubstr("has type F32, expected I32"));

  // Typed getters say what is wrong.
  EXPECT_EQ((*f)->GetString("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT((*f)->GetString("missing").status().message(), HasSubstr("missing key 'missing'"));
  EXPECT_THAT((*f)->GetU32("s").status().message(), HasSubstr("key 's' has type string"));
  EXPECT_THAT((*f)->GetStringArray("fa").status().message(),
              HasSubstr("has type array of float32, expected array of string"));
  EXPECT_EQ((*f)->GetTensor("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufWriterTest, RejectsInvalidTensors) {
  GgufWriter w;
  EXPECT_THAT(w.AddTensor("x", GgmlType::kF32, {2, 3}, std::string(5, '\0')).message(),
              HasSubstr("5 bytes of data for a tensor of 24 bytes"));
  EXPECT_THAT(w.AddTensor("q", GgmlType::kQ4_0, {2, 33}, std::string()).message(),
              HasSubstr("not a multiple of 32"));
  EXPECT_THAT(
      w.AddTensor(std::string(64, 'n'), GgmlType::kF32, {1}, std::string(4, '\0')).message(),
      HasSubstr("name must have 1 to 63 bytes"));
  ASSERT_TRUE(w.AddTensor("x", GgmlType::kF32, {1}, std::string(4, '\0')).ok());
  EXPECT_THAT(w.AddTensor("x", GgmlType::kF32, {1}, std::string(4, '\0')).message(),
              HasSubstr("added twice"));
  EXPECT_THAT(w.AddTensor("z", GgmlType::kF32, {}, std::string()).message(),
              HasSubstr("1 to 4 dimensions"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per kind of damage, each asserting its message.

// A small valid file: 2 key/values, tensors "w" (F32 [2, 32]) and "v" (Q8_0 [1, 32]).
std::string ValidFile() {
  RawGguf g;
  g.Header(2, 2).KvStr("general.architecture", "test").KvU32("n", 7);
  g.TensorInfo("w", {32, 2}, 0, 0).TensorInfo("v", {32, 1}, 8, 256).PadTo(32);
  g.Zeros(256 + 34);
  return g.str();
}

TEST(GgufMalformedTest, ValidFileParses) {
  auto f = ParseString(ValidFile());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 2u);
  EXPECT_EQ((*f)->FindTensor("v")->nbytes, 34u);
}

TEST(GgufMalformedTest, BadMagic) {
  std::string b = ValidFile();
  b[0] = 'X';
  ExpectParseError(b, "bad magic 'XGUF' (expected GGUF): not a GGUF file");
  b[0] = '\x01';
  ExpectParseError(b, "bad magic '\\x01GUF'");
  ExpectParseError("GG", "too small for a GGUF header");
  ExpectParseError("", "too small for a GGUF header");
  // PowerInfer's magic is accepted only when asked for.
  b = ValidFile();
  std::memcpy(b.data(), "PWRI", 4);
  ExpectParseError(b, "expected GGUF");
  auto keep = std::make_shared<std::string>(b);
  auto f = GgufFile::Parse(reinterpret_cast<const uint8_t*>(keep->data()), keep->size(), "p", keep,
                           {kGgufMagic, kPowerInferMagic});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->magic(), "PWRI");
}

TEST(GgufMalformedTest, UnsupportedVersion) {
  ExpectParseError(RawGguf().Header(0, 0, 1).str(), "unsupported GGUF version 1");
  ExpectParseError(RawGguf().Header(0, 0, 4).str(), "unsupported GGUF version 4");
  ExpectParseError(RawGguf().Header(0, 0, 0x03000000).str(),
                   "big-endian GGUF files are not supported");
  EXPECT_TRUE(ParseString(RawGguf().Header(0, 0, 2).str()).ok());
}

TEST(GgufMalformedTest, TruncatedAtEveryOffset) {
  const std::string b = ValidFile();
  auto full = ParseString(b);
  ASSERT_TRUE(full.ok());
  const GgufTensorInfo* last = (*full)->FindTensor("v");
  const size_t needed = (*full)->data_offset() + last->offset + last->nbytes;
  ASSERT_EQ(needed, b.size());
  for (size_t n = 0; n < needed; ++n) {
    SCOPED_TRACE(n);
    auto f = ParseString(b.substr(0, n));
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(f.status().message());
    EXPECT_TRUE(msg.find("truncated") != std::string::npos ||
                msg.find("out of bounds") != std::string::npos)
        << msg;
  }
}

TEST(GgufMalformedTest, HugeCountsAreRejectedBeforeAllocating) {
  ExpectParseError(RawGguf().Header(0, 1ull << 60).str(),
                   "metadata count 1152921504606846976 is more than");
  ExpectParseError(RawGguf().Header(~0ull, 0).str(),
                   "tensor count 18446744073709551615 is more than");
  // A string claiming more bytes than the file has.
  ExpectParseError(RawGguf().Header(0, 1).U64(1ull << 62).Zeros(16).str(),
                   "has length 4611686018427387904");
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(8).U64(~0ull).Zeros(16).str(),
                   "key 'k' at offset");
  // Arrays claiming more elements than fit.
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(9).U32(8).U64(1ull << 61).Zeros(64).str(),
                   "claims 2305843009213693952 strings");
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(9).U32(12).U64(1ull << 61).Zeros(64).str(),
                   "claims 2305843009213693952 elements of 8 bytes");
}

TEST(GgufMalformedTest, UnknownOrNestedValueTypes) {
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(13).Zeros(8).str(),
                   "key 'k' has unknown value type 13");
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(9).U32(77).U64(0).str(),
                   "unknown array element type 77");
  ExpectParseError(RawGguf().Header(0, 1).Str("k").U32(9).U32(9).U64(1).Zeros(16).str(),
                   "nested arrays are not supported");
}

TEST(GgufMalformedTest, DuplicateKeysAndTensors) {
  ExpectParseError(RawGguf().Header(0, 2).KvU32("a", 1).KvU32("a", 2).str(), "duplicate key 'a'");
  RawGguf g;
  g.Header(2, 0).TensorInfo("t", {32}, 0, 0).TensorInfo("t", {32}, 0, 128).PadTo(32).Zeros(256);
  ExpectParseError(g.str(), "duplicate tensor name 't'");
}

TEST(GgufMalformedTest, BadAlignment) {
  ExpectParseError(RawGguf().Header(0, 1).KvU32("general.alignment", 48).str(),
                   "general.alignment 48 is not a power of two");
  ExpectParseError(RawGguf().Header(0, 1).KvU32("general.alignment", 0).str(),
                   "not a power of two");
  ExpectParseError(RawGguf().Header(0, 1).KvStr("general.alignment", "32").str(),
                   "general.alignment has type string, expected uint32");
  // A valid non-default alignment moves the data section.
  RawGguf g;
  g.Header(1, 1).KvU32("general.alignment", 64).TensorInfo("t", {32}, 0, 0).PadTo(64).Zeros(128);
  auto f = ParseString(g.str());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->data_offset() % 64, 0u);
  EXPECT_EQ((*f)->alignment(), 64u);
}

TEST(GgufMalformedTest, BadDimensions) {
  auto one = [](std::vector<uint64_t> ne, uint32_t type) {
    RawGguf g;
    g.Header(1, 0).TensorInfo("t", ne, type, 0).PadTo(32).Zeros(4096);
    return g.str();
  };
  ExpectParseError(one({}, 0), "tensor 't' has 0 dimensions (1 to 4 are supported)");
  ExpectParseError(one({1, 1, 1, 1, 1}, 0), "tensor 't' has 5 dimensions");
  ExpectParseError(one({32, 0}, 0), "tensor 't' has invalid dimension 0");
  ExpectParseError(one({1ull << 63}, 0), "has invalid dimension 9223372036854775808");
  ExpectParseError(one({1ull << 40, 1ull << 30}, 0), "tensor 't': element count overflows");
  ExpectParseError(one({1ull << 62}, 0), "tensor 't': byte size overflows");
  ExpectParseError(one({33}, 8), "row length 33 is not a multiple of the Q8_0 block size 32");
}

TEST(GgufMalformedTest, UnknownTensorType) {
  RawGguf g;
  g.Header(1, 0).TensorInfo("t", {32}, 99, 0).PadTo(32).Zeros(128);
  ExpectParseError(g.str(), "tensor 't' has unknown tensor type 99");
  // Removed ggml ids (4, 5: Q4_2, Q4_3) are unknown too.
  RawGguf h;
  h.Header(1, 0).TensorInfo("t", {32}, 4, 0).PadTo(32).Zeros(128);
  ExpectParseError(h.str(), "unknown tensor type 4");
}

TEST(GgufMalformedTest, OffsetsOutOfBounds) {
  RawGguf misaligned;
  misaligned.Header(1, 0).TensorInfo("t", {8}, 0, 4).PadTo(32).Zeros(64);
  ExpectParseError(misaligned.str(), "tensor 't' offset 4 is not a multiple of the alignment 32");
  RawGguf past_end;
  past_end.Header(1, 0).TensorInfo("t", {8}, 0, 64).PadTo(32).Zeros(64);
  ExpectParseError(past_end.str(), "tensor 't' data (offset 64, 32 bytes) is out of bounds");
  RawGguf huge;
  huge.Header(1, 0).TensorInfo("t", {8}, 0, ~0ull - 31).PadTo(32).Zeros(64);
  ExpectParseError(huge.str(), "is out of bounds");
  RawGguf too_big;
  too_big.Header(1, 0).TensorInfo("t", {1ull << 40}, 0, 0).PadTo(32).Zeros(64);
  ExpectParseError(too_big.str(), "is out of bounds: the data section has 64 bytes");
  RawGguf no_data;  // tensor infos end exactly at the end of the file
  no_data.Header(1, 0).TensorInfo("t", {8}, 0, 0);
  ExpectParseError(no_data.str(), "truncated file: tensor data section starts at");
}

// ---------------------------------------------------------------------------------------------
// Model-level errors: a small random llama written with GgufWriter, then damaged one way at a
// time.

struct TinyLlama {
  int hidden = 32, heads = 4, kv_heads = 2, ffn = 64, layers = 2, vocab = 48;
  std::set<std::string> skip_tensors, skip_keys;
  std::map<std::string, std::vector<int64_t>> shape_override;
  std::map<std::string, GgmlType> type_override;
  std::function<void(GgufWriter&)> extra;
};

std::string FloatBytes(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0, 0.2f);
  std::string out(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    float v = dist(rng);
    std::memcpy(&out[i * 4], &v, 4);
  }
  return out;
}

absl::StatusOr<std::string> WriteTinyLlama(const std::string& name, const TinyLlama& m) {
  GgufWriter w;
  std::mt19937 rng(1);
  auto key = [&](const std::string& k, auto setter) {
    if (!m.skip_keys.count(k)) setter(k);
  };
  key("general.architecture", [&](const std::string& k) { w.SetString(k, "llama"); });
  key("llama.embedding_length", [&](const std::string& k) { w.SetU32(k, m.hidden); });
  key("llama.block_count", [&](const std::string& k) { w.SetU32(k, m.layers); });
  key("llama.feed_forward_length", [&](const std::string& k) { w.SetU32(k, m.ffn); });
  key("llama.attention.head_count", [&](const std::string& k) { w.SetU32(k, m.heads); });
  key("llama.attention.head_count_kv", [&](const std::string& k) { w.SetU32(k, m.kv_heads); });
  key("llama.attention.layer_norm_rms_epsilon", [&](const std::string& k) { w.SetF32(k, 1e-5f); });
  if (m.extra) m.extra(w);
  const int hd = m.hidden / m.heads;
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"token_embd.weight", {m.vocab, m.hidden}},
      {"output_norm.weight", {m.hidden}},
      {"output.weight", {m.vocab, m.hidden}}};
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    tensors.push_back({p + "attn_norm.weight", {m.hidden}});
    tensors.push_back({p + "attn_q.weight", {m.heads * hd, m.hidden}});
    tensors.push_back({p + "attn_k.weight", {m.kv_heads * hd, m.hidden}});
    tensors.push_back({p + "attn_v.weight", {m.kv_heads * hd, m.hidden}});
    tensors.push_back({p + "attn_output.weight", {m.hidden, m.heads * hd}});
    tensors.push_back({p + "ffn_norm.weight", {m.hidden}});
    tensors.push_back({p + "ffn_gate.weight", {m.ffn, m.hidden}});
    tensors.push_back({p + "ffn_up.weight", {m.ffn, m.hidden}});
    tensors.push_back({p + "ffn_down.weight", {m.hidden, m.ffn}});
  }
  for (auto& [tname, shape] : tensors) {
    if (m.skip_tensors.count(tname)) continue;
    if (m.shape_override.count(tname)) shape = m.shape_override.at(tname);
    GgmlType type = GgmlType::kF32;
    if (m.type_override.count(tname)) type = m.type_override.at(tname);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const GgmlTypeTraits* traits = FindGgmlTypeTraits(static_cast<uint32_t>(type));
    std::string data = type == GgmlType::kF32
                           ? FloatBytes(n, rng)
                           : std::string(n / traits->block_size * traits->type_size, '\0');
    // Types the engine computes with get real blocks of random weights.
    auto dtype = DTypeFromGgmlType(static_cast<uint32_t>(type));
    if (type != GgmlType::kF32 && dtype.ok()) {
      const std::string f = FloatBytes(n, rng);
      const int64_t cols = shape.back();
      const size_t rb = RowBytes(*dtype, cols);
      for (int64_t r = 0; r < n / cols; ++r) {
        QuantizeRow(*dtype, reinterpret_cast<const float*>(f.data()) + r * cols, &data[r * rb],
                    cols);
      }
    }
    absl::Status st = w.AddTensor(tname, type, shape, data);
    if (!st.ok()) return st;
  }
  const std::string path = TempPath(name);
  absl::Status st = w.WriteFile(path);
  if (!st.ok()) return st;
  return path;
}

void ExpectLoadError(const std::string& name, const TinyLlama& m, absl::StatusCode code,
                     absl::string_view message) {
  auto path = WriteTinyLlama(name, m);
  ASSERT_TRUE(path.ok()) << path.status();
  auto model = LoadModel(*path);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), code) << model.status();
  EXPECT_THAT(std::string(model.status().message()), HasSubstr(std::string(message)));
}

TEST(GgufModelErrorsTest, ValidTinyModelLoadsAndRuns) {
  auto path = WriteTinyLlama("valid.gguf", TinyLlama());
  ASSERT_TRUE(path.ok()) << path.status();
  auto model = LoadModel(*path);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config.vocab_size, 48);
  EXPECT_EQ((*model)->config.head_dim, 8);
  EXPECT_EQ((*model)->tokenizer, nullptr);  // weights only
  auto ops = NewReferenceOps();
  Transformer t(**model, *ops);
  KvCache cache((*model)->config, 8);
  std::vector<float> logits(48);
  std::vector<int32_t> ids = {1, 5, 7};
  ASSERT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kLast, logits.data()).ok());
  for (float v : logits) EXPECT_TRUE(std::isfinite(v));
}

// A file with general.alignment 1 may leave F32 data unaligned; the model must not change.
TEST(GgufModelErrorsTest, UnalignedDataGivesTheSameModel) {
  auto logits = [](const Model& m) {
    auto ops = NewReferenceOps();
    Transformer t(m, *ops);
    KvCache cache(m.config, 4);
    std::vector<float> out(m.config.vocab_size);
    std::vector<int32_t> ids = {3, 1, 4};
    EXPECT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kLast, out.data()).ok());
    return out;
  };
  auto aligned = LoadModel(*WriteTinyLlama("aligned.gguf", TinyLlama()));
  ASSERT_TRUE(aligned.ok()) << aligned.status();
  bool tested = false;
  for (int pad = 0; pad < 4 && !tested; ++pad) {
    TinyLlama m;
    m.extra = [pad](GgufWriter& w) {
      w.SetU32("general.alignment", 1);
      w.SetString("pad", std::string(pad, 'x'));
    };
    auto path = WriteTinyLlama("unaligned.gguf", m);
    ASSERT_TRUE(path.ok());
    auto file = GgufFile::Open(*path);
    ASSERT_TRUE(file.ok()) << file.status();
    if ((*file)->data_offset() % 4 == 0) continue;
    tested = true;
    auto model = LoadModel(*path);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*model)->layers[1].wq.data) % 4, 0u);
    EXPECT_EQ(logits(**model), logits(**aligned));
  }
  EXPECT_TRUE(tested);
}

// PowerInfer's files: magic PWRI, ReLU FFN, down projection stored transposed (ffn_down_t).
TEST(GgufModelErrorsTest, PowerInferTransposedDownProjection) {
  TinyLlama m;
  m.extra = [](GgufWriter& w) { w.SetString("pinfer.hidden_act", "relu"); };
  auto plain_path = WriteTinyLlama("plain-relu.gguf", m);
  ASSERT_TRUE(plain_path.ok());
  auto plain_file = GgufFile::Open(*plain_path);
  ASSERT_TRUE(plain_file.ok());
  GgufWriter w(kPowerInferMagic);
  for (const GgufKeyValue& kv : (*plain_file)->metadata()) {
    if (kv.key != "pinfer.hidden_act") w.SetValue(kv.key, kv.value);
  }
  w.SetF32("powerinfer.sparse_threshold", 0.f);
  for (const GgufTensorInfo& t : (*plain_file)->tensors()) {
    std::string bytes(reinterpret_cast<const char*>(t.data), t.nbytes);
    std::string name = t.name;
    std::vector<int64_t> shape = t.shape();
    if (name.find("ffn_down") != std::string::npos) {
      // [hidden, ffn] -> [ffn, hidden]
      const int64_t rows = shape[0], cols = shape[1];
      std::string tr(bytes.size(), '\0');
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          std::memcpy(&tr[(c * rows + r) * 4], &bytes[(r * cols + c) * 4], 4);
        }
      }
      bytes = tr;
      shape = {cols, rows};
      name = name.substr(0, name.find("ffn_down")) + "ffn_down_t.weight";
    }
    ASSERT_TRUE(w.AddTensor(name, static_cast<GgmlType>(t.type), shape, bytes).ok());
  }
  const std::string pwri_path = TempPath("powerinfer.gguf");
  ASSERT_TRUE(w.WriteFile(pwri_path).ok());

  auto plain = LoadModel(*plain_path);
  auto pwri = LoadModel(pwri_path);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(pwri.ok()) << pwri.status();
  EXPECT_EQ((*pwri)->config.activation, Activation::kRelu);
  EXPECT_EQ((*pwri)->layers[1].down.shape, (std::vector<int64_t>{32, 64}));
  auto ops = NewReferenceOps();
  auto logits = [&](const Model& model) {
    Transformer t(model, *ops);
    KvCache cache(model.config, 4);
    std::vector<float> out(model.config.vocab_size);
    std::vector<int32_t> ids = {2, 7, 1};
    EXPECT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kLast, out.data()).ok());
    return out;
  };
  EXPECT_EQ(logits(**plain), logits(**pwri));
}

// Linear RoPE scaling divides every frequency by the factor.
TEST(GgufModelErrorsTest, LinearRopeScaling) {
  TinyLlama m;
  m.extra = [](GgufWriter& w) {
    w.SetString("llama.rope.scaling.type", "linear");
    w.SetF32("llama.rope.scaling.factor", 4.f);
    w.SetF32("llama.rope.freq_base", 500.f);
  };
  auto model = LoadModel(*WriteTinyLlama("linear.gguf", m));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<float> inv = RopeInverseFrequencies((*model)->config);
  ASSERT_EQ(inv.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_FLOAT_EQ(inv[i], static_cast<float>(std::pow(500.0, -2.0 * i / 8) / 4)) << i;
  }
}

TEST(GgufModelErrorsTest, MissingTensor) {
  TinyLlama m;
  m.skip_tensors = {"blk.1.ffn_up.weight"};
  ExpectLoadError("missing_tensor.gguf", m, absl::StatusCode::kNotFound,
                  "missing tensor 'blk.1.ffn_up.weight'");
}

TEST(GgufModelErrorsTest, MissingOutputMeansTiedEmbeddings) {
  TinyLlama m;
  m.skip_tensors = {"output.weight"};
  auto path = WriteTinyLlama("tied.gguf", m);
  ASSERT_TRUE(path.ok());
  auto model = LoadModel(*path);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->config.tie_embeddings);
  EXPECT_EQ((*model)->output.data, (*model)->tok_embeddings.data);
}

TEST(GgufModelErrorsTest, MissingKey) {
  TinyLlama m;
  m.skip_keys = {"llama.embedding_length"};
  ExpectLoadError("missing_key.gguf", m, absl::StatusCode::kNotFound,
                  "missing key 'llama.embedding_length'");
  m.skip_keys = {"general.architecture"};
  ExpectLoadError("missing_arch.gguf", m, absl::StatusCode::kNotFound,
                  "missing key 'general.architecture'");
  m.skip_keys = {"llama.attention.layer_norm_rms_epsilon"};
  ExpectLoadError("missing_eps.gguf", m, absl::StatusCode::kNotFound,
                  "missing key 'llama.attention.layer_norm_rms_epsilon'");
}

TEST(GgufModelErrorsTest, KeyOfWrongType) {
  TinyLlama m;
  m.skip_keys = {"llama.block_count"};
  m.extra = [](GgufWriter& w) { w.SetString("llama.block_count", "two"); };
  ExpectLoadError("wrong_type.gguf", m, absl::StatusCode::kInvalidArgument,
                  "key 'llama.block_count' has type string, expected an unsigned integer");
}

TEST(GgufModelErrorsTest, WrongShape) {
  TinyLlama m;
  m.shape_override = {{"blk.0.attn_k.weight", {32, 32}}};
  ExpectLoadError("wrong_shape.gguf", m, absl::StatusCode::kInvalidArgument,
                  "tensor 'blk.0.attn_k.weight' has shape [32,32], expected [16,32]");
  m.shape_override = {{"output_norm.weight", {31}}};
  ExpectLoadError("wrong_norm.gguf", m, absl::StatusCode::kInvalidArgument,
                  "tensor 'output_norm.weight' has shape [31], expected [32]");
}

// Q2_K, Q3_K and the IQ types are not computed: the error names the tensor, its type and the
// types pinfer computes.
TEST(GgufModelErrorsTest, UnsupportedTensorType) {
  for (GgmlType type : {GgmlType::kQ2_K, GgmlType::kQ3_K, GgmlType::kIQ4_XS}) {
    TinyLlama m;
    m.hidden = 256;
    m.heads = 4;
    m.type_override = {{"blk.0.ffn_gate.weight", type}};
    ExpectLoadError("unsupported.gguf", m, absl::StatusCode::kInvalidArgument,
                    "tensor 'blk.0.ffn_gate.weight': unsupported tensor type " +
                        GgmlTypeName(static_cast<uint32_t>(type)) +
                        " (pinfer computes with F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K)");
  }
}

// A K-quant mix as llama.cpp's Q4_K_M writes one (gate and up Q4_K, down and the output head
// Q6_K, one layer's up Q5_K) loads with every tensor in its type, pointing at the file's bytes,
// and computes what an F32 file holding the dequantized weights computes, up to the Q8_K
// rounding of the activations.
TEST(GgufModelErrorsTest, KQuantTensorsStayInTheirType) {
  TinyLlama m;
  m.hidden = 256;
  m.heads = 4;
  m.ffn = 512;
  m.type_override = {
      {"output.weight", GgmlType::kQ6_K},       {"blk.0.ffn_gate.weight", GgmlType::kQ4_K},
      {"blk.0.ffn_up.weight", GgmlType::kQ4_K}, {"blk.0.ffn_down.weight", GgmlType::kQ6_K},
      {"blk.1.ffn_up.weight", GgmlType::kQ5_K}, {"blk.1.attn_v.weight", GgmlType::kQ6_K}};
  auto path = WriteTinyLlama("kquant.gguf", m);
  ASSERT_TRUE(path.ok()) << path.status();
  auto model = LoadModel(*path);
  ASSERT_TRUE(model.ok()) << model.status();
  auto file = GgufFile::Open(*path);
  ASSERT_TRUE(file.ok());
  const Model& k = **model;
  EXPECT_EQ(k.output.dtype, DType::kQ6_K);
  EXPECT_EQ(k.layers[0].gate.dtype, DType::kQ4_K);
  EXPECT_EQ(k.layers[0].down.dtype, DType::kQ6_K);
  EXPECT_EQ(k.layers[1].up.dtype, DType::kQ5_K);
  EXPECT_EQ(k.layers[1].wv.dtype, DType::kQ6_K);
  EXPECT_EQ(k.layers[0].gate.nbytes(), 512u / 256 * 144 * 256);
  EXPECT_EQ(k.layers[0].gate.nbytes(), (*file)->FindTensor("blk.0.ffn_gate.weight")->nbytes);

  // The twin: every tensor as F32 values dequantized from the file.
  GgufWriter twin;
  twin.SetString("general.architecture", "llama");
  for (const char* key :
       {"llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv"}) {
    auto v = (*file)->GetU32(key);
    ASSERT_TRUE(v.ok()) << key;
    twin.SetU32(key, *v);
  }
  twin.SetF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  for (const GgufTensorInfo& info : (*file)->tensors()) {
    auto view = GgufFile::ToTensorView(info);
    ASSERT_TRUE(view.ok());
    std::string bytes(info.numel() * 4, '\0');
    const int64_t cols = view->cols();
    for (int64_t r = 0; r < info.numel() / cols; ++r) {
      DequantizeRow(view->dtype, view->row(r), reinterpret_cast<float*>(bytes.data()) + r * cols,
                    cols);
    }
    ASSERT_TRUE(twin.AddTensor(info.name, GgmlType::kF32, info.shape(), bytes).ok());
  }
  const std::string twin_path = TempPath("kquant_twin.gguf");
  ASSERT_TRUE(twin.WriteFile(twin_path).ok());
  auto reference = LoadModel(twin_path);
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto logits = [](const Model& model) {
    auto ops = NewReferenceOps();
    Transformer t(model, *ops);
    KvCache cache(model.config, 4);
    std::vector<float> out(model.config.vocab_size);
    std::vector<int32_t> ids = {3, 1, 4};
    EXPECT_TRUE(t.Forward(ids, 0, &cache, LogitsMode::kLast, out.data()).ok());
    return out;
  };
  const std::vector<float> got = logits(k), want = logits(**reference);
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    ref += double(want[i]) * want[i];
  }
  EXPECT_GT(err, 0) << "the K-quant products must round x to Q8_K";
  EXPECT_LT(err / ref, 1e-3);
}

TEST(GgufModelErrorsTest, UnsupportedArchitectureAndSettings) {
  TinyLlama m;
  m.skip_keys = {"general.architecture"};
  m.extra = [](GgufWriter& w) { w.SetString("general.architecture", "gpt2"); };
  ExpectLoadError("gpt2.gguf", m, absl::StatusCode::kInvalidArgument,
                  "unsupported architecture 'gpt2' (pinfer loads llama, qwen2 and bamboo)");
  m = TinyLlama();
  m.extra = [](GgufWriter& w) { w.SetU32("llama.rope.dimension_count", 4); };
  ExpectLoadError("partial_rope.gguf", m, absl::StatusCode::kInvalidArgument,
                  "partial rotary embeddings are not supported");
  m.extra = [](GgufWriter& w) { w.SetString("llama.rope.scaling.type", "yarn"); };
  ExpectLoadError("yarn.gguf", m, absl::StatusCode::kInvalidArgument,
                  "unsupported rope scaling type 'yarn'");
  m.extra = [](GgufWriter& w) { w.SetU32("llama.attention.head_count_kv", 3); };
  ExpectLoadError("gqa.gguf", m, absl::StatusCode::kInvalidArgument,
                  "num_attention_heads 4 is not a multiple of num_key_value_heads 3");
  m.extra = [](GgufWriter& w) { w.SetU32("llama.attention.head_count", 0); };
  m.skip_keys = {"llama.attention.head_count"};
  ExpectLoadError("zero_heads.gguf", m, absl::StatusCode::kInvalidArgument,
                  "attention.head_count must be > 0");
  m = TinyLlama();
  m.extra = [](GgufWriter& w) { w.SetString("pinfer.hidden_act", "gelu"); };
  ExpectLoadError("gelu.gguf", m, absl::StatusCode::kInvalidArgument,
                  "unsupported pinfer.hidden_act 'gelu'");
  m.extra = [](GgufWriter& w) { w.SetU32("llama.vocab_size", 50); };
  ExpectLoadError("vocab_size.gguf", m, absl::StatusCode::kInvalidArgument,
                  "llama.vocab_size 50 but token_embd.weight has 48 rows");
  m.extra = [](GgufWriter& w) { w.SetU32("tokenizer.ggml.bos_token_id", 48); };
  ExpectLoadError("bos.gguf", m, absl::StatusCode::kInvalidArgument,
                  "bos/eos token id out of the vocabulary");
}

TEST(GgufModelErrorsTest, VocabularyProblems) {
  TinyLlama m;
  m.extra = [](GgufWriter& w) {
    w.SetString("tokenizer.ggml.model", "bert");
    w.SetStringArray("tokenizer.ggml.tokens", {"a"});
  };
  ExpectLoadError("bert.gguf", m, absl::StatusCode::kUnimplemented,
                  "unsupported tokenizer model 'bert'");
  m.extra = [](GgufWriter& w) { w.SetString("tokenizer.ggml.model", "llama"); };
  ExpectLoadError("no_tokens.gguf", m, absl::StatusCode::kNotFound,
                  "missing key 'tokenizer.ggml.tokens'");
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  // (absl::StrCat, not "t" + std::to_string(i): GCC 12 warns falsely on that -Wrestrict.)
  for (int i = 3; i < 60; ++i) tokens.push_back(absl::StrCat("t", i));
  m.extra = [tokens](GgufWriter& w) {
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetI32Array("tokenizer.ggml.token_type", std::vector<int32_t>(tokens.size(), 1));
  };
  ExpectLoadError("short_types.gguf", m, absl::StatusCode::kInvalidArgument,
                  "has no unknown token");
  m.extra = [tokens](GgufWriter& w) {
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetI32Array("tokenizer.ggml.token_type", {2, 3, 3});
  };
  ExpectLoadError("types_count.gguf", m, absl::StatusCode::kInvalidArgument,
                  "60 tokens but 3 token types");
  m.extra = [tokens](GgufWriter& w) {
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    std::vector<int32_t> types(tokens.size(), 1);
    types[0] = 2;
    w.SetI32Array("tokenizer.ggml.token_type", types);
  };
  ExpectLoadError("big_vocab.gguf", m, absl::StatusCode::kInvalidArgument,
                  "the vocabulary has 60 tokens but token_embd.weight only 48 rows");
}

TEST(GgufModelErrorsTest, NotAGgufFile) {
  const std::string path = TempPath("not_gguf.gguf");
  WriteBytes(path, "{\"hello\": 1}");
  auto model = LoadModel(path);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(model.status().message(), HasSubstr("not a GGUF file"));
  EXPECT_EQ(LoadModel(TempPath("does_not_exist.gguf")).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pinfer
