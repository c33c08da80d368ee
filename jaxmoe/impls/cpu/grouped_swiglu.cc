// Grouped SwiGLU experts for XLA:CPU, as an XLA FFI custom call (impl="cpu").
//
// Why: XLA:CPU never feeds a dot from a slice of a larger array in place; every
// expert `W[e]` becomes a copy before its dot (docs/log/2026-11-29-xla-path.md), and quantized
// experts become a float copy of every touched expert. This kernel reads each selected
// expert's weights where they lie, in their stored format, once per call.
//
// Inputs (sorted pair order, see jaxmoe/dispatch.py):
//   xs      [P, d]  f32   rows sorted by expert (the token rows, gathered)
//   offsets [E]     s32   first sorted row of each expert
//   sizes   [E]     s32   rows of each expert; non-empty ranges must be sorted, disjoint, inside [0, P)
//   then for each of gate, up, down (logical W [E, in, out]: gate/up [E, d, F], down [E, F, d]):
//     data    kind 0: [E, in, out] f32 | bf16             (float, in-major)
//             kind 1: [E, out, in] s8                     (int8 codes, GGUF Q8_0 layout)
//             kind 2: [E, out, in/2] u8                   (int4 codes, low nibble = even element)
//             kind 3..8: [E, out, in/B * BB] u8           (GGUF blocks as in the file: Q4_1, Q5_0,
//                        Q5_1 (B 32), Q4_K, Q5_K, Q6_K (B 256); BB bytes per block)
//     scales  [E, out, in/g] f32 | f16 | bf16             ([0] for kinds 0, 3..8)
//     qbias   [E, out, in/g] same dtype as scales         ([0] for kinds 0, 1, 3..8)
//     W[i, o] = scales[o, i/g] * q[o, i] + qbias[o, i/g]  (kinds 1, 2; kinds 3..8 decode as ggml)
//   b_gate [E, F] | [0], b_up [E, F] | [0], b_down [E, d] | [0]   f32 biases
//   (the shared handler: the shared expert's operands here, see GroupedSwigluSharedImpl)
//   inv     [T k] | [0] s32  the sorted row of each pair t k + j (dispatch.py's plan.inv), or
//                            empty: no combine
//   w       [T k] | [0] f32  each pair's routing weight, or empty (weights on the input)
// Outputs:
//   ys  [P, d] f32   ys[r] = down(act(gate(xs[r]), up(xs[r]))) of r's expert
//   h   [P, F] f32   scratch (the hidden activations), allocated by XLA
//   gu  [P, 2F] | [0] f32  when not empty: each row's gate | up products before the biases
//                    (x W_g, x W_u), the residual the backward reads instead of recomputing them;
//                    rows no expert owns are left unwritten
//   (the shared handler: the shared expert's ys and h here)
//   y   [T, d] | [0] f32  with inv: the combine, y[t] = sum over j in order of
//                    ys[inv[t k + j]] * w[t k + j], +0 for a dropped pair (combine_rows)
// Attributes:
//   act      0 = silu(g) * u, 1 = gpt-oss (clip(u,-L,L)+1) * g' * sigmoid(alpha g'), g' = min(g, L)
//   alpha, limit  the gpt-oss constants
//   round_h  1: round the hidden activations to bfloat16 before the down projection
//   kind_{gate,up,down}, group_{gate,up,down}  the weight formats above (group: 0 for float)
//   up_block, down_block  output columns per task
//   int_dot  1: integer dot products over int8-quantized activations (int_dot.h); 2: the same
//            by ggml's rules (activations="ggml"): int8 / int4 / Q4_0 / Q5_0 / IQ4_NL / MXFP4
//            weights on Q8_0 rows, Q4_1 / Q5_1 on Q8_1 rows, the K-quants, IQ4_XS and the IQ1-3 /
//            TQ kinds on Q8_K rows
//   h_fmt    (ExecConfig(activations="ggml")) h converted by the down weight's ggml activation
//            format before the down projection, as jaxmoe.ggml_activations.ggml_round does:
//            0 none, 1 bf16, 2 q8_0, 3 q8_K, 4 q8_1 (Q4_1 / Q5_1 down weights, int_dot 2: h
//            quantized for their integer dots) (the shared call: sh_fmt for the shared expert)
//
// Work: phase 1 = tasks (expert, row chunk, block of F columns) computing h; phase 2 =
// tasks (expert, row chunk, block of d columns) computing ys; then, with inv, the combine
// (tasks of 16 tokens; on the calling thread alone when it is small). Float weights: register
// tiles of MR rows x NV vectors along the output columns; a task with >= 8 rows packs
// its in-major block to float32 first, one with fewer streams it (up to 3 rows: row by
// row, in address order; 4 to 7: in chunks of whole rows swept by register tiles), and
// an expert with so few rows gets wider tasks, whole rows when enough experts keep the
// threads busy: contiguous reads; each output element is one chain of fused
// multiply-adds in k order either way. Quantized weights (stored
// out-major, blocks along `in`): dot-product tiles of MR rows x NC output columns; each
// vector of codes is widened and scaled in registers (w = s q + b) and multiplied
// into float32 accumulators, so the result is within float rounding of the
// dequantized-weight reference (activations stay float). Tasks with >= 8 rows first
// dequantize their block of columns into a float32 tile buffer (out-major, one block
// of columns, never an expert) and run larger tiles of the same per-element order on
// it. GGUF block kinds decode one block per column (32 or 256 elements) into an L1 buffer
// inside the tile (or, for Q4_K / Q5_K / Q6_K with AVX-512 and Q6_K with AVX2, into
// registers), bit-exact
// with gguf.quants.dequantize, then take the float tile's order of operations.
// With the int_dot attribute (ExecConfig(activations="int8"), opt-in), int8 / int4 / Q4_K /
// Q6_K weights instead multiply their input rows quantized to int8 per block of 32 (done
// once per call before each phase) with integer dot products: int_dot.h.
//
// Vector width is picked at build time from what the compiler targets (-march=native):
// 16 float lanes with AVX-512, else 8 (AVX2). Tasks run on XLA's intra-op thread pool;
// the calling thread takes tasks too. Rows no expert owns are zeroed.
#include "kernel_prelude.h"  // system and FFI headers, namespace ffi

namespace {

#include "kernel_common.h"  // vectors, conversions, weight kinds, GGUF block decoding

// ---------------------------------------------------------------------------------
// Float, in-major weights: C[MR, NV*lanes] = A[MR, K] @ B[K, NV*lanes].
constexpr int64_t kAhead = 16;  // rows of B prefetched ahead when a block is packed (float_matmul)

// Stream: B is read from memory (stream_strips): the accumulators start from C (the sums
// of the rows before, so C round-trips through memory exactly) and each row of B
// prefetches the row `ahead` rows on into L1 and the one `far` rows on into L2.
// Otherwise they start from zero. Every element is one chain of fused multiply-adds in
// k order either way.
template <int MR, int NV, bool Stream, typename W>
inline void tile(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, float* c, int64_t ldc,
                 int64_t ahead, int64_t far) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Stream ? load(c + i * ldc + j * kLanes) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * ldb;
    if (Stream)
      for (int j = 0; j < NV * kLanes * int(sizeof(W)); j += 64) {
        __builtin_prefetch((const char*)(bk + ahead * ldb) + j);
        __builtin_prefetch((const char*)(bk + far * ldb) + j, 0, 2);
      }
    tile_step(acc, a + k, lda, bk);
  }
  store_tile(acc, c, ldc);
}

// How far ahead the quantized few-row tiles (qtile) prefetch the columns to come into L2
// (prefetcht1), besides the next tile into L1; the float strips (stream_strips) prefetch
// 3 chunks ahead the same way (tile<..., Stream>). Measured on the Qwen3.6 layer: int8 T = 1 / 8 ~1.5x, bf16
// T = 1..4 ~1.4x faster; int4 and GGUF block kinds unchanged, so GGUF tiles (gtile) only
// take the L1 prefetch.
constexpr int64_t kFarBytes = 24 << 10;

// Columns that do not fill a vector: plain loops (C[m, ncols]).
template <typename W>
void tile_scalar(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols,
                 float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < ncols; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = fmadd(a[i * lda + k], scalar(b + k * ldb + j), s);
      c[i * ldc + j] = s;
    }
}

// Vectors per register tile row for MR rows (at most ~2/3 of the vector registers hold accumulators).
template <int MR>
constexpr int kMaxNV = kLanes == 16 ? (MR <= 2 ? 8 : 4) : (MR == 1 ? 8 : MR == 2 ? 6 : MR <= 4 ? 3 : 2);

template <int MR, bool Stream, typename W>
void row_tile(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t vec_cols, float* c,
              int64_t ldc, int64_t ahead = 0, int64_t far = 0) {
  constexpr int NV = kMaxNV<MR>;
  int64_t j0 = 0;
  for (; j0 + NV * kLanes <= vec_cols; j0 += NV * kLanes)
    tile<MR, NV, Stream>(a, lda, b + j0, ldb, K, c + j0, ldc, ahead, far);
  for (; j0 < vec_cols; j0 += kLanes) tile<MR, 1, Stream>(a, lda, b + j0, ldb, K, c + j0, ldc, ahead, far);
}

// C[m, ncols] = A[m, K] @ B[K, ncols] for any m, ncols (B in cache: the packed block);
// scalar tail columns.
template <typename W>
void block_matmul(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols,
                  float* c, int64_t ldc) {
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  for_row_tiles<6>(m, [&](auto rows, int64_t i0) {
    constexpr int R = decltype(rows)::value;
    row_tile<R, false>(a + i0 * lda, lda, b, ldb, K, vec_cols, c + i0 * ldc, ldc);
    if (vec_cols < ncols)
      tile_scalar(a + i0 * lda, lda, b + vec_cols, ldb, K, R, ncols - vec_cols, c + i0 * ldc + vec_cols, ldc);
  });
}

// Rows at or above which a task first packs (float) or dequantizes (quantized) its
// block of weights into a float32 tile buffer, read once from memory and then from
// cache by every row tile.
constexpr int64_t kPackRows = 8;

