#include "server/weights/torch_archive.h"

#include <zlib.h>

#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

#include "attnserve/half.h"

namespace attnserve {
namespace {

// ---- Little-endian reads, always bounds-checked by the caller ---------------------------------

uint64_t Le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// ---- The zip container ------------------------------------------------------------------------

struct Entry {
  uint64_t data = 0;  // Offset of the entry's bytes in the file.
  uint64_t size = 0;
};

class Zip {
 public:
  Zip(const std::string& b, const std::string& where) : b_(b), where_(where) {}

  Status Fail(const std::string& what) const {
    return {StatusCode::kFailedPrecondition, where_ + ": torch.save() archive: " + what};
  }

  Status Read(std::map<std::string, Entry>* entries) {
    const uint64_t n = b_.size();
    if (n < 22) return Fail("too short for a zip file (" + std::to_string(n) + " bytes)");
    // End of central directory: the last record, followed by a comment of up to 64 KiB.
    uint64_t eocd = n;
    for (uint64_t i = n - 22 + 1; i-- > 0 && n - 22 - i <= 65535;) {
      if (Le(&b_[i], 4) == 0x06054b50 && i + 22 + Le(&b_[i + 20], 2) == n) {
        eocd = i;
        break;
      }
    }
    if (eocd == n) return Fail("no end-of-central-directory record (truncated or not a zip file)");
    uint64_t count = Le(&b_[eocd + 10], 2), cd_size = Le(&b_[eocd + 12], 4),
             cd_off = Le(&b_[eocd + 16], 4);
    if (Le(&b_[eocd + 4], 2) != 0 || Le(&b_[eocd + 6], 2) != 0)
      return Fail("multi-disk zip files are not supported");
    if (count == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {  // ZIP64
      if (eocd < 20 || Le(&b_[eocd - 20], 4) != 0x07064b50) return Fail("ZIP64 locator missing");
      const uint64_t rec = Le(&b_[eocd - 20 + 8], 8);
      if (rec > n || n - rec < 56 || Le(&b_[rec], 4) != 0x06064b50)
        return Fail("ZIP64 end record out of place");
      count = Le(&b_[rec + 32], 8);
      cd_size = Le(&b_[rec + 40], 8);
      cd_off = Le(&b_[rec + 48], 8);
    }
    if (cd_off > n || cd_size > n - cd_off) return Fail("central directory lies outside the file");
    if (count > 100000) return Fail(std::to_string(count) + " entries is too many");
    uint64_t p = cd_off;
    const uint64_t cd_end = cd_off + cd_size;
    for (uint64_t k = 0; k < count; ++k) {
      if (cd_end - p < 46 || Le(&b_[p], 4) != 0x02014b50)
        return Fail("central directory entry " + std::to_string(k) + " is damaged");
      const uint64_t flags = Le(&b_[p + 8], 2), method = Le(&b_[p + 10], 2);
      const uint32_t crc = static_cast<uint32_t>(Le(&b_[p + 16], 4));
      uint64_t csize = Le(&b_[p + 20], 4), usize = Le(&b_[p + 24], 4);
      const uint64_t name_len = Le(&b_[p + 28], 2), extra_len = Le(&b_[p + 30], 2),
                     comment_len = Le(&b_[p + 32], 2);
      uint64_t local = Le(&b_[p + 42], 4);
      if (cd_end - p - 46 < name_len + extra_len + comment_len)
        return Fail("central directory entry " + std::to_string(k) + " runs past its end");
      const std::string name = b_.substr(p + 46, name_len);
      // ZIP64 extra field: the 64-bit values of the fields marked 0xFFFFFFFF, in this order.
      for (uint64_t e = p + 46 + name_len, end = e + extra_len; end - e >= 4;) {
        const uint64_t id = Le(&b_[e], 2), len = Le(&b_[e + 2], 2);
        if (end - e - 4 < len) return Fail("'" + name + "': extra field runs past its end");
        if (id == 1) {
          uint64_t q = e + 4;
          for (uint64_t* field : {&usize, &csize, &local}) {
            if (*field != 0xFFFFFFFF) continue;
            if (e + 4 + len - q < 8) return Fail("'" + name + "': ZIP64 field too short");
            *field = Le(&b_[q], 8);
            q += 8;
          }
        }
        e += 4 + len;
      }
      p += 46 + name_len + extra_len + comment_len;
      if (flags & 1) return Fail("'" + name + "' is encrypted");
      if (method != 0)
        return Fail("'" + name + "' is compressed (method " + std::to_string(method) +
                    "); torch.save() stores entries uncompressed");
      if (csize != usize) return Fail("'" + name + "': stored sizes disagree");
      if (local > n || n - local < 30 || Le(&b_[local], 4) != 0x04034b50)
        return Fail("'" + name + "': local header out of place");
      const uint64_t data = local + 30 + Le(&b_[local + 26], 2) + Le(&b_[local + 28], 2);
      if (data > n || usize > n - data) {
        return Fail("'" + name + "': its " + std::to_string(usize) +
                    " bytes run past the end of the " + std::to_string(n) +
                    "-byte file (truncated?)");
      }
      const uint32_t actual = static_cast<uint32_t>(crc32_z(
          0, reinterpret_cast<const Bytef*>(b_.data() + data), static_cast<z_size_t>(usize)));
      if (actual != crc) return Fail("'" + name + "': CRC mismatch (the file is damaged)");
      if (!entries->emplace(name, Entry{data, usize}).second)
        return Fail("'" + name + "' appears twice");
    }
    return Status::Ok();
  }

 private:
  const std::string& b_;
  const std::string& where_;
};

// ---- The restricted pickle machine ------------------------------------------------------------

enum class Kind {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kTuple,
  kList,
  kDict,
  kGlobal,
  kStorage,
  kTensor
};

// Values live in an arena and refer to each other by index: no ownership cycles, whatever the
// pickle builds.
struct Value {
  Kind kind = Kind::kNone;
  int64_t i = 0;  // int, bool; storage: element count; tensor: index into tensors
  double f = 0;
  std::string s;           // str; global "module.name"; storage: its key
  std::vector<int> items;  // tuple, list; dict: key, value, key, value, ...
  int dtype = -1;          // storage: element type (index into kStorageTypes)
};

struct StorageType {
  const char* global;
  int bytes;  // 0: refused
  const char* refusal;
};
constexpr StorageType kStorageTypes[] = {
    {"torch.FloatStorage", 4, nullptr},          {"torch.HalfStorage", 2, nullptr},
    {"torch.BFloat16Storage", 2, nullptr},       {"torch.DoubleStorage", 8, nullptr},
    {"torch.LongStorage", 0, "integer"},         {"torch.IntStorage", 0, "integer"},
    {"torch.ShortStorage", 0, "integer"},        {"torch.CharStorage", 0, "integer"},
    {"torch.ByteStorage", 0, "integer"},         {"torch.BoolStorage", 0, "bool"},
    {"torch.ComplexFloatStorage", 0, "complex"}, {"torch.ComplexDoubleStorage", 0, "complex"}};

struct TensorRef {
  int storage;  // Value index of the storage
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;
};

class Unpickler {
 public:
  Unpickler(const char* data, size_t size, const std::string& where)
      : d_(data), n_(size), where_(where) {}

