// Integer dot products over activations quantized to int8 per block of 32 (the opt-in
// `ExecConfig(activations="int8")`, docs/kernels.md "int8 activations"): what ggml does
// for its quantized types, here for the int8 (GGUF Q8_0) and int4 (MLX affine, GGUF Q4_0)
// kinds and the GGUF Q4_K and Q6_K blocks (ktile; without AVX2 the float path on Q8(x)).
// Included by grouped_swiglu.cc inside its anonymous namespace, after the quantized tiles,
// float_scales and gguf_matmul.
//
// What it computes: each activation row x is cut into blocks of 32 along `in`; a block's
// dx = max|x| / 127 (float32) and its codes xq = round-half-even(clip(x / dx, -127, 127))
// (0 where dx = 0), so Q8(x) = dx * xq. The kernel returns
// y = Q8(x) . W (W the dequantized weights, W = s q + b per group) within float32 rounding:
//   sum_k W[k] Q8(x)[k] = sum_blocks s dx sum(q xq)  +  sum_groups b sum_{blocks in g} dx sum(xq)
// with sum(q xq) an exact integer (maddubs / madd, or dpbusd with VNNI; no int16 sum can
// saturate: int4 2 * 15 * 127 + 2 * 15 * 127, int8 2 * 128 * 127 per pair). The error
// against float activations is that of Q8(x): |x - Q8(x)| <= dx / 2 per element.
// A block with a NaN or an infinity gets dx = NaN: its rows' outputs are NaN, as with
// float activations.
//
// Layout of the quantized rows (quantize_rows), per pair of blocks (64 elements):
//   natural order (int8 weights): the 64 codes in element order;
//   split order (int4 weights): [evens of block 0 | evens of block 1 | odds of block 0 |
//     odds of block 1] (16 codes each), matching 32 bytes of int4 codes widened as
//     [low nibbles | high nibbles] per 128-bit lane (byte t holds elements 2t, 2t + 1);
//   dxv: 8 floats, dx of block 0 four times then dx of block 1 four times (the 32-bit
//     lanes of madd's result: lanes 0..3 come from the low 128 bits, block 0 in split order);
//   sb: dx * sum(xq) of each block (the quantization biases' term); kRuleQ8_1: ggml's s.
// A row's K is padded to whole pairs with zero codes and zero dx.
//
// ggml's rule (quantize_rows' `ggml`; ExecConfig(activations="ggml"), int8 / int4 weights,
// whose ggml activation format is Q8_0): dx = f16(max|x| / 127) and xq = round-half-even(x *
// (127 / max|x|)), float32 operations as jaxmoe.ggml_activations.quantize_q8_0. The rows it
// reads were converted to Q8_0 values already (f16(d) q, by XLA for x, in the call for h);
// this rule gives back exactly those codes and d (their largest code is +-127, so
// max|x| = 127 f16(d) and x * (127 / max|x|) rounds to q), and the products are then
// ggml's: f16(d) dw sum(q qw) per block, with an exact integer sum. For Q4_K / Q6_K
// weights (ggml format Q8_K) the rows are the unconverted ones and quantize_q8_K_codes
// makes ggml's codes and d per 256; each block of 32 takes that d as its dx.
#pragma once

constexpr int64_t kQBlock = 32;

struct QRows {
  const int8_t* q = nullptr;  // [rows, pairs * 64]
  const float* dxv = nullptr; // [rows, pairs * 8]
  const float* sb = nullptr;  // [rows, nblk]
  int64_t pairs = 0, nblk = 0;
  QRows at(int64_t r) const {
    QRows o = *this;
    o.q += r * pairs * 64;
    o.dxv += r * pairs * 8;
    o.sb += r * nblk;
    return o;
  }
};

// Storage for the quantized rows of a [rows, K] matrix.
struct QRowsBuf {
  std::vector<int8_t, Aligned64<int8_t>> q;
  fvec dxv, sb;
  QRows view(int64_t rows, int64_t K) {
    const int64_t nblk = K / kQBlock, pairs = (nblk + 1) / 2;
    q.resize(size_t(rows * pairs * 64));
    dxv.resize(size_t(rows * pairs * 8));
    sb.resize(size_t(rows * nblk));
    return QRows{q.data(), dxv.data(), sb.data(), pairs, nblk};
  }
};

// One block's scale: dx = max|x| / 127, NaN for a non-finite block (whose codes are 0).
inline float block_scale(float amax, bool finite) {
  return finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
}

