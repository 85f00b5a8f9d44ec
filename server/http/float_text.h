#pragma once

// float32 numbers as JSON text: nine significant digits, which every float32 reads back from
// exactly, written without a formatting library's shortest-form search (3.6x faster here than
// std::to_chars' shortest form, which was a third of a JSON answer's cost: bench/json_bench.cc).

#include <cstddef>

namespace attnserve {

// The longest text WriteFloat32 writes, and the bytes at `p` it may overwrite (past the text's
// end: what the next number overwrites in turn).
inline constexpr int kFloat32TextMax = 15;
inline constexpr int kFloat32Room = 24;

// Writes `f` at `p` (kFloat32Room bytes of room) and returns the end of its text. Nine significant
// digits, trailing zeros dropped; plain for exponents -4 to 8 ("0.5", "100", "0.000123456789"),
// else "1.5e-05" / "3.40282347e+38". NaN and infinities as Python writes them: "NaN", "Infinity",
// "-Infinity". Any correctly rounding reader, through double or not, gets `f` back bit for bit.
char* WriteFloat32(char* p, float f);

// `count` float32 values (at `values`, aligned or not) as WriteFloat32 writes them, separated by
// commas (kFloat32TextMax + 1 bytes each, and kFloat32Room past the last, of room); returns the
// end of the text.
char* WriteFloat32List(char* p, const void* values, size_t count);

}  // namespace attnserve
