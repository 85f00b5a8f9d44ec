// attnserve.v1 tensors in shared-memory regions, without a server: read into the message or into
// pinned staging, masks too, the answer's room noted, the answer written back, the refusals.
#include "server/v1/shared_tensors.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

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

TEST(SharedTensorsTest, ReadIntoTheMessageOrStagingNoteTheAnswerAndWriteItBack) {
  Object obj(4096);
  SharedMemoryOptions o;
  o.allowed = true;
  SharedMemoryRegistry shm(o);
  ASSERT_TRUE(shm.RegisterSystem("r", obj.key(), 0, 4096).ok());
  v1::AttendRequest req;
  *req.mutable_query()->mutable_shared_memory() = Ref("r", 0, 64);
  *req.mutable_key()->mutable_shared_memory() = Ref("r", 64, 32);
  *req.mutable_value()->mutable_shared_memory() = Ref("r", 96, 32);
  *req.mutable_key_padding_mask()->mutable_shared_memory() = Ref("r", 128, 4);
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
  *plain.mutable_query()->mutable_shared_memory() = Ref("r", 8, 16);
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
  SharedMemoryRegistry shm(o);
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

}  // namespace
}  // namespace attnserve