// The orders of the codes in a pair of blocks (see the top of this file; kOrderK4: [block 0
// elements 0..15 | block 1 elements 0..15 | block 0 elements 16..31 | block 1 elements
// 16..31], matching Q4_K's 32 bytes of one pair of sub-blocks widened as [low | high
// nibbles] and regrouped by 128-bit lane).
enum ActOrder : int { kOrderNatural = 0, kOrderSplit4 = 1, kOrderK4 = 2 };
// How rows are quantized: the int8 mode's rule (top of this file), ggml's Q8_0 (dx =
// f16(d)), ggml's Q8_K (one d per 256 elements, each block of 32 taking it as its dx) or
// ggml's Q8_1 (Q8_0's codes and dx, and sb = f16(d sum(xq)) with d = max|x| / 127 unrounded:
// quantize_row_q8_1's s, the term Q4_1 / Q5_1 minimums multiply).
enum QRule : int { kRuleInt8 = 0, kRuleQ8_0 = 1, kRuleQ8_K = 2, kRuleQ8_1 = 3 };
constexpr int kOrders = 3;
constexpr int kSlots = 3 * kOrders;  // quantized rows per (order, rule class: int8 / Q8_0, Q8_K, Q8_1)
// GGUF blocks of 32 with 4- or 5-bit unsigned codes and an f16 d (b32mtile): Q4_1 (W = d q +
// m), Q5_0 (W = d (q - 16)), Q5_1 (W = d q + m); the fifth bit of element l is bit l of qh.
constexpr bool is_b32m(int q) { return q == kQ4_1 || q == kQ5_0 || q == kQ5_1; }
// The IQ2 / IQ3 grid kinds (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; ggml format Q8_K): signed
// codes, a grid row's magnitudes times its signs (int_dot_k.h's k8tile).
constexpr bool is_iq_grid_kind(int q) {
  return q == kIQ2_XXS || q == kIQ2_XS || q == kIQ2_S || q == kIQ3_XXS || q == kIQ3_S;
}
// What int_dot_k.h's k8tile reads: Q2_K, Q3_K, Q5_K, IQ4_XS, the IQ1-3 / TQ kinds, and Q4_K
// and Q6_K in the ggml mode (their Q8_K rows; the int8 mode's Q4_K / Q6_K, a dx per block of
// 32, are ktile's).
constexpr bool is_k8tile_kind(int kind) {
  return kind == kQ2_K || kind == kQ3_K || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K || kind == kIQ4_XS ||
         is_iq_grid_kind(kind) || kind == kIQ1_S || kind == kIQ1_M || kind == kTQ1_0 || kind == kTQ2_0;
}
// What int_dot_gguf reads: the tiles over blocks of 32 (Q8_0 / Q8_1 rows) and ktile's Q4_K / Q6_K.
constexpr bool is_int_dot_gguf_kind(int q) { return is_table32(q) || is_b32m(q) || q == kQ4_K || q == kQ6_K; }

// The order weight kind Q reads its quantized activations in, quantized by `rule`, or -1
// when it takes float ones. Q4_K's Q8_K rows (the ggml mode, int_dot_k.h's k8tile) are in
// the natural order: there its nibble halves are whole blocks of 32.
inline int act_order(int kind, int rule) {
  if (kind == kInt8) return kOrderNatural;
  if (kind == kInt4) return kOrderSplit4;
  if (is_k8tile_kind(kind) && kind != kQ4_K && kind != kIQ4_XS) return kOrderNatural;
#if defined(__AVX2__)
  if (kind == kQ4_K && rule == kRuleQ8_K) return kOrderNatural;
  if (kind == kQ4_K || is_table32(kind) || kind == kIQ4_XS || is_b32m(kind)) return kOrderK4;
#else
  if (kind == kQ4_K || is_table32(kind) || kind == kIQ4_XS || is_b32m(kind))
    return kOrderNatural;  // the portable float paths
#endif
  return -1;
}
// Which of a call's kSlots sets of quantized rows a weight reads: one per (order, rule class:
// int8 or Q8_0, Q8_K, Q8_1); slot_is_q8k tells a Q8_K set (the ggml mode's K-quant rows).
inline int act_slot(int order, int rule) {
  return order + kOrders * (rule == kRuleQ8_K ? 1 : rule == kRuleQ8_1 ? 2 : 0);
}
inline bool slot_is_q8k(int slot) { return slot / kOrders == 1; }