  Status Fail(const std::string& what) const {
    return {StatusCode::kFailedPrecondition, where_ + ": torch.save() archive: data.pkl at byte " +
                                                 std::to_string(at_) + ": " + what};
  }

  // Runs to STOP; `*result` is the value left.
  Status Run(int* result) {
    for (;;) {
      if (pos_ >= n_) return Fail("ends without STOP");
      at_ = pos_;
      const auto op = static_cast<Op>(d_[pos_++]);
      if (op != Op::kStop) {
        RETURN_IF_ERROR(Step(op));
        continue;
      }
      if (stack_.size() != 1 || !marks_.empty())
        return Fail("STOP leaves " + std::to_string(stack_.size()) + " values");
      *result = stack_.back();
      return Status::Ok();
    }
  }

  const std::vector<Value>& heap() const { return heap_; }
  const std::vector<TensorRef>& tensors() const { return tensors_; }

 private:
  // The opcodes a state_dict uses (Python's pickle module names them so); any other is refused.
  enum class Op : uint8_t {
    kMark = '(',
    kStop = '.',
    kNone = 'N',
    kBinInt = 'J',
    kBinInt1 = 'K',
    kBinInt2 = 'M',
    kBinFloat = 'G',
    kBinUnicode = 'X',
    kGlobal = 'c',
    kEmptyTuple = ')',
    kEmptyList = ']',
    kEmptyDict = '}',
    kTuple = 't',
    kBinPut = 'q',
    kLongBinPut = 'r',
    kBinGet = 'h',
    kLongBinGet = 'j',
    kAppend = 'a',
    kAppends = 'e',
    kSetItem = 's',
    kSetItems = 'u',
    kBinPersId = 'Q',
    kReduce = 'R',
    kBuild = 'b',
    kProto = 0x80,
    kTuple1 = 0x85,
    kTuple2 = 0x86,
    kTuple3 = 0x87,
    kNewTrue = 0x88,
    kNewFalse = 0x89,
    kLong1 = 0x8a,
    kShortBinUnicode = 0x8c,
    kBinUnicode8 = 0x8d,
    kStackGlobal = 0x93,
    kMemoize = 0x94,
    kFrame = 0x95,
  };

