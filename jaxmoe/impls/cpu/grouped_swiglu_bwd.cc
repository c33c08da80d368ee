// Backward pass of the grouped SwiGLU experts for XLA:CPU (impl="cpu"), an XLA FFI
// custom call beside grouped_swiglu.cc (its forward). Built as its own library, so a
// failure here leaves the forward working (jaxmoe/impls/cpu/backward.py falls back).
//
// Inputs (sorted pair order, jaxmoe/dispatch.py):
//   xs      [P, d]  f32   the rows each expert saw in the forward (weighted if weight_on_input)
//   gs      [P, d]  f32   upstream gradient of each row's token (not scaled)
//   scale   [P] | [0] f32 each row's routing weight (the forward multiplied its output by it); [0]: 1
//   offsets [E], sizes [E]  s32  expert e owns rows [offsets[e], offsets[e] + sizes[e]) (sorted, disjoint)
//   w_gate, w_up, w_down: data, scales, qbias each, in the forward's formats
//     (kind 0 float32 / bfloat16 [E, in, out]; kind 1 int8 [E, out, in]; kind 2 int4 [E, out, in/2];
//     kinds 3..8 the GGUF blocks Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K [E, out, in/B * BB], frozen)
//   b_gate [E, F] | [0], b_up [E, F] | [0], b_down [E, d] | [0]   f32
//   gu      [P, 2F] | [0] f32  the forward's gate | up products of each row before the biases
//                  (its `gu` result); [0]: recompute them here
// Results:
//   dxs   [P, d] f32   gradient w.r.t. xs (rows no expert owns: zero)
//   dot   [P]    f32   <gs_r, y_r>, y_r the row's expert output (the routing-weight gradient)
//   dw_gate, dw_up [E, d, F], dw_down [E, F, d]: float32 or bfloat16 (the weights' dtype), or [0]
//                       when that weight is frozen (quantized); experts with no rows get zeros
//   db_gate, db_up [E, F], db_down [E, d] f32, or [0] without biases
//   dgu   [P, 2F]  f32 scratch: dL/dgate | dL/dup of every row
//   parts [nb, P]  f32 scratch: per-F-block partial sums of dot (nb = ceil(F / up_block))
//
// Work, on XLA's intra-op thread pool, two phases:
//   A. tasks (expert, block of up_block columns of F) over all the expert's rows:
//      gate/up of the block (X W_g[:, blk], X W_u[:, blk]: read from gu when the forward
//      saved them, else recomputed), dh0 = gs W_d[blk, :]^T,
//      the activation and its derivative (dgate, dup into dgu), the partial dot
//      sum_j h_j dh0_j, and the weight gradients of the block: dW_g[:, blk] = X^T dgate,
//      dW_u[:, blk] = X^T dup, dW_d[blk, :] = (s h)^T gs, db_gate / db_up of the block.
//      Experts with no rows: tasks that zero their weight-gradient slices.
//   B. tasks (expert, row chunk, block of down_block columns of d):
//      dxs[:, blk] = [dgate | dup] [W_g[blk, :] | W_u[blk, :]]^T, db_down of the block, and
//      (block 0) dot = sum of the partials in block order + <gs, b_down>.
// Every output element is one sequential float32 accumulation in a fixed order
// (deterministic whatever the thread count). Weights: float32 ones are read in place
// (X W_g[:, blk] with row stride F); products with a transposed float weight (gs W_d^T,
// dgu [W_g | W_u]^T) read its rows in place up to kInPlaceRows rows of the expert
// (matmul_nt), and quantized gate / up are decoded in their stored [out, in] order for
// matmul_nt there too; otherwise the block is packed (dequantized) once into a float32
// buffer for the tiled matmul. An expert with up to kWholeRows rows is one task (phase A
// then phase B). Weight gradients go out with non-temporal stores. Phase A reads W_d (and
// W_g, W_u when it recomputes gate/up), phase B reads W_g, W_u. With the forward's gu the
// backward does six matmul-sized products (dh0, the three weight gradients, dxs against
// W_g and W_u), eight when it recomputes gate/up (dgu is this call's own scratch).
#include "kernel_prelude.h"  // system and FFI headers, namespace ffi

namespace {

#include "kernel_common.h"  // vectors, conversions, weight kinds, GGUF block decoding

// ---------------------------------------------------------------------------------
// C[m, n] = A[m, K] @ B[K, n], A read at a[i * sa + k * sk] (so A may be a transpose),
// B a packed float32 [K, n] buffer (row stride ldb). Register tiles of MR rows x NV vectors.
template <int MR, int NV>
inline void tile(const float* a, int64_t sa, int64_t sk, const float* b, int64_t ldb, int64_t K, float* c,
                 int64_t ldc) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    tile_step(acc, a + k * sk, sa, bk);
  }
  store_tile(acc, c, ldc);
}

template <int MR>
constexpr int kMaxNV = kLanes == 16 ? (MR <= 2 ? 8 : 4) : (MR == 1 ? 8 : MR == 2 ? 6 : MR <= 4 ? 3 : 2);

template <int MR>
void row_tile(const float* a, int64_t sa, int64_t sk, const float* b, int64_t ldb, int64_t K, int64_t vec_cols,
              float* c, int64_t ldc) {
  constexpr int NV = kMaxNV<MR>;
  int64_t j0 = 0;
  for (; j0 + NV * kLanes <= vec_cols; j0 += NV * kLanes) tile<MR, NV>(a, sa, sk, b + j0, ldb, K, c + j0, ldc);
  for (; j0 < vec_cols; j0 += kLanes) tile<MR, 1>(a, sa, sk, b + j0, ldb, K, c + j0, ldc);
}

void matmul(const float* a, int64_t sa, int64_t sk, const float* b, int64_t ldb, int64_t K, int64_t m, int64_t n,
            float* c, int64_t ldc) {
  const int64_t vec_cols = (n / kLanes) * kLanes;
  for_row_tiles<6>(m, [&](auto rows, int64_t i0) {
    constexpr int R = decltype(rows)::value;
    const float* ai = a + i0 * sa;
    float* ci = c + i0 * ldc;
    row_tile<R>(ai, sa, sk, b, ldb, K, vec_cols, ci, ldc);
    for (int64_t i = 0; i < R; ++i)  // tail columns: the same sequential chain per element
      for (int64_t j = vec_cols; j < n; ++j) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s = fmadd(ai[i * sa + k * sk], b[k * ldb + j], s);
        ci[i * ldc + j] = s;
      }
  });
}