// ggml's Q8_K of 256 elements (quantize_q8_K / jaxmoe.ggml_activations.quantize_q8_K, the
// same float32 operations as round_q8_K_block): the codes into q, returns d (0 for an
// all-zero block, NaN with codes 0 for a block holding a NaN or an infinity).
inline float quantize_q8_K_codes(const float* v, int8_t* q) {
  float amax = 0.f, mx = 0.f;
  bool fin = true;
  for (int i = 0; i < 256; ++i) {
    const float ax = std::fabs(v[i]);
    fin &= ax <= std::numeric_limits<float>::max();
    if (ax > amax) {
      amax = ax;
      mx = v[i];
    }
  }
  if (!fin || mx == 0.f) {
    std::memset(q, 0, 256);
    return fin ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const float iscale = -127.f / mx;
  for (int i = 0; i < 256; ++i) q[i] = int8_t(int32_t(min_bound(std::nearbyint(iscale * v[i]), 127.f)));
  return 1.f / iscale;
}

// Rows [r0, r1) of a ([*, K] at stride lda, K a multiple of 32) into `out` (a view from
// QRowsBuf::view of all rows), codes in `order`, by `rule` (QRule).
inline void quantize_rows(const float* a, int64_t lda, int64_t r0, int64_t r1, int64_t K, int order, const QRows& out,
                          int rule = kRuleInt8) {
  const int64_t nblk = K / kQBlock;
  const bool ggml = rule == kRuleQ8_0 || rule == kRuleQ8_1;
  alignas(32) int8_t kcodes[256];
  float kd = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a + r * lda;
    int8_t* q = const_cast<int8_t*>(out.q) + r * out.pairs * 64;
    float* dxv = const_cast<float*>(out.dxv) + r * out.pairs * 8;
    float* sb = const_cast<float*>(out.sb) + r * out.nblk;
    if (nblk % 2) {  // the padding half of the last pair
      std::memset(q + (out.pairs - 1) * 64, 0, 64);
      for (int l = 4; l < 8; ++l) dxv[(out.pairs - 1) * 8 + l] = 0.f;
    }
    for (int64_t b = 0; b < nblk; ++b) {
      const float* xb = x + b * kQBlock;
      float amax = 0.f, dx;
      bool finite = true;
      int32_t codes_sum = 0;
      alignas(32) int8_t codes[32];
      if (rule == kRuleQ8_K) {  // ggml's Q8_K: codes and d per 256 (K a multiple of 256), dx = d per block
        if (b % 8 == 0) kd = quantize_q8_K_codes(xb, kcodes);
        dx = kd;
        std::memcpy(codes, kcodes + 32 * (b % 8), 32);
        for (int k = 0; k < 32; ++k) codes_sum += codes[k];
      } else {
#if defined(__AVX2__)
      const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
      __m256 v[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int u = 0; u < 4; ++u) {
        v[u] = _mm256_loadu_ps(xb + 8 * u);
        const __m256 ax = _mm256_andnot_ps(sign, v[u]);
        m = _mm256_max_ps(m, ax);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(ax, inf, _CMP_NLT_UQ));  // NaN or infinity
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      amax = _mm_cvtss_f32(h);
      finite = _mm256_movemask_ps(bad) == 0;
      dx = block_scale(amax, finite);
      __m256i iv[4];
      if (ggml && finite && amax > 0.f) {  // ggml's rule: a product by 127 / amax, dx rounded to float16
        const __m256 inv = _mm256_set1_ps(127.f / amax), lim = _mm256_set1_ps(127.f);
        for (int u = 0; u < 4; ++u)
          iv[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[u], inv), -lim), lim));
        dx = round_f16(dx);
      } else if (!ggml && dx > 0.f) {  // a division, not a product by 1 / dx: no infinity for a subnormal dx
        const __m256 vdx = _mm256_set1_ps(dx), lim = _mm256_set1_ps(127.f);
        for (int u = 0; u < 4; ++u)  // round half even (the default rounding mode)
          iv[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[u], vdx), -lim), lim));
      } else {
        for (int u = 0; u < 4; ++u) iv[u] = _mm256_setzero_si256();
      }
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      codes_sum = _mm_cvtsi128_si32(s4);
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes),
                         _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
      amax = 0.f;
      finite = true;
      for (int k = 0; k < 32; ++k) {
        const float ax = std::fabs(xb[k]);
        if (!(ax < std::numeric_limits<float>::infinity())) finite = false;
        amax = std::max(amax, ax);
      }
      dx = block_scale(amax, finite);
      const bool ggml_codes = ggml && finite && amax > 0.f;
      const float inv = ggml_codes ? 127.f / amax : 0.f;
      for (int k = 0; k < 32; ++k) {
        const float r = ggml_codes ? xb[k] * inv : xb[k] / dx;
        const int32_t c = ggml_codes || dx > 0.f ? int32_t(std::nearbyint(min_bound(max_bound(r, -127.f), 127.f))) : 0;
        codes[k] = int8_t(c);
        codes_sum += c;
      }
      if (ggml_codes) dx = round_f16(dx);
#endif
      }
      const int64_t pr = b / 2, half = b % 2;
      int8_t* qp = q + pr * 64;
      if (order == kOrderSplit4) {
        for (int t = 0; t < 16; ++t) {
          qp[16 * half + t] = codes[2 * t];
          qp[32 + 16 * half + t] = codes[2 * t + 1];
        }
      } else if (order == kOrderK4) {
        std::memcpy(qp + 16 * half, codes, 16);
        std::memcpy(qp + 32 + 16 * half, codes + 16, 16);
      } else {
        std::memcpy(qp + 32 * half, codes, 32);
      }
      for (int l = 0; l < 4; ++l) dxv[pr * 8 + 4 * half + l] = dx;
      // Q8_1: ggml's s, f16 of the unrounded d times the codes' sum (0 for a zero block, NaN
      // for a non-finite one); otherwise dx sum(xq)
      sb[b] = rule == kRuleQ8_1 ? round_f16(block_scale(amax, finite) * float(codes_sum)) : dx * float(codes_sum);
    }
  }
}

// Per row of x and group of g elements: the sums of sb over the group's blocks, in block
// order ([m, K / g], stride ng).
inline void group_sums(const QRows& x, int64_t m, int64_t K, int64_t g, float* out) {
  const int64_t ng = K / g, per = g / kQBlock;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t gi = 0; gi < ng; ++gi) {
      float s = 0.f;
      for (int64_t b = 0; b < per; ++b) s += x.sb[i * x.nblk + gi * per + b];
      out[i * ng + gi] = s;
    }
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // in one fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned bytes times 32 signed bytes, summed in fours into 8 int32 lanes (exact here).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// dot_u8s8(a, x) + dot_u8s8(b, y) for small unsigned bytes a, b (4-bit codes, or MXFP4's
// values offset to 0..24): without VNNI the two int16 pair sums are added before one madd
// (2 * 24 * 127 twice cannot saturate); with VNNI any bytes are exact.
inline __m256i dot2_u4s8(__m256i a, __m256i x, __m256i b, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, x), b, y);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, x), b, y);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, x), _mm256_maddubs_epi16(b, y)),
                           _mm256_set1_epi16(1));