  // One opcode other than STOP.
  Status Step(Op op) {
    switch (op) {
      case Op::kProto:
        return Skip(1);
      case Op::kFrame:
        return Skip(8);
      case Op::kMark:
        marks_.push_back(stack_.size());
        return Status::Ok();
      case Op::kNone:
      case Op::kEmptyTuple:
      case Op::kEmptyList:
      case Op::kEmptyDict:
        return Push(New(op == Op::kNone         ? Kind::kNone
                        : op == Op::kEmptyTuple ? Kind::kTuple
                        : op == Op::kEmptyList  ? Kind::kList
                                                : Kind::kDict));
      case Op::kNewTrue:
      case Op::kNewFalse:
        return PushInt(Kind::kBool, op == Op::kNewTrue);
      case Op::kBinInt1:
      case Op::kBinInt2:
      case Op::kBinInt:
        return OnBinInt(op);
      case Op::kLong1:
        return OnLong1();
      case Op::kBinFloat:
        return OnBinFloat();
      case Op::kBinUnicode:
      case Op::kShortBinUnicode:
      case Op::kBinUnicode8:
        return OnString(op);
      case Op::kGlobal:
        return OnGlobal();
      case Op::kStackGlobal:
        return OnStackGlobal();
      case Op::kTuple:
        return OnTuple();
      case Op::kTuple1:
      case Op::kTuple2:
      case Op::kTuple3:
        return OnSmallTuple(static_cast<size_t>(op) - 0x84);
      case Op::kBinPut:
      case Op::kLongBinPut:
      case Op::kMemoize:
        return OnPut(op);
      case Op::kBinGet:
      case Op::kLongBinGet:
        return OnGet(op);
      case Op::kAppend:
      case Op::kAppends:
        return OnAppend(op);
      case Op::kSetItem:
      case Op::kSetItems:
        return OnSetItem(op);
      case Op::kBinPersId:
        return OnBinPersId();
      case Op::kReduce:
        return OnReduce();
      case Op::kBuild:
        return OnBuild();
      case Op::kStop:
        break;
    }
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned>(op));
    return Fail(std::string("opcode ") + hex + " is not allowed in a state_dict");
  }

  Status PushInt(Kind kind, int64_t value) {
    const int v = New(kind);
    heap_[v].i = value;
    return Push(v);
  }

  Status OnBinInt(Op op) {
    const int len = op == Op::kBinInt1 ? 1 : op == Op::kBinInt2 ? 2 : 4;
    uint64_t raw;
    RETURN_IF_ERROR(ReadLe(len, &raw));
    return PushInt(Kind::kInt,
                   op == Op::kBinInt ? static_cast<int32_t>(raw) : static_cast<int64_t>(raw));
  }

  Status OnLong1() {
    uint64_t len;
    RETURN_IF_ERROR(ReadLe(1, &len));
    if (len > 8) return Fail("LONG1 of " + std::to_string(len) + " bytes is too large");
    uint64_t raw = 0;
    if (len) RETURN_IF_ERROR(ReadLe(static_cast<int>(len), &raw));
    if (len && len < 8 && (raw >> (8 * len - 1)) & 1) raw |= ~uint64_t{0} << (8 * len);
    return PushInt(Kind::kInt, static_cast<int64_t>(raw));
  }

