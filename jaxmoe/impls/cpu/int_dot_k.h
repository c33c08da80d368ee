// Integer dot products for the K-quant kinds whose ggml vec_dot_type is Q8_K and whose
// blocks int_dot.h's ktile does not read: Q2_K, Q3_K, Q5_K and IQ4_XS (ggml's
// ggml_vec_dot_q2_K_q8_K, q3_K_q8_K, q5_K_q8_K and iq4_xs_q8_K). Included at the end of
// int_dot.h (QRows in the natural order, quantized by kRuleQ8_K: the Q8_K codes of the
// unconverted rows, each block of 32 taking its super-block's d as dx; sb = dx sum(xq)).
//
// Per super-block and column the block's codes are built as 256 bytes (kcodes), with a
// float scale per group of 16 (Q2_K, Q3_K) or of 32 (Q5_K, IQ4_XS: the same scale in both
// halves), then per activation block of 32 one integer dot per row and column: lanes
// 0..3 hold the sums over elements 0..15, lanes 4..7 over 16..31 (dot_u8s8), times the
// group's scale and dx. Unsigned codes (Q2_K 0..3, Q5_K 0..31) go straight into the
// unsigned operand; signed ones (Q3_K q - 4, IQ4_XS kvalues_iq4nl, |v| <= 127) take the
// sign trick as Q6_K does. The mins (W = d sc q - dmin m): Q5_K per sub-block of 32 from
// sb as Q4_K; Q2_K per group of 16 from the integer sums of xq over each group (a
// dot_u8s8 of ones, once per row and block), times dmin m and dx. IQ4_XS's codes come
// from its 16-entry table by a byte shuffle (vpshufb). Without AVX2 the float path over
// the Q8_K values (int_dot_gguf's portable path).
#pragma once

constexpr bool is_q8k_codes_kind(int kind) {
  return kind == kQ2_K || kind == kQ3_K || kind == kQ5_K || kind == kIQ4_XS;
}

#if defined(__AVX2__)
// One super-block's codes (256 bytes, element order) and group scales: ds[16] (per 16
// elements; groups of 32 written twice), dm[16] the Q2_K mins per 16, dmn[8] the Q5_K
// mins per 32.
template <int Q>
inline void kcodes(const uint8_t* b, int8_t* __restrict qb, float* __restrict ds, float* __restrict dm,
                   float* __restrict dmn) {
  if constexpr (Q == kQ2_K) {  // scales 16 bytes (low nibble scale, high min), qs 64, d f16, dmin f16
    const uint8_t* sc = b;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int c = 0; c < 2; ++c) {  // elements 128 c + 32 j + l: bits 2 j of qs[32 c + l]
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      for (int j = 0; j < 4; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 128 * c + 32 * j),
                           _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3));
    }
    for (int g = 0; g < 16; ++g) {
      ds[g] = d * float(sc[g] & 15);
      dm[g] = dmin * float(sc[g] >> 4);
    }
    (void)dmn;
  } else if constexpr (Q == kQ3_K) {  // hmask 32 bytes, qs 64, 12 packed 6-bit scales, d f16
    const uint8_t* s = b + 96;
    const float d = f16_at(b + 108);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int c = 0; c < 2; ++c) {  // element 32 k + l (k = 4 c + j): bits 2 j of qs[32 c + l] | bit k of hm[l] << 2, - 4
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * c));
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * c + j;
        const __m256i bit = _mm256_set1_epi8(char(1 << k));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3);
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 32 * k), _mm256_sub_epi8(lo, _mm256_andnot_si256(set, four)));
      }
    }
    for (int g = 0; g < 16; ++g) {  // scale g: low 4 bits from s[g % 8] (nibble g / 8), top 2 from s[8 + g % 4]
      const int lo = (s[g & 7] >> (4 * (g >> 3))) & 15, hi = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
      ds[g] = d * float((lo | (hi << 4)) - 32);
    }
    (void)dm;
    (void)dmn;
  } else if constexpr (Q == kQ5_K) {  // d, dmin, 12 scale bytes, qh 32, qs 128
    alignas(32) float dsc[8];
    k_scales_mins(b + 4, f16_at(b), f16_at(b + 2), dsc, dmn);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i low4 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
    for (int p = 0; p < 4; ++p) {  // sub-block 2p: low nibbles of qs[32 p..], 2p + 1: high; bit j of qh[l] << 4
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * p));
      const __m256i nib[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        const __m256i bit = _mm256_set1_epi8(char(1 << j));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        const __m256i q5 = _mm256_or_si256(nib[h], _mm256_and_si256(set, sixteen));
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 32 * j), q5);
      }
    }
    for (int j = 0; j < 8; ++j) ds[2 * j] = ds[2 * j + 1] = dsc[j];
    (void)dm;
  } else {  // IQ4_XS: d f16, scales_h u16, scales_l 4 bytes, qs 128; per 32: kvalues_iq4nl[nibble]
    const __m256i tab = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p, 2p + 1: 16 bytes each, low nibbles elements 0..15, high 16..31
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * p));
      const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, low4));
      const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 64 * p), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 64 * p + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    for (int j = 0; j < 8; ++j) ds[2 * j] = ds[2 * j + 1] = table_scale<kIQ4_XS>(b, j);
    (void)dm;
    (void)dmn;
  }
}

