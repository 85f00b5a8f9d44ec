#include "server/engine/small_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace attnserve::small_attention {
namespace {

#define ATTNSERVE_AVX2 __attribute__((target("avx2,fma")))
#define ATTNSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// The lane sum of one vector.
ATTNSERVE_AVX2 inline float Sum(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// Kept keys and values lie in memory, not in any cache (a step reads each session's once): the
// kernels ask for the rows a few kilobytes ahead of the ones they multiply, which the hardware's
// own prefetchers do not (a block of 16 keys at d = 64 is one 4 KiB page, where they stop). On the
// Zen 5 EPYC of 2026-12-01 (22 GB/s a thread), [4, 8, 64] over 1,100 cold keys, with and without,
// interleaved in one process: AVX-512 scores 38-41 µs against 56-61, values 64-66 against 76-79;
// AVX2 scores 81 against 137, values 87 against 99 (bench/RESULTS.md, seventh measure).
constexpr int64_t kAheadBytes = 4096;

// The AVX2 values kernel's tile of value rows.
constexpr int64_t kValueTileBytes = 16384;

// Rows [from, to) of x (rows at stride ld, d floats each) asked into the caches, clipped to n.
// Always inlined: a call of its own, which writes nothing, GCC drops as pure.
[[gnu::always_inline]] inline void Prefetch(const float* x, int64_t ld, int64_t d, int64_t from,
                                            int64_t to, int64_t n) {
  for (int64_t j = from; j < std::min(to, n); ++j) {
    for (int64_t c = 0; c < d; c += 16)
      _mm_prefetch(reinterpret_cast<const char*>(x + j * ld + c), _MM_HINT_T0);
  }
}

// Rows of d floats kAheadBytes make, at least `least`.
inline int64_t RowsAhead(int64_t d, int64_t least) {
  return std::max<int64_t>(least, kAheadBytes / (d * 4));
}

// How many value rows ahead a tile's first pass asks for, the tile ending at j1 of n: never past
// row n - 1 (0: none left).
inline int64_t Ahead(int64_t j1, int64_t n, int64_t d) { return std::min(RowsAhead(d, 8), n - j1); }

// [Σ a0, Σ a1, Σ a2, Σ a3]: the lane sums of four vectors as one.
ATTNSERVE_AVX2 inline __m128 Sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// R query rows against four keys: R·4 independent sums over d (twelve accumulators for three
// rows, with the rows' vectors and a key's: every ymm register), each key vector loaded once for
// the R rows: 7 loads to 12 FMAs, where a row against eight keys took 9 to 8 and was bound by its
// loads from L1 (Zen 3). Each sum reduced across its lanes at the end.
template <int R>
ATTNSERVE_AVX2 inline void RowsTimesKeys(const float* const* q, const float* k, int64_t ldk,
                                         int64_t d, __m256 scale, float* const* s) {
  __m256 a[R][4];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) a[r][t] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < d; c += 8) {
    __m256 x[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) x[r] = _mm256_loadu_ps(q[r] + c);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256 kt = _mm256_loadu_ps(k + t * ldk + c);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) a[r][t] = _mm256_fmadd_ps(x[r], kt, a[r][t]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(
        s[r], _mm_mul_ps(Sums4(a[r][0], a[r][1], a[r][2], a[r][3]), _mm256_castps256_ps128(scale)));
  }
}

// Up to eight query rows (`rows` of them; the others zero) as pairs of dims, the layout both
// pairs kernels read: pair c / 2 (dims c and c + 1) is 16 floats, lane 2r + p row r's dim c + p.
inline void QueryPairs(const float* q, int64_t ldq, int64_t rows, int64_t d, float* qt2) {
  for (int64_t c = 0; c < d; c += 2) {
    for (int64_t r = 0; r < 8; ++r) {
      qt2[c * 8 + 2 * r] = r < rows ? q[r * ldq + c] : 0.0f;
      qt2[c * 8 + 2 * r + 1] = r < rows ? q[r * ldq + c + 1] : 0.0f;
    }
  }
}

// Eight query rows against T keys, as pairs of dims: lanes (2r, 2r + 1) of acc[t][g] sum row
// 4g + r's even and odd dims against key t's (qt2 as QueryPairs lays it out: each pair's first
// eight floats rows 0-3, its last eight rows 4-7), each key's dims 2c and 2c + 1 broadcast as one
// 64-bit pair for both groups. Each lane sums in c order from zero: the same whatever T or the
// other rows.
template <int T>
ATTNSERVE_AVX2 inline void KeysAgainstPairs(const float* qt2, const float* k, int64_t ldk,
                                            int64_t d, __m256 acc[T][2]) {
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 2) {
    const __m256 q0 = _mm256_load_ps(qt2 + 8 * c), q1 = _mm256_load_ps(qt2 + 8 * c + 8);
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m256 kc =
          _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(k + t * ldk + c)));
      acc[t][0] = _mm256_fmadd_ps(kc, q0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(kc, q1, acc[t][1]);
    }
  }
}

