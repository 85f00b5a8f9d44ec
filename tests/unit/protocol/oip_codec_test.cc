// The Open Inference Protocol's mapping onto attnserve.v1 without a server: what each field
// becomes, that the inputs' bytes move (no copy), and every refusal naming its field.
#include "server/protocol/oip_codec.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <limits>
#include <set>

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

inference::ModelInferRequest Request() {
  inference::ModelInferRequest r;
  r.set_model_name("demo");
  r.set_id("req-1");
  auto* q = r.add_inputs();
  q->set_name("query");
  q->set_datatype("FP32");
  q->add_shape(1);
  q->add_shape(2);
  q->add_shape(4);
  r.add_raw_input_contents(std::string(32, '\x01'));
  return r;
}

// Request() changed by each case is refused INVALID_ARGUMENT with a message holding `says`.
struct RefusalCase {
  std::function<void(inference::ModelInferRequest*)> change;
  const char* says;
};
void ExpectRefusals(const std::vector<RefusalCase>& cases) {
  for (const RefusalCase& c : cases) {
    inference::ModelInferRequest in = Request();
    c.change(&in);
    v1::AttendRequest out;
    OipReply reply;
    const Status st = OipToAttend(&in, &out, &reply);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(st.message(), HasSubstr(c.says));
  }
}

TEST(OipCodecTest, MapsInputsParametersAndVersionAndMovesTheBytes) {
  inference::ModelInferRequest in = Request();
  in.set_model_version("3");
  auto* mask = in.add_inputs();
  mask->set_name("key_padding_mask");
  mask->set_datatype("BOOL");
  mask->add_shape(1);
  mask->add_shape(2);
  in.add_raw_input_contents(std::string("\x00\x01", 2));
  (*in.mutable_parameters())["is_causal"].set_bool_param(true);
  (*in.mutable_parameters())["layout"].set_string_param("sequence_first");
  in.add_outputs()->set_name("attn_weights");
  const void* bytes = in.raw_input_contents(0).data();
  v1::AttendRequest out;
  OipReply reply;
  ASSERT_TRUE(OipToAttend(&in, &out, &reply).ok());
  EXPECT_EQ(out.model(), "demo");
  EXPECT_EQ(out.model_version(), 3);
  EXPECT_EQ(out.query().dtype(), v1::DATA_TYPE_FLOAT32);
  EXPECT_THAT(out.query().shape(), ElementsAre(1, 2, 4));
  EXPECT_EQ(out.query().data().size(), 32u);
  EXPECT_EQ(static_cast<const void*>(out.query().data().data()), bytes);  // Moved, not copied.
  EXPECT_EQ(out.key_padding_mask().dtype(), v1::DATA_TYPE_BOOL);
  EXPECT_TRUE(out.is_causal());
  EXPECT_EQ(out.layout(), v1::LAYOUT_SEQUENCE_FIRST);
  EXPECT_EQ(out.attn_weights(),
            v1::ATTN_WEIGHTS_AVERAGED);  // Asking for the output asks for weights.
  EXPECT_EQ(reply.id, "req-1");
  EXPECT_THAT(reply.outputs, ElementsAre("attn_weights"));
}