  Status OnBinFloat() {  // Big-endian.
    RETURN_IF_ERROR(Need(8));
    uint64_t raw = 0;
    for (int k = 0; k < 8; ++k) raw = (raw << 8) | static_cast<uint8_t>(d_[pos_ + k]);
    pos_ += 8;
    const int v = New(Kind::kFloat);
    std::memcpy(&heap_[v].f, &raw, 8);
    return Push(v);
  }

  Status OnString(Op op) {
    uint64_t len;
    RETURN_IF_ERROR(ReadLe(op == Op::kBinUnicode ? 4 : op == Op::kShortBinUnicode ? 1 : 8, &len));
    RETURN_IF_ERROR(Need(len));
    const int v = New(Kind::kStr);
    heap_[v].s.assign(d_ + pos_, len);
    pos_ += len;
    return Push(v);
  }

  Status OnGlobal() {  // module\nname\n
    std::string module, name;
    RETURN_IF_ERROR(ReadLine(&module));
    RETURN_IF_ERROR(ReadLine(&name));
    return PushGlobal(module + "." + name);
  }

  Status OnStackGlobal() {
    int name, module;
    RETURN_IF_ERROR(Pop(&name));
    RETURN_IF_ERROR(Pop(&module));
    if (heap_[name].kind != Kind::kStr || heap_[module].kind != Kind::kStr)
      return Fail("STACK_GLOBAL needs two strings");
    return PushGlobal(heap_[module].s + "." + heap_[name].s);
  }

  Status OnTuple() {
    std::vector<int> items;
    RETURN_IF_ERROR(PopMark(&items));
    const int v = New(Kind::kTuple);
    heap_[v].items = std::move(items);
    return Push(v);
  }

  Status OnSmallTuple(size_t k) {
    if (stack_.size() < k + (marks_.empty() ? 0 : marks_.back()))
      return Fail("TUPLE" + std::to_string(k) + " on a stack of " + std::to_string(stack_.size()));
    const int v = New(Kind::kTuple);
    heap_[v].items.assign(stack_.end() - static_cast<long>(k), stack_.end());
    stack_.resize(stack_.size() - k);
    return Push(v);
  }

  Status OnPut(Op op) {
    uint64_t key = memo_.size();
    if (op != Op::kMemoize) RETURN_IF_ERROR(ReadLe(op == Op::kBinPut ? 1 : 4, &key));
    if (stack_.empty()) return Fail("memo store from an empty stack");
    if (memo_.size() >= kMaxValues) return Fail("too many memo entries");
    memo_[key] = stack_.back();
    return Status::Ok();
  }

  Status OnGet(Op op) {
    uint64_t key;
    RETURN_IF_ERROR(ReadLe(op == Op::kBinGet ? 1 : 4, &key));
    auto it = memo_.find(key);
    if (it == memo_.end()) return Fail("memo key " + std::to_string(key) + " was never stored");
    return Push(it->second);
  }

  Status OnAppend(Op op) {
    std::vector<int> items;
    if (op == Op::kAppend) {
      int x;
      RETURN_IF_ERROR(Pop(&x));
      items.push_back(x);
    } else {
      RETURN_IF_ERROR(PopMark(&items));
    }
    if (stack_.empty() || heap_[stack_.back()].kind != Kind::kList)
      return Fail("APPEND to something that is not a list");
    auto& list = heap_[stack_.back()].items;
    list.insert(list.end(), items.begin(), items.end());
    return Status::Ok();
  }

  Status OnSetItem(Op op) {
    std::vector<int> items;
    if (op == Op::kSetItem) {
      int k, v;
      RETURN_IF_ERROR(Pop(&v));
      RETURN_IF_ERROR(Pop(&k));
      items = {k, v};
    } else {
      RETURN_IF_ERROR(PopMark(&items));
      if (items.size() % 2) return Fail("SETITEMS with an odd number of values");
    }
    if (stack_.empty() || heap_[stack_.back()].kind != Kind::kDict)
      return Fail("SETITEM on something that is not a dict");
    auto& dict = heap_[stack_.back()].items;
    dict.insert(dict.end(), items.begin(), items.end());
    return Status::Ok();
  }

  Status OnBinPersId() {
    int pid, v;
    RETURN_IF_ERROR(Pop(&pid));
    RETURN_IF_ERROR(Storage(pid, &v));
    return Push(v);
  }