// C[m, n] = A[m, K] @ W[n, K]^T (and the second pair a2, w2) on nt_tile (kernel_common.h):
// MR-row x 4-column tiles, edges one element at a time with the same sums.
template <typename T>
void matmul_nt(const float* a, int64_t lda, const T* w, int64_t ldw, int64_t K, const float* a2, const T* w2,
               int64_t K2, int64_t m, int64_t n, float* c, int64_t ldc) {
  constexpr int MR = kLanes == 16 ? 4 : 2, NR = 4;
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    const bool full_m = i0 + MR <= m;
    for (int64_t j0 = 0; j0 < n; j0 += NR) {
      const T* wj = w + j0 * ldw;
      const T* w2j = w2 ? w2 + j0 * ldw : nullptr;
      float* cij = c + i0 * ldc + j0;
      if (full_m && j0 + NR <= n) {
        nt_tile<T, MR, NR>(a + i0 * lda, lda, wj, ldw, K, a2 ? a2 + i0 * lda : nullptr, w2j, K2, cij, ldc);
        continue;
      }
      for (int64_t i = i0; i < std::min(m, i0 + MR); ++i)  // edges: one element at a time, same sums
        for (int64_t j = j0; j < std::min(n, j0 + NR); ++j)
          nt_tile<T, 1, 1>(a + i * lda, lda, w + j * ldw, ldw, K, a2 ? a2 + i * lda : nullptr,
                           w2 ? w2 + j * ldw : nullptr, K2, c + i * ldc + j, ldc);
    }
  }
}

// Row r0 of expert e of a float weight [E, in, out] stored as T (float or uint16_t bfloat16).
template <typename T>
const T* float_rows(const Weight& w, int64_t e, int64_t r0) {
  return static_cast<const T*>(w.data) + (e * w.in + r0) * w.out;
}

// fn(float_rows<T>(w, e, r0)) with T the weight's stored type.
template <typename Fn>
void with_float_rows(const Weight& w, int64_t e, int64_t r0, Fn fn) {
  if (w.bf16)
    fn(float_rows<uint16_t>(w, e, r0));
  else
    fn(float_rows<float>(w, e, r0));
}

// ---------------------------------------------------------------------------------
// One expert weight operand in its stored format (logical W [E, in, out]).
// `pack` for a GGUF block kind: each stored column's blocks that overlap [in0, in0 + nin)
// decoded whole (decode_block, bit-exact with the forward and gguf.quants.dequantize),
// the overlap copied out (the Python side aligns the tasks' slices to whole blocks). The
// [nin, nout] layout goes through a column-major staging buffer and a tiled transpose
// (scattering each decoded column with stride nout cost most of the backward).
template <int Q>
void pack_gguf(const Weight& w, int64_t e, int64_t in0, int64_t nin, int64_t out0, int64_t nout, bool transposed,
               float* dst) {
  constexpr int64_t B = block_elems(Q), BB = block_bytes(Q);
  const int64_t K = w.in, N = w.out, row_bytes = K / B * BB;
  thread_local fvec stage;
  float* cols = dst;  // [nout, nin]: dst itself when transposed
  if (!transposed) {
    stage.resize(size_t(nout) * nin);
    cols = stage.data();
  }
  alignas(64) float blk[B];
  for (int64_t oo = 0; oo < nout; ++oo) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + (e * N + out0 + oo) * row_bytes;
    float* col = cols + oo * nin;
    for (int64_t b0 = in0 / B * B; b0 < in0 + nin; b0 += B) {
      const int64_t lo = std::max(b0, in0), hi = std::min(b0 + B, in0 + nin);
      if (lo == b0 && hi == b0 + B) {
        decode_block<Q>(row + b0 / B * BB, col + (b0 - in0));
      } else {
        decode_block<Q>(row + b0 / B * BB, blk);
        std::memcpy(col + (lo - in0), blk + (lo - b0), sizeof(float) * size_t(hi - lo));
      }
    }
  }
  if (transposed) return;
  constexpr int64_t T = 16;  // tiles of T x T floats stay in L1 on both sides
  for (int64_t i0 = 0; i0 < nin; i0 += T)
    for (int64_t o0 = 0; o0 < nout; o0 += T) {
      const int64_t ie = std::min(i0 + T, nin), oe = std::min(o0 + T, nout);
      for (int64_t i = i0; i < ie; ++i)
        for (int64_t oo = o0; oo < oe; ++oo) dst[i * nout + oo] = cols[oo * nin + i];
    }
}

// 32 int8 codes q[0, 32) times the scale sc into o[0, 32).
inline void scale_int8_32(const int8_t* __restrict q, float sc, float* __restrict o) {
#if JM_LANES == 16 && defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(sc);
  for (int h = 0; h < 2; ++h)
    _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h))))));
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(sc);
  for (int h = 0; h < 4; ++h)
    _mm256_storeu_ps(o + 8 * h, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h))))));
#else
  for (int64_t l = 0; l < 32; ++l) o[l] = sc * float(q[l]);
#endif
}