// Few rows (m < kPackRows), strips: the weights stream from memory once, in chunks of
// kc whole rows of the task's vector columns (C's zeroed by float_matmul, which also
// takes the scalar tail), each chunk swept column strip by column strip by the streaming
// register tiles (accumulators from and back to C). Every output element
// is still one chain of fused multiply-adds in k order from zero, as in the packed path,
// so a row's result is the same bits whichever path its task takes. Going strip by strip
// goes back and forth inside each 4 KiB page of the chunk, which slows the memory
// stream (stream_rows, next); it is kept for 4 to 7 rows, where the register tiles'
// fewer loads and stores win.
template <typename W>
void stream_strips(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols, float* c,
                   int64_t ldc) {
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  const int64_t kc = std::max<int64_t>(4, std::min<int64_t>(64, (16 << 10) / std::max<int64_t>(1, ncols * int64_t(sizeof(W)))));
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t n = std::min<int64_t>(kc, K - k0);
    const int64_t ahead = k0 + kc < K ? kc : 0;  // prefetch the next chunk's rows of the same columns
    const int64_t far = k0 + 3 * kc < K ? 3 * kc : 0;  // 3 chunks (~48 KiB of these columns) ahead, into L2
    for_row_tiles<4>(m, [&](auto rows, int64_t i0) {
      constexpr int R = decltype(rows)::value;
      row_tile<R, true>(a + i0 * lda + k0, lda, b + k0 * ldb, ldb, n, vec_cols, c + i0 * ldc, ldc, ahead, far);
    });
  }
}

// One row k of B (its vec_cols columns) into the m = MR rows of C: c[i, :] += a[i, k] b[k, :],
// the accumulators loaded from and stored back to C (in L1), the weights read once, in
// address order.
template <int MR, typename W>
inline void stream_row(const float* a, int64_t lda, const W* bk, int64_t vec_cols, float* c, int64_t ldc) {
  vf av[MR];
  for (int i = 0; i < MR; ++i) av[i] = splat(a[i * lda]);
  int64_t j = 0;
  for (; j + 4 * kLanes <= vec_cols; j += 4 * kLanes) {
    vf bv[4];
    for (int q = 0; q < 4; ++q) bv[q] = load(bk + j + q * kLanes);
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < 4; ++q) {
        float* ci = c + i * ldc + j + q * kLanes;
        store(ci, fmadd(av[i], bv[q], load(ci)));
      }
  }
  for (; j < vec_cols; j += kLanes) {
    const vf bv = load(bk + j);
    for (int i = 0; i < MR; ++i) store(c + i * ldc + j, fmadd(av[i], bv, load(c + i * ldc + j)));
  }
}

// Few rows (m <= kRowOrderRows), rows: the weights stream from memory once, strictly in
// address order: row k of the task's vector columns is read whole, into every row of C
// (zeroed by float_matmul, which also takes the scalar tail), before row k + 1
// (contiguous when the task spans the whole row). Sweeping a chunk of rows
// column strip by column strip (stream_strips) goes back and forth inside each 4 KiB
// page, and Zen 4's hardware prefetchers then stop streaming: one thread read cold
// matrices at about half the speed of a plain read that way, and at the plain read's
// speed row by row (benchmarks/stream_order.cc, docs/performance.md). The accumulators
// round-trip through C, which must stay in L1 (kRowOrderBytes). Every output element is
// still one chain of fused multiply-adds in k order from zero: the same bits as the
// other paths.
template <typename W>
void stream_rows(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols, float* c,
                 int64_t ldc) {
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * ldb;
    with_rows<3>(m, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      stream_row<R>(a + k, lda, bk, vec_cols, c, ldc);
    });
  }
}

// When a few-row task streams its weights row by row (stream_rows) rather than in strips
// (stream_strips): at most kRowOrderRows rows, whose kRowOrderBytes of C stay in L1.
// Measured on the Qwen3.6 layer, both kernels in one process (bench_kernel_ab.py --what
// layer): float32 T = 8 1.5x, T = 64 1.1-1.2x faster than strips for every row count, and
// T = 256 0.9x (bfloat16 0.95x) when 4 to 7 rows and the down projection's 8 KiB rows also
// went row by row; with these limits T = 256 is unchanged.
constexpr int64_t kRowOrderRows = 3;
constexpr int64_t kRowOrderBytes = 16 << 10;

template <typename W>
void float_matmul(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols, float* c,
                  int64_t ldc, fvec& pack) {
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  if (m < kPackRows) {  // stream: the accumulators start from C, zeroed here
    for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, sizeof(float) * size_t(vec_cols));
    if (m <= kRowOrderRows && m * ncols * int64_t(sizeof(float)) <= kRowOrderBytes)
      stream_rows(a, lda, b, ldb, K, m, ncols, c, ldc);
    else
      stream_strips(a, lda, b, ldb, K, m, ncols, c, ldc);
    if (vec_cols < ncols) tile_scalar(a, lda, b + vec_cols, ldb, K, m, ncols - vec_cols, c + vec_cols, ldc);
    return;
  }
  pack.resize(size_t(K) * ncols);
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * ldb;
    if (k + kAhead < K)
      for (int64_t j = 0; j < ncols * int64_t(sizeof(W)); j += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(bk + kAhead * ldb) + j);
        if (k + 3 * kAhead < K)  // and into L2 further ahead (bf16 T = 256 ~1.14x, f32 unchanged)
          __builtin_prefetch(reinterpret_cast<const char*>(bk + 3 * kAhead * ldb) + j, 0, 2);
      }
    float* pk = pack.data() + k * ncols;
    for (int64_t j = 0; j < vec_cols; j += kLanes) store(pk + j, load(bk + j));
    for (int64_t j = vec_cols; j < ncols; ++j) pk[j] = scalar(bk + j);
  }
  block_matmul(a, lda, pack.data(), ncols, K, m, ncols, c, ldc);
}

// ---------------------------------------------------------------------------------
// Quantized (out-major) weights: dot-product tiles.

// Widening of 2 * lanes int8 codes (p), or of lanes bytes = 2 * lanes nibbles (widen_u4),
// to two float vectors. GCC scalarizes a direct int8 -> float
// __builtin_convertvector, so the x86 paths use the widening instructions.
inline void widen_s8(const int8_t* p, vf& w0, vf& w1) {
#if JM_LANES == 16 && defined(__AVX512F__)
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  w0 = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
  w1 = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif defined(__AVX2__)
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w0 = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
  w1 = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
#else
  vs8 q0, q1;
  std::memcpy(&q0, p, kLanes);
  std::memcpy(&q1, p + kLanes, kLanes);
  w0 = __builtin_convertvector(q0, vf);
  w1 = __builtin_convertvector(q1, vf);
#endif
}

// With AVX2 the nibbles come in the split order (kSplitInt4): 8 bytes widened once, w0 the
// low nibbles (the chunk's even elements), w1 the high ones (its odd elements). AVX-512
// builds take the 4-bit table (dequant2); the portable path keeps element order.
inline void widen_u4(const uint8_t* p, vf& w0, vf& w1) {
#if defined(__AVX2__) && JM_LANES == 8
  const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  w0 = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(15)));
  w1 = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(z, 4));
#else
  vu8 bytes;
  std::memcpy(&bytes, p, kLanes);
  const vu8 lo = bytes & uint8_t(15), hi = bytes >> uint8_t(4);
#if JM_LANES == 16
  const vu8 q0 = __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const vu8 q1 = __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
  const vu8 q0 = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
  const vu8 q1 = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
  w0 = __builtin_convertvector(q0, vf);
  w1 = __builtin_convertvector(q1, vf);
#endif
}

// One group of one column: its scale and bias, and for int4 with AVX-512 the table of its
// 16 values (lut16: the same bits as `q * s + b` per element).
struct GroupScale {
  float s, b;
#ifdef JM_LUT16
  vf lut;
#endif
};

template <int Q>
inline GroupScale group_scale(float s, float b) {
  GroupScale g{s, b};
#ifdef JM_LUT16
  if constexpr (Q == kInt4) g.lut = lut16<kScaleAdd>(s, b);
#endif
  return g;
}

// Two vectors (2 * lanes consecutive elements along `in`, starting at k) of column `row`.
template <int Q>
inline void dequant2(const void* row, int64_t k, const GroupScale& g, vf& w0, vf& w1) {
  const float s = g.s, b = g.b;
  if constexpr (Q == kInt8) {
    widen_s8(static_cast<const int8_t*>(row) + k, w0, w1);
    w0 *= s;
    w1 *= s;
  } else if constexpr (Q == kInt4) {
#ifdef JM_LUT16  // 16 bytes = 32 codes (low nibble first), in the split order (kSplitInt4)
    const __m512i z = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + k / 2)));
    w0 = (vf)_mm512_permutexvar_ps(z, (__m512)g.lut);                       // low nibbles: even elements
    w1 = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), (__m512)g.lut);  // high nibbles: odd elements
#else
    widen_u4(static_cast<const uint8_t*>(row) + k / 2, w0, w1);
    w0 = w0 * s + b;
    w1 = w1 * s + b;
#endif
  } else if constexpr (Q == kFP8) {  // 2 * lanes E4M3 codes, exact, times the block's scale (one rounding)
    const uint8_t* p = static_cast<const uint8_t*>(row) + k;
    w0 = fp8_to_vf(p) * s;
    w1 = fp8_to_vf(p + kLanes) * s;
  } else {
    static_assert(Q == kInt8 || Q == kInt4, "dequant2: int8, int4 or FP8 codes");
  }
}

// Where column `col` of expert e starts, for the stored layout of kind Q (or the tile buffer).
struct QCols {
  const char* base;     // column 0 of the block
  int64_t stride;       // bytes between columns
  const void* scales;   // [out, in/g] of this expert, from the block's first column
  const void* qbias;
  int stype;
  int64_t ng, group;
};

// The columns kFarBytes (at least two tiles of NC) past the tile at column j0: what the
// quantized tiles prefetch into L2 while they work on j0 .. j0 + NC - 1.
inline const char* far_cols(const QCols& w, int64_t j0, int64_t NC) {
  return w.base + (j0 + std::max<int64_t>(2 * NC, kFarBytes / w.stride)) * w.stride;
}

