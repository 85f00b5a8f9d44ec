#include "server/core/types.h"

namespace attnserve {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kBool:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

double ForwardFlops(const ModelSpec& m, const AttendCall& c) {
  const double rows_q = static_cast<double>(c.batch * c.query_len);
  const double rows_k = static_cast<double>(c.batch * c.key_len);
  const double e = static_cast<double>(m.embed_dim);
  // Projected widths: embed_dim for nn.MultiheadAttention; heads x head_dim (queries) and
  // key/value heads x head_dim (keys, values) for a decoder's layer.
  const double wq = static_cast<double>(m.q_width()), wkv = static_cast<double>(m.kv_width());
  const double keys = static_cast<double>(c.key_len + m.extra_keys());
  const double projections = 2 * rows_q * e * wq                                        // q
                             + 2 * rows_k * wkv * static_cast<double>(m.kdim + m.vdim)  // k, v
                             + 2 * rows_q * wq * e;                                     // output
  const double attention = 4 * rows_q * keys * wq;  // QK^T and PV over all query heads
  return projections + attention;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace attnserve