// 32 int4 codes from 16 bytes p (byte j: element 2 j in its low nibble, 2 j + 1 in its high
// one) as s q + b into o[0, 32): one multiply, then one add.
inline void affine_int4_32(const uint8_t* __restrict p, float sc, float bs, float* __restrict o) {
#if JM_LANES == 16 && defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(sc), bv = _mm512_set1_ps(bs);
  const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 lo = _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15)))), bv);
  const __m512 hi = _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4))), bv);
  const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, i0, hi));
  _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, i1, hi));
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(sc), bv = _mm256_set1_ps(bs);
  for (int h = 0; h < 2; ++h) {  // bytes 8 h ..: elements 16 h ..
    const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    const __m256 lo = _mm256_add_ps(_mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(15)))), bv);
    const __m256 hi = _mm256_add_ps(_mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_srli_epi32(z, 4))), bv);
    const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);  // [0..3 | 8..11], [4..7 | 12..15]
    _mm256_storeu_ps(o + 16 * h, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(o + 16 * h + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
#else
  for (int64_t l = 0; l < 32; ++l) {
    const uint8_t byte = p[l / 2];
    const float v = sc * float((l & 1) ? (byte >> 4) : (byte & 15));
    o[l] = v + bs;
  }
#endif
}

// Elements [in0, in0 + B) of stored row `col` of an int8 / int4 weight (in0 and B multiples
// of 32), dequantized with pack's arithmetic (s q; s q + b: one multiply, then one add), 32
// at a time in vectors (pack's former per-element loop took ~93% of a T = 8 Q4_0 backward step).
void decode_int_slice(const Weight& w, int64_t col, int64_t in0, int64_t B, float* __restrict out) {
  const int64_t K = w.in, ng = K / w.group, row_bytes = w.kind == kInt4 ? K / 2 : K;
  const char* codes = static_cast<const char*>(w.data) + col * row_bytes;
  if (w.kind == kFP8) {  // fp8_kind.h: the block's scale (b a multiple of 32: one per 32 codes)
    for (int64_t i = in0; i < in0 + B; i += 32)
      scale_fp8_32(reinterpret_cast<const uint8_t*>(codes) + i, fp8_scale_at(w, col, i), out + (i - in0));
    return;
  }
  for (int64_t i = in0; i < in0 + B; i += 32) {
    const int64_t gi = col * ng + i / w.group;
    const float sc = load_scale(w.scales, w.stype, gi);
    if (w.kind == kInt8)
      scale_int8_32(reinterpret_cast<const int8_t*>(codes) + i, sc, out + (i - in0));
    else
      affine_int4_32(reinterpret_cast<const uint8_t*>(codes) + i / 2, sc, load_scale(w.qbias, w.stype, gi), out + (i - in0));
  }
}

// Rows per expert up to which the quantized input-gradient products take axpy_rows.
constexpr int64_t kAxpyRows = 16;
// Stored rows ahead of the one decoded that axpy_weight prefetches (4 -> 8: T = 8 frozen
// Q4_K_M step 1.1x faster; none -> 8 for int8: the Q8_0 step 1.5x faster, 4 Dec 2026).
constexpr int64_t kAxpyAhead = 8;

// Few rows, quantized weights: acc[m, B] += A[m, R] . rows, where row o < R is stored row o
// of expert e (W[:, o] in the logical [in, out] view: column o), elements [in0, in0 + B).
// Each stored row's slice is decoded once into an L1 buffer (`decode(o, buf)`: GGUF blocks
// by decode_block, int8 / int4 by decode_int_slice) and multiply-added into the m rows'
// accumulators, o ascending: per element the chain of `matmul` over the packed [R, B]
// buffer (fused multiply-adds in o order from zero), so the same bits, without a [R, B]
// buffer going through the caches (pack + matmul of that buffer took ~60% of a T = 8
// Q4_K_M backward step, perf). A second call with the next weight's rows (A's columns
// after the first's) continues the chains.
template <typename Decode>
void axpy_rows(int64_t B, int64_t R, const float* a, int64_t lda, int64_t m, float* acc, int64_t buf_elems,
               Decode decode) {
  const int64_t vec = B / kLanes * kLanes;
  thread_local fvec blk;
  blk.resize(size_t(buf_elems));
  for (int64_t o = 0; o < R; ++o) {
    decode(o, blk.data());
    for (int64_t r = 0; r < m; ++r) {
      const float ar = a[r * lda + o];
      const vf av = splat(ar);
      float* c = acc + r * B;
      int64_t j = 0;
      for (; j < vec; j += kLanes) store(c + j, fmadd(av, load(blk.data() + j), load(c + j)));
      for (; j < B; ++j) c[j] = fmadd(ar, blk[size_t(j)], c[j]);
    }
  }
}

void axpy_weight(const Weight& w, int64_t e, int64_t in0, int64_t B, int64_t R, const float* a, int64_t lda,
                 int64_t m, float* acc) {
  if (is_gguf(w.kind))
    return with_gguf_kind(w.kind, [&](auto Q) {
      constexpr int64_t BE = block_elems(Q.value), BB = block_bytes(Q.value);
      const int64_t row_bytes = w.in / BE * BB, nb = (B + BE - 1) / BE;
      const uint8_t* base = static_cast<const uint8_t*>(w.data) + e * w.out * row_bytes + in0 / BE * BB;
      axpy_rows(B, R, a, lda, m, acc, nb * BE, [&](int64_t o, float* buf) {
        const uint8_t* row = base + o * row_bytes;
        if (o + kAxpyAhead < R)  // a few rows ahead (rows are row_bytes apart)
          for (int64_t q = 0; q < nb * BB; q += 64) __builtin_prefetch(row + kAxpyAhead * row_bytes + q);
        for (int64_t b = 0; b < nb; ++b) decode_block<Q.value>(row + b * BB, buf + b * BE);
      });
    });
  const bool half = w.kind == kInt4;  // int8 / FP8: a byte per code
  const int64_t row_bytes = half ? w.in / 2 : w.in, nbytes = half ? B / 2 : B;
  const char* base = static_cast<const char*>(w.data) + e * w.out * row_bytes + (half ? in0 / 2 : in0);
  axpy_rows(B, R, a, lda, m, acc, B, [&](int64_t o, float* buf) {
    if (o + kAxpyAhead < R)  // the slice a few rows ahead (rows are row_bytes apart)
      for (int64_t q = 0; q < nbytes; q += 64) __builtin_prefetch(base + (o + kAxpyAhead) * row_bytes + q);
    decode_int_slice(w, e * w.out + o, in0, B, buf);
  });
}

// Whether axpy_matmul takes W[in0 : in0 + B, :] for m rows: GGUF blocks with in0 on a block
// boundary, int8 / int4 with in0 and B multiples of 32.
inline bool axpy_takes(const Weight& w, int64_t in0, int64_t B, int64_t m) {
  if (m > kAxpyRows) return false;
  if (is_gguf(w.kind)) return in0 % block_elems(w.kind) == 0;
  return (w.kind == kInt8 || w.kind == kInt4 || w.kind == kFP8) && in0 % 32 == 0 && B % 32 == 0;
}

// C[m, B] (row stride ldc) = A[m, R] . W[in0 : in0 + B, :]^T by axpy_rows (and, with w2,
// + A2 . W2[...]^T continuing the chains), through a zeroed [m, B] accumulator.
void axpy_matmul(const Weight& w, const Weight* w2, int64_t e, int64_t in0, int64_t B, int64_t R, const float* a,
                 const float* a2, int64_t lda, int64_t m, float* c, int64_t ldc) {
  thread_local fvec acc;
  acc.assign(size_t(m * B), 0.f);
  axpy_weight(w, e, in0, B, R, a, lda, m, acc.data());
  if (w2) axpy_weight(*w2, e, in0, B, R, a2, lda, m, acc.data());
  for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldc, acc.data() + r * B, sizeof(float) * size_t(B));
}