TEST(OipCodecTest, RefusesWhatItDoesNotTakeNamingTheField) {
  using Case = RefusalCase;
  const std::vector<Case> cases = {
      {[](auto* r) { r->mutable_inputs(0)->set_name("q"); },
       "inputs[0].name: 'q' is not an input; allowed: query"},
      {[](auto* r) { r->mutable_inputs(0)->set_datatype("INT8"); },
       "inputs[0].datatype: 'INT8' is not allowed"},
      {[](auto* r) { r->add_raw_input_contents("x"); },
       "raw_input_contents: 2 entries for 1 inputs"},
      {[](auto* r) { r->mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
       "inputs[0].contents: given with raw_input_contents"},
      {[](auto* r) {
         r->clear_raw_input_contents();
         r->mutable_inputs(0)->set_datatype("FP16");
       },
       "FP16 and BF16 have no typed contents"},
      {[](auto* r) {
         (*r->mutable_inputs(0)->mutable_parameters())["colour"].set_string_param("x");
       },
       "inputs[0].parameters['colour']: not an input parameter"},
      {[](auto* r) {
         (*r->mutable_inputs(0)->mutable_parameters())["shared_memory_region"].set_string_param(
             "x");
         r->clear_raw_input_contents();
       },
       "shared_memory_region and shared_memory_byte_size go together"},
      {[](auto* r) {
         (*r->mutable_inputs(0)->mutable_parameters())["shared_memory_region"].set_int64_param(1);
         (*r->mutable_inputs(0)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(
             32);
         r->clear_raw_input_contents();
       },
       "parameters['shared_memory_region']: a int64 parameter; expected string"},
      {[](auto* r) { r->set_model_version("latest"); }, "model_version: 'latest'"},
      {[](auto* r) { r->set_model_version("-1"); }, "model_version: '-1'"},
      {[](auto* r) { r->set_model_version("99999999999999999999"); },
       "model_version: '99999999999999999999'"},
      {[](auto* r) { (*r->mutable_parameters())["is_causal"].set_string_param("yes"); },
       "parameters['is_causal']: a string parameter; expected bool"},
      {[](auto* r) { (*r->mutable_parameters())["attn_weights"].set_string_param("all"); },
       "allowed: none, averaged"},
      {[](auto* r) { (*r->mutable_parameters())["sequence_start"].set_bool_param(true); },
       "need parameters['sequence_id']"},
      {[](auto* r) { (*r->mutable_parameters())["sequence_id"].set_int64_param(0); },
       "0 and \"\" mean no sequence"},
      {[](auto* r) { (*r->mutable_parameters())["sequence_id"].set_double_param(1.5); },
       "a double parameter; expected int64, uint64 or string"},
      {[](auto* r) {
         (*r->mutable_parameters())["sequence_id"].set_int64_param(3);
         (*r->mutable_parameters())["session"].set_string_param("abc");
       },
       "a sequence is a session of its own"},
      {[](auto* r) { (*r->mutable_parameters())["priority"].set_string_param("high"); },
       "parameters['priority']: a string parameter"},
      {[](auto* r) { (*r->mutable_parameters())["timeout"].set_int64_param(-1); },
       "parameters['timeout']: -1; allowed: 0 or more"},
      {[](auto* r) { r->add_outputs()->set_name("logits"); },
       "outputs[0].name: 'logits' is not an output"},
      {[](auto* r) {
         (*r->mutable_parameters())["attn_weights"].set_string_param("none");
         r->add_outputs()->set_name("attn_weights");
       },
       "parameters['attn_weights'] is 'none'"},
      {[](auto* r) {
         *r->add_inputs() = r->inputs(0);
         r->add_raw_input_contents(r->raw_input_contents(0));
       },
       "'query' given twice"},
  };
  ExpectRefusals(cases);
}

TEST(OipCodecTest, TypedFp32AndBoolContentsBecomeTheSameBytes) {
  inference::ModelInferRequest in = Request();
  in.clear_raw_input_contents();
  for (float v : {1.f, -2.f, 0.5f, 3.f, 0.f, 1.f, 2.f, 4.f})
    in.mutable_inputs(0)->mutable_contents()->add_fp32_contents(v);
  (*in.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(
      32);  // Ignored.
  auto* mask = in.add_inputs();
  mask->set_name("key_padding_mask");
  mask->set_datatype("BOOL");
  mask->add_shape(1);
  mask->add_shape(2);
  mask->mutable_contents()->add_bool_contents(false);
  mask->mutable_contents()->add_bool_contents(true);
  v1::AttendRequest out;
  OipReply reply;
  ASSERT_TRUE(OipToAttend(&in, &out, &reply).ok());
  ASSERT_EQ(out.query().data().size(), 32u);
  float second;
  std::memcpy(&second, out.query().data().data() + 4, 4);
  EXPECT_EQ(second, -2.f);
  EXPECT_EQ(out.key_padding_mask().data(), std::string("\x00\x01", 2));
}

TEST(OipCodecTest, SequenceParametersNameTheSequenceAndItsBatch) {
  inference::ModelInferRequest in = Request();
  (*in.mutable_parameters())["sequence_id"].set_string_param("conv-1");
  (*in.mutable_parameters())["sequence_start"].set_bool_param(true);
  v1::AttendRequest out;
  OipReply reply;
  ASSERT_TRUE(OipToAttend(&in, &out, &reply).ok());
  ASSERT_TRUE(reply.sequence.has_value());
  EXPECT_EQ(reply.sequence->id, "s:conv-1");
  EXPECT_TRUE(reply.sequence->start);
  EXPECT_FALSE(reply.sequence->end);
  EXPECT_EQ(OipBatchOf(out), 1);
  out.set_layout(v1::LAYOUT_SEQUENCE_FIRST);
  EXPECT_EQ(OipBatchOf(out), 2);  // [L=1, B=2, E=4] read sequence-first
}

TEST(OipCodecTest, SequenceIdsAtTheIntegerExtremesStayDistinct) {
  std::set<std::string> ids;
  const auto id_of = [](const std::function<void(inference::InferParameter*)>& set) {
    inference::ModelInferRequest in = Request();
    set(&(*in.mutable_parameters())["sequence_id"]);
    v1::AttendRequest out;
    OipReply reply;
    const Status st = OipToAttend(&in, &out, &reply);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return st.ok() ? reply.sequence->id : std::string();
  };
  ids.insert(id_of([](auto* p) { p->set_int64_param(std::numeric_limits<int64_t>::min()); }));
  ids.insert(id_of([](auto* p) { p->set_int64_param(std::numeric_limits<int64_t>::max()); }));
  ids.insert(id_of([](auto* p) { p->set_uint64_param(std::numeric_limits<uint64_t>::max()); }));
  ids.insert(id_of([](auto* p) { p->set_int64_param(-1); }));
  ids.insert(id_of([](auto* p) { p->set_string_param("-1"); }));  // A string id is not a number id.
  EXPECT_EQ(ids.size(), 5u);
  EXPECT_EQ(ids.count("i:18446744073709551615"), 1u);
  // The same number as int64 and as uint64 is the same id (clients send either).
  EXPECT_EQ(id_of([](auto* p) { p->set_int64_param(7); }),
            id_of([](auto* p) { p->set_uint64_param(7); }));
}

TEST(OipCodecTest, AnswersCarryTheRequestedOutputsInOrder) {
  AttendAnswer answer;
  answer.meta.set_model("demo");
  answer.meta.set_model_version(2);
  answer.meta.mutable_output()->set_dtype(v1::DATA_TYPE_FLOAT16);
  for (int64_t d : {1, 2, 4}) answer.meta.mutable_output()->add_shape(d);
  answer.meta.mutable_attn_weights()->set_dtype(v1::DATA_TYPE_FLOAT16);
  for (int64_t d : {1, 2, 2}) answer.meta.mutable_attn_weights()->add_shape(d);
  answer.output = std::make_unique<std::string>("out");
  answer.weights = std::make_unique<std::string>("w");
  const OipReply reply{"id-9", {"attn_weights", "attn_output"}};
  const inference::ModelInferResponse head = OipResponseHead(answer, reply);
  EXPECT_EQ(head.model_version(), "2");
  EXPECT_EQ(head.id(), "id-9");
  ASSERT_EQ(head.outputs_size(), 2);
  EXPECT_EQ(head.outputs(0).name(), "attn_weights");
  EXPECT_EQ(head.outputs(0).datatype(), "FP16");
  EXPECT_THAT(head.outputs(1).shape(), ElementsAre(1, 2, 4));
  const auto raw = OipRawOutputs(&answer, reply);
  ASSERT_EQ(raw.size(), 2u);
  EXPECT_EQ(*raw[0].own, "w");
  EXPECT_EQ(*raw[1].own, "out");
  // An output the engine left in a staging block goes out from there.
  auto block = std::make_shared<std::string>("staged");
  AttendAnswer staged;
  staged.output_block = {block, block->data(), block->size()};
  const auto from_block = OipRawOutputs(&staged, OipReply{"id", {"attn_output"}});
  ASSERT_EQ(from_block.size(), 1u);
  EXPECT_EQ(from_block[0].block.data, block->data());
  EXPECT_EQ(from_block[0].size(), 6u);
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// A bfloat16 model says so in its metadata (it takes BF16 on the wire and answers in it, half the
// bytes of FP32, no conversion pass); float32 stays FP32.
// A rotary model's positions: parameters query_position and key_position, and the INT64
// "positions" input from raw bytes or int64_contents, into AttendRequest's fields; a wrong kind,
// datatype, shape or count names its field.
TEST(OipCodecTest, PositionsFromParametersAndAnInt64Input) {
  const std::vector<int64_t> pos = {7, int64_t{1} << 40};  // The validator bounds them.
  for (const bool raw : {true, false}) {
    inference::ModelInferRequest in = Request();  // A query [1, 2, 4].
    if (!raw) in.clear_raw_input_contents();
    if (!raw) in.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(8, 0.5f);
    auto* p = in.add_inputs();
    p->set_name("positions");
    p->set_datatype("INT64");
    p->add_shape(1);
    p->add_shape(2);
    if (raw) {
      in.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(pos.data()), pos.size() * 8));
    } else {
      for (int64_t v : pos) p->mutable_contents()->add_int64_contents(v);
    }
    (*in.mutable_parameters())["key_position"].set_int64_param(5);
    v1::AttendRequest out;
    OipReply reply;
    const Status st = OipToAttend(&in, &out, &reply);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_THAT(out.positions(), ElementsAre(7, int64_t{1} << 40)) << raw;
    EXPECT_EQ(out.key_position(), 5);
    EXPECT_FALSE(out.has_query_position());
  }
  inference::ModelInferRequest in = Request();
  (*in.mutable_parameters())["query_position"].set_int64_param(1000);
  v1::AttendRequest out;
  OipReply reply;
  ASSERT_TRUE(OipToAttend(&in, &out, &reply).ok());
  EXPECT_TRUE(out.has_query_position());
  EXPECT_EQ(out.query_position(), 1000);

  using Case = RefusalCase;
  const auto positions = [](inference::ModelInferRequest* r, const char* dtype,
                            std::vector<int64_t> shape) {
    auto* p = r->add_inputs();
    p->set_name("positions");
    p->set_datatype(dtype);
    for (int64_t d : shape) p->add_shape(d);
    return p;
  };
  const std::vector<Case> cases = {
      {[&](auto* r) {
         positions(r, "FP32", {1, 2});
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "inputs[1].datatype: 'FP32' is not allowed for positions; expected INT64"},
      {[&](auto* r) {
         positions(r, "INT64", {1, 2, 1});
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "inputs[1].shape: 3 dims; positions are [batch, query_len] or [query_len]"},
      {[&](auto* r) {
         positions(r, "INT64", {-2, -1});
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "inputs[1].shape: [-2, -1] is not a size"},
      {[&](auto* r) {
         positions(r, "INT64", {int64_t{1} << 32, int64_t{1} << 32});
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "is not a size; each dim is 0 or more, their product an int64"},
      {[&](auto* r) {
         positions(r, "INT64", {1, 2});
         r->add_raw_input_contents(std::string(12, '\0'));
       },
       "inputs[1]: 12 bytes for shape [1, 2]; expected 2 INT64 values, 8 bytes each"},
      {[&](auto* r) {
         r->clear_raw_input_contents();
         r->mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(8, 0.f);
         positions(r, "INT64", {1, 2})->mutable_contents()->add_int64_contents(1);
       },
       "inputs[1].contents.int64_contents: 1 values for shape [1, 2]; expected 2"},
      {[&](auto* r) {
         positions(r, "INT64", {1, 2});
         r->add_raw_input_contents(std::string(16, '\0'));
         positions(r, "INT64", {1, 2});
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "inputs[2].name: 'positions' given twice"},
      {[&](auto* r) {
         auto* p = positions(r, "INT64", {1, 2});
         (*p->mutable_parameters())["shared_memory_region"].set_string_param("r");
         (*p->mutable_parameters())["shared_memory_byte_size"].set_int64_param(16);
       },
       "inputs[1]: positions come in the request"},
      {[&](auto* r) {
         positions(r, "INT64", {2, 1});  // Two values, but the query is one sequence of two.
         r->add_raw_input_contents(std::string(16, '\0'));
       },
       "inputs[1].shape: [2, 1] for a query of batch 1 and 2 tokens; positions are [batch, "
       "query_len] = [1, 2] (batch-first whatever the layout), or [query_len]"},
      {[&](auto* r) {
         positions(r, "INT64", {0});  // No positions at all, for a query of two sequences.
         r->add_raw_input_contents("");
         (*r->mutable_parameters())["layout"].set_string_param("sequence_first");
       },
       "inputs[1].shape: [0] for a query of batch 2 and 1 tokens"},
      {[](auto* r) { (*r->mutable_parameters())["query_position"].set_string_param("3"); },
       "parameters['query_position']: a string parameter; expected int64"},
      {[](auto* r) { (*r->mutable_parameters())["key_position"].set_double_param(3); },
       "parameters['key_position']: a double parameter; expected int64"},
  };
  ExpectRefusals(cases);
}

TEST(OipCodecTest, MetadataOfADecoderLayerNamesItsPositionsInput) {
  ModelSpec spec;
  spec.name = "layer";
  spec.embed_dim = spec.kdim = spec.vdim = 8;
  spec.num_heads = 2;
  DecoderSpec dec;
  dec.family = "llama";
  dec.num_kv_heads = 1;
  dec.rotary = RotarySpec{};
  spec.decoder = dec;
  const auto names = [](const inference::ModelMetadataResponse& m) {
    std::set<std::string> out;
    for (const auto& t : m.inputs()) out.insert(t.name() + ":" + t.datatype());
    return out;
  };
  inference::ModelMetadataResponse m = OipModelMetadata(spec, {1});
  EXPECT_EQ(m.platform(), "attnserve_decoder_attention");
  EXPECT_TRUE(names(m).count("positions:INT64"));
  EXPECT_TRUE(names(m).count("key:FP32"));
  spec.decoder->sliding_window = 4;  // Self-attention only: no key or value input.
  m = OipModelMetadata(spec, {1});
  EXPECT_FALSE(names(m).count("key:FP32"));
  EXPECT_FALSE(names(m).count("value:FP32"));
  spec.decoder.reset();
  m = OipModelMetadata(spec, {1});
  EXPECT_EQ(m.platform(), "attnserve_multihead_attention");
  EXPECT_FALSE(names(m).count("positions:INT64"));
}

TEST(OipCodecTest, MetadataNamesTheModelsComputeDtype) {
  ModelSpec spec;
  spec.name = "m";
  spec.embed_dim = spec.kdim = spec.vdim = 8;
  spec.num_heads = 2;
  for (const auto& [dtype, want] :
       {std::pair{DType::kFloat32, "FP32"}, std::pair{DType::kBFloat16, "BF16"}}) {
    spec.compute_dtype = dtype;
    const inference::ModelMetadataResponse m = OipModelMetadata(spec, {1});
    for (const auto& t : m.inputs()) {
      if (t.name() == "query" || t.name() == "key" || t.name() == "value")
        EXPECT_EQ(t.datatype(), want) << t.name();
    }
    for (const auto& t : m.outputs()) EXPECT_EQ(t.datatype(), want) << t.name();
  }
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// A POSIX shared memory object for the shared-memory cases, filled with `bytes`, unlinked after.
class ShmObject {
 public:
  explicit ShmObject(const std::string& bytes) {
    key_ = "/attnserve-oip-test-" + std::to_string(::getpid()) + "-" + std::to_string(n_++);
    const int fd = ::shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes.size())), 0);
    EXPECT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  }
  ~ShmObject() { ::shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }
  std::string Read(size_t n) const {
    const int fd = ::shm_open(key_.c_str(), O_RDONLY, 0);
    std::string out(n, '\0');
    EXPECT_EQ(::pread(fd, out.data(), n, 0), static_cast<ssize_t>(n));
    ::close(fd);
    return out;
  }

 private:
  std::string key_;
  static inline int n_ = 0;
};

void InRegion(google::protobuf::Map<std::string, inference::InferParameter>* p,
              const std::string& region, int64_t size, int64_t offset = 0) {
  (*p)["shared_memory_region"].set_string_param(region);
  (*p)["shared_memory_byte_size"].set_int64_param(size);
  if (offset) (*p)["shared_memory_offset"].set_int64_param(offset);
}

SharedMemoryOptions Allowed() {
  SharedMemoryOptions o;
  o.allowed = true;
  return o;
}

// Triton's shared-memory parameters: an input read from its region (raw contents carry only the
// inputs not in shared memory), an output's region noted with its size, and the refusals.
TEST(OipCodecTest, InputsAndOutputsInSharedMemoryRegions) {
  std::string bytes(64, '\0');
  for (int i = 0; i < 64; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>(i);
  ShmObject obj(bytes);
  SharedMemoryRegistry shm_all(Allowed());
  const TenantRegions shm = shm_all.For({});
  ASSERT_TRUE(shm.RegisterSystem("in", obj.key(), 0, 64).ok());
  ASSERT_TRUE(shm.RegisterSystem("out", obj.key(), 16, 48).ok());
  inference::ModelInferRequest in = Request();
  in.clear_raw_input_contents();
  InRegion(in.mutable_inputs(0)->mutable_parameters(), "in", 32, 8);
  auto* mask = in.add_inputs();  // Not in shared memory: the one raw entry is its.
  mask->set_name("key_padding_mask");
  mask->set_datatype("BOOL");
  mask->add_shape(1);
  mask->add_shape(2);
  in.add_raw_input_contents(std::string("\x00\x01", 2));
  auto* out_tensor = in.add_outputs();
  out_tensor->set_name("attn_output");
  InRegion(out_tensor->mutable_parameters(), "out", 40);
  v1::AttendRequest out;
  OipReply reply;
  ASSERT_TRUE(OipToAttend(&in, &out, &reply, &shm).ok());
  EXPECT_EQ(out.query().data(), bytes.substr(8, 32));
  EXPECT_EQ(out.key_padding_mask().data(), std::string("\x00\x01", 2));
  ASSERT_EQ(reply.regions.size(), 1u);
  ASSERT_EQ(reply.output_regions.size(), 1u);
  ASSERT_TRUE(reply.output_regions[0]);
  const OutputLimits limits = OipOutputLimits(reply);
  EXPECT_EQ(limits.output.bytes, 40);
  EXPECT_THAT(limits.output.field, HasSubstr("outputs[0]"));
  EXPECT_EQ(limits.weights.bytes, -1);
  // The answer goes to the region, and its raw entry is empty.
  AttendAnswer answer;
  answer.output = std::make_unique<std::string>(32, 'z');
  ASSERT_TRUE(OipWriteSharedOutputs(&answer, reply).ok());
  EXPECT_EQ(obj.Read(64).substr(16, 32), std::string(32, 'z'));
  const auto raw = OipRawOutputs(&answer, reply);
  ASSERT_EQ(raw.size(), 1u);
  EXPECT_EQ(raw[0].size(), 0u);
  // The same region unregistered now: the request still holds it.
  ASSERT_TRUE(shm.Unregister("out", false).ok());
  answer.output = std::make_unique<std::string>(8, 'y');
  EXPECT_TRUE(OipWriteSharedOutputs(&answer, reply).ok());

  struct Case {
    std::function<void(inference::ModelInferRequest*)> change;
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {[](auto* r) { InRegion(r->mutable_inputs(0)->mutable_parameters(), "nope", 32); },
       StatusCode::kNotFound, "region 'nope' is not registered"},
      {[](auto* r) { InRegion(r->mutable_inputs(0)->mutable_parameters(), "in", 32, 40); },
       StatusCode::kInvalidArgument, "inputs[0]: offset 40 and byte size 32 do not fit"},
      {[](auto* r) { InRegion(r->mutable_inputs(0)->mutable_parameters(), "in", -1); },
       StatusCode::kInvalidArgument, "do not fit"},
      {[](auto* r) {
         InRegion(r->mutable_inputs(0)->mutable_parameters(), "in", 32,
                  std::numeric_limits<int64_t>::max());
       },
       StatusCode::kInvalidArgument, "do not fit"},
      {[](auto* r) {
         InRegion(r->mutable_inputs(0)->mutable_parameters(), "in", 32);
         r->add_raw_input_contents(std::string(32, 'x'));
       },
       StatusCode::kInvalidArgument, "inputs not in shared memory"},
      {[](auto* r) {
         InRegion(r->mutable_inputs(0)->mutable_parameters(), "in", 32);
         InRegion(r->add_outputs()->mutable_parameters(), "in", 8, 60);
         r->mutable_outputs(0)->set_name("attn_output");
       },
       StatusCode::kInvalidArgument, "outputs[0]: offset 60 and byte size 8 do not fit"},
  };
  for (const Case& c : cases) {
    inference::ModelInferRequest r = Request();
    r.clear_raw_input_contents();
    c.change(&r);
    v1::AttendRequest o;
    OipReply rep;
    const Status st = OipToAttend(&r, &o, &rep, &shm);
    EXPECT_EQ(st.code(), c.code) << c.says << ": " << st.message();
    EXPECT_THAT(st.message(), HasSubstr(c.says));
    EXPECT_THAT(st.message(), ::testing::Not(HasSubstr(obj.key())));  // Never a key.
  }
  // Shared memory off: a request naming a region is refused saying how to turn it on.
  SharedMemoryRegistry off_all{SharedMemoryOptions{}};
  const TenantRegions off = off_all.For({});
  inference::ModelInferRequest r = Request();
  r.clear_raw_input_contents();
  InRegion(r.mutable_inputs(0)->mutable_parameters(), "in", 32);
  v1::AttendRequest o;
  OipReply rep;
  const Status st = OipToAttend(&r, &o, &rep, &off);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("--allow-shared-memory"));
}

// Issue 48, found by a hostile review (2026-11-28): one small ModelInfer naming a 512 MiB window
// as its query made the server read all of it before the shape check refused the request (peak
// memory 185 MB -> 707 MB). Every window is now checked against its tensor and all of them against
// the request limit before a byte is read.
TEST(OipCodecTest, RegionInputsAreBoundedBeforeAByteIsRead) {
  const std::string key = "/attnserve-oip-sparse-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, int64_t{256} << 20), 0);  // Sparse: no page is touched.
  ::close(fd);
  SharedMemoryRegistry shm_all(Allowed());
  const TenantRegions shm = shm_all.For({});
  ASSERT_TRUE(shm.RegisterSystem("big", key, 0, uint64_t{256} << 20).ok());
  // A window larger than the tensor ([1, 2, 4] FP32: 32 bytes).
  inference::ModelInferRequest wrong = Request();
  wrong.clear_raw_input_contents();
  InRegion(wrong.mutable_inputs(0)->mutable_parameters(), "big", int64_t{64} << 20);
  v1::AttendRequest out;
  OipReply reply;
  Status st = OipToAttend(&wrong, &out, &reply, &shm, int64_t{64} << 20);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("inputs[0].parameters.shared_memory_byte_size"));
  EXPECT_THAT(st.message(), HasSubstr("take 32 bytes"));
  EXPECT_TRUE(out.query().data().empty()) << "bytes were read";
  // Windows that match their tensors, more bytes in all than the limit.
  inference::ModelInferRequest large = Request();
  large.clear_raw_input_contents();
  for (const char* name : {"key", "value"}) {
    auto* t = large.add_inputs();
    t->set_name(name);
    t->set_datatype("FP32");
  }
  for (int i = 0; i < 3; ++i) {
    auto* t = large.mutable_inputs(i);
    t->clear_shape();
    for (int64_t d : {1, 1024, 1024}) t->add_shape(d);
    InRegion(t->mutable_parameters(), "big", int64_t{4} << 20);
  }
  v1::AttendRequest out2;
  OipReply reply2;
  st = OipToAttend(&large, &out2, &reply2, &shm, int64_t{8} << 20);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("12582912 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("--max-message-bytes"));
  EXPECT_TRUE(out2.query().data().empty() && out2.key().data().empty()) << "bytes were read";
  ::shm_unlink(key.c_str());
}

}  // namespace
}  // namespace attnserve
