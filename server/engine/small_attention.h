#pragma once
// The two products of a decoding step's attention on the CPU in float32, for a few query rows a
// head (a one-token step: one row, or a grouped key/value head's G query heads): scores = scale ·
// q · kᵀ and heads = p · v, each reading the kept keys or values once, straight from their rows.
// oneDNN's and the BLAS's general kernels pack or stride over cold keys for such short products
// (bench/RESULTS.md, "Decoder layers, fifth and sixth measures"); the softmax, and float32's
// rounding to bfloat16 (with it or alone) for the bfloat16 path. AVX2 with FMA, and AVX-512 for
// the values' product (rows in pairs), detected at run time; elsewhere (or for shapes it does not
// take) the functions return false and the caller multiplies another way. No LibTorch here: plain
// pointers and strides in elements.

#include <cstdint>

namespace attnserve::small_attention {

/// Query rows a head the kernels take: from kMinRows (one row, a plain head's decoding step,
/// oneDNN's matrix-vector kernel reads as fast: [32, 1, 64] over 1,121 cold keys 0.67 ms against
/// 0.81 here) to kMaxRows (more: the general products fill their tiles).
constexpr int64_t kMinRows = 2, kMaxRows = 16;

/// The kernels' instruction sets, each CPU running those up to its best.
enum class Isa { kNone, kAvx2, kAvx512 };
/// This CPU's best: kAvx512 with AVX-512F, BW and VL, kAvx2 with AVX2 and FMA, else kNone.
Isa Best();
/// Whether this CPU runs the kernels (AVX2 and FMA at least).
bool Available();

/// s[i][j] = scale · Σ_c q[i][c] · k[j][c] for i < m, j < n, c < d: q rows at stride ldq, key rows
/// at stride ldk, score rows at stride lds (each row's elements contiguous). False (nothing
/// written) unless kMinRows <= m <= kMaxRows, d is a multiple of 8 and this CPU runs `isa` (not
/// kNone; the AVX2 kernel either way: its AVX-512 form was no faster, bench/RESULTS.md).
bool Scores(const float* q, int64_t ldq, int64_t m, const float* k, int64_t ldk, int64_t n,
            int64_t d, float scale, float* s, int64_t lds, Isa isa = Best());

/// o[i][c] (+)= Σ_j p[i][j] · v[j][c] for i < m, c < d, j < n: probability rows at stride ldp,
/// value rows at stride ldv, output rows at stride ldo; `accumulate` adds to o instead of
/// overwriting it. False (nothing written) under the same conditions as Scores; `isa` picks the
/// kernel (tests run each the CPU has).
bool TimesValues(const float* p, int64_t ldp, int64_t m, const float* v, int64_t ldv, int64_t n,
                 int64_t d, float* o, int64_t ldo, bool accumulate, Isa isa = Best());

/// Rows i < m of s (n scores each, rows at stride lds) replaced by their softmax, as LibTorch's
/// (a row with a NaN, or whose largest score is ±inf, all NaN; a score of -inf weighs exactly 0):
/// exp to within 2 ulp of float32's, the sum in float32. `isa` picks the kernel (AVX2's eight lanes
/// or AVX-512's sixteen; tests run each the CPU has); false (nothing done) for kNone, an `isa` this
/// CPU lacks, or when n is 0.
bool Softmax(float* s, int64_t lds, int64_t m, int64_t n, Isa isa = Best());

/// The same softmax, each row's probabilities rounded to bfloat16 as LibTorch rounds a float32
/// (to nearest, ties to even; a NaN to 0x7fc0) into `out` (rows at stride ldo) in one pass: what
/// Softmax then a conversion gives, bit for bit. s is left holding the exponentials. AVX-512 only,
/// as Softmax.
bool SoftmaxToBfloat16(float* s, int64_t lds, int64_t m, int64_t n, uint16_t* out, int64_t ldo,
                       Isa isa = Best());

/// y[i] = x[i] rounded to bfloat16 as above, for i < n (a float32 request's rows for a bfloat16
/// model: 0.15-0.22 ns an element on the AMX Xeon's core, LibTorch 1.13's conversion 0.28-0.79).
/// AVX-512 only; false elsewhere.
bool ToBfloat16(const float* x, int64_t n, uint16_t* y, Isa isa = Best());

}  // namespace attnserve::small_attention