// dst[o * nin + i] = src[i * ld + o] for i < nin, o < nout: a [nin, nout] block of rows
// (row stride ld) transposed. 8 x 8 tiles through registers (AVX) or through L1 (portable):
// the element-by-element loop this replaces wrote every destination line 8-16 times, far
// apart, and was ~40% of a float32 T = 1024 backward step (`perf`).
#if defined(__AVX__)
inline void transpose8x8(const float* src, int64_t ld, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (h = 1)
    const __m256 lo0 = t[4 * h], hi0 = t[4 * h + 1], lo1 = t[4 * h + 2], hi1 = t[4 * h + 3];
    r[4 * h] = _mm256_shuffle_ps(lo0, lo1, _MM_SHUFFLE(1, 0, 1, 0));  // column 0 | 4 of 4 rows
    r[4 * h + 1] = _mm256_shuffle_ps(lo0, lo1, _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * h + 2] = _mm256_shuffle_ps(hi0, hi1, _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * h + 3] = _mm256_shuffle_ps(hi0, hi1, _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
  }
}
#else
inline void transpose8x8(const float* src, int64_t ld, float* dst, int64_t ldd) {
  for (int o = 0; o < 8; ++o)
    for (int i = 0; i < 8; ++i) dst[o * ldd + i] = src[i * ld + o];
}
#endif

void transpose_block(const float* src, int64_t ld, int64_t nin, int64_t nout, float* dst) {
  const int64_t i8 = nin / 8 * 8, o8 = nout / 8 * 8;
  for (int64_t i0 = 0; i0 < i8; i0 += 8) {
    for (int64_t o0 = 0; o0 < o8; o0 += 8) transpose8x8(src + i0 * ld + o0, ld, dst + o0 * nin + i0, nin);
    for (int64_t o = o8; o < nout; ++o)
      for (int64_t i = i0; i < i0 + 8; ++i) dst[o * nin + i] = src[i * ld + o];
  }
  for (int64_t i = i8; i < nin; ++i)
    for (int64_t o = 0; o < nout; ++o) dst[o * nin + i] = src[i * ld + o];
}

// dst = W_e[in0 : in0 + nin, out0 : out0 + nout] as float32, laid out [nin, nout]
// (transposed = false) or [nout, nin] (transposed = true); quantized codes dequantized
// as the forward does (w = s q, int4: w = s q + b).
void pack(const Weight& w, int64_t e, int64_t in0, int64_t nin, int64_t out0, int64_t nout, bool transposed,
          float* dst) {
  const int64_t K = w.in, N = w.out;
  if (w.kind == kFloat && !w.bf16 && transposed) {
    return transpose_block(static_cast<const float*>(w.data) + (e * K + in0) * N + out0, N, nin, nout, dst);
  }
  if (w.kind == kFloat) {
    for (int64_t ii = 0; ii < nin; ++ii) {
      const int64_t src = (e * K + in0 + ii) * N + out0;
      if (!transposed) {
        float* d = dst + ii * nout;
        if (w.bf16) {
          const uint16_t* s = static_cast<const uint16_t*>(w.data) + src;
          for (int64_t oo = 0; oo < nout; ++oo) d[oo] = bf16_to_float(s[oo]);
        } else {
          std::memcpy(d, static_cast<const float*>(w.data) + src, sizeof(float) * size_t(nout));
        }
      } else if (w.bf16) {
        const uint16_t* s = static_cast<const uint16_t*>(w.data) + src;
        for (int64_t oo = 0; oo < nout; ++oo) dst[oo * nin + ii] = bf16_to_float(s[oo]);
      } else {
        const float* s = static_cast<const float*>(w.data) + src;
        for (int64_t oo = 0; oo < nout; ++oo) dst[oo * nin + ii] = s[oo];
      }
    }
    return;
  }
  if (is_gguf(w.kind)) {
    return with_gguf_kind(w.kind, [&](auto Q) { pack_gguf<Q.value>(w, e, in0, nin, out0, nout, transposed, dst); });
  }
  // int8 / int4: each column's slice by decode_int_slice (in0 and nin are multiples of 32:
  // groups are, and the Python side's slices are whole INT_SLICE blocks or the full width)
  thread_local fvec col_buf;
  col_buf.resize(size_t(nin));
  for (int64_t oo = 0; oo < nout; ++oo) {
    float* out = transposed ? dst + oo * nin : col_buf.data();
    decode_int_slice(w, e * N + out0 + oo, in0, nin, out);
    if (!transposed)
      for (int64_t ii = 0; ii < nin; ++ii) dst[ii * nout + oo] = col_buf[size_t(ii)];
  }
}

// A weight-gradient result: float32 or bfloat16 [E, in, out], or absent.
struct Grad {
  void* data = nullptr;
  bool bf16 = false;
};

