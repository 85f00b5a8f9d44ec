#include "server/engine/onednn.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <utility>

namespace attnserve::onednn {
namespace {

using dnnl::memory;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Parallelism is the server's (one worker per core, idle ones helping: parallel.h), so each
// thread runs its products alone. oneDNN's OpenMP runtime gives a thread that never set its own
// count a team of every core, and the engine's workers are such threads (at::set_num_threads(1)
// sets only its caller's). Set before a primitive is made too: its kernels size their work for
// the team of the thread that makes it. libgomp comes with libdnnl; looked up, so this file needs
// no OpenMP flags.
void OneThreadHere() {
  using SetThreads = void (*)(int);
  static const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  thread_local const bool done = (set != nullptr ? set(1) : void(), true);
  (void)done;
}

// Streams are not thread-safe: one per thread.
dnnl::stream& Stream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

// The thread's scratchpad (primitives made with scratchpad_mode::user), grown as needed.
void* Scratchpad(size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.size) {
    std::free(buffer.p);
    buffer.size = (bytes + 4095) / 4096 * 4096;
    buffer.p = std::aligned_alloc(64, buffer.size);
    if (buffer.p == nullptr) buffer.size = 0;
  }
  return buffer.p;
}

memory::data_type DataType(Type t) {
  return t == Type::kBFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
}

size_t TypeSize(Type t) { return t == Type::kBFloat16 ? 2 : 4; }

memory::desc Desc(const View& v) {
  return memory::desc(memory::dims(v.dims.begin(), v.dims.end()), DataType(v.type),
                      memory::dims(v.strides.begin(), v.strides.end()));
}

// A primitive and what executing it needs; `ok` false: oneDNN offered only its reference kernel
// (or none) for these operands, so the caller multiplies another way.
struct Entry {
  bool ok = false;
  std::string kernel;  // oneDNN's implementation, as its verbose lines name it.
  dnnl::matmul prim;
  memory::desc scratchpad;
};

// Primitives by their operands' shapes. Bounded: when full it starts again (the shapes a server
// sees repeat, and making one again costs what a cache miss costs).
class Cache {
 public:
  template <typename Make>
  std::shared_ptr<const Entry> Get(const std::string& key, Make&& make) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
    }
    auto entry = std::make_shared<Entry>();
    try {
      dnnl::matmul::primitive_desc pd = make();
      const std::string impl = pd.impl_info_str();
      entry->kernel = impl;
      entry->ok = impl.rfind("ref", 0) != 0 && impl.find(":ref") == std::string::npos;
      if (entry->ok) {
        entry->scratchpad = pd.scratchpad_desc();
        entry->prim = dnnl::matmul(pd);
      }
    } catch (const dnnl::error&) {
      entry->ok = false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.size() >= kMaxEntries) entries_.clear();
    return entries_.emplace(key, std::move(entry)).first->second;
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Entry>> entries_;
};

void Append(std::string* key, const View& v) {
  key->push_back(v.type == Type::kBFloat16 ? 'h' : 'f');
  for (int64_t d : v.dims) key->append(std::to_string(d)).push_back(',');
  key->push_back('/');
  for (int64_t s : v.strides) key->append(std::to_string(s)).push_back(',');
  key->push_back(';');
}

dnnl::primitive_attr Attr(float alpha) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  return attr;
}

void Execute(const Entry& e, std::unordered_map<int, memory> args) {
  const size_t bytes = e.scratchpad.get_size();
  if (bytes > 0)
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(e.scratchpad, Engine(), Scratchpad(bytes)));
  e.prim.execute(Stream(), args);
  Stream().wait();
}

}  // namespace

namespace {

// What oneDNN dispatches to here (ONEDNN_MAX_CPU_ISA may cap it below what the CPU has): its ISA's
// name, the CPU class for bfloat16 products, and which kernels it has.
struct Isa {
  const char* name;
  const char* cpu_class;
  bool avx512 = false, bf16 = false;
};

Isa EffectiveIsa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx:
      return {"avx512_core_amx", "AMX", true, true};
    case dnnl::cpu_isa::avx512_core_bf16:
      return {"avx512_core_bf16", "AVX512-BF16", true, true};
    case dnnl::cpu_isa::avx512_core_vnni:
      return {"avx512_core_vnni", "AVX-512 without BF16", true, false};
    case dnnl::cpu_isa::avx512_core:
      return {"avx512_core", "AVX-512 without BF16", true, false};
    case dnnl::cpu_isa::avx2:
      return {"avx2", "AVX2 only"};
    default:
      return {"other", "AVX2 only"};
  }
}

}  // namespace

std::string CpuClass() { return EffectiveIsa().cpu_class; }

bool HasBfloat16Kernels() { return EffectiveIsa().bf16; }

bool HasAvx512Kernels() { return EffectiveIsa().avx512; }

bool WantsDenseOperands() {
  return dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx;
}

std::string Describe() {
  const dnnl_version_t* v = dnnl::version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch) + ", " + EffectiveIsa().name;
}