#endif
}

// acc + float(dot2_u4s8 of one row's 64 int8 activations at xq) * sw * dx (8 lanes of dx at dxv):
// one pair of 4-bit code vectors a (first 32 activations) and b (next 32) against one row.
inline __m256 pair_step(__m256 acc, __m256i a, __m256i b, __m256 sw, const int8_t* xq, const float* dxv) {
  const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2_u4s8(a, x0, b, x1)), _mm256_mul_ps(sw, _mm256_load_ps(dxv)), acc);
}
#endif

// sum_g b[g] * s[g] (the quantization biases' term of one output): 8 lanes, then the tail.
inline float bias_dot(const float* b, const float* s, int64_t n) {
  int64_t g = 0;
  float r = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(s + g), acc);
  r = hsum8(acc);
#endif
  for (; g < n; ++g) r = fmadd(b[g], s[g], r);
  return r;
}

// C[MR, NC] (columns j0.. at stride ldc) = Q8(X)[MR, K] . W columns j0.., int8 / int4 codes
// with float32 scales (float_scales), g a multiple of 32. sg: group_sums of these rows.
template <int MR, int NC, int Q>
void itile(const QRows& x, const QCols& w, const float* sg, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(Q == kInt8 || Q == kInt4, "itile: int8 or int4 codes");
  const int64_t G = w.group, nblk = K / kQBlock;
  const float* S = static_cast<const float*>(w.scales) + j0 * w.ng;
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8;
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, as in qtile
  const char* far = far_cols(w, j0, NC);
  float out[MR][NC];
#if defined(__AVX2__)
  constexpr int64_t kPairBytes = Q == kInt8 ? 64 : 32;
  const int64_t full = nblk / 2;
  __m256 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t p = 0; p <= full; ++p) {
    const bool tail = p == full;
    if (tail && nblk % 2 == 0) break;
    const int64_t kb = p * kPairBytes;
    if (kb % 64 == 0)
      for (int j = 0; j < NC; ++j) {
        __builtin_prefetch(next + j * w.stride + kb);
        __builtin_prefetch(far + j * w.stride + kb, 0, 2);
      }
    const int64_t g0 = (64 * p) / G, g1 = (64 * p + 32) / G;
    for (int j = 0; j < NC; ++j) {
      const char* row = w.base + (j0 + j) * w.stride;
      const float s0 = S[j * w.ng + g0], s1 = tail ? 0.f : S[j * w.ng + g1];
      if constexpr (Q == kInt4) {
        __m256i v;
        if (tail)
          v = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kb)));
        else
          v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kb));
        if (tail) v = _mm256_inserti128_si256(v, _mm_setzero_si128(), 1);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256 sw = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
        for (int i = 0; i < MR; ++i)
          acc[i][j] = pair_step(acc[i][j], lo, hi, sw, x.q + i * xq_stride + p * 64, x.dxv + i * xd_stride + p * 8);
      } else {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kb));
        const __m256i w1 =
            tail ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kb + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        const __m256 sw0 = _mm256_set1_ps(s0), sw1 = _mm256_set1_ps(s1);
        for (int i = 0; i < MR; ++i) {
          const int8_t* xq = x.q + i * xq_stride + p * 64;
          const float* dx = x.dxv + i * xd_stride + p * 8;
          const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i q0 = dot_u8s8(a0, _mm256_sign_epi8(x0, w0));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_mul_ps(sw0, _mm256_broadcast_ss(dx)), acc[i][j]);
          if (!tail) {
            const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32));
            const __m256i q1 = dot_u8s8(a1, _mm256_sign_epi8(x1, w1));
            acc[i][j] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_mul_ps(sw1, _mm256_broadcast_ss(dx + 4)), acc[i][j]);
          }
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) out[i][j] = hsum8(acc[i][j]);
#else
  (void)next;
  (void)far;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) {
      const char* row = w.base + (j0 + j) * w.stride;
      float s = 0.f;
      for (int64_t b = 0; b < nblk; ++b) {
        const int8_t* xq = x.q + i * xq_stride + (b / 2) * 64;
        int32_t isum = 0;
        for (int t = 0; t < 32; ++t) {
          if constexpr (Q == kInt8) {
            isum += int32_t(reinterpret_cast<const int8_t*>(row)[b * 32 + t]) * xq[32 * (b % 2) + t];
          } else {
            const uint8_t byte = reinterpret_cast<const uint8_t*>(row)[b * 16 + t / 2];
            const int32_t code = t % 2 ? byte >> 4 : byte & 15;
            isum += code * xq[(t % 2 ? 32 : 0) + 16 * (b % 2) + t / 2];
          }
        }
        const float dx = x.dxv[i * xd_stride + (b / 2) * 8 + 4 * (b % 2)];
        s = fmadd(float(isum), S[j * w.ng + (b * 32) / G] * dx, s);
      }
      out[i][j] = s;
    }