// Non-temporal stores for the weight-gradient results: written once and never read back
// here, into pages the kernel has just zeroed, so plain stores would first read every line
// back from memory (read for ownership). From the first vector-aligned element on; the
// rest with memcpy / memset. A task that streamed ends with `stream_fence`.
#if defined(__AVX512F__)
constexpr uintptr_t kStreamAlign = 64;
#elif defined(__AVX__)
constexpr uintptr_t kStreamAlign = 32;
#else
constexpr uintptr_t kStreamAlign = 0;
#endif
inline void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX__)
  constexpr int64_t V = int64_t(kStreamAlign / 4);
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & (kStreamAlign - 1)); ++j) dst[j] = src[j];
  for (; j + V <= n; j += V)
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#else
    _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#endif
#endif
  if (j < n) std::memcpy(dst + j, src + j, sizeof(float) * size_t(n - j));
}
inline void stream_zero(char* dst, size_t bytes) {
  size_t j = 0;
#if defined(__AVX512F__) || defined(__AVX__)
  for (; j < bytes && (reinterpret_cast<uintptr_t>(dst + j) & (kStreamAlign - 1)); ++j) dst[j] = 0;
  for (; j + kStreamAlign <= bytes; j += kStreamAlign)
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), _mm512_setzero_si512());
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_setzero_si256());
#endif
#endif
  if (j < bytes) std::memset(dst + j, 0, bytes - j);
}
inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// Writes src [m, n] (row stride lds) into g at element offset `at` with row stride ld.
void write_grad(const Grad& g, int64_t at, int64_t ld, const float* src, int64_t lds, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    const float* s = src + i * lds;
    if (g.bf16) {
      uint16_t* d = static_cast<uint16_t*>(g.data) + at + i * ld;
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_bf16(s[j]);
    } else {
      stream_copy(static_cast<float*>(g.data) + at + i * ld, s, n);
    }
  }
}

// Huge pages under a weight-gradient result (advise_huge_pages, kernel_common.h).
void advise_huge_pages(const Grad& g, int64_t count) {
  if (g.data) advise_huge_pages(g.data, size_t(count) * (g.bf16 ? 2 : 4));
}

void zero_grad(const Grad& g, int64_t at, int64_t count) {
  if (g.data) stream_zero(static_cast<char*>(g.data) + at * (g.bf16 ? 2 : 4), size_t(count) * (g.bf16 ? 2 : 4));
}

// ---------------------------------------------------------------------------------
struct Problem : Experts {
  const float* xs;
  const float* gs;
  const float* scale;  // null: 1
  const float* gu;  // [P, 2F] the forward's gate | up products, or null (recompute)
  float* dxs;
  float* dot;
  Grad dwg, dwu, dwd;
  float* dbg;
  float* dbu;
  float* dbd;
  float* dgu;    // [P, 2F]
  float* parts;  // [nb, P]
  int64_t P, up_block;
};

struct Task {
  int32_t expert;
  int32_t row0, rows;
  int32_t col0, cols;
  bool whole = false;  // every phase A and phase B task of the expert, in one task
};

bool is_f32(const Weight& w) { return w.kind == kFloat && !w.bf16; }
// Up to this many rows, products with a transposed float weight (dh0 = gs W_d^T, dxs =
// dgu [W_g | W_u]^T) read the weight's rows in place (matmul_nt); above it, packing the
// block once and the register-tiled matmul are faster (measured on the Qwen3.6 layer).
constexpr int64_t kInPlaceRows = 16;
// Experts with at most this many rows get one task for all their phase A and phase B
// work. Measured when phase A always recomputed gate/up (phase B then read W_g, W_u from
// the last-level cache; Qwen3.6 layer fwd+bwd at T = 64: 812 -> 560 ms). With the
// forward's gu phase A reads only W_d, and it still pays: 627 / 680 -> 578 / 574 ms
// (kWholeRows 0 -> 16, A B A B, `benchmarks/bench_backward_residual.py --tokens 64`, best
// of 8 of the saved-residual step).
constexpr int64_t kWholeRows = 16;

// The tasks of expert e with rows [o, o + n): phase A (one per block of up_block columns of
// F, all the rows) into `a`, phase B (row chunks x blocks of down_block columns of d) into `b`.
void expert_tasks(int64_t e, int32_t o, int32_t n, int64_t F, int64_t d, int64_t up_block, int64_t down_block,
                  std::vector<Task>& a, std::vector<Task>& b) {
  for (int64_t c = 0; c < F; c += up_block)
    a.push_back(Task{int32_t(e), o, n, int32_t(c), int32_t(std::min<int64_t>(up_block, F - c))});
  constexpr int32_t kRowChunk = 128;
  for (int32_t r = 0; r < n; r += kRowChunk)
    for (int64_t c = 0; c < d; c += down_block)
      b.push_back(Task{int32_t(e), o + r, std::min(kRowChunk, n - r), int32_t(c),
                       int32_t(std::min<int64_t>(down_block, d - c))});
}