// C[MR, NC] (columns col0.. of C at stride ldc) = A[MR, K] . column rows.
template <int MR, int NC, int Q>
void qtile(const float* a, int64_t lda, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  vf acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = vf{};
  const void* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = w.base + (j0 + j) * w.stride;
  // The next tile's columns (the next pages of an out-major matrix: the hardware
  // prefetcher does not cross 4 KiB pages), fetched line by line into L1 as this tile
  // advances, and the columns kFarBytes ahead into L2 (int8 T = 1 / 8 ~1.5x faster).
  const char* next = w.base + (j0 + NC) * w.stride;
  const char* far = far_cols(w, j0, NC);
  static_assert(Q == kInt8 || Q == kInt4 || Q == kFP8, "qtile: int8, int4 or FP8 codes");
  constexpr int kBytesPerStep = Q == kInt4 ? kLanes : 2 * kLanes;
  const int64_t G = w.group;
  for (int64_t o = 0; o < NC * w.ng; o += 16) {  // the next tile's scales (and biases): float32 [ncols, ng]
    __builtin_prefetch(static_cast<const float*>(w.scales) + (j0 + NC) * w.ng + o);
    if (w.qbias) __builtin_prefetch(static_cast<const float*>(w.qbias) + (j0 + NC) * w.ng + o);
  }
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    GroupScale gs[NC];
    for (int j = 0; j < NC; ++j) {
      const int64_t si = (j0 + j) * w.ng + gi;  // float32 here (float_scales)
      gs[j] = group_scale<Q>(static_cast<const float*>(w.scales)[si],
                             w.qbias ? static_cast<const float*>(w.qbias)[si] : 0.f);
    }
    for (int64_t k = g0, ke = std::min(g0 + G, K); k < ke; k += 2 * kLanes) {  // FP8: a last block may be partial
      const int64_t kb = int64_t(uint64_t(k) / (2 * kLanes)) * kBytesPerStep;
      if (kb % 64 == 0)
        for (int j = 0; j < NC; ++j) {
          __builtin_prefetch(next + j * w.stride + kb);
          __builtin_prefetch(far + j * w.stride + kb, 0, 2);
        }
      vf w0[NC], w1[NC];
      for (int j = 0; j < NC; ++j) dequant2<Q>(rows[j], k, gs[j], w0[j], w1[j]);
      for (int i = 0; i < MR; ++i) {
        const vf x0 = load(a + i * lda + k), x1 = load(a + i * lda + k + kLanes);
        for (int j = 0; j < NC; ++j) {
          acc[i][j] = fmadd(x0, w0[j], acc[i][j]);
          acc[i][j] = fmadd(x1, w1[j], acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j0 + j] = hsum(acc[i][j]);
}

// The same tile for GGUF block kinds: per block of B elements, each of the NC columns'
// block is decoded into a small float32 buffer (NC x B floats, in L1: never more than
// one block per column), then multiplied in the same order as the packed path's tiles, so a
// row's result does not depend on whether its task took this path or the packed one.
// With AVX-512, Q4_K, Q5_K and Q6_K skip the buffer: each 16 elements are decoded straight into
// registers and multiplied in the same order (the same bits). Q4_K: per pair of
// sub-blocks of each column, 32 bytes widened once and both nibbles looked up in the
// sub-blocks' tables; Q6_K: the block's codes built as bytes (q6k_codes), then a vector at
// a time widened (q6k_codes_vec). With AVX2, Q6_K takes the same register path (8 lanes);
// the other kinds fill the buffer with decode_block's vector decoders (8 codes per
// vector: Q4_K / Q5_K kept in registers spilled ~half their vectors at NC = 4 and were no
// faster, Q5_K 0.8x).
template <int MR, int NC, int Q>
void gtile(const float* a, int64_t lda, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  constexpr int B = block_elems(Q), BB = block_bytes(Q);
  vf acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = vf{};
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns (as in qtile); for the
  // K-quants also far_cols into L2, as ktile does (block-32 kinds: no measurable gain)
  const char* far = far_cols(w, j0, NC);
  auto madd = [&](int64_t k, const vf* wv) {  // acc += x[:, k .. k + lanes - 1] * wv
    for (int i = 0; i < MR; ++i) {
      const vf x = load(a + i * lda + k);
      for (int j = 0; j < NC; ++j) acc[i][j] = fmadd(x, wv[j], acc[i][j]);
    }
  };
  alignas(64) float wb[NC][B];
  for (int64_t g0 = 0, blk = 0; g0 < K; g0 += B, ++blk) {
    for (int j = 0; j < NC; ++j)
      for (int o = 0; o < BB; o += 64) {
        __builtin_prefetch(next + j * w.stride + blk * BB + o);
        if constexpr (B == 256) __builtin_prefetch(far + j * w.stride + blk * BB + o, 0, 2);  // K-quants
      }
#ifdef JM_LUT16
    if constexpr (Q == kQ4_K || Q == kQ5_K) {
      // Q5_K: the fifth bit (bit s of qh[l] for sub-block s) into bit 4 of the index, and
      // 32-entry tables (codes 0..15 | 16..31) looked up by one two-table permute.
      constexpr int kQs = Q == kQ5_K ? 48 : 16;  // where the nibbles start
      alignas(32) float dsc[NC][8], dmn[NC][8];
      __m512i h0[NC], h1[NC];  // Q5_K: qh[0..15], qh[16..31], one byte per lane
      for (int j = 0; j < NC; ++j) {
        const uint8_t* bj = rows[j] + blk * BB;
        k_scales_mins(bj + 4, f16_at(bj), f16_at(bj + 2), dsc[j], dmn[j]);
        if constexpr (Q == kQ5_K) {
          h0[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bj + 16)));
          h1[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bj + 32)));
        }
      }
      for (int p = 0; p < 4; ++p) {
        __m512i z0[NC], z1[NC], q0[NC], q1[NC];  // Q5_K: q = qh >> 2p (sub-block 2p's bit at bit 0)
        vf t[NC][2][2];  // [column][sub-block 2p, 2p + 1][codes 0..15, 16..31]
        for (int j = 0; j < NC; ++j) {
          if constexpr (Q == kQ5_K) {
            const __m128i n = _mm_cvtsi32_si128(2 * p);
            q0[j] = _mm512_srl_epi32(h0[j], n);
            q1[j] = _mm512_srl_epi32(h1[j], n);
          }
          const uint8_t* qs = rows[j] + blk * BB + kQs + 32 * p;
          z0[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
          z1[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
          for (int u = 0; u < 2; ++u) {
            t[j][u][0] = lut16<kScaleSub>(dsc[j][2 * p + u], dmn[j][2 * p + u]);
            if constexpr (Q == kQ5_K) t[j][u][1] = lut16<kScaleSub>(dsc[j][2 * p + u], dmn[j][2 * p + u], 16);
          }
        }
        for (int h = 0; h < 4; ++h) {  // elements 64 p + 16 h ..: low nibbles of z0, z1, then high ones
          vf wv[NC];
          for (int j = 0; j < NC; ++j) {
            const __m512i z = h & 1 ? z1[j] : z0[j];
            const vf* tj = t[j][h >> 1];
            if constexpr (Q == kQ4_K) {  // vpermps reads the low 4 bits of each index: no mask
              wv[j] = (vf)_mm512_permutexvar_ps(h < 2 ? z : _mm512_srli_epi32(z, 4), (__m512)tj[0]);
            } else {
              const __m512i q = h & 1 ? q1[j] : q0[j];
              const __m512i bit = h < 2 ? _mm512_slli_epi32(q, 4) : _mm512_slli_epi32(q, 3);  // to bit 4
              const __m512i nib = h < 2 ? _mm512_and_si512(z, _mm512_set1_epi32(15)) : _mm512_srli_epi32(z, 4);
              const __m512i idx = _mm512_ternarylogic_epi32(nib, bit, _mm512_set1_epi32(16), 0xF8);  // nib | (bit & 16)
              wv[j] = (vf)_mm512_permutex2var_ps((__m512)tj[0], idx, (__m512)tj[1]);
            }
          }
          madd(g0 + 64 * p + 16 * h, wv);
        }
      }
      continue;
    }
#endif
#ifdef JM_VDECODE
    if constexpr (Q == kQ6_K) {
      alignas(64) float ds[NC][16];
      alignas(64) int8_t qb[NC][256];
      for (int j = 0; j < NC; ++j) {
        q6k_scales(rows[j] + blk * BB, ds[j]);
        q6k_codes(rows[j] + blk * BB, qb[j]);
      }
#pragma GCC unroll 32
      for (int e = 0; e < 256; e += kLanes) {
        vf wv[NC];
        for (int j = 0; j < NC; ++j) wv[j] = q6k_codes_vec(qb[j] + e) * ds[j][e / 16];
        madd(g0 + e, wv);
      }
      continue;
    }
#endif
    for (int j = 0; j < NC; ++j) decode_block<Q>(rows[j] + blk * BB, wb[j]);
    for (int k = 0; k < B; k += kLanes) {
      vf wv[NC];
      for (int j = 0; j < NC; ++j) wv[j] = load(wb[j] + k);
      madd(g0 + k, wv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j0 + j] = hsum(acc[i][j]);
}

template <int MR, int Q>
void qrow_tile(const float* a, int64_t lda, const QCols& w, int64_t ncols, int64_t K, float* c, int64_t ldc) {
  constexpr int NC = MR == 1 ? 4 : 2;
  int64_t j0 = 0;
  if constexpr (is_gguf(Q)) {
    for (; j0 + NC <= ncols; j0 += NC) gtile<MR, NC, Q>(a, lda, w, j0, K, c, ldc);
    for (; j0 < ncols; ++j0) gtile<MR, 1, Q>(a, lda, w, j0, K, c, ldc);
  } else {
    for (; j0 + NC <= ncols; j0 += NC) qtile<MR, NC, Q>(a, lda, w, j0, K, c, ldc);
    for (; j0 < ncols; ++j0) qtile<MR, 1, Q>(a, lda, w, j0, K, c, ldc);
  }
}

template <int Q>
void qblock(const float* a, int64_t lda, const QCols& w, int64_t m, int64_t ncols, int64_t K, float* c, int64_t ldc) {
  for_row_tiles<4>(m, [&](auto rows, int64_t i0) {
    constexpr int R = decltype(rows)::value;
    qrow_tile<R, Q>(a + i0 * lda, lda, w, ncols, K, c + i0 * ldc, ldc);
  });
}

// The packed path's row tiles: nt_tile (kernel_common.h, the backward's tile) over the
// float32 tile buffer, up to 6 rows x 4 columns. Its per-element chain (lane l sums
// k = l, l + lanes, ... in order, then hsum; K is a multiple of the lanes, so no tail) is
// that of the few-row tiles qtile / gtile, so a row's result is the same bits whichever
// path its task takes. (A 4 x 2 tile of two vectors per step, 12 loads per 16
// multiply-adds, was bound by L2 loads here: 6 x 4 made T = 256 kernel calls 1.1-1.3x
// faster; the backward's matmul_nt, 4 rows and single-element edges, is ~0.92x of this.)
template <int MR>
void prow_tile(const float* a, int64_t lda, const float* b, int64_t K, int64_t ncols, float* c, int64_t ldc) {
  constexpr int NC = 4;
  int64_t j0 = 0;
  for (; j0 + NC <= ncols; j0 += NC) nt_tile<float, MR, NC>(a, lda, b + j0 * K, K, K, nullptr, nullptr, 0, c + j0, ldc);
  for (; j0 < ncols; ++j0) nt_tile<float, MR, 1>(a, lda, b + j0 * K, K, K, nullptr, nullptr, 0, c + j0, ldc);
}

// C[m, ncols] = A[m, K] . pack[ncols, K] (the dequantized tile buffer; K a multiple of the lanes).
inline void pblock(const float* a, int64_t lda, const float* pack, int64_t m, int64_t ncols, int64_t K, float* c,
                   int64_t ldc) {
  const int64_t tiles = (m + 5) / 6;  // row tiles of at most 6, as even as they can be (8 = 4 + 4, not 6 + 2)
  for (int64_t i0 = 0, t = 0; i0 < m; ++t) {
    const int64_t mr = (m - i0) / (tiles - t) + ((m - i0) % (tiles - t) != 0);
    const float* ai = a + i0 * lda;
    float* ci = c + i0 * ldc;
    with_rows<6>(mr, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      prow_tile<R>(ai, lda, pack, K, ncols, ci, ldc);
    });
    i0 += mr;
  }
}

// Dequantizes columns [0, ncols) of the block into pack [ncols, K] float32 (out-major).
template <int Q>
void dequant_block(const QCols& w, int64_t ncols, int64_t K, float* pack) {
  const int64_t row_bytes = Q == kInt4 ? K / 2 : K;
  for (int64_t j = 0; j < ncols; ++j) {
    const void* row = w.base + j * w.stride;
    if (j + 2 < ncols)  // two columns ahead: the next page (the hardware prefetcher stops at pages)
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(w.base + (j + 2) * w.stride + o);
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += w.group, ++gi) {
      const int64_t si = j * w.ng + gi;  // float32 here (float_scales)
      const GroupScale gs = group_scale<Q>(static_cast<const float*>(w.scales)[si],
                                           w.qbias ? static_cast<const float*>(w.qbias)[si] : 0.f);
      for (int64_t k = g0, ke = std::min(g0 + w.group, K); k < ke; k += 2 * kLanes) {
        vf w0, w1;
        dequant2<Q>(row, k, gs, w0, w1);
        store(pack + j * K + k, w0);
        store(pack + j * K + k + kLanes, w1);
      }
    }
  }
}

// n scales (or biases) of type stype to float32, in vectors (exact either way; scalar
// conversions of GGUF Q8_0's float16 scales, ncols x in / 32 per task, took ~10-15% of a
// T = 1 / 8 layer call).
inline void scales_to_float(const void* src, int stype, int64_t n, float* __restrict out) {
  int64_t i = 0;
  if (stype == kSBF16) {  // a 16-bit shift, which the compiler vectorizes
    const uint16_t* __restrict h = static_cast<const uint16_t*>(src);
    for (; i < n; ++i) {
      const uint32_t w = uint32_t(h[i]) << 16;
      std::memcpy(out + i, &w, 4);
    }
    return;
  }
#if defined(__F16C__) && defined(__AVX2__)
  if (stype == kSF16)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                    static_cast<const uint16_t*>(src) + i))));
