#include "server/engine/panel_gemm.h"

#include <immintrin.h>

#include <algorithm>

namespace attnserve::panel_gemm {
namespace {

#define ATTNSERVE_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t kColumns = Panels::kColumns;
constexpr int kMaxRows = 6;  // Twelve accumulators, two panel vectors and a broadcast: 15 ymm.
constexpr int64_t kPrefetchMinK = 512;  // Panels of more rows of k ask for the next one (Run).

// The last columns of a panel past n: a store mask of the first `count` lanes.
ATTNSERVE_AVX2 inline __m256i FirstLanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Step j of RowsTimesPanels: x[r][j] times row j of the P panels, into the accumulators.
template <int R, int P>
[[gnu::always_inline]] ATTNSERVE_AVX2 inline void PanelStep(const float* x, int64_t ldx,
                                                            const float* panel, int64_t k,
                                                            int64_t j, __m256 (&a)[R][P][2]) {
  if constexpr (P == 1) {  // Each row's broadcast used at once: 12 accumulators + 3 in 16 ymm.
    const __m256 w0 = _mm256_loadu_ps(panel + j * kColumns);
    const __m256 w1 = _mm256_loadu_ps(panel + j * kColumns + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + j);
      a[r][0][0] = _mm256_fmadd_ps(xr, w0, a[r][0][0]);
      a[r][0][1] = _mm256_fmadd_ps(xr, w1, a[r][0][1]);
    }
  } else {  // One or two rows' broadcasts held across the panels.
    __m256 xr[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) xr[r] = _mm256_broadcast_ss(x + r * ldx + j);
#pragma GCC unroll 6
    for (int q = 0; q < P; ++q) {
      const float* w = panel + (q * k + j) * kColumns;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        a[r][q][0] = _mm256_fmadd_ps(xr[r], w0, a[r][q][0]);
        a[r][q][1] = _mm256_fmadd_ps(xr[r], w1, a[r][q][1]);
      }
    }
  }
}

// R rows of x against P consecutive panels (16 columns each, `width` of the last one kept): each
// output starts at its bias and adds x[i][j] · W[c][j] for j ascending, in registers for the whole
// of k. One or two rows take several panels at once: each sum waits on its own last FMA (4 cycles
// here), so a pass needs eight or more of them to keep both FMA units busy; the sums' order is
// the same whatever P. The first `ahead_lines` steps each ask for one line from `ahead` (a share
// of the next panel) into the caches.
template <int R, int P>
ATTNSERVE_AVX2 void RowsTimesPanels(const float* x, int64_t ldx, const float* panel,
                                    const float* bias, int64_t k, float* y, int64_t ldy,
                                    int64_t width, const float* ahead, int64_t ahead_lines) {
  static_assert(R * P <= kMaxRows, "twelve accumulators at most");
  __m256 a[R][P][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 6
    for (int q = 0; q < P; ++q) {
      a[r][q][0] = _mm256_loadu_ps(bias + q * kColumns);
      a[r][q][1] = _mm256_loadu_ps(bias + q * kColumns + 8);
    }
  }
  const int64_t ahead_end = std::min(k, ahead_lines);
  int64_t j = 0;
  for (; j < ahead_end; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + j * kColumns), _MM_HINT_T0);
    PanelStep<R, P>(x, ldx, panel, k, j, a);
  }
  for (; j < k; ++j) PanelStep<R, P>(x, ldx, panel, k, j, a);
  const __m256i m0 = FirstLanes(width), m1 = FirstLanes(width - 8);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 6
    for (int q = 0; q < P; ++q) {
      float* yq = y + r * ldy + q * kColumns;
      if (q < P - 1 || width == kColumns) {
        _mm256_storeu_ps(yq, a[r][q][0]);
        _mm256_storeu_ps(yq + 8, a[r][q][1]);
      } else {
        _mm256_maskstore_ps(yq, m0, a[r][q][0]);
        _mm256_maskstore_ps(yq + 8, m1, a[r][q][1]);
      }
    }
  }
}

// The kernel of R rows against one panel, by R (1 to kMaxRows).
using Kernel = void (*)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t,
                        int64_t, const float*, int64_t);
constexpr Kernel kKernels[kMaxRows + 1] = {nullptr,
                                           RowsTimesPanels<1, 1>,
                                           RowsTimesPanels<2, 1>,
                                           RowsTimesPanels<3, 1>,
                                           RowsTimesPanels<4, 1>,
                                           RowsTimesPanels<5, 1>,
                                           RowsTimesPanels<6, 1>};

