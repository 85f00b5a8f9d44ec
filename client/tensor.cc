#include "attnserve/tensor.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "attnserve/half.h"

namespace attnserve {
namespace {

void CheckCount(const std::vector<int64_t>& shape, size_t n) {
  int64_t want = 1;
  for (int64_t d : shape) want *= d;
  if (static_cast<size_t>(want) != n) {
    throw std::invalid_argument("attnserve::Tensor: " + std::to_string(n) +
                                " values for a shape of " + std::to_string(want) + " elements");
  }
}

}  // namespace

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kBool:
      return 1;
  }
  return 0;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor Tensor::Float32(std::vector<int64_t> shape, const std::vector<float>& values) {
  CheckCount(shape, values.size());
  Tensor t{DataType::kFloat32, std::move(shape), {}};
  t.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

Tensor Tensor::Float16(std::vector<int64_t> shape, const std::vector<float>& values) {
  CheckCount(shape, values.size());
  Tensor t{DataType::kFloat16, std::move(shape), {}};
  t.data.resize(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h = FloatToHalf(values[i]);
    std::memcpy(&t.data[2 * i], &h, 2);
  }
  return t;
}

Tensor Tensor::BFloat16(std::vector<int64_t> shape, const std::vector<float>& values) {
  CheckCount(shape, values.size());
  Tensor t{DataType::kBFloat16, std::move(shape), {}};
  t.data.resize(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBFloat16(values[i]);
    std::memcpy(&t.data[2 * i], &b, 2);
  }
  return t;
}

Tensor Tensor::InSharedMemory(DataType dtype, std::vector<int64_t> shape, std::string region,
                              int64_t offset) {
  Tensor t{dtype, std::move(shape), {}, std::nullopt};
  t.shared_memory = SharedMemoryRef{std::move(region), offset, t.byte_size()};
  return t;
}

Tensor Tensor::Bool(std::vector<int64_t> shape, const std::vector<bool>& values) {
  CheckCount(shape, values.size());
  Tensor t{DataType::kBool, std::move(shape), {}};
  t.data.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) t.data[i] = values[i] ? 1 : 0;
  return t;
}

std::vector<float> Tensor::ToFloats() const {
  const size_t n = data.size() / DataTypeSize(dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DataType::kFloat32:
        std::memcpy(&out[i], &data[4 * i], 4);
        break;
      case DataType::kFloat16: {
        uint16_t h;
        std::memcpy(&h, &data[2 * i], 2);
        out[i] = HalfToFloat(h);
        break;
      }
      case DataType::kBFloat16: {
        uint16_t h;
        std::memcpy(&h, &data[2 * i], 2);
        out[i] = BFloat16ToFloat(h);
        break;
      }
      case DataType::kBool:
        out[i] = data[i] ? 1.f : 0.f;
        break;
    }
  }
  return out;
}

}  // namespace attnserve