  Status OnReduce() {
    int args, fn, v;
    RETURN_IF_ERROR(Pop(&args));
    RETURN_IF_ERROR(Pop(&fn));
    RETURN_IF_ERROR(Reduce(fn, args, &v));
    return Push(v);
  }

  Status OnBuild() {  // The state is ignored.
    int state;
    RETURN_IF_ERROR(Pop(&state));
    if (stack_.empty()) return Fail("BUILD on an empty stack");
    const Kind k = heap_[stack_.back()].kind;
    if (k != Kind::kDict && k != Kind::kTensor)
      return Fail("BUILD on something that is neither a dict nor a tensor");
    return Status::Ok();
  }

  static constexpr size_t kMaxValues = 1 << 22;

  int New(Kind k) {
    heap_.emplace_back();
    heap_.back().kind = k;
    return static_cast<int>(heap_.size() - 1);
  }
  Status Need(uint64_t k) const {
    if (n_ - pos_ < k) return Fail("truncated (needs " + std::to_string(k) + " more bytes)");
    return Status::Ok();
  }
  Status Skip(uint64_t k) {
    RETURN_IF_ERROR(Need(k));
    pos_ += k;
    return Status::Ok();
  }
  Status ReadLe(int len, uint64_t* v) {
    RETURN_IF_ERROR(Need(static_cast<uint64_t>(len)));
    *v = Le(d_ + pos_, len);
    pos_ += static_cast<size_t>(len);
    return Status::Ok();
  }
  Status ReadLine(std::string* s) {
    const void* nl = std::memchr(d_ + pos_, '\n', std::min<size_t>(n_ - pos_, 256));
    if (!nl) return Fail("GLOBAL name without an end of line");
    const char* end = static_cast<const char*>(nl);
    s->assign(d_ + pos_, end);
    pos_ = static_cast<size_t>(end - d_) + 1;
    return Status::Ok();
  }
  Status Push(int v) {
    if (stack_.size() >= kMaxValues || heap_.size() >= kMaxValues) return Fail("too many values");
    stack_.push_back(v);
    return Status::Ok();
  }
  Status Pop(int* v) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back()))
      return Fail("pop from an empty stack");
    *v = stack_.back();
    stack_.pop_back();
    return Status::Ok();
  }
  Status PopMark(std::vector<int>* items) {
    if (marks_.empty()) return Fail("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    items->assign(stack_.begin() + static_cast<long>(m), stack_.end());
    stack_.resize(m);
    return Status::Ok();
  }
  Status PushGlobal(const std::string& name) {
    static const std::set<std::string> kAllowed = {
        "collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor", "torch._utils._rebuild_parameter"};
    bool storage = false;
    for (const StorageType& t : kStorageTypes) storage |= name == t.global;
    if (!storage && !kAllowed.count(name))
      return Fail("global '" + name + "' is not allowed in a state_dict");
    const int v = New(Kind::kGlobal);
    heap_[v].s = name;
    return Push(v);
  }
  bool IsInt(int v) const { return heap_[v].kind == Kind::kInt; }
  // ('storage', <storage type>, key, location, numel)
  Status Storage(int pid, int* out) {
    const std::vector<int> t = heap_[pid].items;  // A copy: New() below may move the arena.
    if (heap_[pid].kind != Kind::kTuple || t.size() != 5 || heap_[t[0]].s != "storage" ||
        heap_[t[1]].kind != Kind::kGlobal || heap_[t[2]].kind != Kind::kStr || !IsInt(t[4])) {
      return Fail("persistent id is not ('storage', type, key, location, numel)");
    }
    const std::string type = heap_[t[1]].s;
    int dtype = -1;
    for (size_t k = 0; k < std::size(kStorageTypes); ++k) {
      if (type == kStorageTypes[k].global) dtype = static_cast<int>(k);
    }
    if (dtype < 0) return Fail("'" + type + "' is not a storage type");
    if (kStorageTypes[dtype].bytes == 0) {
      return Fail(type + " holds " + kStorageTypes[dtype].refusal +
                  " values; attention weights must be floating point (float32, float16, bfloat16, "
                  "float64)");
    }
    const int64_t numel = heap_[t[4]].i;
    if (numel < 0 || numel > (int64_t{1} << 34))
      return Fail("storage of " + std::to_string(numel) + " elements");
    std::string key = heap_[t[2]].s;
    const int v = New(Kind::kStorage);
    heap_[v].s = std::move(key);
    heap_[v].i = numel;
    heap_[v].dtype = dtype;
    *out = v;
    return Status::Ok();
  }
  Status IntTuple(int v, const char* what, std::vector<int64_t>* out) {
    if (heap_[v].kind != Kind::kTuple || heap_[v].items.size() > 8)
      return Fail(std::string(what) + " is not a tuple of at most 8 ints");
    for (int x : heap_[v].items) {
      if (!IsInt(x)) return Fail(std::string(what) + " holds a value that is not an int");
      out->push_back(heap_[x].i);
    }
    return Status::Ok();
  }
  Status Reduce(int fn, int args, int* out) {
    if (heap_[fn].kind != Kind::kGlobal || heap_[args].kind != Kind::kTuple)
      return Fail("REDUCE needs a callable and a tuple");
    const std::string& name = heap_[fn].s;
    const std::vector<int> a = heap_[args].items;
    if (name == "collections.OrderedDict") {
      if (!a.empty()) return Fail("OrderedDict called with arguments");
      *out = New(Kind::kDict);
      return Status::Ok();
    }
    if (name == "torch._utils._rebuild_parameter") {
      if (a.size() < 1 || heap_[a[0]].kind != Kind::kTensor)
        return Fail("_rebuild_parameter without a tensor");
      *out = a[0];
      return Status::Ok();
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      if (a.size() < 4 || heap_[a[0]].kind != Kind::kStorage || !IsInt(a[1])) {
        return Fail(name + " needs (storage, offset, size, stride, ...)");
      }
      TensorRef t;
      t.storage = a[0];
      t.offset = heap_[a[1]].i;
      RETURN_IF_ERROR(IntTuple(a[2], "size", &t.sizes));
      RETURN_IF_ERROR(IntTuple(a[3], "stride", &t.strides));
      if (t.sizes.size() != t.strides.size()) return Fail("size and stride differ in length");
      tensors_.push_back(std::move(t));
      *out = New(Kind::kTensor);
      heap_[*out].i = static_cast<int64_t>(tensors_.size() - 1);
      return Status::Ok();
    }
    return Fail("'" + name + "' cannot be called");
  }

  const char* d_;
  size_t n_;
  const std::string& where_;
  size_t pos_ = 0, at_ = 0;
  std::vector<Value> heap_;
  std::vector<int> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, int> memo_;
  std::vector<TensorRef> tensors_;
};

