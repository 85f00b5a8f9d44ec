// Callers closed to each other, as a state machine over both kinds of state several tenants keep:
// each step's first byte picks a call on the shared-memory regions or on the keys and values kept
// between requests, the rest of the step's bytes its choices.
// Regions: three tenants (a: no terms; b: a byte cap and a key prefix; c: a small cap, calling from
// off the host at times) on one shared-memory registry over real /dev/shm objects (ordinary ones,
// one cut short and grown back underneath, a FIFO, a link, a directory): register (hostile names,
// every offset and size up to the int64 and uint64 extremes), unregister one name or all, status,
// find and read a window, and a CreateMemory request's tensors read from regions (v1's
// ReadSharedTensors). A model of each tenant's regions says what every call must answer; after
// every operation: each tenant lists exactly its model (never another's name or key), another's
// name reads exactly as an unknown one, bytes read are the object's, and the registry's totals are
// the models' sums.
// Keys and values: four tenants (caps, guarantees, one unnamed) on one KvStore over the LibTorch
// engine, opening, stepping, forking, truncating and closing sessions, creating and deleting
// memories, holding entries, ticking the clock and probing each other's handles
// (tests/lib/kv_tenant_check.h); after every call every byte is charged to exactly one tenant,
// caps, the budget and guarantees hold, and another's handle answers as one never made; at the
// end, cleared, every tenant is charged nothing.
// A broken invariant aborts naming it and the operation.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/shm/shared_memory.h"
#include "server/v1/shared_tensors.h"
#include "tests/lib/kv_tenant_check.h"

namespace attnserve {
namespace {

constexpr int64_t kObjectBytes = 4096;
constexpr int64_t kBudget = 12000;
constexpr size_t kMaxRegions = 6;

[[noreturn]] void Broken(const std::string& what, int step) {
  std::fprintf(stderr, "tenants state machine: step %d: %s\n", step, what.c_str());
  std::abort();
}

// The objects every run names, made once per process: keys "/attnserve-fz-PID-..." (tenant b's
// prefix is "attnserve-fz-b", which only "b-own" matches).
struct Objects {
  std::string pid = std::to_string(::getpid());
  std::vector<std::string> keys;  // Index: what an operation names.
  std::vector<bool> regular;      // Registrable at all.
  std::string bytes;              // Every regular object's content (byte i: i * 13).
  bool cut = false;               // "cut" is 16 bytes long now.
  Objects() {
    for (int i = 0; i < kObjectBytes; ++i) bytes.push_back(static_cast<char>(i * 13));
    Make("/attnserve-fz-" + pid + "-plain", true);
    Make("/attnserve-fz-" + pid + "-cut", true);
    Make("/attnserve-fz-b" + pid + "-own", true);
    const std::string fifo = "/attnserve-fz-" + pid + "-fifo";
    ::mkfifo(("/dev/shm" + fifo).c_str(), 0600);
    Add(fifo, false);
    const std::string link = "/attnserve-fz-" + pid + "-link";
    (void)!::symlink(("/dev/shm" + keys[0]).c_str(), ("/dev/shm" + link).c_str());
    Add(link, false);
    const std::string dir = "/attnserve-fz-" + pid + "-dir";
    ::mkdir(("/dev/shm" + dir).c_str(), 0700);
    Add(dir, false);
    Add("/attnserve-fz-" + pid + "-missing", false);
    Add("../etc/passwd", false);
  }
  ~Objects() {
    for (const std::string& k : keys) {
      ::unlink(("/dev/shm" + k).c_str());
      ::rmdir(("/dev/shm" + k).c_str());
    }
  }
  void Add(const std::string& key, bool ok) {
    keys.push_back(key);
    regular.push_back(ok);
  }
  void Make(const std::string& key, bool ok) {
    const int fd = ::shm_open(key.c_str(), O_CREAT | O_RDWR, 0600);
    (void)!::ftruncate(fd, kObjectBytes);
    (void)!::pwrite(fd, bytes.data(), bytes.size(), 0);
    ::close(fd);
    Add(key, ok);
  }
  void Cut(bool cut_now) {
    const int fd = ::shm_open(keys[1].c_str(), O_RDWR, 0);
    (void)!::ftruncate(fd, cut_now ? 16 : kObjectBytes);
    if (!cut_now) (void)!::pwrite(fd, bytes.data(), bytes.size(), 0);
    ::close(fd);
    cut = cut_now;
  }
  int64_t Size(size_t i) const { return i == 1 && cut ? 16 : kObjectBytes; }
};

Objects& TheObjects() {
  static Objects* objects = new Objects();  // Left for the process's end (libFuzzer's workers).
  static const bool cleaned = [] {
    std::atexit([] { delete &TheObjects(); });
    return true;
  }();
  (void)cleaned;
  return *objects;
}

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool more() const { return at_ < size_; }
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  template <typename T>
  const T& Pick(const std::vector<T>& from) {
    return from[Byte() % from.size()];
  }