#endif
  for (; i < n; ++i) out[i] = load_scale(src, stype, i);
}

// The block's scales (and biases) as float32 [ncols, ng]: float32 ones as they are, others
// converted into `buf` (one conversion per group and column, outside the tiles, which
// then read plain floats; a scalar copy of float32 ones was slower).
inline QCols float_scales(const QCols& w, int64_t ncols, fvec& buf) {
  if (w.stype == kSF32) return w;
  const int64_t n = ncols * w.ng;
  buf.resize(size_t(w.qbias ? 2 * n : n));
  scales_to_float(w.scales, w.stype, n, buf.data());
  if (w.qbias) scales_to_float(w.qbias, w.stype, n, buf.data() + n);
  QCols f = w;
  f.scales = buf.data();
  f.qbias = w.qbias ? buf.data() + n : nullptr;
  f.stype = kSF32;
  return f;
}

// With AVX-512 (the 4-bit table) and AVX2, the codes of each 2 * lanes elements (lanes
// bytes) are widened once (one byte per 32-bit lane) and both nibbles taken from there:
// the first vector holds the chunk's even elements (low nibbles), the second its odd ones
// (AVX-512: 3 shuffles per 32 codes instead of 6; AVX2: 1 per 16 instead of 4, MLX int4 /
// Q4_0 T = 1 / 8 kernel 1.2-1.4x on Zen 3). The activations are read in the same order
// (split_rows) by both the few-row tiles and the packed path (dequant_block stores the
// split order), so every output element is still one chain over k, the same whatever the
// row count; only the order of that chain differs from the element order.
#ifdef JM_VDECODE
constexpr bool kSplitInt4 = true;
#else
constexpr bool kSplitInt4 = false;
#endif

// out[i, c + l] = a[i, c + 2 l], out[i, c + L + l] = a[i, c + 2 l + 1] (L = lanes, c a multiple of 2 L,
// l < L): rows [m, K] of a (stride lda) in the split order, stride K.
inline void split_rows(const float* a, int64_t lda, int64_t m, int64_t K, float* out) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < K; c += 2 * kLanes)
      for (int l = 0; l < kLanes; ++l) {
        out[i * K + c + l] = a[i * lda + c + 2 * l];
        out[i * K + c + kLanes + l] = a[i * lda + c + 2 * l + 1];
      }
}

template <int Q>
void quant_matmul(const float* a, int64_t lda, const QCols& wq, int64_t K, int64_t m, int64_t ncols, float* c,
                  int64_t ldc, fvec& pack) {
  thread_local fvec sbuf, abuf;
  const QCols w = Q == kFP8 ? wq : float_scales(wq, ncols, sbuf);  // FP8: fp8_matmul expanded them
  if constexpr (Q == kInt4 && kSplitInt4) {
    abuf.resize(size_t(m * K));
    split_rows(a, lda, m, K, abuf.data());
    a = abuf.data();
    lda = K;
  }
  if (m < kPackRows) return qblock<Q>(a, lda, w, m, ncols, K, c, ldc);
  pack.resize(size_t(K) * ncols);
  dequant_block<Q>(w, ncols, K, pack.data());
  pblock(a, lda, pack.data(), m, ncols, K, c, ldc);
}

// GGUF block kinds: < 8 rows decode block by block inside the tiles; >= 8 rows decode
// the task's block of columns into the float32 tile buffer (ncols x K) first.
template <int Q>
void gguf_matmul(const float* a, int64_t lda, const QCols& w, int64_t K, int64_t m, int64_t ncols, float* c,
                 int64_t ldc, fvec& pack) {
  constexpr int B = block_elems(Q), BB = block_bytes(Q);
  if (m < kPackRows) return qblock<Q>(a, lda, w, m, ncols, K, c, ldc);
  pack.resize(size_t(K) * ncols);
  for (int64_t j = 0; j < ncols; ++j) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.base + j * w.stride);
    if (j + 2 < ncols)  // two columns ahead, as in dequant_block
      for (int64_t o = 0; o < w.stride; o += 64) __builtin_prefetch(w.base + (j + 2) * w.stride + o);
    for (int64_t blk = 0; blk < K / B; ++blk) decode_block<Q>(row + blk * BB, pack.data() + j * K + blk * B);
  }
  pblock(a, lda, pack.data(), m, ncols, K, c, ldc);
}

#include "int_dot.h"  // the opt-in integer dot products over int8-quantized activations

// Block-scaled FP8 (fp8_kind.h): the int8 tiles' order of operations over the codes'
// exact values times their block's scale. Each of the task's columns gets its own float32
// row of ceil(in / b) scales (its block row's, converted once: ncols x in / b values per
// task), so the tiles read per-column groups of b as they do int8's.
void fp8_matmul(const Weight& w, int64_t e, int64_t col0, const float* a, int64_t lda, int64_t m, int64_t ncols,
                float* c, int64_t ldc, fvec& pack) {
  const int64_t K = w.in, N = w.out, ng = fp8_scale_cols(w), sr = fp8_scale_rows(w);
  const int64_t ssize = w.stype == kSF32 ? 4 : 2;
  thread_local fvec sbuf;
  sbuf.resize(size_t(ncols * ng));
  for (int64_t j = 0; j < ncols; ++j) {
    const int64_t r = (col0 + j) / w.group;
    if (j > 0 && r == (col0 + j - 1) / w.group) {
      std::memcpy(sbuf.data() + j * ng, sbuf.data() + (j - 1) * ng, sizeof(float) * size_t(ng));
      continue;
    }
    scales_to_float(static_cast<const char*>(w.scales) + (e * sr + r) * ng * ssize, w.stype, ng, sbuf.data() + j * ng);
  }
  QCols q{static_cast<const char*>(w.data) + (e * N + col0) * K, K, sbuf.data(), nullptr, kSF32, ng, w.group};
  quant_matmul<kFP8>(a, lda, q, K, m, ncols, c, ldc, pack);
}