bool Matmul(const View& a, const View& b, const View& dst, float alpha) {
  OneThreadHere();
  static Cache cache;
  std::string key;
  Append(&key, a);
  Append(&key, b);
  Append(&key, dst);
  key.append(std::to_string(alpha));
  const std::shared_ptr<const Entry> e = cache.Get(key, [&] {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(Desc(a), Desc(b), Desc(dst)),
                                        Attr(alpha), Engine());
  });
  if (!e->ok) return false;
  Execute(*e, {{DNNL_ARG_SRC, memory(Desc(a), Engine(), a.data)},
               {DNNL_ARG_WEIGHTS, memory(Desc(b), Engine(), b.data)},
               {DNNL_ARG_DST, memory(Desc(dst), Engine(), dst.data)}});
  return true;
}

// A packed layout's block of output columns (dim 1 of Wᵀ): the fewest columns that lie in one
// piece of it. n when its column blocks are not outermost (oneDNN's plain "ab" for AVX2's
// gemm:jit, say), or it is not blocked: such weights are not cut.
int64_t ColumnBlockOf(const memory::desc& packed, int64_t n) {
  const dnnl_memory_desc_t& d = packed.data;
  if (d.format_kind != dnnl_blocked || d.offset0 != 0 ||
      d.format_desc.blocking.strides[1] < d.format_desc.blocking.strides[0])
    return n;
  int64_t block = 1;
  for (int j = 0; j < d.format_desc.blocking.inner_nblks; ++j)
    if (d.format_desc.blocking.inner_idxs[j] == 1) block *= d.format_desc.blocking.inner_blks[j];
  return block;
}

struct PackedLinear::Impl {
  int64_t n = 0, k = 0;
  Type type = Type::kFloat32;
  memory::desc packed_desc;
  memory weights, bias;
  bool has_bias = false;
  int64_t column_block = 0;  // ColumnBlock(), once.
  mutable Cache cache;
  // Output columns [n0, n0 + nn) of m rows: their primitive (null when the columns do not lie in
  // one piece of the packed weights) and its operands' descriptors.
  struct Piece {
    std::shared_ptr<const Entry> entry;
    memory::desc wei, src, dst, bias;
    size_t wei_offset = 0;  // Bytes into the packed weights.
  };
  Piece Columns(int64_t m, int64_t ldx, Type y_type, int64_t n0, int64_t nn) const;
};