// A block's pair sums: h[t] = key t's scores of rows 0, 1, 4, 5 | 2, 3, 6, 7 (each 128-bit half).
constexpr int kPairLaneRow[8] = {0, 1, 4, 5, 2, 3, 6, 7};

// T keys from k against a block's eight rows (`rows` of them kept), scaled, into s by rows.
template <int T>
ATTNSERVE_AVX2 inline void KeysIntoRows(const float* qt2, const float* k, int64_t ldk, int64_t d,
                                        __m256 scale, int64_t rows, float* s, int64_t lds) {
  __m256 acc[T][2], h[T];
  KeysAgainstPairs<T>(qt2, k, ldk, d, acc);
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) h[t] = _mm256_mul_ps(_mm256_hadd_ps(acc[t][0], acc[t][1]), scale);
  if constexpr (T == 4) {  // Each half's 4 x 4 transposed: o[u] half e = row kPairLaneRow[u + 4e].
    const __m256 t0 = _mm256_unpacklo_ps(h[0], h[1]), t1 = _mm256_unpackhi_ps(h[0], h[1]),
                 t2 = _mm256_unpacklo_ps(h[2], h[3]), t3 = _mm256_unpackhi_ps(h[2], h[3]);
    const __m256 o[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      if (kPairLaneRow[u] < rows)
        _mm_storeu_ps(s + kPairLaneRow[u] * lds, _mm256_castps256_ps128(o[u]));
      if (kPairLaneRow[u + 4] < rows)
        _mm_storeu_ps(s + kPairLaneRow[u + 4] * lds, _mm256_extractf128_ps(o[u], 1));
    }
  } else {
    alignas(32) float lanes[T][8];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) _mm256_store_ps(lanes[t], h[t]);
    for (int l = 0; l < 8; ++l) {
      if (kPairLaneRow[l] >= rows) continue;
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) s[kPairLaneRow[l] * lds + t] = lanes[t][l];
    }
  }
}

// Query rows eight to a block as pairs of dims (the last block's missing rows zero): four keys at
// a time against every block, the keys' rows staying in L1 across the blocks; the last keys one
// by one. Each key pair broadcast feeds two FMAs: 6 loads to 8 FMAs and one short sum at the end
// of a block, where rows against keys (ScoresAvx2 up to four rows) sum every accumulator across
// its lanes, a quarter of their time at d = 64. Zen 3, one thread, a grouped layer's [8, 2680, 64]:
// 72-78 GFLOP/s with the keys in L2 against 53-57, 57-70 over 64 cold heads against 49-52.
constexpr int64_t kPairRows = 8, kPairMaxDims = 256, kPairMinKeys = 64;
ATTNSERVE_AVX2 void ScoresInPairsAvx2(const float* q, int64_t ldq, int64_t m, const float* k,
                                      int64_t ldk, int64_t n, int64_t d, float scale, float* s,
                                      int64_t lds) {
  alignas(32) float qt2[2 * kPairMaxDims * kPairRows];  // kMaxRows (16) rows: two blocks
  const int64_t blocks = (m + kPairRows - 1) / kPairRows;
  for (int64_t b = 0; b < blocks; ++b) {
    QueryPairs(q + b * kPairRows * ldq, ldq, std::min(kPairRows, m - b * kPairRows), d,
               qt2 + b * d * kPairRows);
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t ahead = RowsAhead(d, 8);
  int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) {
    Prefetch(k, ldk, d, j0 + ahead, j0 + ahead + 4, n);
    for (int64_t b = 0; b < blocks; ++b) {
      KeysIntoRows<4>(qt2 + b * d * kPairRows, k + j0 * ldk, ldk, d, vscale,
                      std::min(kPairRows, m - b * kPairRows), s + b * kPairRows * lds + j0, lds);
    }
  }
  for (; j0 < n; ++j0) {
    for (int64_t b = 0; b < blocks; ++b) {
      KeysIntoRows<1>(qt2 + b * d * kPairRows, k + j0 * ldk, ldk, d, vscale,
                      std::min(kPairRows, m - b * kPairRows), s + b * kPairRows * lds + j0, lds);
    }
  }
}