// Phase A: one (expert, F block) over all of the expert's rows.
void run_a(const Problem& p, const Task& t) {
  thread_local fvec pw, g, u, dh, hs, dg, du, out;
  const int64_t e = t.expert, d = p.d, F = p.F, n = t.rows, B = t.cols, c0 = t.col0;
  if (n == 0) {  // an expert with no rows: zero weight gradients
    const int64_t sz = d * F;
    zero_grad(p.dwg, e * sz, sz);
    zero_grad(p.dwu, e * sz, sz);
    zero_grad(p.dwd, e * sz, sz);
    stream_fence();
    if (p.dbg) {
      std::memset(p.dbg + e * F, 0, sizeof(float) * size_t(F));
      std::memset(p.dbu + e * F, 0, sizeof(float) * size_t(F));
    }
    return;
  }
  const float* x = p.xs + int64_t(t.row0) * d;
  const float* gsr = p.gs + int64_t(t.row0) * d;
  pw.resize(size_t(d) * B);
  g.resize(size_t(n) * B);
  u.resize(size_t(n) * B);
  dh.resize(size_t(n) * B);
  if (p.gu) {  // the forward's products
    for (int64_t r = 0; r < n; ++r) {
      const float* src = p.gu + (int64_t(t.row0) + r) * 2 * F + c0;
      std::memcpy(g.data() + r * B, src, sizeof(float) * size_t(B));
      std::memcpy(u.data() + r * B, src + F, sizeof(float) * size_t(B));
    }
  } else {
    for (auto [w, dst] : {std::pair{&p.wg, &g}, std::pair{&p.wu, &u}}) {  // X W[:, blk], recomputed
      if (is_f32(*w)) {  // read in place (row stride F)
        matmul(x, d, 1, float_rows<float>(*w, e, 0) + c0, F, d, n, B, dst->data(), B);
      } else if (w->kind != kFloat && n <= kInPlaceRows) {  // quantized: decoded in its stored [out, in] order
        pack(*w, e, 0, d, c0, B, true, pw.data());
        matmul_nt(x, d, pw.data(), d, d, static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), 0, n,
                  B, dst->data(), B);
      } else {
        pack(*w, e, 0, d, c0, B, false, pw.data());
        matmul(x, d, 1, pw.data(), B, d, n, B, dst->data(), B);
      }
    }
  }
  if (p.wd.kind == kFloat && n <= kInPlaceRows) {  // dh0 = gs W_d[blk, :]^T, W_d's rows read in place
    with_float_rows(p.wd, e, c0, [&](auto* wr) {
      matmul_nt(gsr, d, wr, d, d, static_cast<const float*>(nullptr), decltype(wr)(nullptr), 0, n, B, dh.data(), B);
    });
  } else if (axpy_takes(p.wd, c0, B, n)) {  // dh0[:, j] = sum_i gs[:, i] W_d[c0 + j, i], stored row i decoded in L1
    axpy_matmul(p.wd, nullptr, e, c0, B, d, gsr, nullptr, d, n, dh.data(), B);
  } else {
    pack(p.wd, e, c0, B, 0, d, true, pw.data());  // pw[i * B + j] = W_d[c0 + j, i]
    matmul(gsr, d, 1, pw.data(), B, d, n, B, dh.data(), B);
  }
  hs.resize(size_t(n) * B);
  dg.resize(size_t(n) * B);
  du.resize(size_t(n) * B);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = t.row0 + r;
    const float s = p.scale ? p.scale[row] : 1.f;
    float part = 0.f;
    for (int64_t j = 0; j < B; ++j) {
      const int64_t q = r * B + j;
      float gv = g[q], uv = u[q];
      if (p.bg) {
        gv += p.bg[e * F + c0 + j];
        uv += p.bu[e * F + c0 + j];
      }
      float h, dhdg, dhdu;
      if (p.act == 0) {
        const float sig = 1.f / (1.f + std::exp(-gv));
        const float silu = gv * sig;
        h = silu * uv;
        dhdu = silu;
        dhdg = uv * (sig * (1.f + gv * (1.f - sig)));
      } else {
        const bool gin = gv <= p.limit;  // jnp.minimum: the gradient goes to g when g <= L (ties: half in JAX)
        const bool uin = uv >= -p.limit && uv <= p.limit;
        const float gc = min_bound(gv, p.limit);
        const float uc = max_bound(min_bound(uv, p.limit), -p.limit);
        const float sig = 1.f / (1.f + std::exp(-p.alpha * gc));
        const float glu = gc * sig;
        h = (uc + 1.f) * glu;
        dhdu = uin ? glu : 0.f;
        dhdg = gin ? (uc + 1.f) * (sig + p.alpha * gc * sig * (1.f - sig)) : 0.f;
      }
      if (p.round_h) h = round_bf16(h);
      const float d0 = dh[q];
      part = fmadd(h, d0, part);
      const float dhv = s * d0;
      dg[q] = dhv * dhdg;
      du[q] = dhv * dhdu;
      hs[q] = s * h;
      p.dgu[row * 2 * F + c0 + j] = dg[q];
      p.dgu[row * 2 * F + F + c0 + j] = du[q];
    }
    p.parts[(c0 / p.up_block) * p.P + row] = part;
  }
  if (p.dbg)
    for (int64_t j = 0; j < B; ++j) {
      float sg = 0.f, su = 0.f;
      for (int64_t r = 0; r < n; ++r) {
        sg += dg[r * B + j];
        su += du[r * B + j];
      }
      p.dbg[e * F + c0 + j] = sg;
      p.dbu[e * F + c0 + j] = su;
    }
  // C = A^T B into `out`, then into the gradient (row stride ld) with non-temporal stores
  auto grad = [&](const Grad& gr, int64_t at, int64_t ld, const float* a, int64_t ka, const float* b, int64_t kb,
                  int64_t rows, int64_t cols) {
    if (!gr.data) return;
    out.resize(size_t(rows) * cols);
    matmul(a, 1, ka, b, kb, n, rows, cols, out.data(), cols);
    write_grad(gr, at, ld, out.data(), cols, rows, cols);
  };
  grad(p.dwg, e * d * F + c0, F, x, d, dg.data(), B, d, B);  // dW_g[:, blk] = X^T dgate
  grad(p.dwu, e * d * F + c0, F, x, d, du.data(), B, d, B);
  grad(p.dwd, e * F * d + c0 * d, d, hs.data(), B, gsr, d, B, d);  // dW_d[blk, :] = (s h)^T gs
  stream_fence();
}