PackedLinear::PackedLinear(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PackedLinear::~PackedLinear() = default;
int64_t PackedLinear::out_features() const { return impl_->n; }
int64_t PackedLinear::in_features() const { return impl_->k; }

std::string PackedLinear::Layout() const {
  const dnnl_memory_desc_t& d = impl_->packed_desc.data;
  if (d.format_kind != dnnl_blocked) return "non-blocked";
  // Outer dims by stride (largest first), then the inner blocks: as oneDNN's verbose tags read.
  std::string tag;
  std::vector<int> order = {0, 1};
  if (d.format_desc.blocking.strides[1] > d.format_desc.blocking.strides[0]) order = {1, 0};
  for (int i : order) {
    bool blocked = false;
    for (int j = 0; j < d.format_desc.blocking.inner_nblks; ++j)
      blocked = blocked || d.format_desc.blocking.inner_idxs[j] == i;
    tag.push_back(static_cast<char>((blocked ? 'A' : 'a') + i));
  }
  for (int j = 0; j < d.format_desc.blocking.inner_nblks; ++j) {
    tag += std::to_string(d.format_desc.blocking.inner_blks[j]);
    tag.push_back(static_cast<char>('a' + d.format_desc.blocking.inner_idxs[j]));
  }
  return tag;
}

std::unique_ptr<PackedLinear> PackedLinear::Make(const float* w, const float* bias, int64_t n,
                                                 int64_t k, Type type) {
  OneThreadHere();
  try {
    auto impl = std::make_unique<Impl>();
    impl->n = n;
    impl->k = k;
    impl->type = type;
    const memory::data_type dt = DataType(type);
    // The layout the kernels want, asked of a product of a typical batch's height.
    const memory::desc src({128, k}, dt, memory::dims{k, 1});
    const memory::desc wei_any({k, n}, dt, memory::format_tag::any);
    const memory::desc dst({128, n}, dt, memory::dims{n, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei_any, dst), Attr(1.0f),
                                          Engine());
    const std::string impl_name = pd.impl_info_str();
    if (impl_name.rfind("ref", 0) == 0) return nullptr;
    impl->packed_desc = pd.weights_desc();
    impl->column_block = ColumnBlockOf(impl->packed_desc, n);
    impl->weights = memory(impl->packed_desc, Engine());
    // W [n, k] row-major is Wᵀ [k, n] with strides (1, k): reordered (and converted) once.
    memory plain(memory::desc({k, n}, memory::data_type::f32, memory::dims{1, k}), Engine(),
                 const_cast<float*>(w));
    dnnl::reorder(plain, impl->weights).execute(Stream(), plain, impl->weights);
    if (bias != nullptr) {
      impl->has_bias = true;
      impl->bias =
          memory(memory::desc({1, n}, memory::data_type::f32, memory::dims{n, 1}), Engine());
      std::memcpy(impl->bias.get_data_handle(), bias, static_cast<size_t>(n) * sizeof(float));
    }
    Stream().wait();
    return std::unique_ptr<PackedLinear>(new PackedLinear(std::move(impl)));
  } catch (const dnnl::error&) {
    return nullptr;
  }
}

int64_t PackedLinear::ColumnBlock() const { return impl_->column_block; }

bool PackedLinear::Run(const void* x, int64_t m, int64_t ldx, void* y, Type y_type,
                       int64_t ldy) const {
  return RunColumns(x, m, ldx, y, y_type, ldy, 0, impl_->n);
}

// Columns of a layout whose column blocks are outermost (ColumnBlock() < n) lie in one piece: the
// same blocking over nn columns, from that piece's start.
PackedLinear::Impl::Piece PackedLinear::Impl::Columns(int64_t m, int64_t ldx, Type y_type,
                                                      int64_t n0, int64_t nn) const {
  const int64_t cb = column_block;
  const bool whole = n0 == 0 && nn == n;
  Piece piece;
  if (n0 < 0 || nn <= 0 || n0 + nn > n ||
      (!whole && (n0 % cb != 0 || (n0 + nn != n && nn % cb != 0))))
    return piece;
  piece.wei = packed_desc;
  if (!whole) {  // (Only where cb < n: ColumnBlockOf checked the layout.)
    dnnl_memory_desc_t d = packed_desc.data;
    d.dims[1] = nn;
    d.padded_dims[1] = (nn + cb - 1) / cb * cb;
    piece.wei = memory::desc(d);
    piece.wei_offset =
        static_cast<size_t>(n0 / cb * d.format_desc.blocking.strides[1]) * TypeSize(type);
  }
  piece.src = memory::desc({m, k}, DataType(type), memory::dims{ldx, 1});
  piece.dst = memory::desc({m, nn}, DataType(y_type), memory::dims{nn, 1});
  piece.bias = memory::desc({1, nn}, memory::data_type::f32, memory::dims{nn, 1});
  const std::string key = std::to_string(m) + "," + std::to_string(ldx) + "," +
                          (y_type == Type::kBFloat16 ? "h" : "f") + std::to_string(n0) + "," +
                          std::to_string(nn);
  piece.entry = cache.Get(key, [&] {
    return has_bias
               ? dnnl::matmul::primitive_desc(
                     dnnl::matmul::desc(piece.src, piece.wei, piece.bias, piece.dst), Attr(1.0f),
                     Engine())
               : dnnl::matmul::primitive_desc(dnnl::matmul::desc(piece.src, piece.wei, piece.dst),
                                              Attr(1.0f), Engine());
  });
  return piece;
}

std::string PackedLinear::Kernel(int64_t m, int64_t ldx, Type y_type, int64_t n0,
                                 int64_t nn) const {
  const Impl::Piece piece = impl_->Columns(m, ldx, y_type, n0, nn);
  return piece.entry && piece.entry->ok ? piece.entry->kernel : std::string();
}

bool PackedLinear::RunColumns(const void* x, int64_t m, int64_t ldx, void* y, Type y_type,
                              int64_t ldy, int64_t n0, int64_t nn) const {
  OneThreadHere();
  const Impl& p = *impl_;
  const Impl::Piece piece = p.Columns(m, ldx, y_type, n0, nn);
  if (!piece.entry || !piece.entry->ok) return false;
  // A piece must round as the whole product does: oneDNN picks its kernel by shape (on AMX,
  // a few rows' bfloat16 product of every column on the tiles, of 64 on AVX512-BF16), and
  // another kernel sums in another order. Such a piece is refused.
  if (!(n0 == 0 && nn == p.n) && Kernel(m, ldx, y_type, 0, p.n) != piece.entry->kernel)
    return false;
  // oneDNN's kernels write dense rows only: a piece of wider rows goes through a buffer.
  const bool dense = ldy == nn;
  const size_t y_elem = TypeSize(y_type), row_bytes = static_cast<size_t>(nn) * y_elem;
  char* out = static_cast<char*>(y) + n0 * y_elem;
  thread_local std::vector<char> buffer;
  if (!dense) buffer.resize(static_cast<size_t>(m) * row_bytes);
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, memory(piece.src, Engine(), const_cast<void*>(x))},
      {DNNL_ARG_WEIGHTS,
       memory(piece.wei, Engine(),
              static_cast<char*>(p.weights.get_data_handle()) + piece.wei_offset)},
      {DNNL_ARG_DST, memory(piece.dst, Engine(), dense ? out : buffer.data())}};
  if (p.has_bias) {
    args.emplace(DNNL_ARG_BIAS,
                 memory(piece.bias, Engine(), static_cast<float*>(p.bias.get_data_handle()) + n0));
  }
  Execute(*piece.entry, std::move(args));
  for (int64_t i = 0; !dense && i < m; ++i)
    std::memcpy(out + i * ldy * y_elem, buffer.data() + i * row_bytes, row_bytes);
  return true;
}

}  // namespace attnserve::onednn