// Five rows or more over 64 keys or more: ScoresInPairsAvx2. Else four keys at a time, the query
// rows three at a time against them (the keys' rows staying in L1 across the passes); then the
// remaining keys one by one.
ATTNSERVE_AVX2 void ScoresAvx2(const float* q, int64_t ldq, int64_t m, const float* k, int64_t ldk,
                               int64_t n, int64_t d, float scale, float* s, int64_t lds) {
  // (Under 64 keys, laying out the rows' pairs costs more than the pairs save: half the rate at
  // 8 keys, a self-attention prefill's few rows.)
  if (m > 4 && d <= kPairMaxDims && n >= kPairMinKeys)
    return ScoresInPairsAvx2(q, ldq, m, k, ldk, n, d, scale, s, lds);
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t ahead = RowsAhead(d, 8);
  int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) {
    Prefetch(k, ldk, d, j0 + ahead, j0 + ahead + 4, n);
    const float* kt = k + j0 * ldk;
    for (int64_t i = 0; i < m; i += 3) {
      const float* rows[3] = {q + i * ldq, q + (i + 1) * ldq, q + (i + 2) * ldq};
      float* outs[3] = {s + i * lds + j0, s + (i + 1) * lds + j0, s + (i + 2) * lds + j0};
      switch (std::min<int64_t>(3, m - i)) {
        case 3:
          RowsTimesKeys<3>(rows, kt, ldk, d, vscale, outs);
          break;
        case 2:
          RowsTimesKeys<2>(rows, kt, ldk, d, vscale, outs);
          break;
        default:
          RowsTimesKeys<1>(rows, kt, ldk, d, vscale, outs);
      }
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

// AVX-512 scores, as a small GEMM: for 16 keys at a time, Sᵀ = K · Qᵀ with Q's rows as lanes, so
// that no dot product is summed across a vector's lanes (ScoresAvx2's reduction, its cost at
// d = 64). Eight query rows a pass, each lane pair (2r, 2r + 1) one row's even and odd dims: a
// key's dims 2c and 2c + 1 broadcast as one 64-bit pair against qt2[c] (rows' dims 2c, 2c + 1). At
// the end of a block the pairs are summed and the 16 keys x 8 rows transposed in registers.
constexpr int kPassRows = 8, kBlockKeys = 16, kMaxPairs = 128;  // d <= 2 * kMaxPairs.

// The permutations' lane indices (a second operand's lanes from 16): the pair sums' even and odd
// halves (row r's key 2u + h at lane 2r + h of vector u), then for b = 0, 1, 2 the swap of vector
// index bit b with lane bit b + 1 (after which vector r's lane t holds row r's key t).
struct Permutations {
  alignas(64) int32_t even[16], odd[16], low[3][16], high[3][16];
  constexpr Permutations() : even(), odd(), low(), high() {
    for (int lane = 0; lane < 16; ++lane) {
      const int r = lane >> 1, h = (lane & 1) * 16;
      even[lane] = h + 2 * r;
      odd[lane] = h + 2 * r + 1;
      for (int b = 0; b < 3; ++b) {
        const int l = 2 << b;
        low[b][lane] = (lane & l) == 0 ? lane : 16 + (lane & ~l);
        high[b][lane] = (lane & l) == 0 ? (lane | l) : 16 + lane;
      }
    }
  }
};
constexpr Permutations kPermutations;

// A key's dims c and c + 1 as a vector of eight copies of the pair.
ATTNSERVE_AVX512 inline __m512 PairOf(const float* kc) {
  double pair;
  std::memcpy(&pair, kc, sizeof pair);
  return _mm512_castpd_ps(_mm512_set1_pd(pair));
}

// The 16 keys from k: acc[t] lane 2r + p = Σ over dims c ≡ p (mod 2) of q[r][c] · k[t][c].
ATTNSERVE_AVX512 inline void KeyBlock(const float* qt2, const float* k, int64_t ldk, int64_t d,
                                      __m512 acc[kBlockKeys]) {
#pragma GCC unroll 16
  for (int t = 0; t < kBlockKeys; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const float* qc = qt2 + c * 8;  // (c / 2) pairs of 16 floats
    const __m512 q0 = _mm512_load_ps(qc), q1 = _mm512_load_ps(qc + 16);
    const __m512 q2 = _mm512_load_ps(qc + 32), q3 = _mm512_load_ps(qc + 48);
#pragma GCC unroll 16
    for (int t = 0; t < kBlockKeys; ++t) {
      const float* kc = k + t * ldk + c;
      acc[t] = _mm512_fmadd_ps(PairOf(kc), q0, acc[t]);
      acc[t] = _mm512_fmadd_ps(PairOf(kc + 2), q1, acc[t]);
      acc[t] = _mm512_fmadd_ps(PairOf(kc + 4), q2, acc[t]);
      acc[t] = _mm512_fmadd_ps(PairOf(kc + 6), q3, acc[t]);
    }
  }
}

// A block's pair sums, transposed: rows[r] lane t = row r's score of key t (unscaled).
ATTNSERVE_AVX512 inline void Transposed(const __m512 acc[kBlockKeys], __m512 rows[kPassRows]) {
  const Permutations& p = kPermutations;
  const __m512i even = _mm512_load_si512(p.even), odd = _mm512_load_si512(p.odd);
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) {
    rows[u] = _mm512_add_ps(_mm512_permutex2var_ps(acc[2 * u], even, acc[2 * u + 1]),
                            _mm512_permutex2var_ps(acc[2 * u], odd, acc[2 * u + 1]));
  }
#pragma GCC unroll 3
  for (int b = 0; b < 3; ++b) {
    const __m512i low = _mm512_load_si512(p.low[b]), high = _mm512_load_si512(p.high[b]);
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) {
      if ((a >> b) & 1) continue;
      const __m512 x = rows[a], y = rows[a | (1 << b)];
      rows[a] = _mm512_permutex2var_ps(x, low, y);
      rows[a | (1 << b)] = _mm512_permutex2var_ps(x, high, y);
    }
  }
}