#endif
  const float* qb = static_cast<const float*>(w.qbias);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j)
      c[i * ldc + j0 + j] = qb ? out[i][j] + bias_dot(qb + (j0 + j) * w.ng, sg + i * w.ng, w.ng) : out[i][j];
}

// Block `blk` (BB bytes) of the next tile's NC columns into L1 and of the columns at `far`
// into L2, as the super-block tiles (ktile, k8tile) advance.
template <int NC, int BB>
inline void prefetch_kblock(const char* next, const char* far, int64_t stride, int64_t blk) {
  for (int j = 0; j < NC; ++j)
    for (int o = 0; o < BB; o += 64) {
      __builtin_prefetch(next + j * stride + blk * BB + o);
      __builtin_prefetch(far + j * stride + blk * BB + o, 0, 2);
    }
}

#if defined(__AVX2__)
// The same tile for GGUF Q4_K and Q6_K blocks (super-blocks of 256; w.stride the row's
// bytes). Q4_K (W = d sc_s q - dmin m_s per sub-block s of 32): per pair of sub-blocks, 32
// bytes of nibbles, [low | high] regrouped by 128-bit lane (kOrderK4), so one conversion and
// one multiply-add per pair and row; the mins' term sum_s dmin m_s dx_s sum(xq) per
// super-block from sb. Q6_K (W = d sc_g (q - 32) per group g of 16): the block's codes as
// bytes (q6k_codes), then per block of 32 the sign trick as for int8, lanes 0..3 holding
// group 2b's sums and lanes 4..7 group 2b + 1's.
template <int MR, int NC, int Q>
void ktile(const QRows& x, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(Q == kQ4_K || Q == kQ6_K, "ktile: Q4_K or Q6_K blocks");
  constexpr int BB = block_bytes(Q);
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8;
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, and far_cols into L2
  const char* far = far_cols(w, j0, NC);
  __m256 acc[MR][NC], macc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = macc[i][j] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    prefetch_kblock<NC, BB>(next, far, w.stride, blk);
    if constexpr (Q == kQ4_K) {
      alignas(32) float dsc[NC][8], dmn[NC][8];
      for (int j = 0; j < NC; ++j) {
        const uint8_t* bj = rows[j] + blk * BB;
        k_scales_mins(bj + 4, f16_at(bj), f16_at(bj + 2), dsc[j], dmn[j]);
        for (int i = 0; i < MR; ++i)
          macc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(dmn[j]), _mm256_loadu_ps(x.sb + i * x.nblk + 8 * blk), macc[i][j]);
      }
      for (int p = 0; p < 4; ++p) {
        const int64_t pr = 4 * blk + p;
        for (int j = 0; j < NC; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + blk * BB + 16 + 32 * p));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          const __m256i a = _mm256_permute2x128_si256(lo, hi, 0x20), b = _mm256_permute2x128_si256(lo, hi, 0x31);
          const __m256 sw = _mm256_set_m128(_mm_set1_ps(dsc[j][2 * p + 1]), _mm_set1_ps(dsc[j][2 * p]));
          for (int i = 0; i < MR; ++i)
            acc[i][j] = pair_step(acc[i][j], a, b, sw, x.q + i * xq_stride + pr * 64, x.dxv + i * xd_stride + pr * 8);
        }
      }
    } else {
      alignas(64) float ds[NC][16];
      alignas(64) int8_t qb[NC][256];
      for (int j = 0; j < NC; ++j) {
        q6k_scales(rows[j] + blk * BB, ds[j]);
        q6k_codes(rows[j] + blk * BB, qb[j]);
      }
      for (int b = 0; b < 8; ++b) {
        const int64_t xb = 8 * blk + b;  // the activation block
        for (int j = 0; j < NC; ++j) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(qb[j] + 32 * b));
          const __m256i aw = _mm256_abs_epi8(wv);
          const __m256 sw = _mm256_set_m128(_mm_set1_ps(ds[j][2 * b + 1]), _mm_set1_ps(ds[j][2 * b]));
          for (int i = 0; i < MR; ++i) {
            const int8_t* xq = x.q + i * xq_stride + (xb / 2) * 64 + 32 * (xb % 2);
            const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
            const __m256i q32 = dot_u8s8(aw, _mm256_sign_epi8(xv, wv));
            const __m256 dx = _mm256_broadcast_ss(x.dxv + i * xd_stride + (xb / 2) * 8 + 4 * (xb % 2));
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), _mm256_mul_ps(sw, dx), acc[i][j]);
          }
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j)
      c[i * ldc + j0 + j] = Q == kQ4_K ? hsum8(acc[i][j]) - hsum8(macc[i][j]) : hsum8(acc[i][j]);
}
#endif

