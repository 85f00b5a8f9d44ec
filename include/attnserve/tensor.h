#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace attnserve {

/// Element type of a Tensor's bytes (the wire's DataType).
enum class DataType { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3, kBool = 4 };

/// Bytes per element of `dtype`.
size_t DataTypeSize(DataType dtype);

/// Bytes in a shared-memory region registered with the server (Client::RegisterSharedMemory):
/// `byte_size` bytes from `offset` of the region's window.
struct SharedMemoryRef {
  std::string region;
  int64_t offset = 0;
  int64_t byte_size = 0;
};

/// A dense row-major tensor as it travels: dtype, shape and little-endian raw bytes, or (with
/// `shared_memory`) a reference to where its bytes lie in a region the server reads.
/// A value type; not thread-safe to mutate from several threads.
struct Tensor {
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;
  /// Instead of `data`: the bytes lie in a registered shared-memory region (docs/clients.md
  /// "Shared memory"); `data` stays empty.
  std::optional<SharedMemoryRef> shared_memory;

  /// Number of elements: the product of shape (1 for an empty shape).
  int64_t numel() const;
  /// A float32 tensor holding `values` (size must equal the shape's product).
  static Tensor Float32(std::vector<int64_t> shape, const std::vector<float>& values);
  /// A float16 tensor from float values (rounded to nearest even).
  static Tensor Float16(std::vector<int64_t> shape, const std::vector<float>& values);
  /// A bfloat16 tensor from float values (rounded to nearest even; NaN stays NaN): half the
  /// bytes of float32 on the wire, what a `--dtype bfloat16` server computes in.
  static Tensor BFloat16(std::vector<int64_t> shape, const std::vector<float>& values);
  /// A BOOL tensor (true = masked out, PyTorch's convention).
  static Tensor Bool(std::vector<int64_t> shape, const std::vector<bool>& values);
  /// The values as float, whatever the floating dtype (BOOL gives 0/1).
  std::vector<float> ToFloats() const;
  /// A tensor of `dtype` and `shape` whose bytes lie in region `region` from `offset` on.
  static Tensor InSharedMemory(DataType dtype, std::vector<int64_t> shape, std::string region,
                               int64_t offset = 0);
  /// Bytes the shape holds in this dtype.
  int64_t byte_size() const { return numel() * static_cast<int64_t>(DataTypeSize(dtype)); }
};

}  // namespace attnserve