// Up to eight rows at a time; the keys past the last whole block through ScoresAvx2.
ATTNSERVE_AVX512 void ScoresAvx512(const float* q, int64_t ldq, int64_t m, const float* k,
                                   int64_t ldk, int64_t n, int64_t d, float scale, float* s,
                                   int64_t lds) {
  alignas(64) float qt2[kMaxPairs * 16];
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t whole = n / kBlockKeys * kBlockKeys;
  for (int64_t r0 = 0; r0 < m; r0 += kPassRows) {
    const int64_t rows = std::min<int64_t>(kPassRows, m - r0);
    QueryPairs(q + r0 * ldq, ldq, rows, d, qt2);  // Rows past m: zeros.
    float* sr = s + r0 * lds;
    const int64_t ahead = RowsAhead(d, kBlockKeys);
    for (int64_t j0 = 0; j0 < whole; j0 += kBlockKeys) {
      // (A second pass of rows, m > 8, finds the head's keys in L2.)
      if (r0 == 0) Prefetch(k, ldk, d, j0 + ahead, j0 + ahead + kBlockKeys, n);
      __m512 acc[kBlockKeys], out[kPassRows];
      KeyBlock(qt2, k + j0 * ldk, ldk, d, acc);
      Transposed(acc, out);
      for (int64_t r = 0; r < rows; ++r)
        _mm512_storeu_ps(sr + r * lds + j0, _mm512_mul_ps(out[r], vscale));
    }
    if (whole < n) {
      ScoresAvx2(q + r0 * ldq, ldq, rows, k + whole * ldk, ldk, n - whole, d, scale, sr + whole,
                 lds);
    }
  }
}

// The AVX2 values kernel's next tile of value rows, asked into the caches while this tile's rows
// are multiplied: `left` lines from `at` on, a row's `row_lines` then `gap` bytes to the next row's
// (0 where rows lie end to end), one line at each key step (two where a single pass of rows takes
// the tile: fewer steps than lines). Each pass over the tile asks for its share: when the first
// row's pass alone asked (16 rows ahead), it waited on memory and the other passes computed with no
// read in flight. A step is a test and a few adds: a loop over `per` lines cost ~13% in L2.
struct NextTile {
  const char* at = nullptr;
  int64_t gap = 0, row_lines = 1, in_row = 1, left = 0;
  bool twice = false;
  [[gnu::always_inline]] void One() {
    _mm_prefetch(at, _MM_HINT_T0);
    at += 64, --left;
    if (--in_row == 0) in_row = row_lines, at += gap;
  }
  [[gnu::always_inline]] void Step() {
    if (left <= 0) return;
    One();
    if (twice && left > 0) One();
  }
};

// R query rows' W·8 outputs (from the pointers given) over keys [j0, j1): R·W accumulators, each
// value vector loaded once for the R rows. Three rows of 32 outputs take twelve accumulators, the
// three rows' weights and the value vector: every ymm register. Against one row of 64 outputs (a
// value load and an FMA each, plus the weight's broadcast), 7 loads to 12 FMAs in place of 9 to 8:
// on Zen 3 the kernel was bound by its loads from L1, not its FMAs.
template <int R, int W>
ATTNSERVE_AVX2 inline void RowsTimesValues(const float* const* p, const float* v, int64_t ldv,
                                           int64_t j0, int64_t j1, float* const* o, bool first,
                                           NextTile* ahead) {
  __m256 a[R][W];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w)
      a[r][w] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o[r] + 8 * w);
  }
  NextTile next = *ahead;  // (In registers across the loop.)
#pragma GCC unroll 2
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * ldv;
    next.Step();
    __m256 x[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) x[r] = _mm256_broadcast_ss(p[r] + j);
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) {
      const __m256 vw = _mm256_loadu_ps(vj + 8 * w);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) a[r][w] = _mm256_fmadd_ps(x[r], vw, a[r][w]);
    }
  }
  *ahead = next;
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(o[r] + 8 * w, a[r][w]);
  }
}

// R rows' outputs: in chunks of 32, then the tail's 8, 16 or 24.
template <int R>
ATTNSERVE_AVX2 inline void RowsTimesValues(const float* const* p, const float* v, int64_t ldv,
                                           int64_t j0, int64_t j1, int64_t d, float* const* o,
                                           bool first, NextTile* ahead) {
  float* oc[R];
  const auto at = [&](int64_t c) {
    for (int r = 0; r < R; ++r) oc[r] = o[r] + c;
  };
  int64_t c = 0;
  for (; c + 32 <= d; c += 32)
    at(c), RowsTimesValues<R, 4>(p, v + c, ldv, j0, j1, oc, first, ahead);
  if (d - c == 24) at(c), RowsTimesValues<R, 3>(p, v + c, ldv, j0, j1, oc, first, ahead);
  if (d - c == 16) at(c), RowsTimesValues<R, 2>(p, v + c, ldv, j0, j1, oc, first, ahead);
  if (d - c == 8) at(c), RowsTimesValues<R, 1>(p, v + c, ldv, j0, j1, oc, first, ahead);
}