// C[m, ncols] = A[m, in] @ W_e[:, col0 : col0 + ncols] for any weight format; for a weight
// with int_dot set, Q8(A) @ W_e[...] from qa (A's rows quantized, int_dot.h).
void matmul(const Weight& w, int64_t e, int64_t col0, const float* a, int64_t lda, int64_t m, int64_t ncols, float* c,
            int64_t ldc, fvec& pack, const QRows* qa) {
  const int64_t K = w.in, N = w.out;
  if (w.kind == kFloat) {
    if (w.bf16)
      return float_matmul(a, lda, static_cast<const uint16_t*>(w.data) + e * K * N + col0, N, K, m, ncols, c, ldc, pack);
    return float_matmul(a, lda, static_cast<const float*>(w.data) + e * K * N + col0, N, K, m, ncols, c, ldc, pack);
  }
  if (is_gguf(w.kind)) {
    const int64_t row_bytes = K / block_elems(w.kind) * block_bytes(w.kind);
    QCols q{static_cast<const char*>(w.data) + (e * N + col0) * row_bytes, row_bytes, nullptr, nullptr, 0, 0,
            block_elems(w.kind)};
    if (w.int_dot && is_k8tile_kind(w.kind) && slot_is_q8k(w.qslot))  // ggml's Q8_K rows: int_dot_k.h
      return with_gguf_kind(w.kind, [&](auto Q) {
        if constexpr (is_k8tile_kind(Q.value)) int_dot_gguf_k<Q.value>(*qa, q, K, m, ncols, c, ldc);
      });
    if (w.int_dot && is_int_dot_gguf_kind(w.kind))  // Q8_0 / Q8_1 rows, and the int8 mode's Q4_K / Q6_K
      return with_gguf_kind(w.kind, [&](auto Q) {
        if constexpr (is_int_dot_gguf_kind(Q.value)) int_dot_gguf<Q.value>(*qa, q, K, m, ncols, c, ldc);
      });
    return with_gguf_kind(w.kind, [&](auto Q) { gguf_matmul<Q.value>(a, lda, q, K, m, ncols, c, ldc, pack); });
  }
  if (w.kind == kFP8) return fp8_matmul(w, e, col0, a, lda, m, ncols, c, ldc, pack);
  const int64_t ng = K / w.group, col = e * N + col0;
  const int64_t ssize = w.stype == kSF32 ? 4 : 2;
  const int64_t row_bytes = w.kind == kInt8 ? K : K / 2;
  QCols q{static_cast<const char*>(w.data) + col * row_bytes,
          row_bytes,
          static_cast<const char*>(w.scales) + col * ng * ssize,
          w.qbias ? static_cast<const char*>(w.qbias) + col * ng * ssize : nullptr,
          w.stype,
          ng,
          w.group};
  if (w.int_dot) {
    if (w.kind == kInt8) return int_dot_matmul<kInt8>(*qa, q, K, m, ncols, c, ldc);
    return int_dot_matmul<kInt4>(*qa, q, K, m, ncols, c, ldc);
  }
  if (w.kind == kInt8) return quant_matmul<kInt8>(a, lda, q, K, m, ncols, c, ldc, pack);
  return quant_matmul<kInt4>(a, lda, q, K, m, ncols, c, ldc, pack);
}

// ---------------------------------------------------------------------------------
struct Problem : Experts {
  const float* xs;
  float* h;   // [P, F] scratch (an XLA-allocated result)
  float* gu;  // [P, 2F] gate | up residual, or null
  float* ys;  // [P, d]
  const float* sgate;  // the shared expert's gate vector [d] (ys[r] *= sigmoid(gx[r] . sgate)), or null
  float* glogit;       // [P] scratch for those logits when sgate is set
  const float* gx = nullptr;  // [P, d] the rows the gate reads, or null: xs (ggml mode: xs are converted)
  int64_t E;
  int64_t rows;   // P
  int64_t owned;  // the rows the experts own (the sum of sizes)
  QRows qx[kSlots], qh[kSlots];  // int8 activations (int_dot.h): xs and h in the (order, rule) slots used
  int32_t h_fmt = 0;               // the ggml format h is converted to (kHfmt*), 0: none
  // The combine in the call (the routed experts' rows back to tokens), or inv null: none.
  const int32_t* cinv = nullptr;  // [T k] the sorted row of each pair t k + j
  const float* cw = nullptr;      // [T k] each pair's routing weight, or null (weights on the input)
  float* cy = nullptr;            // [T, d] the result
  const float* cadd = nullptr;    // [T, d] added to each token's sum (the shared expert's ys), or null
  int64_t ctokens = 0, ck = 0;    // T, k (a pair is valid when its sorted row is below `owned`)
};

// The quantized rows weight w reads (in its kind's order), from row row0 on; null for float
// activations.
inline const QRows* rows_for(const Weight& w, const QRows* by_slot, int64_t row0, QRows& out) {
  if (!w.int_dot) return nullptr;
  out = by_slot[w.qslot].at(row0);
  return &out;
}

constexpr int64_t kRowChunk = 128;  // rows per task at most (keeps the tile buffers small)

struct Task {
  int32_t expert;
  int32_t row0, rows;
  int32_t col0, cols;
  int32_t part = 0;  // which problem of a call (0: the routed experts, 1: the shared expert)
};

// x . g over d elements in one fixed order (lane l sums k = l mod lanes, then hsum, then
// the tail in order): the same bits for a row whatever the call's row count.
inline float row_dot(const float* x, const float* g, int64_t d) {
  vf acc{};
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) acc = fmadd(load(x + k), load(g + k), acc);
  float s = hsum(acc);
  for (; k < d; ++k) s += x[k] * g[k];
  return s;
}

void run_gate_up(const Problem& p, const Task& t) {
  thread_local fvec gbuf, ubuf, pack;
  const int64_t e = t.expert, d = p.d, F = p.F;
  const float* x = p.xs + int64_t(t.row0) * d;
  gbuf.resize(size_t(t.rows) * t.cols);
  ubuf.resize(size_t(t.rows) * t.cols);
  QRows qg, qu;
  if (p.sgate && t.col0 == 0) {  // one task per row chunk starts at column 0: each logit once
    const float* gx = p.gx ? p.gx + int64_t(t.row0) * d : x;
    for (int64_t i = 0; i < t.rows; ++i) p.glogit[t.row0 + i] = row_dot(gx + i * d, p.sgate, d);
  }
  matmul(p.wg, e, t.col0, x, d, t.rows, t.cols, gbuf.data(), t.cols, pack,
         rows_for(p.wg, p.qx, t.row0, qg));
  matmul(p.wu, e, t.col0, x, d, t.rows, t.cols, ubuf.data(), t.cols, pack,
         rows_for(p.wu, p.qx, t.row0, qu));
  if (p.gu)
    for (int64_t i = 0; i < t.rows; ++i) {
      float* grow = p.gu + (int64_t(t.row0) + i) * 2 * F + t.col0;
      std::memcpy(grow, gbuf.data() + i * t.cols, sizeof(float) * size_t(t.cols));
      std::memcpy(grow + F, ubuf.data() + i * t.cols, sizeof(float) * size_t(t.cols));
    }
  for (int64_t i = 0; i < t.rows; ++i) {
    float* hrow = p.h + (int64_t(t.row0) + i) * F + t.col0;
    for (int64_t j = 0; j < t.cols; ++j) {
      float g = gbuf[i * t.cols + j], u = ubuf[i * t.cols + j];
      if (p.bg) {
        g += p.bg[e * F + t.col0 + j];
        u += p.bu[e * F + t.col0 + j];
      }
      float hv;
      if (p.act == 0) {
        hv = g / (1.f + std::exp(-g)) * u;
      } else {
        g = min_bound(g, p.limit);
        u = max_bound(min_bound(u, p.limit), -p.limit);
        hv = (u + 1.f) * (g / (1.f + std::exp(-p.alpha * g)));
      }
      hrow[j] = p.round_h ? round_bf16(hv) : hv;
    }
  }
}

void run_down(const Problem& p, const Task& t) {
  thread_local fvec pack;
  const int64_t e = t.expert, d = p.d, F = p.F;
  float* y = p.ys + int64_t(t.row0) * d + t.col0;
  QRows qd;
  matmul(p.wd, e, t.col0, p.h + int64_t(t.row0) * F, F, t.rows, t.cols, y, d, pack,
         rows_for(p.wd, p.qh, t.row0, qd));
  if (p.bd)
    for (int64_t i = 0; i < t.rows; ++i)
      for (int64_t j = 0; j < t.cols; ++j) y[i * d + j] += p.bd[e * d + t.col0 + j];
  if (p.sgate)  // the shared expert's gate, as jaxmoe.experts.shared_gate: y * sigmoid(x . gate)
    for (int64_t i = 0; i < t.rows; ++i) {
      const float s = 1.f / (1.f + std::exp(-p.glogit[t.row0 + i]));
      for (int64_t j = 0; j < t.cols; ++j) y[i * d + j] = y[i * d + j] * s;
    }
}

// Tokens [t0, t1) of the combine (jaxmoe.impls.common.combine in its batch-invariant form,
// jaxmoe.invariance.slot_sum): y[t] = p_0 + p_1 + ... + p_{k-1}, added in slot order, with
// p_j = ys[inv[t k + j]] * w[t k + j] (no w: the row itself) for a valid pair and +0 for a
// dropped one (whose row is never read): a product and a sum each rounded (built with
// -ffp-contract=off), the same float32 operations as the jnp form. With cadd (the shared
// expert's output) the sum then adds its row: y[t] + ys_s[t], one more rounded add.
void combine_rows(const Problem& p, int64_t t0, int64_t t1) {
  const int64_t d = p.d, k = p.ck;
  for (int64_t t = t0; t < t1; ++t) {
    float* out = p.cy + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t q = t * k + j;
      const int64_t r = p.cinv[q];
      if (r >= p.owned) {  // a dropped pair adds +0 (a -0 sum becomes +0, as in jnp)
        for (int64_t i = 0; i < d; ++i) out[i] = j == 0 ? 0.f : out[i] + 0.f;
        continue;
      }
      const float* row = p.ys + r * d;
      if (p.cw) {
        const float w = p.cw[q];
        if (j == 0)
          for (int64_t i = 0; i < d; ++i) out[i] = row[i] * w;
        else
          for (int64_t i = 0; i < d; ++i) out[i] = out[i] + row[i] * w;
      } else if (j == 0) {
        std::memcpy(out, row, sizeof(float) * size_t(d));
      } else {
        for (int64_t i = 0; i < d; ++i) out[i] = out[i] + row[i];
      }
    }
    if (p.cadd)
      for (int64_t i = 0; i < d; ++i) out[i] = out[i] + p.cadd[t * d + i];
  }
}

// Experts with rows but fewer than kPackRows of them (they stream their weights).
int64_t streaming_experts(const Problem& p) {
  int64_t n = 0;
  for (int64_t e = 0; e < p.E; ++e) n += p.sizes[e] > 0 && p.sizes[e] < kPackRows;
  return n;
}

// Tasks over (expert, row chunk, column block) for experts with rows, in expert order.
// An expert with fewer than kPackRows rows streams its weights (float_matmul): its
// tasks span wider blocks of columns, whole rows when there are enough such experts in
// the call (`small`: every problem's, the shared expert's too) to keep `threads` busy
// (at least two tasks per thread), so each task reads its weights in address order; the
// block width never changes a result (each element is one chain over k).
std::vector<Task> make_tasks(const Problem& p, int64_t ncols, int64_t block, int64_t threads, int64_t small) {
  int64_t wide = block;
  if (small > 0) {
    const int64_t splits = std::max<int64_t>(1, (2 * threads + small - 1) / small);
    const int64_t w = ((ncols + splits - 1) / splits + kLanes - 1) / kLanes * kLanes;
    wide = std::max<int64_t>(block, w);
  }
  std::vector<Task> tasks;
  for (int64_t e = 0; e < p.E; ++e) {
    const int32_t n = p.sizes[e];
    const int64_t bw = n < kPackRows ? wide : block;
    for (int32_t r = 0; r < n; r += kRowChunk)
      for (int64_t c = 0; c < ncols; c += bw)
        tasks.push_back(Task{int32_t(e), p.offsets[e] + r, int32_t(std::min<int64_t>(kRowChunk, n - r)), int32_t(c),
                             int32_t(std::min<int64_t>(bw, ncols - c))});
  }
  return tasks;
}

