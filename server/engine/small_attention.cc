#include "server/engine/small_attention.h"

#include <immintrin.h>

#include <algorithm>

namespace attnserve::small_attention {
namespace {

#define ATTNSERVE_AVX2 __attribute__((target("avx2,fma")))

// [Σ a0, ..., Σ a7]: the lane sums of eight vectors as one.
ATTNSERVE_AVX2 inline __m256 Sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                   __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The lane sum of one vector.
ATTNSERVE_AVX2 inline float Sum(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// Eight keys at a time: each query row against the eight key rows (eight independent sums over
// d, reduced into one vector of eight scores), the keys' 8 rows staying in L1 across the query
// rows; then the remaining keys one by one.
ATTNSERVE_AVX2 void ScoresAvx2(const float* q, int64_t ldq, int64_t m, const float* k, int64_t ldk,
                               int64_t n, int64_t d, float scale, float* s, int64_t lds) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + 8 <= n; j0 += 8) {
    const float* kt = k + j0 * ldk;
    for (int64_t i = 0; i < m; ++i) {
      const float* qi = q + i * ldq;
      // Named accumulators (an array of them the compiler kept on the stack, stored every step).
      __m256 a0, a1, a2, a3, a4, a5, a6, a7;
      a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qi + c);
        const float* kc = kt + c;
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + ldk), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 2 * ldk), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 3 * ldk), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 4 * ldk), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 5 * ldk), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 6 * ldk), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 7 * ldk), a7);
      }
      _mm256_storeu_ps(s + i * lds + j0,
                       _mm256_mul_ps(Sums8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
    }
  }
  for (; j0 < n; ++j0) {
    const float* kj = k + j0 * ldk;
    for (int64_t i = 0; i < m; ++i) {
      const float* qi = q + i * ldq;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), _mm256_loadu_ps(kj + c), acc);
      s[i * lds + j0] = Sum(acc) * scale;
    }
  }
}

// One query row's 64 outputs from c0 over keys [j0, j1), in eight accumulators held in registers
// (named: an array of them the compiler kept on the stack, stored at every key).
ATTNSERVE_AVX2 inline void RowTimesValues64(const float* pi, const float* v, int64_t ldv,
                                            int64_t j0, int64_t j1, float* oi, bool first) {
  __m256 a0, a1, a2, a3, a4, a5, a6, a7;
  if (first) {
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm256_setzero_ps();
  } else {
    a0 = _mm256_loadu_ps(oi), a1 = _mm256_loadu_ps(oi + 8), a2 = _mm256_loadu_ps(oi + 16);
    a3 = _mm256_loadu_ps(oi + 24), a4 = _mm256_loadu_ps(oi + 32), a5 = _mm256_loadu_ps(oi + 40);
    a6 = _mm256_loadu_ps(oi + 48), a7 = _mm256_loadu_ps(oi + 56);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 b = _mm256_broadcast_ss(pi + j);
    const float* vj = v + j * ldv;
    a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj), a0);
    a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 8), a1);
    a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 16), a2);
    a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 24), a3);
    a4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 32), a4);
    a5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 40), a5);
    a6 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 48), a6);
    a7 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 56), a7);
  }
  _mm256_storeu_ps(oi, a0), _mm256_storeu_ps(oi + 8, a1), _mm256_storeu_ps(oi + 16, a2);
  _mm256_storeu_ps(oi + 24, a3), _mm256_storeu_ps(oi + 32, a4), _mm256_storeu_ps(oi + 40, a5);
  _mm256_storeu_ps(oi + 48, a6), _mm256_storeu_ps(oi + 56, a7);
}

// The same for 8 outputs.
ATTNSERVE_AVX2 inline void RowTimesValues8(const float* pi, const float* v, int64_t ldv, int64_t j0,
                                           int64_t j1, float* oi, bool first) {
  __m256 a = first ? _mm256_setzero_ps() : _mm256_loadu_ps(oi);
  for (int64_t j = j0; j < j1; ++j)
    a = _mm256_fmadd_ps(_mm256_broadcast_ss(pi + j), _mm256_loadu_ps(v + j * ldv), a);
  _mm256_storeu_ps(oi, a);
}

// Tiles of keys whose value rows stay in L1 (16 KiB) while every query row takes them; each row's
// outputs in chunks of 64 (eight accumulators), carried in o from tile to tile.
ATTNSERVE_AVX2 void TimesValuesAvx2(const float* p, int64_t ldp, int64_t m, const float* v,
                                    int64_t ldv, int64_t n, int64_t d, float* o, int64_t ldo,
                                    bool accumulate) {
  const int64_t tile = std::max<int64_t>(8, 4096 / d);
  int64_t j0 = 0;
  do {
    const int64_t j1 = std::min(n, j0 + tile);
    const bool first = j0 == 0 && !accumulate;
    for (int64_t i = 0; i < m; ++i) {
      const float* pi = p + i * ldp;
      float* oi = o + i * ldo;
      int64_t c0 = 0;
      for (; c0 + 64 <= d; c0 += 64) RowTimesValues64(pi, v + c0, ldv, j0, j1, oi + c0, first);
      for (; c0 < d; c0 += 8) RowTimesValues8(pi, v + c0, ldv, j0, j1, oi + c0, first);
    }
    j0 = j1;
  } while (j0 < n);
}

bool Takes(int64_t m, int64_t d) {
  return Available() && m >= kMinRows && m <= kMaxRows && d >= 8 && d % 8 == 0;
}

}  // namespace

bool Available() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

bool Scores(const float* q, int64_t ldq, int64_t m, const float* k, int64_t ldk, int64_t n,
            int64_t d, float scale, float* s, int64_t lds) {
  if (!Takes(m, d)) return false;
  ScoresAvx2(q, ldq, m, k, ldk, n, d, scale, s, lds);
  return true;
}

bool TimesValues(const float* p, int64_t ldp, int64_t m, const float* v, int64_t ldv, int64_t n,
                 int64_t d, float* o, int64_t ldo, bool accumulate) {
  if (!Takes(m, d)) return false;
  TimesValuesAvx2(p, ldp, m, v, ldv, n, d, o, ldo, accumulate);
  return true;
}

}  // namespace attnserve::small_attention