// Tiles of keys whose value rows stay in L1 while every query row takes them, the rows three at
// a time (then a last one or two), their outputs carried in o from tile to tile. The next tile's
// rows are asked for during this one's passes, each pass a share of them.
ATTNSERVE_AVX2 void TimesValuesAvx2(const float* p, int64_t ldp, int64_t m, const float* v,
                                    int64_t ldv, int64_t n, int64_t d, float* o, int64_t ldo,
                                    bool accumulate) {
  const int64_t tile = std::max<int64_t>(8, kValueTileBytes / (d * 4));
  const int64_t row_lines = (d * 4 + 63) / 64, calls = (d + 31) / 32, passes = (m + 2) / 3;
  int64_t j0 = 0;
  do {
    const int64_t j1 = std::min(n, j0 + tile), j2 = std::min(n, j1 + tile);
    const bool first = j0 == 0 && !accumulate;
    // The next tile's lines, each pass (three rows) a share of them.
    const int64_t lines = (j2 - j1) * row_lines, share = (lines + passes - 1) / passes;
    const int64_t steps = std::max<int64_t>(1, (j1 - j0) * calls);  // (No keys: none.)
    for (int64_t i = 0, pass = 0; i < m; i += 3, ++pass) {
      const int64_t from = std::min(lines, pass * share);
      NextTile ahead;
      ahead.at = reinterpret_cast<const char*>(v + (j1 + from / row_lines) * ldv) +
                 64 * (from % row_lines);
      ahead.gap = ldv * 4 - 64 * row_lines, ahead.row_lines = row_lines;
      ahead.in_row = row_lines - from % row_lines;
      ahead.left = std::min(lines, (pass + 1) * share) - from;
      ahead.twice = share > steps;
      const float* rows[3] = {p + i * ldp, p + (i + 1) * ldp, p + (i + 2) * ldp};
      float* outs[3] = {o + i * ldo, o + (i + 1) * ldo, o + (i + 2) * ldo};
      switch (std::min<int64_t>(3, m - i)) {
        case 3:
          RowsTimesValues<3>(rows, v, ldv, j0, j1, d, outs, first, &ahead);
          break;
        case 2:
          RowsTimesValues<2>(rows, v, ldv, j0, j1, d, outs, first, &ahead);
          break;
        default:
          RowsTimesValues<1>(rows, v, ldv, j0, j1, d, outs, first, &ahead);
      }
    }
    j0 = j1;
  } while (j0 < n);
}

// AVX-512: rows two at a time, each value row's vectors loaded once for both (an AVX2 pair would
// need sixteen accumulators, every ymm register); W vectors of 16 outputs a row from o0/o1, the
// last one masked to `last` (an 8-output tail), over keys [j0, j1).
template <int W, bool kTwo>
ATTNSERVE_AVX512 inline void RowsTimesValues512(const float* p0, const float* p1, const float* v,
                                                int64_t ldv, int64_t j0, int64_t j1, float* o0,
                                                float* o1, bool first, __mmask16 last,
                                                int64_t ahead) {
  __m512 a[W], b[W];
#pragma GCC unroll 4
  for (int w = 0; w < W; ++w) {
    const __mmask16 k = w == W - 1 ? last : 0xFFFF;
    a[w] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k, o0 + 16 * w);
    b[w] = first || !kTwo ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k, o1 + 16 * w);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * ldv;
    if (ahead > 0) {
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w)
        _mm_prefetch(reinterpret_cast<const char*>(vj + ahead * ldv + 16 * w), _MM_HINT_T0);
    }
    const __m512 x = _mm512_set1_ps(p0[j]);
    const __m512 y = kTwo ? _mm512_set1_ps(p1[j]) : x;
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) {
      const __m512 vw = _mm512_maskz_loadu_ps(w == W - 1 ? last : 0xFFFF, vj + 16 * w);
      a[w] = _mm512_fmadd_ps(x, vw, a[w]);
      if (kTwo) b[w] = _mm512_fmadd_ps(y, vw, b[w]);
    }
  }
#pragma GCC unroll 4
  for (int w = 0; w < W; ++w) {
    const __mmask16 k = w == W - 1 ? last : 0xFFFF;
    _mm512_mask_storeu_ps(o0 + 16 * w, k, a[w]);
    if (kTwo) _mm512_mask_storeu_ps(o1 + 16 * w, k, b[w]);
  }
}