 private:
  const uint8_t* data_;
  size_t size_, at_ = 0;
};

struct Held {
  std::string key;
  uint64_t offset, size;
};

struct Tenant {
  std::string name;
  RegionTerms terms;
  std::map<std::string, Held> model;
};

RegionTerms Terms(int64_t max_bytes, int64_t max_regions, const std::string& key_prefix,
                  std::vector<std::string> others = {}) {
  RegionTerms t;
  t.max_bytes = max_bytes;
  t.max_regions = max_regions;
  t.key_prefix = key_prefix;
  t.others_prefixes = std::move(others);
  return t;
}

std::string Unnamed(const Status& st, const std::string& name) {
  std::string m = st.message();
  // The name as a message carries it: bytes that are not UTF-8 read '?' (Status).
  const std::string carried = Status(StatusCode::kInternal, name).message();
  for (size_t at; (at = m.find("'" + carried + "'")) != std::string::npos;) {
    m.replace(at, carried.size() + 2, "<>");
  }
  return std::to_string(static_cast<int>(st.code())) + " " + m;
}

bool ValidName(const std::string& n) {
  if (n.empty() || n.size() > 256) return false;
  for (unsigned char c : n) {
    if (c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

class Machine {
 public:
  Machine() : objects_(TheObjects()) {
    if (objects_.cut) objects_.Cut(false);
    SharedMemoryOptions o;
    o.allowed = true;
    o.max_bytes = kBudget;
    o.max_regions = kMaxRegions;
    registry_ = std::make_unique<SharedMemoryRegistry>(o);
    // a: any key but b's (b's prefix is longer than a's empty one); c: at most 2 regions.
    tenants_ = {{"a", Terms(0, 0, "", {"attnserve-fz-b"}), {}},
                {"b", Terms(6000, 0, "attnserve-fz-b"), {}},
                {"c", Terms(3000, 2, ""), {}}};
  }

  void Step(Input& in, int step) {
    step_ = step;
    Tenant& t = tenants_[in.Byte() % tenants_.size()];
    const bool local = t.name != "c" || in.Byte() % 2 == 0;
    const TenantRegions view = registry_->For(RegionCaller{t.name, t.terms, local});
    static const std::vector<std::string> names = {
        "r", "s", "", "\x01", std::string(257, 'x'), std::string(256, 'y'), "r s", "\xff"};
    const std::string& name = in.Pick(names);
    const int op = in.Byte() % 6;
    if (std::getenv("ATTNSERVE_FUZZ_TRACE")) {
      std::fprintf(stderr, "step %d: tenant %s op %d name '%s'\n", step, t.name.c_str(), op,
                   name.substr(0, 8).c_str());
    }
    switch (op) {
      case 0:
        return Register(in, t, view, name, local);
      case 1:
        return Unregister(in, t, view, name);
      case 2:
        return Read(in, t, view, name, local);
      case 3:
        return CreateMemory(in, t, view, name, local);
      case 4:
        return objects_.Cut(!objects_.cut);
      default:
        return Check();
    }
  }

  void Check() {
    int64_t bytes = 0;
    size_t regions = 0;
    for (Tenant& t : tenants_) {
      const auto listed = registry_->For(RegionCaller{t.name, t.terms, true}).List("", false);
      if (!listed.ok()) Broken("List failed: " + listed.status().message(), step_);
      std::map<std::string, std::string> seen, want;
      for (const RegionInfo& r : *listed) seen[r.name] = r.key;
      for (const auto& [n, h] : t.model) want[n] = h.key, bytes += static_cast<int64_t>(h.size);
      if (seen != want) {
        std::string detail;
        for (const auto& [n, k] : seen) detail += " listed '" + n.substr(0, 8) + "' " + k;
        for (const auto& [n, k] : want) detail += " model '" + n.substr(0, 8) + "' " + k;
        Broken("tenant " + t.name + " lists other than its own regions:" + detail, step_);
      }
      regions += t.model.size();
    }
    if (registry_->registered_bytes() != bytes)
      Broken("registered bytes differ from the sum", step_);
    if (registry_->regions() != regions) Broken("region count differs from the sum", step_);
  }

 private:
  int64_t Total() const {
    int64_t s = 0;
    for (const Tenant& t : tenants_) {
      for (const auto& [n, h] : t.model) s += static_cast<int64_t>(h.size);
    }
    return s;
  }
  size_t Count() const {
    size_t n = 0;
    for (const Tenant& t : tenants_) n += t.model.size();
    return n;
  }

  void Register(Input& in, Tenant& t, const TenantRegions& view, const std::string& name,
                bool local) {
    static const std::vector<uint64_t> offsets = {0,         1, 16, 4095, 4096, uint64_t{INT64_MAX},
                                                  UINT64_MAX};
    static const std::vector<uint64_t> sizes = {
        0, 1, 16, 1000, 2000, 4080, 4096, 4097, uint64_t{INT64_MAX}, UINT64_MAX};
    const size_t obj = in.Byte() % objects_.keys.size();
    const uint64_t offset = in.Pick(offsets), size = in.Pick(sizes);
    const std::string& key = objects_.keys[obj];
    const Status st = view.RegisterSystem(name, key, offset, size);
    int64_t mine = 0;
    for (const auto& [n, h] : t.model) mine += static_cast<int64_t>(h.size);
    const auto starts = [&key](const std::string& p) { return key.compare(1, p.size(), p) == 0; };
    bool prefix_ok = starts(t.terms.key_prefix);
    for (const std::string& other : t.terms.others_prefixes) {
      if (other.size() > t.terms.key_prefix.size() && starts(other)) prefix_ok = false;
    }
    const bool fits = offset <= uint64_t{INT64_MAX} && size <= uint64_t{INT64_MAX} &&
                      offset + size <= static_cast<uint64_t>(objects_.Size(obj));
    const bool want =
        local && ValidName(name) && !t.model.count(name) && Count() < kMaxRegions && size >= 1 &&
        size <= uint64_t{kBudget} && static_cast<int64_t>(size) <= kBudget - Total() &&
        (t.terms.max_bytes == 0 || static_cast<int64_t>(size) <= t.terms.max_bytes - mine) &&
        (t.terms.max_regions == 0 || static_cast<int64_t>(t.model.size()) < t.terms.max_regions) &&
        objects_.regular[obj] && prefix_ok && fits;
    if (st.ok() != want) {
      Broken("register " + t.name + " '" + name.substr(0, 8) + "' " + key + " " +
                 std::to_string(offset) + "+" + std::to_string(size) + ": " +
                 (st.ok() ? "OK" : st.message()) +
                 (want ? " (expected OK)" : " (expected a refusal)"),
             step_);
    }
    if (st.message().size() > kMaxStatusMessage) Broken("an unbounded message", step_);
    if (st.ok()) t.model[name] = Held{key, offset, size};
  }

  void Unregister(Input& in, Tenant& t, const TenantRegions& view, const std::string& name) {
    const bool all = in.Byte() % 4 == 0 || name.empty();  // "" is every region of the tenant.
    if (!view.Unregister(all ? "" : name, false).ok()) Broken("unregister failed", step_);
    if (all) {
      t.model.clear();
    } else {
      t.model.erase(name);
    }
  }

  // Another tenant's name, and a name nobody registered, read exactly alike.
  void ExpectUnknown(const TenantRegions& view, const Status& st, const std::string& name) {
    const std::string other = name == "zz" ? "zy" : "zz";
    if (Unnamed(st, name) != Unnamed(view.Find(other).status(), other)) {
      Broken("'" + name.substr(0, 8) + "' reads otherwise than an unknown name: " + st.message(),
             step_);
    }
  }

  // A call from off the host reaches no region (the server does not let remote peers use them).
  void Read(Input& in, Tenant& t, const TenantRegions& view, const std::string& name, bool local) {
    const auto found = view.Find(name);
    if (!local) {
      if (found.status().code() != StatusCode::kPermissionDenied)
        Broken("Find from off the host was not PERMISSION_DENIED", step_);
      return;
    }
    if (found.ok() != (t.model.count(name) > 0)) Broken("Find disagrees with the model", step_);
    if (!found.ok()) return ExpectUnknown(view, found.status(), name);
    const Held& h = t.model[name];
    const int64_t at = in.Byte() % 64, size = in.Byte() % 64;
    std::string got(static_cast<size_t>(size), '\0');
    const Status st = (*found)->Read(at, size, got.data(), "read");
    const bool inside = static_cast<uint64_t>(at + size) <= h.size;
    const size_t obj = Index(h.key);
    const bool whole =
        size == 0 || static_cast<int64_t>(h.offset) + at + size <= objects_.Size(obj);
    if (st.ok() != (inside && whole))
      Broken("a window read answered wrongly: " + st.message(), step_);
    if (st.ok() && got != objects_.bytes.substr(h.offset + static_cast<uint64_t>(at), got.size())) {
      Broken("a window read other bytes than its object's", step_);
    }
  }

  void CreateMemory(Input& in, Tenant& t, const TenantRegions& view, const std::string& name,
                    bool local) {
    v1::CreateMemoryRequest r;
    const int64_t rows = 1 + in.Byte() % 4, offset = 16 * (in.Byte() % 4);
    for (v1::Tensor* x : {r.mutable_key(), r.mutable_value()}) {
      x->set_dtype(v1::DATA_TYPE_FLOAT32);
      x->add_shape(1);
      x->add_shape(rows);
      x->add_shape(4);
      v1::SharedMemoryRef* ref = x->mutable_shared_memory();
      ref->set_region(name);
      ref->set_offset(offset);
      ref->set_byte_size(rows * 16);
    }
    SharedTensors shared;
    const Status st = ReadSharedTensors(view, &r, &shared, /*max_input_bytes=*/100);
    const auto it = t.model.find(name);
    if (!local) {  // Off the host: no region, its tenant's or not.
      if (st.code() != StatusCode::kPermissionDenied)
        Broken("a request from off the host was not PERMISSION_DENIED: " + st.message(), step_);
      return;
    }
    if (it == t.model.end()) {
      if (st.ok()) Broken("a request read another tenant's (or no) region", step_);
      if (st.code() == StatusCode::kNotFound) ExpectUnknown(view, st, name);
      return;
    }
    const Held& h = it->second;
    const bool fits = static_cast<uint64_t>(offset + rows * 16) <= h.size;
    const bool whole =
        static_cast<int64_t>(h.offset) + offset + rows * 16 <= objects_.Size(Index(h.key));
    const bool want = fits && whole && 2 * rows * 16 <= 100;
    if (st.ok() != want) Broken("CreateMemory's regions answered wrongly: " + st.message(), step_);
    if (st.ok() && r.key().data() != objects_.bytes.substr(h.offset + offset, rows * 16)) {
      Broken("CreateMemory read other bytes than its object's", step_);
    }
  }

  size_t Index(const std::string& key) const {
    for (size_t i = 0; i < objects_.keys.size(); ++i) {
      if (objects_.keys[i] == key) return i;
    }
    return 0;
  }

  Objects& objects_;
  std::unique_ptr<SharedMemoryRegistry> registry_;
  std::vector<Tenant> tenants_;
  int step_ = 0;
};

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::Input in(data, size);
  attnserve::Machine machine;
  std::string log;
  attnserve::testing::KvTenantOptions options;
  const bool trace = std::getenv("ATTNSERVE_FUZZ_TRACE") != nullptr;
  if (trace) options.log = &log;
  attnserve::testing::KvTenantMachine kv(options);
  const std::function<uint8_t()> byte = [&in] { return in.Byte(); };
  int step = 0;
  for (; step < 256 && in.more(); ++step) {
    if (in.Byte() % 2 == 0) {
      machine.Step(in, step);
      machine.Check();
      continue;
    }
    const std::string broken = kv.Step(byte);
    if (trace) {
      std::fprintf(stderr, "step %d: kv %s", step, log.c_str());
      log.clear();
    }
    if (!broken.empty()) attnserve::Broken("keys and values: " + broken, step);
  }
  if (const std::string broken = kv.End(); !broken.empty()) {
    attnserve::Broken("keys and values: " + broken, step);
  }
  return 0;
}