#if defined(__AVX2__)
// The same tile for the GGUF blocks of 32 with one scale and 4-bit codes (ggml format Q8_0;
// w.stride the row's bytes): Q4_0 (W = d (q - 8)), IQ4_NL (W = d kvalues_iq4nl[q]), MXFP4
// (W = 2^(e - 128) kvalues_mxfp4[q]). Per pair of blocks, their two 16-byte runs of nibbles in
// one vector ([block 0 | block 1]), low nibbles (elements 0..15) and high ones (16..31) as two
// vectors: kOrderK4's order. Q4_0: one dot2_u4s8 per pair and row, the offset 8 taken off in
// integers (8 sum(xq) per lane, once per row and pair, a dot2_u4s8 of eights). MXFP4 (and
// IQ4_NL where VNNI is built): the codes' values plus an offset o (12; 127) by a byte
// shuffle of a table of unsigned bytes, one dot2_u4s8 per pair and row, o sum(xq) taken off
// as for Q4_0 (sum (v + o) x - o sum x = sum v x, exact in int32). IQ4_NL without VNNI:
// its values (-127..113) plus 127 would saturate vpmaddubsw's int16 pair sums, so the sign
// trick as for int8 (|v| <= 127). Each lane holds an exact integer sum, times the block's
// scale times dx, as ggml's vec_dot.
// Bytes kb .. kb + 127 of the next tile's NC columns into L1 and of the columns at `far`
// into L2 (the tiles over pairs of blocks of 32: every other pair, as they advance).
template <int NC>
inline void prefetch_pairs(const char* next, const char* far, int64_t stride, int64_t kb) {
  for (int j = 0; j < NC; ++j) {
    __builtin_prefetch(next + j * stride + kb);
    __builtin_prefetch(next + j * stride + kb + 64);
    __builtin_prefetch(far + j * stride + kb, 0, 2);
    __builtin_prefetch(far + j * stride + kb + 64, 0, 2);
  }
}
alignas(16) inline constexpr int8_t kIQ4Bytes[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) inline constexpr int8_t kFP4Bytes[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
inline constexpr bool kVnniDot = true;  // dot2_u4s8 exact for any unsigned bytes
#else
inline constexpr bool kVnniDot = false;
#endif
// The offset that b32tile's unsigned table adds to kind Q's values (0: the sign trick).
template <int Q>
constexpr int table_offset() {
  return Q == kQ4_0 ? 8 : Q == kMXFP4 ? 12 : (Q == kIQ4_NL && kVnniDot) ? 127 : 0;
}
template <int MR, int NC, int Q>
void b32tile(const QRows& x, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(is_table32(Q), "b32tile: Q4_0, IQ4_NL or MXFP4 blocks");
  constexpr int64_t BB = block_bytes(Q), QS = Q == kMXFP4 ? 1 : 2;  // block bytes, where the nibbles start
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8, full = (K / kQBlock) / 2;
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, and far_cols into L2
  const char* far = far_cols(w, j0, NC);
  __m256 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm256_setzero_ps();
  constexpr int kOff = table_offset<Q>();
  const __m256i low4 = _mm256_set1_epi8(15), offv = _mm256_set1_epi8(char(kOff));
  // the values, plus the offset where there is one (bytewise: the unsigned table)
  const __m256i table = _mm256_add_epi8(
      _mm256_broadcastsi128_si256(
          _mm_load_si128(reinterpret_cast<const __m128i*>(Q == kMXFP4 ? kFP4Bytes : kIQ4Bytes))),
      offv);
  for (int64_t p = 0; p < x.pairs; ++p) {
    const bool tail = p == full;  // an odd block count: block 2 p + 1 is padding (zero codes and dx)
    const int64_t kb = 2 * p * BB;
    if (p % 2 == 0) prefetch_pairs<NC>(next, far, w.stride, kb);
    __m256i x0[MR], x1[MR], off[MR];
    __m256 dx[MR];
    for (int i = 0; i < MR; ++i) {
      const int8_t* xq = x.q + i * xq_stride + p * 64;
      x0[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
      x1[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32));
      if constexpr (kOff != 0) off[i] = dot2_u4s8(offv, x0[i], offv, x1[i]);
      dx[i] = _mm256_load_ps(x.dxv + i * xd_stride + p * 8);
    }
    for (int j = 0; j < NC; ++j) {
      const uint8_t* b0 = rows[j] + kb;
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + QS));
      const __m128i q1 = tail ? _mm_setzero_si128() : _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + BB + QS));
      const __m256i v = _mm256_set_m128i(q1, q0);
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const __m256 sw =
          _mm256_set_m128(_mm_set1_ps(tail ? 0.f : table_scale<Q>(b0 + BB, 0)), _mm_set1_ps(table_scale<Q>(b0, 0)));
      if constexpr (kOff != 0) {
        const __m256i ul = Q == kQ4_0 ? lo : _mm256_shuffle_epi8(table, lo);
        const __m256i uh = Q == kQ4_0 ? hi : _mm256_shuffle_epi8(table, hi);
        for (int i = 0; i < MR; ++i) {
          const __m256i q = _mm256_sub_epi32(dot2_u4s8(ul, x0[i], uh, x1[i]), off[i]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sw, dx[i]), acc[i][j]);
        }
      } else {
        const __m256i wl = _mm256_shuffle_epi8(table, lo), wh = _mm256_shuffle_epi8(table, hi);
        const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
        for (int i = 0; i < MR; ++i) {
          const __m256i q = _mm256_add_epi32(dot_u8s8(al, _mm256_sign_epi8(x0[i], wl)),
                                             dot_u8s8(ah, _mm256_sign_epi8(x1[i], wh)));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sw, dx[i]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j0 + j] = hsum8(acc[i][j]);
}
#endif