// Four rows at a time (a grouped layer's decoding step: a group's 8 query heads are 8 rows), each
// value row's vectors loaded once for all four: half the passes over a tile of values that pairs
// take. W vectors of 16 outputs a row, the last masked to `last`; each output summed over the keys
// in the order a pair sums it (the same answers to the bit).
template <int W>
ATTNSERVE_AVX512 inline void FourRowsTimesValues512(const float* const* p, const float* v,
                                                    int64_t ldv, int64_t j0, int64_t j1,
                                                    float* const* o, bool first, __mmask16 last,
                                                    int64_t ahead) {
  __m512 a[4][W];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) {
      a[r][w] = first ? _mm512_setzero_ps()
                      : _mm512_maskz_loadu_ps(w == W - 1 ? last : 0xFFFF, o[r] + 16 * w);
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * ldv;
    if (ahead > 0) {
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w)
        _mm_prefetch(reinterpret_cast<const char*>(vj + ahead * ldv + 16 * w), _MM_HINT_T0);
    }
    __m512 x[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) x[r] = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) {
      const __m512 vw = _mm512_maskz_loadu_ps(w == W - 1 ? last : 0xFFFF, vj + 16 * w);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) a[r][w] = _mm512_fmadd_ps(x[r], vw, a[r][w]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w)
      _mm512_mask_storeu_ps(o[r] + 16 * w, w == W - 1 ? last : 0xFFFF, a[r][w]);
  }
}

// Four rows' outputs, in chunks of 64, then 16, then the 8-output tail.
ATTNSERVE_AVX512 inline void FourRowsTimesValues512(const float* const* p, const float* v,
                                                    int64_t ldv, int64_t j0, int64_t j1, int64_t d,
                                                    float* const* o, bool first, int64_t ahead) {
  int64_t c = 0;
  const auto at = [&](float* const* rows, int64_t off, float** out) {
    for (int r = 0; r < 4; ++r) out[r] = rows[r] + off;
  };
  float* oc[4];
  for (; c + 64 <= d; c += 64) {
    at(o, c, oc);
    FourRowsTimesValues512<4>(p, v + c, ldv, j0, j1, oc, first, 0xFFFF, ahead);
  }
  for (; c + 16 <= d; c += 16) {
    at(o, c, oc);
    FourRowsTimesValues512<1>(p, v + c, ldv, j0, j1, oc, first, 0xFFFF, ahead);
  }
  if (c < d) {
    at(o, c, oc);
    FourRowsTimesValues512<1>(p, v + c, ldv, j0, j1, oc, first, 0xFF, ahead);
  }
}

// One row or a pair's outputs, in chunks of 64, then 16, then the 8-output tail.
template <bool kTwo>
ATTNSERVE_AVX512 inline void RowsTimesValues512(const float* p0, const float* p1, const float* v,
                                                int64_t ldv, int64_t j0, int64_t j1, int64_t d,
                                                float* o0, float* o1, bool first, int64_t ahead) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64)
    RowsTimesValues512<4, kTwo>(p0, p1, v + c, ldv, j0, j1, o0 + c, o1 + c, first, 0xFFFF, ahead);
  for (; c + 16 <= d; c += 16)
    RowsTimesValues512<1, kTwo>(p0, p1, v + c, ldv, j0, j1, o0 + c, o1 + c, first, 0xFFFF, ahead);
  if (c < d)
    RowsTimesValues512<1, kTwo>(p0, p1, v + c, ldv, j0, j1, o0 + c, o1 + c, first, 0xFF, ahead);
}

// As TimesValuesAvx2, the rows four at a time, then in pairs (an odd last row alone).
ATTNSERVE_AVX512 void TimesValuesAvx512(const float* p, int64_t ldp, int64_t m, const float* v,
                                        int64_t ldv, int64_t n, int64_t d, float* o, int64_t ldo,
                                        bool accumulate) {
  const int64_t tile = std::max<int64_t>(8, 4096 / d);
  int64_t j0 = 0;
  do {
    const int64_t j1 = std::min(n, j0 + tile);
    const bool first = j0 == 0 && !accumulate;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      const float* rows[4] = {p + i * ldp, p + (i + 1) * ldp, p + (i + 2) * ldp, p + (i + 3) * ldp};
      float* outs[4] = {o + i * ldo, o + (i + 1) * ldo, o + (i + 2) * ldo, o + (i + 3) * ldo};
      FourRowsTimesValues512(rows, v, ldv, j0, j1, d, outs, first, i == 0 ? Ahead(j1, n, d) : 0);
    }
    for (; i + 2 <= m; i += 2) {
      RowsTimesValues512<true>(p + i * ldp, p + (i + 1) * ldp, v, ldv, j0, j1, d, o + i * ldo,
                               o + (i + 1) * ldo, first, i == 0 ? Ahead(j1, n, d) : 0);
    }
    if (i < m)
      RowsTimesValues512<false>(p + i * ldp, nullptr, v, ldv, j0, j1, d, o + i * ldo, nullptr,
                                first, i == 0 ? Ahead(j1, n, d) : 0);
    j0 = j1;
  } while (j0 < n);
}

// exp(x) for x <= 0 (a score less its row's largest): k = round(x / ln 2), r = x - k ln 2 (ln 2 in
// two parts, Cephes' split: k · 0.693359375 is exact), a degree-7 Taylor polynomial of e^r for
// |r| <= ln 2 / 2 (truncation under 6e-9, relative), times 2^k. Below -87.3 (where e^x is
// subnormal) exactly 0, as e^-inf is: a masked key weighs nothing.
ATTNSERVE_AVX512 inline __m512 ExpOfNonPositive(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 e = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(e, k));
}