// Runs fn(task) for every task on the intra-op pool plus the calling thread (parallel_for).
template <typename Fn>
void parallel_tasks(ffi::ThreadPool& pool, const std::vector<Task>& tasks, Fn fn) {
  parallel_for(pool, int64_t(tasks.size()), [&tasks, &fn](int64_t i) { fn(tasks[size_t(i)]); });
}

// ---------------------------------------------------------------------------------
// ggml's activation formats for h (ExecConfig(activations="ggml")): the values a row
// stands for once converted, float32 op for float32 op as jaxmoe.ggml_activations.ggml_round
// computes them in jnp (same bits). A block holding a NaN or an infinity becomes NaN.
// kHQ8_1 (Q4_1 / Q5_1 down weights, whose integer dots need ggml's block sums): h is not
// converted but quantized by kRuleQ8_1 for the integer dots alone (int_dot 2 only).
enum HFmt : int32_t { kHNone = 0, kHBf16 = 1, kHQ8_0 = 2, kHQ8_K = 3, kHQ8_1 = 4 };
constexpr int32_t kIntDotGgml = 2;  // the int_dot attribute of ggml activations

inline int64_t hfmt_block(int32_t f) { return f == kHQ8_0 || f == kHQ8_1 ? 32 : f == kHQ8_K ? 256 : 1; }

inline bool fill_non_finite(float* v, int64_t n) {  // NaN over a block with a NaN / inf
  bool fin = true;
  for (int64_t i = 0; i < n; ++i) fin &= std::fabs(v[i]) <= std::numeric_limits<float>::max();
  if (!fin)
    for (int64_t i = 0; i < n; ++i) v[i] = std::numeric_limits<float>::quiet_NaN();
  return !fin;
}

// q8_0 (quantize_q8_0): amax = max |v|, q = round_even(v * (127 / amax)) clipped to
// [-128, 127], value = f16(amax / 127) * q; an all-zero block stays zero.
inline void round_q8_0_block(float* v) {
  if (fill_non_finite(v, 32)) return;
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = max_bound(std::fabs(v[i]), amax);
  if (amax == 0.f) {
    for (int i = 0; i < 32; ++i) v[i] = 0.f;
    return;
  }
  const float inv = 127.f / amax, d = round_f16(amax / 127.f);
  for (int i = 0; i < 32; ++i) {
    const float q = min_bound(max_bound(std::nearbyint(v[i] * inv), -128.f), 127.f);
    v[i] = float(int32_t(q)) * d;  // through an integer: a code 0 is +0, as jnp's int8 codes
  }
}

// q8_K (quantize_q8_K): mx = the first element of largest |v|, iscale = -127 / mx,
// q = min(round_even(iscale * v), 127), value = (1 / iscale) * q.
inline void round_q8_K_block(float* v) {
  if (fill_non_finite(v, 256)) return;
  float amax = 0.f, mx = 0.f;
  for (int i = 0; i < 256; ++i)
    if (std::fabs(v[i]) > amax) {
      amax = std::fabs(v[i]);
      mx = v[i];
    }
  if (mx == 0.f) {
    for (int i = 0; i < 256; ++i) v[i] = 0.f;
    return;
  }
  const float iscale = -127.f / mx, d = 1.f / iscale;
  for (int i = 0; i < 256; ++i) {
    const float q = min_bound(std::nearbyint(iscale * v[i]), 127.f);
    v[i] = float(int32_t(q)) * d;
  }
}

// Converts rows [r0, r1) of a [*, K] matrix in place to format f (HFmt).
void ggml_round_rows(float* a, int64_t K, int64_t r0, int64_t r1, int32_t f) {
  for (int64_t r = r0; r < r1; ++r) {
    float* row = a + r * K;
    if (f == kHBf16)
      for (int64_t k = 0; k < K; ++k) row[k] = round_bf16(row[k]);
    else if (f == kHQ8_0)
      for (int64_t k = 0; k < K; k += 32) round_q8_0_block(row + k);
    else if (f == kHQ8_K)
      for (int64_t k = 0; k < K; k += 256) round_q8_K_block(row + k);
  }
}

// Quantizes the rows the experts own of a [P, K] matrix (stride K) into `out`, for
// int8 activations: tasks of up to 64 rows on the pool.
void quantize_owned_rows(ffi::ThreadPool& pool, const Problem& p, int64_t E, const float* a, int64_t K, int order,
                         const QRows& out, int rule) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int32_t r = 0; r < p.sizes[e]; r += 64)
      tasks.push_back(Task{int32_t(e), p.offsets[e] + r, std::min<int32_t>(64, p.sizes[e] - r), 0, 0});
  parallel_tasks(pool, tasks, [&](const Task& t) { quantize_rows(a, K, t.row0, t.row0 + t.rows, K, order, out, rule); });
}

// Checks one weight operand against its logical [E, in, out] shape; fills `w` (check_weight;
// a quantized kind's groups fill whole vectors of 32 codes).
ffi::Error bind_weight(const char* name, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer qbias, int32_t kind,
                       int32_t group, int64_t E, int64_t in, int64_t out, Weight& w) {
  return check_weight("jaxmoe_grouped_swiglu", 32, "a multiple of 32 dividing", name, data, scales, qbias, kind, group,
                      E, in, out, w);
}

// The weight formats and constants of one call's experts (the FFI attributes).
struct Attrs {
  int32_t act;
  float alpha, limit;
  int32_t round_h;
  int32_t kind[3], group[3];
  int32_t h_fmt;  // HFmt
};

// Binds one problem: rows xs [P, d] (expert e owns rows offsets[e] .. + sizes[e], E
// experts), its weights and biases, and its results ys [P, d], h [P, F], gu [P, 2F] | [0];
// `what` names the problem in errors ("" for the routed experts, "shared " for the
// shared expert).
ffi::Error bind_problem(const std::string& what, const float* xs, int64_t P, int64_t d, const int32_t* offsets,
                        const int32_t* sizes, int64_t E, ffi::AnyBuffer* w3, ffi::Buffer<ffi::F32>* b3,
                        ffi::ResultBuffer<ffi::F32>& ys, ffi::ResultBuffer<ffi::F32>& hbuf,
                        float* gu, const Attrs& at, Problem& p) {
  const std::string pre = "jaxmoe_grouped_swiglu: " + what;
  auto hd = hbuf->dimensions();
  if (hd.size() != 2 || hd[0] != P) return ffi::Error::InvalidArgument(pre + "the h result must be [P, F]");
  auto yd = ys->dimensions();
  if (yd.size() != 2 || yd[0] != P || yd[1] != d) return ffi::Error::InvalidArgument(pre + "the ys result must be [P, d]");
  const int64_t F = hd[1];
  p = Problem{};
  const char* names[3] = {"w_gate", "w_up", "w_down"};
  Weight* ws[3] = {&p.wg, &p.wu, &p.wd};
  const int64_t ins[3] = {d, d, F}, outs[3] = {F, F, d};
  for (int m = 0; m < 3; ++m)
    if (auto err = bind_weight((what + names[m]).c_str(), w3[3 * m], w3[3 * m + 1], w3[3 * m + 2], at.kind[m],
                               at.group[m], E, ins[m], outs[m], *ws[m]);
        err.failure())
      return err;
  const bool has_bias = b3[0].element_count() != 0;
  if (has_bias && (b3[0].element_count() != size_t(E * F) || b3[1].element_count() != size_t(E * F) ||
                   b3[2].element_count() != size_t(E * d)))
    return ffi::Error::InvalidArgument(pre + "biases must be [E, F], [E, F], [E, d] or empty");
  int64_t covered = 0, end = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = offsets[e], n = sizes[e];
    if (n < 0 || o < 0 || o + n > P)
      return ffi::Error::InvalidArgument(pre + "expert " + std::to_string(e) + "'s rows [" + std::to_string(o) + ", " +
                                         std::to_string(o + n) + ") run outside xs [0, " + std::to_string(P) + ")");
    if (n > 0 && o < end)
      return ffi::Error::InvalidArgument(pre + "group ranges must be sorted by expert and disjoint; expert " +
                                         std::to_string(e) + " starts at row " + std::to_string(o) +
                                         " before the previous range ends at " + std::to_string(end));
    if (n > 0) end = o + n;
    covered += n;
  }
  p.xs = xs;
  p.offsets = offsets;
  p.sizes = sizes;
  p.bg = has_bias ? b3[0].typed_data() : nullptr;
  p.bu = has_bias ? b3[1].typed_data() : nullptr;
  p.bd = has_bias ? b3[2].typed_data() : nullptr;
  p.ys = ys->typed_data();
  p.h = hbuf->typed_data();
  p.gu = gu;
  p.E = E;
  p.rows = P;
  p.owned = covered;
  set_expert_attrs(p, d, F, at.act, at.alpha, at.limit, at.round_h);
  if (at.h_fmt < kHNone || at.h_fmt > kHQ8_1)
    return ffi::Error::InvalidArgument(pre + "h_fmt must be 0 (none), 1 (bf16), 2 (q8_0), 3 (q8_K) or 4 (q8_1), got " +
                                       std::to_string(at.h_fmt));
  if (at.h_fmt == kHQ8_1 && at.kind[2] != kQ4_1 && at.kind[2] != kQ5_1)
    return ffi::Error::InvalidArgument(pre + "h_fmt 4 (q8_1) is for w_down of kind Q4_1 / Q5_1 (" +
                                       std::to_string(kQ4_1) + ", " + std::to_string(kQ5_1) + "), got kind " +
                                       std::to_string(at.kind[2]));
  if (F % hfmt_block(at.h_fmt))
    return ffi::Error::InvalidArgument(pre + "h_fmt " + std::to_string(at.h_fmt) + " converts blocks of " +
                                       std::to_string(hfmt_block(at.h_fmt)) + "; F = " + std::to_string(F) +
                                       " is not a multiple");
  p.h_fmt = at.h_fmt;
  advise_huge_pages(p.ys, sizeof(float) * size_t(P) * d);
  advise_huge_pages(p.h, sizeof(float) * size_t(P) * F);
  advise_huge_pages(p.gu, sizeof(float) * size_t(P) * 2 * F);
  if (covered < P) std::memset(p.ys, 0, sizeof(float) * size_t(P) * d);  // rows no expert owns
  return ffi::Error::Success();
}

