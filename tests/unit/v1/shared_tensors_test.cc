// attnserve.v1 tensors in shared-memory regions, without a server: read into the message or into
// pinned staging, masks too, the answer's room noted, the answer written back, the refusals.
#include "server/v1/shared_tensors.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class Object {
 public:
  explicit Object(size_t size) {
    key_ = "/attnserve-st-test-" + std::to_string(::getpid());
    const int fd = ::shm_open(key_.c_str(), O_CREAT | O_RDWR, 0600);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    std::string bytes(size, '\0');
    for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 7);
    EXPECT_EQ(::pwrite(fd, bytes.data(), size, 0), static_cast<ssize_t>(size));
    ::close(fd);
    bytes_ = bytes;
  }
  ~Object() { ::shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string key_, bytes_;
};

v1::SharedMemoryRef Ref(const std::string& region, int64_t offset, int64_t size) {
  v1::SharedMemoryRef r;
  r.set_region(region);
  r.set_offset(offset);
  r.set_byte_size(size);
  return r;
}

// A tensor in a region: its dtype, shape and window.
void Declare(v1::Tensor* t, v1::DataType dtype, std::vector<int64_t> shape,
             const v1::SharedMemoryRef& ref) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_shared_memory() = ref;
}

TEST(SharedTensorsTest, ReadIntoTheMessageOrStagingNoteTheAnswerAndWriteItBack) {
  Object obj(4096);
  SharedMemoryOptions o;
  o.allowed = true;
  SharedMemoryRegistry shm_all(o);
  const TenantRegions shm = shm_all.For({});
  ASSERT_TRUE(shm.RegisterSystem("r", obj.key(), 0, 4096).ok());
  v1::AttendRequest req;
  Declare(req.mutable_query(), v1::DATA_TYPE_FLOAT32, {1, 16}, Ref("r", 0, 64));
  Declare(req.mutable_key(), v1::DATA_TYPE_FLOAT32, {1, 8}, Ref("r", 64, 32));
  Declare(req.mutable_value(), v1::DATA_TYPE_FLOAT32, {1, 8}, Ref("r", 96, 32));
  Declare(req.mutable_key_padding_mask(), v1::DATA_TYPE_BOOL, {1, 4}, Ref("r", 128, 4));
  *req.mutable_output_shared_memory() = Ref("r", 1024, 64);
  ASSERT_TRUE(NamesSharedMemory(req));
  // With a staging (a CUDA server's): query, key and value there, the mask in the message.
  HostStaging staging(1 << 20, /*pinned=*/false);
  StagedInputs staged;
  SharedTensors shared;
  OutputLimits limits;
  ASSERT_TRUE(ReadSharedTensors(shm, &staging, &req, &staged, &shared, &limits).ok());
  EXPECT_EQ(std::string(staged.query.data, staged.query.size), obj.bytes().substr(0, 64));
  EXPECT_EQ(std::string(staged.value.data, staged.value.size), obj.bytes().substr(96, 32));
  EXPECT_TRUE(req.query().data().empty());
  EXPECT_FALSE(req.query().has_shared_memory());
  EXPECT_EQ(req.key_padding_mask().data(), obj.bytes().substr(128, 4));
  EXPECT_EQ(limits.output.bytes, 64);
  EXPECT_EQ(shared.held.size(), 4u);
  // Without one: everything into the message.
  v1::AttendRequest plain;
  Declare(plain.mutable_query(), v1::DATA_TYPE_FLOAT16, {2, 4}, Ref("r", 8, 16));
  StagedInputs none;
  SharedTensors shared2;
  OutputLimits limits2;
  ASSERT_TRUE(ReadSharedTensors(shm, nullptr, &plain, &none, &shared2, &limits2).ok());
  EXPECT_EQ(plain.query().data(), obj.bytes().substr(8, 16));
  EXPECT_FALSE(none.query);
  // The answer into the region, its bytes gone from the answer.
  AttendAnswer answer;
  answer.output = std::make_unique<std::string>(64, 'a');
  ASSERT_TRUE(WriteSharedTensors(shared, &answer).ok());
  EXPECT_EQ(answer.output, nullptr);
  char back[64];
  ASSERT_TRUE(shm.Find("r").value()->Read(1024, 64, back, "x").ok());
  EXPECT_EQ(std::string(back, 64), std::string(64, 'a'));
}