// x's lanes rounded to bfloat16 as LibTorch rounds one (c10::round_to_nearest_even: to nearest,
// ties to even; a NaN to 0x7fc0), as 16 bits each.
ATTNSERVE_AVX512 inline __m256i RoundToBfloat16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                       _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
}

// One row of n in place. As LibTorch's: a row with a NaN, or whose largest score is ±inf, all NaN.
// With `out`, the row's probabilities rounded to bfloat16 there instead (s then holds the
// exponentials).
ATTNSERVE_AVX512 void SoftmaxRowAvx512(float* s, int64_t n, uint16_t* out = nullptr) {
  const int64_t whole = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1);
  // Four running maxima and two running sums: one chain of vmaxps (or vaddps) a vector waits on
  // its latency (4 cycles), which bound the row before.
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest, top1 = lowest, top2 = lowest, top3 = lowest;
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 64 <= whole; j += 64) {
    const __m512 x0 = _mm512_loadu_ps(s + j), x1 = _mm512_loadu_ps(s + j + 16),
                 x2 = _mm512_loadu_ps(s + j + 32), x3 = _mm512_loadu_ps(s + j + 48);
    nan |= _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q) |
           _mm512_cmp_ps_mask(x2, x2, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x3, x3, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, x0);
    top1 = _mm512_max_ps(top1, x1);
    top2 = _mm512_max_ps(top2, x2);
    top3 = _mm512_max_ps(top3, x3);
  }
  for (; j <= whole; j += 16) {
    const __mmask16 k = j < whole ? 0xFFFF : tail;
    const __m512 x = _mm512_mask_loadu_ps(top, k, s + j);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, x);
  }
  const float largest =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top, top1), _mm512_max_ps(top2, top3)));
  if (nan != 0 || !std::isfinite(largest)) {
    if (out != nullptr) {
      std::fill(out, out + n, uint16_t{0x7fc0});
    } else {
      std::fill(s, s + n, std::numeric_limits<float>::quiet_NaN());
    }
    return;
  }
  const __m512 vmax = _mm512_set1_ps(largest);
  __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (j = 0; j + 32 <= whole; j += 32) {
    const __m512 e0 = ExpOfNonPositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax));
    const __m512 e1 = ExpOfNonPositive(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vmax));
    _mm512_storeu_ps(s + j, e0);
    _mm512_storeu_ps(s + j + 16, e1);
    sum = _mm512_add_ps(sum, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; j <= whole; j += 16) {
    const __mmask16 k = j < whole ? 0xFFFF : tail;
    const __m512 e = _mm512_maskz_mov_ps(
        k, ExpOfNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vmax)));
    _mm512_mask_storeu_ps(s + j, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 scale = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_add_ps(sum, sum1)));
  for (j = 0; j <= whole; j += 16) {
    const __mmask16 k = j < whole ? 0xFFFF : tail;
    const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), scale);
    if (out != nullptr) {
      _mm256_mask_storeu_epi16(out + j, k, RoundToBfloat16(p));
    } else {
      _mm512_mask_storeu_ps(s + j, k, p);
    }
  }
}

// ExpOfNonPositive on eight lanes: no scalef, so 2^k is made from its exponent bits (k >= -126 for
// x >= -87.3: a normal float) and multiplied in, which rounds the product as scalef does.
ATTNSERVE_AVX2 inline __m256 ExpOfNonPositive256(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 normal = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 e = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  const __m256i two_to_k =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(normal, _mm256_mul_ps(e, _mm256_castsi256_ps(two_to_k)));
}

// All ones in lanes [0, count) (count <= 8): maskload's and maskstore's mask of a row's tail.
ATTNSERVE_AVX2 inline __m256i FirstLanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