// Runs the problems of one call (the routed experts, and the shared expert when the call
// has it) together: phase 1 takes every problem's gate/up tasks on the pool, phase 2
// every problem's down tasks, so a layer's experts share two rounds of the pool instead
// of two per problem. The column blocks count every problem's streaming experts
// (make_tasks); a block's width never changes a result: the same bits as separate calls.
void run_problems(ffi::ThreadPool& pool, Problem* const* parts, int n, int64_t up_block, int64_t down_block,
                  int32_t int_dot) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  std::vector<Task> up_tasks, down_tasks;
  int64_t small = 0;
  for (int i = 0; i < n; ++i) small += streaming_experts(*parts[i]);
  for (int i = 0; i < n; ++i) {
    const Problem& p = *parts[i];
    for (Task t : make_tasks(p, p.F, up_block, threads, small)) {
      t.part = i;
      up_tasks.push_back(t);
    }
    for (Task t : make_tasks(p, p.d, down_block, threads, small)) {
      t.part = i;
      down_tasks.push_back(t);
    }
  }
  thread_local QRowsBuf qx_buf[2][kSlots], qh_buf[2][kSlots];
  const bool ggml = int_dot == kIntDotGgml;
  // the rule a weight's rows are quantized by: ggml's format of its kind (Q8_0: int8 / int4 /
  // Q4_0 / Q5_0 / IQ4_NL / MXFP4, Q8_K: the K-quants, IQ4_XS and the IQ1-3 / TQ kinds, both
  // from the unconverted rows or from rows converted to that format, which give the same
  // codes; Q8_1: Q4_1 / Q5_1, from the unconverted rows only), else the int8 mode's
  auto rule = [ggml](int kind) {
    return !ggml                                                                     ? kRuleInt8
           : kind == kQ4_1 || kind == kQ5_1                                          ? kRuleQ8_1
           : kind == kInt8 || kind == kInt4 || is_table32(kind) || kind == kQ5_0 ? kRuleQ8_0
                                                                                     : kRuleQ8_K;
  };
  auto order = [&rule](int kind) { return act_order(kind, rule(kind)); };  // the order its rows are quantized in
  if (int_dot)  // each integer-capable weight reads its input quantized in its kind's order
    for (int i = 0; i < n; ++i) {
      Problem& p = *parts[i];
      for (Weight* w : {&p.wg, &p.wu, &p.wd})  // ggml: the kinds whose ggml format is Q8_0 or Q8_K; the int8
        // mode: int8, int4, Q4_K and Q6_K (the others multiply float activations there)
        w->int_dot = order(w->kind) >= 0 && (!ggml ? w->kind == kInt8 || w->kind == kInt4 || w->kind == kQ4_K ||
                                                             w->kind == kQ6_K
                                                       : w->kind == kInt8 || w->kind == kInt4 || is_table32(w->kind) ||
                                                             is_k8tile_kind(w->kind) || is_b32m(w->kind));
      if (ggml && !(p.wg.int_dot && p.wu.int_dot) && rule(p.wg.kind) == kRuleQ8_K)  // (ggml_x_unconverted)
        p.wg.int_dot = p.wu.int_dot = false;  // xs holds converted rows: the float path for both
      // (Q8_1 kinds have no float path in the mode: gate and up both Q4_1 / Q5_1, by the caller)
      for (Weight* w : {&p.wg, &p.wu, &p.wd})  // rows are shared by the weights of one order and rule
        w->qslot = int8_t(act_slot(order(w->kind), rule(w->kind)));
      for (const Weight* w : {&p.wg, &p.wu}) {
        const int s = w->qslot;
        if (w->int_dot && !p.qx[s].q)
          quantize_owned_rows(pool, p, p.E, p.xs, p.d, order(w->kind), p.qx[s] = qx_buf[i][s].view(p.rows, p.d),
                              rule(w->kind));
      }
    }
  parallel_tasks(pool, up_tasks, [parts](const Task& t) { run_gate_up(*parts[t.part], t); });
  // Q8_K and Q8_1 integer dots read h unconverted: quantized before the pass below
  auto raw_h = [&rule](const Problem& p) {
    return p.wd.int_dot && (rule(p.wd.kind) == kRuleQ8_K || rule(p.wd.kind) == kRuleQ8_1);
  };
  for (int i = 0; i < n; ++i) {
    Problem& p = *parts[i];
    if (raw_h(p)) {
      const int s = p.wd.qslot;
      quantize_owned_rows(pool, p, p.E, p.h, p.F, order(p.wd.kind), p.qh[s] = qh_buf[i][s].view(p.rows, p.F),
                          rule(p.wd.kind));
    }
  }
  std::vector<Task> h_tasks;  // ggml activations: h converted to the down weight's format, 64 rows a task
  for (int i = 0; i < n; ++i) {
    const Problem& p = *parts[i];
    if (p.h_fmt != kHNone && !raw_h(p))
      for (int64_t e = 0; e < p.E; ++e)
        for (int32_t r = 0; r < p.sizes[e]; r += 64)
          h_tasks.push_back(Task{int32_t(e), p.offsets[e] + r, std::min<int32_t>(64, p.sizes[e] - r), 0, 0, i});
  }
  if (!h_tasks.empty())
    parallel_tasks(pool, h_tasks, [parts](const Task& t) {
      const Problem& p = *parts[t.part];
      ggml_round_rows(p.h, p.F, t.row0, t.row0 + t.rows, p.h_fmt);
    });
  for (int i = 0; i < n; ++i) {
    Problem& p = *parts[i];
    if (p.wd.int_dot && !raw_h(p)) {
      const int s = p.wd.qslot;
      quantize_owned_rows(pool, p, p.E, p.h, p.F, order(p.wd.kind), p.qh[s] = qh_buf[i][s].view(p.rows, p.F),
                          rule(p.wd.kind));
    }
  }
  parallel_tasks(pool, down_tasks, [parts](const Task& t) { run_down(*parts[t.part], t); });
  std::vector<Task> c_tasks;  // the combine: tasks of 16 tokens; a small one on this thread alone
  int64_t c_work = 0;
  for (int i = 0; i < n; ++i) {
    const Problem& p = *parts[i];
    if (!p.cinv) continue;
    for (int64_t t = 0; t < p.ctokens; t += 16)
      c_tasks.push_back(Task{0, int32_t(t), int32_t(std::min<int64_t>(16, p.ctokens - t)), 0, 0, i});
    c_work += p.ctokens * p.ck * p.d;
  }
  auto combine_task = [parts](const Task& t) { combine_rows(*parts[t.part], t.row0, t.row0 + t.rows); };
  if (c_work < (int64_t(1) << 17))
    for (const Task& t : c_tasks) combine_task(t);
  else
    parallel_tasks(pool, c_tasks, combine_task);
}

// The combine's operands (inv [T k] s32 and w [T k] f32 | [0], the result y [T, d]), checked,
// then bound into `p`: an empty inv (and y) is no combine.
ffi::Error bind_combine(ffi::Buffer<ffi::S32>& cinv, ffi::Buffer<ffi::F32>& cw, ffi::ResultBuffer<ffi::F32>& cy,
                        Problem& p) {
  const std::string pre = "jaxmoe_grouped_swiglu: the combine's ";
  const int64_t P = p.rows;
  if (cinv.element_count() == 0) {
    if (cy->element_count() != 0 || cw.element_count() != 0)
      return ffi::Error::InvalidArgument(pre + "y and w must be empty without inv");
    return ffi::Error::Success();
  }
  auto yd = cy->dimensions();
  if (yd.size() != 2 || yd[1] != p.d || yd[0] < 1 || P % yd[0] != 0)
    return ffi::Error::InvalidArgument(pre + "y must be [T, d] with T dividing the " + std::to_string(P) +
                                       " rows of xs and d = " + std::to_string(p.d));
  if (cinv.element_count() != size_t(P))
    return ffi::Error::InvalidArgument(pre + "inv must hold one sorted row per pair: " + std::to_string(P) +
                                       " entries, got " + std::to_string(cinv.element_count()));
  if (cw.element_count() != 0 && cw.element_count() != size_t(P))
    return ffi::Error::InvalidArgument(pre + "w must be [T k] = [" + std::to_string(P) + "] or empty, got " +
                                       std::to_string(cw.element_count()) + " entries");
  const int32_t* inv = cinv.typed_data();
  for (int64_t q = 0; q < P; ++q)
    if (inv[q] < 0 || inv[q] >= P)
      return ffi::Error::InvalidArgument(pre + "inv[" + std::to_string(q) + "] = " + std::to_string(inv[q]) +
                                         " is outside the sorted rows [0, " + std::to_string(P) + ")");
  p.cinv = inv;
  p.cw = cw.element_count() ? cw.typed_data() : nullptr;
  p.cy = cy->typed_data();
  p.ctokens = yd[0];
  p.ck = P / yd[0];
  return ffi::Error::Success();
}

// The routed experts' arguments: checked, then bound into `p`.
ffi::Error bind_routed(ffi::Buffer<ffi::F32>& xs, ffi::Buffer<ffi::S32>& offsets, ffi::Buffer<ffi::S32>& sizes,
                       ffi::AnyBuffer* w3, ffi::Buffer<ffi::F32>* b3, ffi::ResultBuffer<ffi::F32>& ys,
                       ffi::ResultBuffer<ffi::F32>& hbuf, ffi::ResultBuffer<ffi::F32>& gubuf,
                       const Attrs& at, int32_t up_block, int32_t down_block, Problem& p) {
  auto xd = xs.dimensions();
  auto ud = offsets.dimensions();
  if (xd.size() != 2 || ud.size() != 1)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: xs must be [P, d] and offsets [E]");
  const int64_t P = xd[0], d = xd[1], E = ud[0];
  if (sizes.element_count() != size_t(E))
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: offsets and sizes must both be [E]");
  if (up_block < 1 || down_block < 1)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: up_block and down_block must be positive");
  if (auto err = bind_problem("", xs.typed_data(), P, d, offsets.typed_data(), sizes.typed_data(), E, w3, b3, ys, hbuf,
                              gubuf->element_count() ? gubuf->typed_data() : nullptr, at, p);
      err.failure())
    return err;
  if (gubuf->element_count() != 0 && gubuf->element_count() != size_t(P * 2 * p.F))
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: the gu result must be [P, 2F] or empty");
  return ffi::Error::Success();
}