TEST(SharedTensorsTest, RefusalsNameTheField) {
  Object obj(256);
  SharedMemoryOptions o;
  o.allowed = true;
  SharedMemoryRegistry shm_all(o);
  const TenantRegions shm = shm_all.For({});
  ASSERT_TRUE(shm.RegisterSystem("r", obj.key(), 0, 256).ok());
  struct Case {
    std::function<void(v1::AttendRequest*)> set;
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {[](auto* r) {
         r->mutable_query()->set_data("xx");
         *r->mutable_query()->mutable_shared_memory() = Ref("r", 0, 2);
       },
       StatusCode::kInvalidArgument, "query: both data and shared_memory given"},
      {[](auto* r) { *r->mutable_key()->mutable_shared_memory() = Ref("r", 250, 8); },
       StatusCode::kInvalidArgument, "key.shared_memory: offset 250 and byte size 8"},
      {[](auto* r) { *r->mutable_attn_mask()->mutable_shared_memory() = Ref("gone", 0, 8); },
       StatusCode::kNotFound, "region 'gone'"},
      {[](auto* r) { *r->mutable_output_shared_memory() = Ref("r", -1, 8); },
       StatusCode::kInvalidArgument, "output_shared_memory.shared_memory: offset -1"},
      {[](auto* r) { *r->mutable_attn_weights_shared_memory() = Ref("r", 0, INT64_MAX); },
       StatusCode::kInvalidArgument, "attn_weights_shared_memory.shared_memory"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest req;
    c.set(&req);
    StagedInputs staged;
    SharedTensors shared;
    OutputLimits limits;
    const Status st = ReadSharedTensors(shm, nullptr, &req, &staged, &shared, &limits);
    EXPECT_EQ(st.code(), c.code) << c.says << ": " << st.message();
    EXPECT_THAT(st.message(), HasSubstr(c.says));
  }
}

// Issue 48: a 75-byte request naming a 256 MiB sparse region as its query, key and value made the
// server read 768 MiB before the shapes were checked. Now every window is checked against its
// tensor's declared shape and dtype, and all of them against the request limit, before a byte is
// read.
TEST(SharedTensorsTest, EveryWindowIsBoundedBeforeAByteIsRead) {
  const std::string key = "/attnserve-st-sparse-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  const int64_t big = int64_t{256} << 20;
  ASSERT_EQ(::ftruncate(fd, big), 0);  // Sparse: no page is touched.
  ::close(fd);
  SharedMemoryOptions o;
  o.allowed = true;
  SharedMemoryRegistry shm_all(o);
  const TenantRegions shm = shm_all.For({});
  ASSERT_TRUE(shm.RegisterSystem("big", key, 0, static_cast<uint64_t>(big)).ok());
  const auto read = [&](v1::AttendRequest* req, int64_t max_bytes) {
    StagedInputs staged;
    SharedTensors shared;
    OutputLimits limits;
    const Status st = ReadSharedTensors(shm, nullptr, req, &staged, &shared, &limits, max_bytes);
    EXPECT_TRUE(req->query().data().empty()) << "bytes were read";
    EXPECT_TRUE(req->key().data().empty()) << "bytes were read";
    return st;
  };
  // The window is not what the shape says: refused, naming both.
  v1::AttendRequest wrong;
  for (v1::Tensor* t : {wrong.mutable_query(), wrong.mutable_key(), wrong.mutable_value()})
    Declare(t, v1::DATA_TYPE_FLOAT32, {1, 2, 4}, Ref("big", 0, big));
  Status st = read(&wrong, int64_t{64} << 20);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("query.shared_memory: byte_size 268435456"));
  EXPECT_THAT(st.message(), HasSubstr("32 bytes"));
  // Shapes that overflow int64 are refused the same way.
  v1::AttendRequest huge;
  Declare(huge.mutable_query(), v1::DATA_TYPE_FLOAT32, {INT64_MAX, INT64_MAX}, Ref("big", 0, 8));
  EXPECT_EQ(read(&huge, int64_t{64} << 20).code(), StatusCode::kInvalidArgument);
  // Shapes that match, but more bytes in all than one request may bring: refused, nothing read.
  v1::AttendRequest large;
  for (v1::Tensor* t : {large.mutable_query(), large.mutable_key(), large.mutable_value()})
    Declare(t, v1::DATA_TYPE_FLOAT32, {1, 1024, 1024}, Ref("big", 0, 4 << 20));
  st = read(&large, int64_t{8} << 20);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("12582912 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("--max-message-bytes"));
  ::shm_unlink(key.c_str());
}

}  // namespace
}  // namespace attnserve