// C[MR, NC] (columns j0.. at stride ldc) = Q8_K(X)[MR, K] . W columns j0.. for Q2_K / Q3_K
// / Q5_K / IQ4_XS blocks (w.stride the row's bytes).
template <int MR, int NC, int Q>
void k8tile(const QRows& x, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(is_q8k_codes_kind(Q), "k8tile: Q2_K, Q3_K, Q5_K or IQ4_XS blocks");
  constexpr int BB = block_bytes(Q);
  constexpr bool kUnsigned = Q == kQ2_K || Q == kQ5_K;
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8;
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, and far_cols into L2
  const char* far = far_cols(w, j0, NC);
  __m256 acc[MR][NC], macc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = macc[i][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    prefetch_kblock<NC, BB>(next, far, w.stride, blk);
    alignas(64) int8_t qb[NC][256];
    alignas(32) float ds[NC][16], dm[NC][16], dmn[NC][8];
    for (int j = 0; j < NC; ++j) {
      kcodes<Q>(rows[j] + blk * BB, qb[j], ds[j], dm[j], dmn[j]);
      if constexpr (Q == kQ5_K)
        for (int i = 0; i < MR; ++i)
          macc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(dmn[j]), _mm256_loadu_ps(x.sb + i * x.nblk + 8 * blk), macc[i][j]);
    }
    for (int b = 0; b < 8; ++b) {
      const int64_t xb = 8 * blk + b;  // the activation block
      __m256i xv[MR];
      __m256 dx[MR], xs[MR];
      for (int i = 0; i < MR; ++i) {
        xv[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + i * xq_stride + (xb / 2) * 64 + 32 * (xb % 2)));
        dx[i] = _mm256_broadcast_ss(x.dxv + i * xd_stride + (xb / 2) * 8 + 4 * (xb % 2));
        if constexpr (Q == kQ2_K) xs[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(ones, xv[i])), dx[i]);
      }
      for (int j = 0; j < NC; ++j) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(qb[j] + 32 * b));
        const __m256i aw = kUnsigned ? wv : _mm256_abs_epi8(wv);
        const __m256 sw = _mm256_set_m128(_mm_set1_ps(ds[j][2 * b + 1]), _mm_set1_ps(ds[j][2 * b]));
        __m256 mw;
        if constexpr (Q == kQ2_K) mw = _mm256_set_m128(_mm_set1_ps(dm[j][2 * b + 1]), _mm_set1_ps(dm[j][2 * b]));
        for (int i = 0; i < MR; ++i) {
          const __m256i q32 = kUnsigned ? dot_u8s8(aw, xv[i]) : dot_u8s8(aw, _mm256_sign_epi8(xv[i], wv));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), _mm256_mul_ps(sw, dx[i]), acc[i][j]);
          if constexpr (Q == kQ2_K) macc[i][j] = _mm256_fmadd_ps(xs[i], mw, macc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j)
      c[i * ldc + j0 + j] = kUnsigned ? hsum8(acc[i][j]) - hsum8(macc[i][j]) : hsum8(acc[i][j]);
}
#endif

// C[m, ncols] = Q8_K(X)[m, K] . W[:, 0 : ncols] for Q2_K / Q3_K / Q5_K / IQ4_XS blocks.
template <int Q>
void int_dot_gguf_k(const QRows& x, const QCols& w, int64_t K, int64_t m, int64_t ncols, float* c, int64_t ldc) {
#if defined(__AVX2__)
  int_dot_tiles(m, ncols, [&](auto MRc, auto NCc, int64_t i0, int64_t j0) {
    k8tile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), w, j0, K, c + i0 * ldc, ldc);
  });
#else
  thread_local fvec abuf, pack;  // the float path over the Q8_K values, as int_dot_gguf's portable path
  abuf.resize(size_t(m * K));
  for (int64_t i = 0; i < m; ++i) {
    const QRows xi = x.at(i);
    for (int64_t k = 0; k < K; ++k) abuf[i * K + k] = xi.dxv[(k / 64) * 8 + 4 * ((k / 32) % 2)] * float(xi.q[k]);
  }
  gguf_matmul<Q>(abuf.data(), K, w, K, m, ncols, c, ldc, pack);
#endif
}