ffi::Error GroupedSwigluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> offsets,
                             ffi::Buffer<ffi::S32> sizes, ffi::AnyBuffer wg, ffi::AnyBuffer sg, ffi::AnyBuffer qg,
                             ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer qu, ffi::AnyBuffer wd,
                             ffi::AnyBuffer sd, ffi::AnyBuffer qd, ffi::Buffer<ffi::F32> bg, ffi::Buffer<ffi::F32> bu,
                             ffi::Buffer<ffi::F32> bd, ffi::Buffer<ffi::S32> cinv, ffi::Buffer<ffi::F32> cw,
                             ffi::ResultBuffer<ffi::F32> ys, ffi::ResultBuffer<ffi::F32> hbuf,
                             ffi::ResultBuffer<ffi::F32> gubuf, ffi::ResultBuffer<ffi::F32> cy,
                             int32_t act, float alpha, float limit, int32_t round_h, int32_t kind_gate,
                             int32_t kind_up, int32_t kind_down, int32_t group_gate, int32_t group_up,
                             int32_t group_down, int32_t up_block, int32_t down_block, int32_t int_dot,
                             int32_t h_fmt) {
  const Attrs at{act,   alpha, limit, round_h, {kind_gate, kind_up, kind_down}, {group_gate, group_up, group_down},
                 h_fmt};
  ffi::AnyBuffer w3[9] = {wg, sg, qg, wu, su, qu, wd, sd, qd};
  ffi::Buffer<ffi::F32> b3[3] = {bg, bu, bd};
  Problem p;
  if (auto err = bind_routed(xs, offsets, sizes, w3, b3, ys, hbuf, gubuf, at, up_block, down_block, p); err.failure())
    return err;
  if (auto err = bind_combine(cinv, cw, cy, p); err.failure()) return err;
  Problem* parts[1] = {&p};
  if (int_dot < 0 || int_dot > kIntDotGgml)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: int_dot must be 0, 1 (int8) or 2 (ggml), got " +
                                       std::to_string(int_dot));
  if (h_fmt == kHQ8_1 && int_dot != kIntDotGgml)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: h_fmt 4 (q8_1) needs int_dot 2 (ggml)");
  run_problems(pool, parts, 1, up_block, down_block, int_dot);
  return ffi::Error::Success();
}

// The routed experts (the arguments of GroupedSwigluImpl) and the shared expert in one
// call: x [T, d] (every token's row, which the shared expert owns), its weights (the
// same kinds of operands, with a leading expert axis of 1), its biases ([0] or
// [1, F_s], [1, F_s], [1, d]), gate [d] | [0] and the gate's rows gx [T, d] | [0] (empty: x;
// the ggml mode passes the unconverted rows); results ys_s [T, d] (gated: ys_s[t] =
// sigmoid(gx[t] . gate) * down(...)) and h_s [T, F_s] (scratch). With the combine, the
// combined y [T, d] includes ys_s (y[t] = slot sum + ys_s[t]).
ffi::Error GroupedSwigluSharedImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> sizes,
    ffi::AnyBuffer wg, ffi::AnyBuffer sg, ffi::AnyBuffer qg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer qu,
    ffi::AnyBuffer wd, ffi::AnyBuffer sd, ffi::AnyBuffer qd, ffi::Buffer<ffi::F32> bg, ffi::Buffer<ffi::F32> bu,
    ffi::Buffer<ffi::F32> bd, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer swg, ffi::AnyBuffer ssg, ffi::AnyBuffer sqg,
    ffi::AnyBuffer swu, ffi::AnyBuffer ssu, ffi::AnyBuffer squ, ffi::AnyBuffer swd, ffi::AnyBuffer ssd,
    ffi::AnyBuffer sqd, ffi::Buffer<ffi::F32> sbg, ffi::Buffer<ffi::F32> sbu, ffi::Buffer<ffi::F32> sbd,
    ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> gx, ffi::Buffer<ffi::S32> cinv, ffi::Buffer<ffi::F32> cw,
    ffi::ResultBuffer<ffi::F32> ys,
    ffi::ResultBuffer<ffi::F32> hbuf, ffi::ResultBuffer<ffi::F32> gubuf, ffi::ResultBuffer<ffi::F32> sys,
    ffi::ResultBuffer<ffi::F32> shbuf, ffi::ResultBuffer<ffi::F32> cy, int32_t act, float alpha, float limit, int32_t round_h, int32_t kind_gate, int32_t kind_up, int32_t kind_down,
    int32_t group_gate, int32_t group_up, int32_t group_down, int32_t skind_gate, int32_t skind_up,
    int32_t skind_down, int32_t sgroup_gate, int32_t sgroup_up, int32_t sgroup_down, int32_t up_block,
    int32_t down_block, int32_t int_dot, int32_t h_fmt, int32_t sh_fmt) {
  const Attrs at{act,   alpha, limit, round_h, {kind_gate, kind_up, kind_down}, {group_gate, group_up, group_down},
                 h_fmt};
  const Attrs sat{act,   alpha, limit, round_h, {skind_gate, skind_up, skind_down}, {sgroup_gate, sgroup_up, sgroup_down},
                  sh_fmt};
  ffi::AnyBuffer w3[9] = {wg, sg, qg, wu, su, qu, wd, sd, qd};
  ffi::Buffer<ffi::F32> b3[3] = {bg, bu, bd};
  ffi::AnyBuffer sw3[9] = {swg, ssg, sqg, swu, ssu, squ, swd, ssd, sqd};
  ffi::Buffer<ffi::F32> sb3[3] = {sbg, sbu, sbd};
  Problem p, s;
  if (auto err = bind_routed(xs, offsets, sizes, w3, b3, ys, hbuf, gubuf, at, up_block, down_block, p); err.failure())
    return err;
  if (auto err = bind_combine(cinv, cw, cy, p); err.failure()) return err;
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != p.d)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: the shared expert's x must be [T, d] with d = " +
                                       std::to_string(p.d));
  const int64_t T = xd[0];
  if (T > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: the shared expert's x has too many rows");
  const int32_t start = 0, count = int32_t(T);
  if (auto err = bind_problem("shared ", x.typed_data(), T, p.d, &start, &count, 1, sw3, sb3, sys, shbuf, nullptr, sat,
                              s);
      err.failure())
    return err;
  std::vector<float> logits;
  if (gate.element_count() != 0) {
    if (gate.element_count() != size_t(p.d))
      return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: the shared gate must be [d] or empty, d = " +
                                         std::to_string(p.d));
    logits.resize(size_t(T));
    s.sgate = gate.typed_data();
    s.glogit = logits.data();
  }
  if (gx.element_count() != 0) {
    if (gx.element_count() != size_t(T * p.d) || !s.sgate)
      return ffi::Error::InvalidArgument(
          "jaxmoe_grouped_swiglu: the shared gate's rows gx must be [T, d] = [" + std::to_string(T) + ", " +
          std::to_string(p.d) + "] with a gate, or empty; got " + std::to_string(gx.element_count()) + " entries");
    s.gx = gx.typed_data();
  }
  if (p.cinv) {  // the combined y includes the shared expert's rows
    if (p.ctokens != T)
      return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: the combine's y has " + std::to_string(p.ctokens) +
                                         " tokens but the shared expert's x has " + std::to_string(T));
    p.cadd = s.ys;
  }
  Problem* parts[2] = {&p, &s};
  if (int_dot < 0 || int_dot > kIntDotGgml)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: int_dot must be 0, 1 (int8) or 2 (ggml), got " +
                                       std::to_string(int_dot));
  if ((h_fmt == kHQ8_1 || sh_fmt == kHQ8_1) && int_dot != kIntDotGgml)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: h_fmt / sh_fmt 4 (q8_1) need int_dot 2 (ggml)");
  run_problems(pool, parts, T > 0 ? 2 : 1, up_block, down_block, int_dot);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeGroupedSwiglu, GroupedSwigluImpl,
                              bind_expert_attrs(bind_experts(ffi::Ffi::Bind()
                                                                 .Ctx<ffi::ThreadPool>()
                                                                 .Arg<ffi::Buffer<ffi::F32>>())  // xs
                                                    .Arg<ffi::Buffer<ffi::S32>>()  // the combine's inv [T k] | [0]
                                                    .Arg<ffi::Buffer<ffi::F32>>()  // its w [T k] | [0]
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // ys
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // h (scratch)
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // gu (residual, or empty)
                                                    .Ret<ffi::Buffer<ffi::F32>>())  // y [T, d] (combined) | [0]
                                  .Attr<int32_t>("up_block")
                                  .Attr<int32_t>("down_block")
                                  .Attr<int32_t>("int_dot")
                                  .Attr<int32_t>("h_fmt"));

// The routed experts' operands, then the shared expert's: its rows x, weights, biases and
// gate vector; the shared expert's results after the routed ones' (ys, h: gated, scratch).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeGroupedSwigluShared, GroupedSwigluSharedImpl,
                              bind_expert_attrs(bind_weights(bind_experts(ffi::Ffi::Bind()
                                                                              .Ctx<ffi::ThreadPool>()
                                                                              .Arg<ffi::Buffer<ffi::F32>>())  // xs
                                                                 .Arg<ffi::Buffer<ffi::F32>>())  // x (shared rows)
                                                    .Arg<ffi::Buffer<ffi::F32>>()  // shared gate [d] | [0]
                                                    .Arg<ffi::Buffer<ffi::F32>>()  // the gate's rows gx [T, d] | [0]
                                                    .Arg<ffi::Buffer<ffi::S32>>()  // the combine's inv [T k] | [0]
                                                    .Arg<ffi::Buffer<ffi::F32>>()  // its w [T k] | [0]
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // ys
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // h (scratch)
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // gu (residual, or empty)
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // ys of the shared expert
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // h of the shared expert
                                                    .Ret<ffi::Buffer<ffi::F32>>())  // y [T, d] (combined) | [0]
                                  .Attr<int32_t>("skind_gate")
                                  .Attr<int32_t>("skind_up")
                                  .Attr<int32_t>("skind_down")
                                  .Attr<int32_t>("sgroup_gate")
                                  .Attr<int32_t>("sgroup_up")
                                  .Attr<int32_t>("sgroup_down")
                                  .Attr<int32_t>("up_block")
                                  .Attr<int32_t>("down_block")
                                  .Attr<int32_t>("int_dot")
                                  .Attr<int32_t>("h_fmt")
                                  .Attr<int32_t>("sh_fmt"));