#if defined(__AVX2__)
// 0xFF in byte j where bit j % 8 of byte pick[j] of v (in j's 128-bit lane) is set, else 0.
inline __m256i bit_mask_bytes(__m256i v, __m256i pick) {
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, pick), bit), bit);
}

// The fifth bits of a pair of Q5_0 / Q5_1 blocks (qh0, qh1: their u32 qh) as 16s in kOrderK4's
// order: `high` false gives elements 0..15 of block 0 | block 1 (bits 0..15 of each qh),
// true elements 16..31 (bits 16..31).
inline __m256i fifth_bits(uint32_t qh0, uint32_t qh1, bool high) {
  const __m256i sixteen = _mm256_set1_epi8(16);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const uint32_t k = high ? (qh0 >> 16) | (qh1 & 0xFFFF0000u) : (qh0 & 0xFFFFu) | (qh1 << 16);
  return _mm256_maskz_mov_epi8(__mmask32(k), sixteen);
#else
  const __m256i qv = _mm256_set_m128i(_mm_set1_epi32(int(qh1)), _mm_set1_epi32(int(qh0)));
  const char a = high ? 2 : 0, b = high ? 3 : 1;  // the qh bytes holding the lane's 16 bits
  const __m256i pick = _mm256_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b,  //
                                        a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
  return _mm256_and_si256(bit_mask_bytes(qv, pick), sixteen);
#endif
}

// The same tile for Q4_1 / Q5_0 / Q5_1 blocks (is_b32m; ggml formats Q8_1 / Q8_0 / Q8_1;
// w.stride the row's bytes): per pair of blocks, their nibbles as b32tile reads them
// (kOrderK4), the fifth bits added from qh (fifth_bits), one dot2_u4s8 per pair and row of
// the unsigned codes (2 * 31 * 127 twice fits vpmaddubsw's int16 pair sums). Q5_0: the offset
// 16 taken off in integers as Q4_0's 8 (16 sum(xq) per lane). Q4_1 / Q5_1: the minimum's term
// m s per block (s: the Q8_1 rows' sb, ggml's rounded block sum) in lanes 0 and 4 of the
// same accumulator, as vec_dot_q4_1_q8_1 adds m s per block.
template <int MR, int NC, int Q>
void b32mtile(const QRows& x, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(is_b32m(Q), "b32mtile: Q4_1, Q5_0 or Q5_1 blocks");
  constexpr int64_t BB = block_bytes(Q), QS = Q == kQ4_1 ? 4 : Q == kQ5_0 ? 6 : 8;  // where the nibbles start
  constexpr int64_t QH = Q == kQ5_0 ? 2 : 4;                                          // where qh lies (Q5_*)
  constexpr bool kMin = Q != kQ5_0;
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8, full = (K / kQBlock) / 2;
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, and far_cols into L2
  const char* far = far_cols(w, j0, NC);
  __m256 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15), offv = _mm256_set1_epi8(16);
  for (int64_t p = 0; p < x.pairs; ++p) {
    const bool tail = p == full;  // an odd block count: block 2 p + 1 is padding (zero codes and dx)
    const int64_t kb = 2 * p * BB;
    if (p % 2 == 0) prefetch_pairs<NC>(next, far, w.stride, kb);
    __m256i x0[MR], x1[MR], off[MR];
    __m256 dx[MR], sv[MR];
    for (int i = 0; i < MR; ++i) {
      const int8_t* xq = x.q + i * xq_stride + p * 64;
      x0[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
      x1[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32));
      if constexpr (!kMin) off[i] = dot2_u4s8(offv, x0[i], offv, x1[i]);
      dx[i] = _mm256_load_ps(x.dxv + i * xd_stride + p * 8);
      if constexpr (kMin) {
        const float* s = x.sb + i * x.nblk + 2 * p;
        sv[i] = _mm256_setr_ps(s[0], 0.f, 0.f, 0.f, tail ? 0.f : s[1], 0.f, 0.f, 0.f);
      }
    }
    for (int j = 0; j < NC; ++j) {
      const uint8_t* b0 = rows[j] + kb;
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + QS));
      const __m128i q1 = tail ? _mm_setzero_si128() : _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + BB + QS));
      const __m256i v = _mm256_set_m128i(q1, q0);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (Q != kQ4_1) {
        uint32_t qh0, qh1 = 0;
        std::memcpy(&qh0, b0 + QH, 4);
        if (!tail) std::memcpy(&qh1, b0 + BB + QH, 4);
        lo = _mm256_or_si256(lo, fifth_bits(qh0, qh1, false));
        hi = _mm256_or_si256(hi, fifth_bits(qh0, qh1, true));
      }
      const __m256 sw = _mm256_set_m128(_mm_set1_ps(tail ? 0.f : f16_at(b0 + BB)), _mm_set1_ps(f16_at(b0)));
      if constexpr (kMin) {
        const __m256 mw = _mm256_set_m128(_mm_set1_ps(tail ? 0.f : f16_at(b0 + BB + 2)), _mm_set1_ps(f16_at(b0 + 2)));
        for (int i = 0; i < MR; ++i) {
          const __m256i q = dot2_u4s8(lo, x0[i], hi, x1[i]);
          acc[i][j] = _mm256_fmadd_ps(mw, sv[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sw, dx[i]), acc[i][j]));
        }
      } else {
        for (int i = 0; i < MR; ++i) {
          const __m256i q = _mm256_sub_epi32(dot2_u4s8(lo, x0[i], hi, x1[i]), off[i]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sw, dx[i]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j0 + j] = hsum8(acc[i][j]);
}
#endif

// Runs tile(MR, NC, i0, j0) over row tiles of 4 (then fewer) x 2 columns (1 x 4 for a single
// row), as int_dot_matmul and int_dot_gguf do.
template <typename Tile>
inline void int_dot_tiles(int64_t m, int64_t ncols, Tile&& tile) {
  for (int64_t i0 = 0; i0 < m;) {
    const int64_t mr = std::min<int64_t>(4, m - i0);
    auto row_tiles = [&](auto MRc) {
      constexpr int MR = decltype(MRc)::value;
      constexpr int NC = MR == 1 ? 4 : 2;
      int64_t j0 = 0;
      for (; j0 + NC <= ncols; j0 += NC) tile(std::integral_constant<int, MR>{}, std::integral_constant<int, NC>{}, i0, j0);
      for (; j0 < ncols; ++j0) tile(std::integral_constant<int, MR>{}, std::integral_constant<int, 1>{}, i0, j0);
    };
    switch (mr) {
      case 1: row_tiles(std::integral_constant<int, 1>{}); break;
      case 2: row_tiles(std::integral_constant<int, 2>{}); break;
      case 3: row_tiles(std::integral_constant<int, 3>{}); break;
      default: row_tiles(std::integral_constant<int, 4>{}); break;
    }
    i0 += mr;
  }
}

// C[m, ncols] = Q8(X)[m, K] . W[:, 0 : ncols] for Q4_K / Q6_K / Q4_0 / IQ4_NL / MXFP4 /
// Q4_1 / Q5_0 / Q5_1 blocks (Q4_1 / Q5_1: rows by kRuleQ8_1).
template <int Q>
void int_dot_gguf(const QRows& x, const QCols& w, int64_t K, int64_t m, int64_t ncols, float* c, int64_t ldc) {
#if defined(__AVX2__)
  int_dot_tiles(m, ncols, [&](auto MRc, auto NCc, int64_t i0, int64_t j0) {
    if constexpr (is_table32(Q))
      b32tile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), w, j0, K, c + i0 * ldc, ldc);
    else if constexpr (is_b32m(Q))
      b32mtile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), w, j0, K, c + i0 * ldc, ldc);
    else
      ktile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), w, j0, K, c + i0 * ldc, ldc);
  });