ATTNSERVE_AVX2 inline float LargestLane(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// SoftmaxRowAvx512's float32 form on eight lanes. On a Zen 3 LibTorch 1.13's softmax took a grouped
// layer's [8, 2680] scores in 21-27 us, this 14 (its exp alone was 5% of a batched decoding step).
ATTNSERVE_AVX2 void SoftmaxRowAvx2(float* s, int64_t n) {
  const int64_t whole = n / 8 * 8;
  const __m256i tail = FirstLanes(n - whole);
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = lowest, top1 = lowest, top2 = lowest, top3 = lowest, nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= whole; j += 32) {
    const __m256 x0 = _mm256_loadu_ps(s + j), x1 = _mm256_loadu_ps(s + j + 8),
                 x2 = _mm256_loadu_ps(s + j + 16), x3 = _mm256_loadu_ps(s + j + 24);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(x2, x3, _CMP_UNORD_Q)));
    top = _mm256_max_ps(top, x0);
    top1 = _mm256_max_ps(top1, x1);
    top2 = _mm256_max_ps(top2, x2);
    top3 = _mm256_max_ps(top3, x3);
  }
  for (; j <= whole; j += 8) {
    const __m256 x = j < whole ? _mm256_loadu_ps(s + j)
                               : _mm256_blendv_ps(lowest, _mm256_maskload_ps(s + j, tail),
                                                  _mm256_castsi256_ps(tail));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, x);
  }
  const float largest =
      LargestLane(_mm256_max_ps(_mm256_max_ps(top, top1), _mm256_max_ps(top2, top3)));
  if (_mm256_movemask_ps(nan) != 0 || !std::isfinite(largest)) {
    std::fill(s, s + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const __m256 vmax = _mm256_set1_ps(largest);
  __m256 sum = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  for (j = 0; j + 16 <= whole; j += 16) {
    const __m256 e0 = ExpOfNonPositive256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    const __m256 e1 = ExpOfNonPositive256(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vmax));
    _mm256_storeu_ps(s + j, e0);
    _mm256_storeu_ps(s + j + 8, e1);
    sum = _mm256_add_ps(sum, e0);
    sum1 = _mm256_add_ps(sum1, e1);
  }
  for (; j < whole; j += 8) {
    const __m256 e = ExpOfNonPositive256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (whole < n) {
    const __m256 e = _mm256_and_ps(
        _mm256_castsi256_ps(tail),
        ExpOfNonPositive256(_mm256_sub_ps(_mm256_maskload_ps(s + whole, tail), vmax)));
    _mm256_maskstore_ps(s + whole, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / Sum(_mm256_add_ps(sum, sum1)));
  for (j = 0; j < whole; j += 8)
    _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), scale));
  if (whole < n) {
    _mm256_maskstore_ps(s + whole, tail, _mm256_mul_ps(_mm256_maskload_ps(s + whole, tail), scale));
  }
}

ATTNSERVE_AVX512 void ToBfloat16Avx512(const float* x, int64_t n, uint16_t* y) {
  const int64_t whole = n / 16 * 16;
  for (int64_t j = 0; j < whole; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), RoundToBfloat16(_mm512_loadu_ps(x + j)));
  }
  if (whole < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - whole)) - 1);
    _mm256_mask_storeu_epi16(y + whole, k, RoundToBfloat16(_mm512_maskz_loadu_ps(k, x + whole)));
  }
}

bool Takes(int64_t m, int64_t d, Isa isa) {
  return isa != Isa::kNone && static_cast<int>(isa) <= static_cast<int>(Best()) && m >= kMinRows &&
         m <= kMaxRows && d >= 8 && d % 8 == 0;
}

}  // namespace

Isa Best() {
  static const Isa best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vl")
                              ? Isa::kAvx512
                          : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                              ? Isa::kAvx2
                              : Isa::kNone;
  return best;
}

bool Available() { return Best() != Isa::kNone; }

bool Scores(const float* q, int64_t ldq, int64_t m, const float* k, int64_t ldk, int64_t n,
            int64_t d, float scale, float* s, int64_t lds, Isa isa) {
  if (!Takes(m, d, isa)) return false;
  // (Up to four rows the AVX-512 kernel leaves half its lanes empty: even with ScoresAvx2.)
  if (isa == Isa::kAvx512 && m > 4 && d <= 2 * kMaxPairs) {
    ScoresAvx512(q, ldq, m, k, ldk, n, d, scale, s, lds);
  } else {
    ScoresAvx2(q, ldq, m, k, ldk, n, d, scale, s, lds);
  }
  return true;
}

bool Softmax(float* s, int64_t lds, int64_t m, int64_t n, Isa isa) {
  if (isa == Isa::kNone || static_cast<int>(isa) > static_cast<int>(Best()) || n < 1) return false;
  for (int64_t i = 0; i < m; ++i) {
    if (isa == Isa::kAvx512) {
      SoftmaxRowAvx512(s + i * lds, n);
    } else {
      SoftmaxRowAvx2(s + i * lds, n);
    }
  }
  return true;
}

bool SoftmaxToBfloat16(float* s, int64_t lds, int64_t m, int64_t n, uint16_t* out, int64_t ldo,
                       Isa isa) {
  if (isa != Isa::kAvx512 || Best() != Isa::kAvx512 || n < 1) return false;
  for (int64_t i = 0; i < m; ++i) SoftmaxRowAvx512(s + i * lds, n, out + i * ldo);
  return true;
}

bool ToBfloat16(const float* x, int64_t n, uint16_t* y, Isa isa) {
  if (isa != Isa::kAvx512 || Best() != Isa::kAvx512) return false;
  ToBfloat16Avx512(x, n, y);
  return true;
}

bool TimesValues(const float* p, int64_t ldp, int64_t m, const float* v, int64_t ldv, int64_t n,
                 int64_t d, float* o, int64_t ldo, bool accumulate, Isa isa) {
  if (!Takes(m, d, isa)) return false;
  if (isa == Isa::kAvx512) {
    TimesValuesAvx512(p, ldp, m, v, ldv, n, d, o, ldo, accumulate);
  } else {
    TimesValuesAvx2(p, ldp, m, v, ldv, n, d, o, ldo, accumulate);
  }
  return true;
}

}  // namespace attnserve::small_attention