// The archive's data.pkl and the prefix its entries share ("archive/"); a byteorder entry must
// say little-endian.
Status FindPickle(const Zip& zip, const std::string& bytes,
                  const std::map<std::string, Entry>& entries, const Entry** pickle,
                  std::string* prefix) {
  *pickle = nullptr;
  for (const auto& [name, e] : entries) {
    const std::string tail = "data.pkl";
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.compare(slash + 1, std::string::npos, tail) == 0) {
      if (*pickle) return zip.Fail("more than one data.pkl");
      *prefix = name.substr(0, slash + 1);
      *pickle = &e;
    }
  }
  if (!*pickle) return zip.Fail("no <archive>/data.pkl entry (not written by torch.save()?)");
  auto order = entries.find(*prefix + "byteorder");
  if (order != entries.end() &&
      bytes.compare(order->second.data, order->second.size, "little") != 0) {
    return zip.Fail("byteorder is not 'little'");
  }
  return Status::Ok();
}

// The element count of tensor `t` (named `name`) after checking that every element it views lies
// inside its storage of `storage_elements`.
StatusOr<int64_t> CheckedView(const Zip& zip, const std::string& name, const TensorRef& t,
                              int64_t storage_elements) {
  int64_t numel = 1, last = t.offset;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] < 0 || t.strides[d] < 0)
      return zip.Fail("'" + name + "': negative size or stride");
    int64_t span;
    if (__builtin_mul_overflow(numel, t.sizes[d], &numel) ||
        __builtin_mul_overflow(t.sizes[d] > 0 ? t.sizes[d] - 1 : 0, t.strides[d], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return zip.Fail("'" + name + "': size " + ShapeString(t.sizes) + " overflows");
    }
  }
  if (t.offset < 0 || (numel > 0 && last >= storage_elements)) {
    return zip.Fail("'" + name + "': shape " + ShapeString(t.sizes) + " at offset " +
                    std::to_string(t.offset) + " reaches past its storage of " +
                    std::to_string(storage_elements) + " elements");
  }
  return numel;
}