// Phase B: one (expert, row chunk, d block): dxs, db_down, and (block 0) dot.
void run_b(const Problem& p, const Task& t) {
  thread_local fvec pw;
  const int64_t e = t.expert, d = p.d, F = p.F, n = t.rows, B = t.cols, i0 = t.col0;
  const float* dgu = p.dgu + int64_t(t.row0) * 2 * F;
  float* dx = p.dxs + int64_t(t.row0) * d + i0;
  if (p.wg.kind == kFloat && p.wu.kind == kFloat && p.wg.bf16 == p.wu.bf16 && n <= kInPlaceRows) {  // in place
    with_float_rows(p.wg, e, i0, [&](auto* wgr) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(wgr)>>;
      matmul_nt(dgu, 2 * F, wgr, F, F, dgu + F, float_rows<T>(p.wu, e, i0), F, n, B, dx, d);
    });
  } else if (axpy_takes(p.wg, i0, B, n) && axpy_takes(p.wu, i0, B, n)) {  // the same chains, W_g's rows then W_u's
    axpy_matmul(p.wg, &p.wu, e, i0, B, F, dgu, dgu + F, 2 * F, n, dx, d);
  } else {
    pw.resize(size_t(2 * F) * B);
    pack(p.wg, e, i0, B, 0, F, true, pw.data());  // pw[j * B + i] = W_g[i0 + i, j]
    pack(p.wu, e, i0, B, 0, F, true, pw.data() + F * B);
    matmul(dgu, 2 * F, 1, pw.data(), B, 2 * F, n, B, dx, d);
  }
  if (i0 != 0) return;
  const int64_t nb = (F + p.up_block - 1) / p.up_block;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = t.row0 + r;
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) s += p.parts[b * p.P + row];
    if (p.bd) {
      const float* gr = p.gs + row * d;
      float sb = 0.f;
      for (int64_t i = 0; i < d; ++i) sb = fmadd(gr[i], p.bd[e * d + i], sb);
      s += sb;
    }
    p.dot[row] = s;
  }
}

// db_down[e] = sum_r s_r gs_r over all of the expert's rows (zero with no rows).
void run_bias_down(const Problem& p, int64_t e) {
  const int64_t d = p.d, o = p.offsets[e], n = p.sizes[e];
  float* out = p.dbd + e * d;
  std::memset(out, 0, sizeof(float) * size_t(d));
  for (int64_t r = 0; r < n; ++r) {
    const float s = p.scale ? p.scale[o + r] : 1.f;
    const float* gr = p.gs + (o + r) * d;
    for (int64_t i = 0; i < d; ++i) out[i] = fmadd(s, gr[i], out[i]);
  }
}

// Checks one weight operand against its logical [E, in, out] shape; fills `w` (check_weight).
ffi::Error bind_weight(const char* name, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer qbias, int32_t kind,
                       int32_t group, int64_t E, int64_t in, int64_t out, Weight& w) {
  return check_weight("jaxmoe_grouped_swiglu_bwd", 2, "even and divide", name, data, scales, qbias, kind, group, E, in,
                      out, w);
}