#else
  // Portable builds: Q8(x) as float rows (dx * xq; the natural order keeps element k at
  // q[k]) through the float path of the same blocks.
  thread_local fvec abuf, pack;
  abuf.resize(size_t(m * K));
  for (int64_t i = 0; i < m; ++i) {
    const QRows xi = x.at(i);
    for (int64_t k = 0; k < K; ++k) abuf[i * K + k] = xi.dxv[(k / 64) * 8 + 4 * ((k / 32) % 2)] * float(xi.q[k]);
  }
  gguf_matmul<Q>(abuf.data(), K, w, K, m, ncols, c, ldc, pack);
  if constexpr (Q == kQ4_1 || Q == kQ5_1) {  // the minimums' term: m (s - dx sum(xq)) per block, s's rounding
    const int64_t nb = K / kQBlock;
    thread_local fvec res;  // s - dx sum(xq) per row and block, once for every column
    res.resize(size_t(m * nb));
    for (int64_t i = 0; i < m; ++i) {
      const QRows xi = x.at(i);
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sq = 0;
        for (int t = 0; t < 32; ++t) sq += xi.q[32 * b + t];
        res[size_t(i * nb + b)] = xi.sb[b] - xi.dxv[(b / 2) * 8 + 4 * (b % 2)] * float(sq);
      }
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < ncols; ++j) {
        const uint8_t* row = reinterpret_cast<const uint8_t*>(w.base + j * w.stride);
        float r = 0.f;
        for (int64_t b = 0; b < nb; ++b) r = fmadd(f16_at(row + b * block_bytes(Q) + 2), res[size_t(i * nb + b)], r);
        c[i * ldc + j] += r;
      }
  }
#endif
}

// C[m, ncols] = Q8(X)[m, K] . W[:, 0 : ncols] (the block's columns): row tiles of 4 (then
// fewer) x 2 columns (1 x 4 for a single row); each element the same order whatever m is.
template <int Q>
void int_dot_matmul(const QRows& x, const QCols& wq, int64_t K, int64_t m, int64_t ncols, float* c, int64_t ldc) {
  thread_local fvec sbuf, gbuf;
  const QCols w = float_scales(wq, ncols, sbuf);
  gbuf.resize(size_t(m * w.ng));
  group_sums(x, m, K, w.group, gbuf.data());
  int_dot_tiles(m, ncols, [&](auto MRc, auto NCc, int64_t i0, int64_t j0) {
    itile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), w, gbuf.data() + i0 * w.ng, j0, K, c + i0 * ldc,
                                                          ldc);
  });
}

#include "int_dot_k.h"  // Q2_K / Q3_K / Q5_K / IQ4_XS against Q8_K codes