// One element of a storage of `type` at `p`, as float32.
float ElementAt(const char* p, const StorageType& type) {
  if (type.bytes == 4) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  if (type.bytes == 8) {
    double x;
    std::memcpy(&x, p, 8);
    return static_cast<float>(x);
  }
  uint16_t x;
  std::memcpy(&x, p, 2);
  return std::strcmp(type.global, "torch.BFloat16Storage") == 0 ? BFloat16ToFloat(x)
                                                                : HalfToFloat(x);
}

// Tensor `t`'s `numel` elements, in row-major order, from its storage's bytes at `base`.
HostTensor CopyTensor(const TensorRef& t, int64_t numel, const StorageType& type,
                      const char* base) {
  HostTensor h;
  h.shape = t.sizes;
  h.values.resize(static_cast<size_t>(numel));
  bool contiguous = true;  // Row-major strides: elements are consecutive from the offset.
  for (int64_t d = static_cast<int64_t>(t.sizes.size()) - 1, want = 1; d >= 0; --d) {
    contiguous &= t.sizes[d] == 1 || t.strides[d] == want;
    want *= t.sizes[d];
  }
  std::vector<int64_t> index(t.sizes.size(), 0);
  for (int64_t n = 0; n < numel; ++n) {
    int64_t e = t.offset;
    if (contiguous) {
      e += n;
    } else {
      for (size_t d = 0; d < index.size(); ++d) e += index[d] * t.strides[d];
    }
    h.values[static_cast<size_t>(n)] = ElementAt(base + e * type.bytes, type);
    for (size_t d = index.size(); d-- > 0;) {  // Row-major odometer.
      if (++index[d] < t.sizes[d]) break;
      index[d] = 0;
    }
  }
  return h;
}

}  // namespace

// Three jobs: find the pickle, unpickle the state_dict, copy each tensor out of its storage.
StatusOr<NamedTensors> ParseTorchArchive(const std::string& bytes, const std::string& where) {
  Zip zip(bytes, where);
  std::map<std::string, Entry> entries;
  RETURN_IF_ERROR(zip.Read(&entries));
  std::string prefix;
  const Entry* pickle = nullptr;
  RETURN_IF_ERROR(FindPickle(zip, bytes, entries, &pickle, &prefix));
  Unpickler u(bytes.data() + pickle->data, pickle->size, where);
  int root = -1;
  RETURN_IF_ERROR(u.Run(&root));
  const auto& heap = u.heap();
  if (heap[root].kind != Kind::kDict) {
    return zip.Fail("holds something other than a state_dict (torch.save(module.state_dict()))");
  }
  NamedTensors out;
  const auto& items = heap[root].items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    const Value& key = heap[items[k]];
    const Value& value = heap[items[k + 1]];
    if (key.kind != Kind::kStr || value.kind != Kind::kTensor) {
      return zip.Fail("state_dict entries must map names to tensors");
    }
    const TensorRef& t = u.tensors()[static_cast<size_t>(value.i)];
    const Value& storage = heap[t.storage];
    const StorageType& type = kStorageTypes[storage.dtype];
    auto it = entries.find(prefix + "data/" + storage.s);
    if (it == entries.end())
      return zip.Fail("'" + key.s + "': storage '" + storage.s + "' is missing");
    const uint64_t want = static_cast<uint64_t>(storage.i) * static_cast<uint64_t>(type.bytes);
    if (it->second.size != want) {
      return zip.Fail("'" + key.s + "': storage '" + storage.s + "' holds " +
                      std::to_string(it->second.size) + " bytes, expected " + std::to_string(want) +
                      " for " + std::to_string(storage.i) + " elements (cut short or padded)");
    }
    ASSIGN_OR_RETURN(const int64_t numel, CheckedView(zip, key.s, t, storage.i));
    HostTensor h = CopyTensor(t, numel, type, bytes.data() + it->second.data);
    if (!out.emplace(key.s, std::move(h)).second) return zip.Fail("'" + key.s + "' appears twice");
  }
  if (out.empty()) return zip.Fail("the state_dict holds no tensors");
  return out;
}

}  // namespace attnserve