// One or two rows (m <= 2) over panels [c0, c0 + nc): as many panels at a time as keep twelve
// accumulators (one row: six, two rows: three), the rest one by one.
template <int R>
ATTNSERVE_AVX2 void FewRows(const float* x, int64_t ldx, const float* panels, const float* bias,
                            int64_t n, int64_t k, float* y, int64_t ldy, int64_t c0, int64_t nc) {
  constexpr int kPanels = kMaxRows / R;
  int64_t c = c0;
  for (; c + kPanels * kColumns <= std::min(n, c0 + nc); c += kPanels * kColumns) {
    RowsTimesPanels<R, kPanels>(x, ldx, panels + (c / kColumns) * k * kColumns, bias + c, k, y + c,
                                ldy, kColumns, nullptr, 0);
  }
  for (; c < c0 + nc; c += kColumns) {
    RowsTimesPanels<R, 1>(x, ldx, panels + (c / kColumns) * k * kColumns, bias + c, k, y + c, ldy,
                          std::min(kColumns, n - c), nullptr, 0);
  }
}

ATTNSERVE_AVX2 void Run(const float* x, int64_t m, int64_t ldx, const float* panels,
                        const float* bias, int64_t n, int64_t k, float* y, int64_t ldy, int64_t c0,
                        int64_t nc) {
  if (m == 1) return FewRows<1>(x, ldx, panels, bias, n, k, y, ldy, c0, nc);
  if (m == 2) return FewRows<2>(x, ldx, panels, bias, n, k, y, ldy, c0, nc);
  for (int64_t c = c0; c < c0 + nc; c += kColumns) {
    const float* panel = panels + (c / kColumns) * k * kColumns;
    const int64_t width = std::min(kColumns, n - c);
    // The rows in as few blocks as six-row blocks take, their sizes even (32 rows: 6, 6, 5, 5, 5,
    // 5): a block of one or two rows has too few accumulators to keep both FMA units busy (each
    // waits on its own last sum). Each block asks for its share of the next panel's lines: a
    // decoding batch's weights come from memory (the keys and values read between two calls pass
    // the caches), and the hardware's prefetcher starts on a panel only when its first block
    // does, which then waited on memory (one thread, 32 rows, cold weights: 7.6-7.9 ms against
    // 9.3-10.0 for [2560, 2048] and [2048, 2048]; hot, the same). Not where a panel fits L1 (k up
    // to 512: 32 KiB), which the next one's lines would then push out.
    const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
    const bool more = c + kColumns < c0 + nc && k > kPrefetchMinK;
    for (int64_t bi = 0, i = 0; bi < blocks; ++bi) {
      const int64_t rows = m / blocks + (bi < m % blocks ? 1 : 0);
      const float* xi = x + i * ldx;
      float* yi = y + i * ldy + c;
      const int64_t l0 = k * bi / blocks, l1 = k * (bi + 1) / blocks;
      kKernels[rows](xi, ldx, panel, bias + c, k, yi, ldy, width,
                     panel + k * kColumns + l0 * kColumns, more ? l1 - l0 : 0);
      i += rows;
    }
  }
}

}  // namespace

bool Available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
}

std::unique_ptr<Panels> Panels::Make(const float* w, const float* bias, int64_t n, int64_t k) {
  if (!Available() || n <= 0 || k <= 0) return nullptr;
  std::unique_ptr<Panels> p(new Panels(n, k));
  const int64_t count = (n + kColumns - 1) / kColumns;
  p->panels_.assign(static_cast<size_t>(count * k * kColumns), 0.0f);
  p->bias_.assign(static_cast<size_t>(count * kColumns), 0.0f);
  for (int64_t c = 0; c < n; ++c) {
    float* panel = p->panels_.data() + (c / kColumns) * k * kColumns + c % kColumns;
    for (int64_t j = 0; j < k; ++j) panel[j * kColumns] = w[c * k + j];
    if (bias != nullptr) p->bias_[static_cast<size_t>(c)] = bias[c];
  }
  return p;
}

void Panels::Run(const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int64_t c0,
                 int64_t nc) const {
  panel_gemm::Run(x, m, ldx, panels_.data(), bias_.data(), n_, k_, y, ldy, c0, nc);
}

}  // namespace attnserve::panel_gemm