// A weight-gradient result: empty (frozen), or [E, in, out] in the weight's float dtype.
ffi::Error bind_grad(const char* name, ffi::Result<ffi::AnyBuffer>& r, const Weight& w, int64_t E, Grad& g) {
  g = Grad{};
  if (r->element_count() == 0) return ffi::Error::Success();
  const auto dd = r->dimensions();
  const auto t = r->element_type();
  if (w.kind != kFloat || dd.size() != 3 || dd[0] != E || dd[1] != w.in || dd[2] != w.out ||
      (t != ffi::DataType::F32 && t != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(std::string("jaxmoe_grouped_swiglu_bwd: the gradient of ") + name +
                                       " must be empty or a float32 / bfloat16 [E, in, out] of float weights");
  g.data = r->untyped_data();
  g.bf16 = t == ffi::DataType::BF16;
  return ffi::Error::Success();
}

ffi::Error GroupedSwigluBwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::F32> gs,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> offsets,
                                ffi::Buffer<ffi::S32> sizes, ffi::AnyBuffer wg, ffi::AnyBuffer sg, ffi::AnyBuffer qg,
                                ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer qu, ffi::AnyBuffer wd,
                                ffi::AnyBuffer sd, ffi::AnyBuffer qd, ffi::Buffer<ffi::F32> bg,
                                ffi::Buffer<ffi::F32> bu, ffi::Buffer<ffi::F32> bd, ffi::Buffer<ffi::F32> gu,
                                ffi::ResultBuffer<ffi::F32> dxs,
                                ffi::ResultBuffer<ffi::F32> dot, ffi::Result<ffi::AnyBuffer> dwg,
                                ffi::Result<ffi::AnyBuffer> dwu, ffi::Result<ffi::AnyBuffer> dwd,
                                ffi::ResultBuffer<ffi::F32> dbg, ffi::ResultBuffer<ffi::F32> dbu,
                                ffi::ResultBuffer<ffi::F32> dbd, ffi::ResultBuffer<ffi::F32> dgu,
                                ffi::ResultBuffer<ffi::F32> parts, int32_t act, float alpha, float limit,
                                int32_t round_h, int32_t kind_gate, int32_t kind_up, int32_t kind_down,
                                int32_t group_gate, int32_t group_up, int32_t group_down, int32_t up_block,
                                int32_t down_block) {
  auto bad = [](const std::string& why) { return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu_bwd: " + why); };
  const auto xd = xs.dimensions();
  if (xd.size() != 2 || offsets.dimensions().size() != 1) return bad("xs must be [P, d] and offsets [E]");
  const int64_t P = xd[0], d = xd[1], E = offsets.dimensions()[0];
  const auto gd = dgu->dimensions();
  if (gd.size() != 2 || gd[0] != P || gd[1] % 2 != 0) return bad("the dgu scratch must be [P, 2F]");
  const int64_t F = gd[1] / 2;
  if (up_block < 1 || down_block < 1) return bad("up_block and down_block must be positive");
  const int64_t nb = (F + up_block - 1) / up_block;
  if (gs.element_count() != size_t(P * d)) return bad("gs must be [P, d] like xs");
  if (scale.element_count() != 0 && scale.element_count() != size_t(P)) return bad("scale must be [P] or empty");
  if (sizes.element_count() != size_t(E)) return bad("offsets and sizes must both be [E]");
  if (parts->element_count() != size_t(nb * P)) return bad("the parts scratch must be [ceil(F / up_block), P]");
  if (gu.element_count() != 0 && gu.element_count() != size_t(P * 2 * F))
    return bad("gu (the forward's gate | up products) must be [P, 2F] or empty");
  Problem p{};
  if (auto err = bind_weight("w_gate", wg, sg, qg, kind_gate, group_gate, E, d, F, p.wg); err.failure()) return err;
  if (auto err = bind_weight("w_up", wu, su, qu, kind_up, group_up, E, d, F, p.wu); err.failure()) return err;
  if (auto err = bind_weight("w_down", wd, sd, qd, kind_down, group_down, E, F, d, p.wd); err.failure()) return err;
  if (auto err = bind_grad("w_gate", dwg, p.wg, E, p.dwg); err.failure()) return err;
  if (auto err = bind_grad("w_up", dwu, p.wu, E, p.dwu); err.failure()) return err;
  if (auto err = bind_grad("w_down", dwd, p.wd, E, p.dwd); err.failure()) return err;
  const bool has_bias = bg.element_count() != 0;
  if (has_bias && (bg.element_count() != size_t(E * F) || bu.element_count() != size_t(E * F) ||
                   bd.element_count() != size_t(E * d)))
    return bad("biases must be [E, F], [E, F], [E, d] or empty");
  const bool bias_grads = dbg->element_count() != 0;
  if (bias_grads && (!has_bias || dbg->element_count() != size_t(E * F) || dbu->element_count() != size_t(E * F) ||
                     dbd->element_count() != size_t(E * d)))
    return bad("bias gradients must be [E, F], [E, F], [E, d] (with biases) or empty");
  p.offsets = offsets.typed_data();
  p.sizes = sizes.typed_data();
  int64_t covered = 0, end = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = p.offsets[e], n = p.sizes[e];
    if (n < 0 || o < 0 || o + n > P)
      return bad("expert " + std::to_string(e) + "'s rows [" + std::to_string(o) + ", " + std::to_string(o + n) +
                 ") run outside xs [0, " + std::to_string(P) + ")");
    if (n > 0 && o < end)
      return bad("group ranges must be sorted by expert and disjoint; expert " + std::to_string(e) +
                 " starts at row " + std::to_string(o) + " before the previous range ends at " + std::to_string(end));
    if (n > 0) end = o + n;
    covered += n;
  }
  p.xs = xs.typed_data();
  p.gs = gs.typed_data();
  p.scale = scale.element_count() ? scale.typed_data() : nullptr;
  p.bg = has_bias ? bg.typed_data() : nullptr;
  p.bu = has_bias ? bu.typed_data() : nullptr;
  p.bd = has_bias ? bd.typed_data() : nullptr;
  p.gu = gu.element_count() ? gu.typed_data() : nullptr;
  p.dxs = dxs->typed_data();
  p.dot = dot->typed_data();
  p.dbg = bias_grads ? dbg->typed_data() : nullptr;
  p.dbu = bias_grads ? dbu->typed_data() : nullptr;
  p.dbd = bias_grads ? dbd->typed_data() : nullptr;
  p.dgu = dgu->typed_data();
  p.parts = parts->typed_data();
  p.P = P;
  p.up_block = up_block;
  set_expert_attrs(p, d, F, act, alpha, limit, round_h);
  advise_huge_pages(p.dwg, E * d * F);
  advise_huge_pages(p.dwu, E * d * F);
  advise_huge_pages(p.dwd, E * F * d);
  advise_huge_pages(p.dxs, sizeof(float) * size_t(P) * d);
  advise_huge_pages(p.dgu, sizeof(float) * size_t(P) * 2 * F);
  if (covered < P) {  // rows no expert owns
    std::memset(p.dxs, 0, sizeof(float) * size_t(P) * d);
    std::memset(p.dot, 0, sizeof(float) * size_t(P));
  }
  // Phase A: (expert, F block) with all the expert's rows; one zeroing task per empty expert
  // (when there are weight or bias gradients to zero).
  const bool any_grad = p.dwg.data || p.dwu.data || p.dwd.data || p.dbg;
  std::vector<Task> a_tasks, b_tasks;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t n = p.sizes[e], o = p.offsets[e];
    if (n == 0) {
      if (any_grad) a_tasks.push_back(Task{int32_t(e), o, 0, 0, 0});
      continue;
    }
    if (n <= kWholeRows)  // one task for the whole expert (phase A, then phase B)
      a_tasks.push_back(Task{int32_t(e), o, n, 0, 0, true});
    else
      expert_tasks(e, o, n, F, d, up_block, down_block, a_tasks, b_tasks);
  }
  parallel_for(pool, int64_t(a_tasks.size()), [&](int64_t i) {
    const Task& t = a_tasks[size_t(i)];
    if (!t.whole) return run_a(p, t);
    thread_local std::vector<Task> a, b;  // the expert's phase A tasks, then its phase B ones
    a.clear();
    b.clear();
    expert_tasks(t.expert, t.row0, t.rows, F, d, up_block, down_block, a, b);
    for (const Task& ta : a) run_a(p, ta);
    for (const Task& tb : b) run_b(p, tb);
  });
  parallel_for(pool, int64_t(b_tasks.size()), [&](int64_t i) { run_b(p, b_tasks[size_t(i)]); });
  if (p.dbd) parallel_for(pool, E, [&](int64_t e) { run_bias_down(p, e); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeGroupedSwigluBwd, GroupedSwigluBwdImpl,
                              bind_expert_attrs(bind_experts(ffi::Ffi::Bind()
                                                                 .Ctx<ffi::ThreadPool>()
                                                                 .Arg<ffi::Buffer<ffi::F32>>()    // xs
                                                                 .Arg<ffi::Buffer<ffi::F32>>()    // gs
                                                                 .Arg<ffi::Buffer<ffi::F32>>())   // scale
                                                    .Arg<ffi::Buffer<ffi::F32>>()  // gu (the forward's residual, or empty)
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // dxs
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // dot
                                                    .Ret<ffi::AnyBuffer>()         // dw_gate
                                                    .Ret<ffi::AnyBuffer>()         // dw_up
                                                    .Ret<ffi::AnyBuffer>()         // dw_down
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // db_gate
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // db_up
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // db_down
                                                    .Ret<ffi::Buffer<ffi::F32>>()  // dgu (scratch)
                                                    .Ret<ffi::Buffer<ffi::F32>>())  // parts (scratch)
                                  .Attr<int32_t>("up_block")
                                  .Attr<int32_t>("down_block"));
