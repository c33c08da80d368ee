// Integer dot products for the kinds whose ggml vec_dot_type is Q8_K: Q2_K, Q3_K, Q5_K,
// IQ4_XS, the IQ2 / IQ3 grid kinds (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), IQ1_S, IQ1_M,
// TQ1_0 and TQ2_0, and in the ggml mode Q4_K and Q6_K (ggml's ggml_vec_dot_q2_K_q8_K ...
// q6_K_q8_K, iq4_xs_q8_K, iq2_xxs_q8_K ... iq1_m_q8_K, tq1_0_q8_K and tq2_0_q8_K; the int8
// mode's Q4_K / Q6_K, a dx per block of 32, are int_dot.h's ktile). IQ1_M's codes are
// 8 g +- 1 (its delta folded in, d / 8), IQ1_S's delta a term like the mins', TQ1_0's
// trits unpacked by 16-bit products. Included at the end of int_dot.h (QRows quantized by
// kRuleQ8_K: the Q8_K codes of the unconverted rows, each block of 32 taking its
// super-block's d as dx; the natural order, IQ4_XS kOrderK4).
//
// As ggml computes them: per super-block, column and row one exact integer sum of code x
// activation code x group scale, then times d dx in float32. Per activation block of 32
// the column's 32 codes are built in a register (KBlock::code) and multiplied in int16
// pairs (vpmaddubsw: unsigned codes, Q2_K 0..3, Q3_K 0..7, Q4_K 0..15, Q5_K 0..31, Q6_K
// 0..63, straight; IQ4_XS's signed kvalues_iq4nl, by a byte shuffle, by the sign trick; the
// grid kinds' rows of magnitudes (8 bytes, IQ3: two rows of 4, gathered by index as ggml
// does) signed by their sign rows, by the sign trick too; no pair sum saturates, |w| x 127
// x 2 <= 32258), then times the int16 scales of the block's
// two groups of 16 (one byte shuffle picks them, GroupScales) and summed into int32 lanes
// (vpmaddwd, or vpdpwssd with VNNI). The mins (W = d sc q - dmin m): Q2_K per group of
// 16, Q4_K / Q5_K per sub-block of 32, the offsets of Q3_K (4) and Q6_K (32) as 4 sc and
// 32 sc per group of 16 (their codes taken unsigned), as an integer dot of the mins with the sums of 16
// activation codes (bsums, made once per call of int_dot_gguf_k), times dmin dx. The
// scale bytes are unpacked in registers (a vector reloaded from bytes just stored stalls
// the store forwarding). Without AVX2 the float path over the Q8_K values (int_dot_gguf's
// portable path).
#pragma once

// Q2_K, Q4_K and Q5_K: unsigned codes with mins (W = d sc q - dmin m); Q3_K, Q6_K and TQ2_0
// the same way (W = d sc u - d o sc, u unsigned, o = 4 / 32 / 1); IQ4_XS and the grid kinds:
// signed codes, no mins; IQ1_S: signed codes (-1, 0, 1) and a term like the mins' (its
// delta: W = d ls (g +- 1/8), the +-ls / 8 per 32 elements times their activation sum).
constexpr bool has_mins(int kind) {
  return kind == kQ2_K || kind == kQ3_K || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K || kind == kTQ1_0 ||
         kind == kTQ2_0;
}
constexpr bool uses_bsums(int kind) { return has_mins(kind) || kind == kIQ1_S; }

#if defined(__AVX2__)
// acc + the int16 pairs p16 times the int16 scales s16, summed in pairs into int32 lanes.
inline __m256i madd_acc(__m256i acc, __m256i p16, __m256i s16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p16, s16);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p16, s16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, s16));
#endif
}

// A super-block's 16 int16 group scales (one per 16 elements) as two vectors: groups 0..7
// in both 128-bit lanes, then 8..15; block b (elements 32 b ..) reads its two groups by
// one byte shuffle (2 b in the low lane: elements 0..15, 2 b + 1 in the high lane).
struct GroupScales {
  __m256i half[2];
  static GroupScales of(__m256i s16) {
    return {{_mm256_permute2x128_si256(s16, s16, 0x00), _mm256_permute2x128_si256(s16, s16, 0x11)}};
  }
  __m256i block(int b) const {
    const int k = b & 3;
    const __m256i ctl = _mm256_set_m128i(_mm_set1_epi16(int16_t(((4 * k + 3) << 8) | (4 * k + 2))),
                                         _mm_set1_epi16(int16_t(((4 * k + 1) << 8) | (4 * k))));
    return _mm256_shuffle_epi8(half[b >> 2], ctl);
  }
};

// 8 unsigned scale bytes (one per 32 elements, low 8 bytes of s) as 16 int16 group scales.
inline __m256i scales_per32(__m128i s) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s)); }

// Sign rows of 8 elements by ggml's 7-bit ksigns index (IQ2_XXS, IQ2_XS, IQ3_XXS), one 64-bit
// row each for vpsignb: byte j 0xFF (-1) where bit j of kKSigns[i] is set, else 0x01 (+1).
struct SignRows {
  uint64_t v[128];
};
constexpr SignRows sign_rows_k() {
  SignRows t{};
  for (int i = 0; i < 128; ++i)
    for (int j = 0; j < 8; ++j) t.v[i] |= uint64_t((kKSigns[i] >> j) & 1 ? 0xFF : 0x01) << (8 * j);
  return t;
}
alignas(64) inline constexpr SignRows kSignsK = sign_rows_k();
inline uint64_t grid_row8(const int8_t* r) {  // a grid row of 8 magnitudes
  uint64_t v;
  std::memcpy(&v, r, 8);
  return v;
}
inline uint64_t grid_rows4(const int8_t* a, const int8_t* b) {  // two grid rows of 4
  uint32_t lo, hi;
  std::memcpy(&lo, a, 4);
  std::memcpy(&hi, b, 4);
  return uint64_t(lo) | (uint64_t(hi) << 32);
}
// The sign rows of 32 elements from their 4 sign bytes (u32 s, byte r for row r): byte j
// 0xFF where bit j % 8 of byte j / 8 is set, else 0x01, in registers (as ggml's AVX2
// vec_dot_iq2_s / iq3_s expand them; a table row per byte took four scalar loads).
inline __m256i sign_bytes(uint32_t s) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  return _mm256_or_si256(bit_mask_bytes(_mm256_set1_epi32(int(s)), pick), _mm256_set1_epi8(1));
}
// 32 signed codes: four rows of 8 magnitudes (g0 the lowest elements) times four sign rows.
inline __m256i signed_rows(uint64_t g0, uint64_t g1, uint64_t g2, uint64_t g3, uint64_t s0, uint64_t s1, uint64_t s2,
                           uint64_t s3) {
  return _mm256_sign_epi8(_mm256_set_epi64x(int64_t(g3), int64_t(g2), int64_t(g1), int64_t(g0)),
                          _mm256_set_epi64x(int64_t(s3), int64_t(s2), int64_t(s1), int64_t(s0)));
}
// 16 int16 group scales 2 s + 1: from 16 nibbles s, one per group of 16 (the 8 bytes at p,
// low nibble first), or from 8 values s, one per 32 elements (both of its groups).
inline __m256i odd_scales_per16(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  const __m128i b = _mm_cvtsi64_si128(int64_t(v));
  const __m128i n = _mm_unpacklo_epi8(_mm_and_si128(b, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
  const __m256i s = _mm256_cvtepu8_epi16(n);
  return _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1));
}
inline __m256i odd_scales_per32(const uint8_t (&s)[8]) {
  uint64_t v;
  std::memcpy(&v, s, 8);
  const __m256i w = scales_per32(_mm_cvtsi64_si128(int64_t(v)));
  return _mm256_add_epi16(_mm256_add_epi16(w, w), _mm256_set1_epi16(1));
}

// TQ1_0's trits: byte j of the result is trit n of byte j of x where m's byte j is 3^n,
// ((x 3^n mod 256) 3) >> 8 (0, 1 or 2; gguf.quants' rule), in 16-bit lanes (even and
// odd bytes apart: AVX2 has no byte multiply).
inline __m256i trits(__m256i x, __m256i m) {
  const __m256i lo8 = _mm256_set1_epi16(0x00FF), three = _mm256_set1_epi16(3);
  const __m256i pe = _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(x, lo8), _mm256_and_si256(m, lo8)), lo8);
  const __m256i po = _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(x, 8), _mm256_srli_epi16(m, 8)), lo8);
  const __m256i te = _mm256_srli_epi16(_mm256_mullo_epi16(pe, three), 8);
  const __m256i to = _mm256_srli_epi16(_mm256_mullo_epi16(po, three), 8);
  return _mm256_or_si256(te, _mm256_slli_epi16(to, 8));
}

// One super-block of one column, what k8tile multiplies: its group scales (integers), the
// mins per group of 16 (has_mins kinds; integers), d and dmin; code(b) builds block b's 32
// codes as bytes (unsigned for the has_mins kinds, signed for IQ4_XS).
template <int Q>
struct KBlock {
  const uint8_t* b;
  GroupScales sc;
  __m256i mins;
  float d, dmin;

  static KBlock at(const uint8_t* b) {
    KBlock o;
    o.b = b;
    o.sc = GroupScales::of(scales(b, o.mins, o.d, o.dmin));
    return o;
  }
  static __m256i scales(const uint8_t* b, __m256i& mins, float& d, float& dmin) {
    if constexpr (Q == kQ2_K) {  // scales 16 bytes (low nibble scale, high min), qs 64, d f16, dmin f16
      const __m128i low4 = _mm_set1_epi8(15);
      const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low4));
      d = f16_at(b + 80);
      dmin = f16_at(b + 82);
      return _mm256_cvtepu8_epi16(_mm_and_si128(s, low4));
    } else if constexpr (Q == kQ3_K) {  // hmask 32, qs 64, 12 bytes of 6-bit scales (- 32), d f16
      // scale g: the low 4 bits from byte g % 8 (nibble g / 8), the top 2 from byte 8 + g % 4
      // (bits 2 (g / 4)); in registers: the 8 low bytes' nibbles side by side, the 4 high
      // bytes in every 32-bit lane shifted by 2 (g / 4) (the 12 bytes read as 8 + 4: the
      // block's last 2 bytes, d, end the tensor's buffer)
      const __m128i low4 = _mm_set1_epi8(15), three = _mm_set1_epi8(3);
      const __m128i l8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 96));
      uint32_t h4;
      std::memcpy(&h4, b + 104, 4);
      const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(l8, low4), _mm_and_si128(_mm_srli_epi16(l8, 4), low4));
      const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(h4)), _mm_setr_epi32(0, 2, 4, 6)), three);
      const __m128i s = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(s, _mm_set1_epi8(32)));
      mins = _mm256_slli_epi16(sc, 2);  // 4 sc: d sc (u - 4) = d sc u - d (4 sc), u = q + 4 in 0..7
      d = dmin = f16_at(b + 108);
      return sc;
    } else if constexpr (Q == kQ4_K || Q == kQ5_K) {  // d, dmin, 12 scale bytes, (Q5_K: qh 32), qs 128
      const __m128i v = k_scale_min_bytes(b + 4);  // bytes: sc 0..7, mn 0..7
      mins = scales_per32(_mm_srli_si128(v, 8));
      d = f16_at(b);
      dmin = f16_at(b + 2);
      return scales_per32(v);
    } else if constexpr (Q == kQ6_K) {  // ql 128, qh 64, 16 int8 scales (one per 16), d f16
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      mins = _mm256_slli_epi16(sc, 5);  // 32 sc: d sc (q - 32) = d sc q - d (32 sc)
      d = dmin = f16_at(b + 208);
      return sc;
    } else if constexpr (is_iq_grid_kind(Q)) {  // signed codes, no mins; scale 2 s + 1 (IQ3_S: 1 + 2 s)
      // and d times ggml's factor (IQ2: 1 / 8, IQ3_XXS: 1 / 4; exact), as vec_dot_iq*_q8_K
      mins = _mm256_setzero_si256();
      dmin = 0.f;
      uint8_t s8[8];
      if constexpr (Q == kIQ2_XXS || Q == kIQ3_XXS) {  // the scale in the top 4 bits of each sub-block's u32
        for (int ib = 0; ib < 8; ++ib) {
          uint32_t aux;
          std::memcpy(&aux, b + (Q == kIQ2_XXS ? 6 + 8 * ib : 66 + 4 * ib), 4);
          s8[ib] = uint8_t(aux >> 28);
        }
        d = f16_at(b) * (Q == kIQ2_XXS ? 0.125f : 0.25f);
        return odd_scales_per32(s8);
      } else if constexpr (Q == kIQ3_S) {  // 4 bytes of nibbles at 106, one per 32
        for (int ib = 0; ib < 8; ++ib) s8[ib] = (b[106 + ib / 2] >> (4 * (ib & 1))) & 15;
        d = f16_at(b);
        return odd_scales_per32(s8);
      } else {  // IQ2_XS (at 66), IQ2_S (at 74): 8 bytes of nibbles, one per 16
        d = f16_at(b) * 0.125f;
        return odd_scales_per16(b + (Q == kIQ2_XS ? 66 : 74));
      }
    } else if constexpr (Q == kIQ1_S) {  // d f16, qs 32, per 32 a u16 qh: scale (bits 12-14), delta sign (15)
      // ls = 2 s + 1 per 32; the delta's term -dmin mins . bsums with dmin = d / 8 and
      // mins = -ls (delta +1/8) or +ls (delta -1/8), as vec_dot_iq1_s_q8_K's sumi1
      uint8_t s8[8];
      int8_t m8[8];
      for (int ib = 0; ib < 8; ++ib) {
        uint16_t qh;
        std::memcpy(&qh, b + 34 + 2 * ib, 2);
        s8[ib] = uint8_t((qh >> 12) & 7);
        const int ls = 2 * s8[ib] + 1;
        m8[ib] = int8_t(qh & 0x8000 ? ls : -ls);
      }
      uint64_t mv;
      std::memcpy(&mv, m8, 8);
      const __m128i mb = _mm_cvtsi64_si128(int64_t(mv));
      mins = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(mb, mb));
      d = f16_at(b);
      dmin = d * 0.125f;
      return odd_scales_per32(s8);
    } else if constexpr (Q == kIQ1_M) {  // qs 32, qh 16, 4 u16: a 3-bit scale per 16, d f16 in their top nibbles
      // W = d (2 s + 1) (g +- 1/8) = (d / 8) (2 s + 1) (8 g +- 1): integer codes 8 g +- 1 (code())
      uint16_t sw[4];
      std::memcpy(sw, b + 48, 8);
      alignas(16) uint8_t s16[16];
      for (int g = 0; g < 16; ++g) s16[g] = uint8_t((sw[g / 4] >> (3 * (g & 3))) & 7);
      const __m256i sc = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(s16)));
      mins = _mm256_setzero_si256();
      d = half_to_float(uint16_t((sw[0] >> 12) | ((sw[1] >> 8) & 0x00f0) | ((sw[2] >> 4) & 0x0f00) | (sw[3] & 0xf000))) *
          0.125f;
      dmin = 0.f;
      return _mm256_add_epi16(_mm256_add_epi16(sc, sc), _mm256_set1_epi16(1));
    } else if constexpr (Q == kTQ2_0 || Q == kTQ1_0) {  // codes c = t + 1 (0..2), d f16: W = d c - d
      mins = _mm256_set1_epi16(1);
      d = dmin = f16_at(b + (Q == kTQ2_0 ? 64 : 52));
      return _mm256_set1_epi16(1);
    } else {  // IQ4_XS: d f16, scales_h u16, scales_l 4 bytes, qs 128; ls - 32 per 32
      // ls_j = nibble j of scales_l | bits 2j, 2j + 1 of scales_h << 4, spread to byte j of a
      // 64-bit word in registers (bytes built in memory and reloaded as a vector stall the
      // store forwarding)
      uint16_t sh;
      uint32_t sl;
      std::memcpy(&sh, b + 2, 2);
      std::memcpy(&sl, b + 4, 4);
      uint64_t lo = sl, hi = sh;
      lo = (lo | (lo << 16)) & 0x0000FFFF0000FFFFull;
      lo = (lo | (lo << 8)) & 0x00FF00FF00FF00FFull;
      lo = (lo | (lo << 4)) & 0x0F0F0F0F0F0F0F0Full;
      hi = (hi | (hi << 24)) & 0x000000FF000000FFull;
      hi = (hi | (hi << 12)) & 0x000F000F000F000Full;
      hi = (hi | (hi << 6)) & 0x0303030303030303ull;
      const __m128i ls = _mm_sub_epi8(_mm_cvtsi64_si128(int64_t(lo | (hi << 4))), _mm_set1_epi8(32));
      mins = _mm256_setzero_si256();
      d = f16_at(b);
      dmin = 0.f;
      // kOrderK4: blocks 2p and 2p + 1 hold sub-blocks 2p (low lane) and 2p + 1 (high lane),
      // so groups 4p .. 4p + 3 take ls[2p], ls[2p + 1], ls[2p], ls[2p + 1]
      return _mm256_cvtepi8_epi16(_mm_unpacklo_epi16(ls, ls));
    }
  }
  __m256i code(int k) const {
    if constexpr (Q == kQ2_K) {  // element 128 c + 32 j + l: bits 2 j of qs[32 c + l]
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (k >> 2)));
      return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (k & 3)), _mm256_set1_epi8(3));
    } else if constexpr (Q == kQ3_K) {  // element 32 k + l: u = bits 2 j of qs[32 c + l] | bit k of hm[l] << 2
      // (unsigned, 0..7; the offset 4 is the mins' term); the 16-bit shifts bring each
      // byte's own bit k to bit 2
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * (k >> 2)));
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (k & 3)), _mm256_set1_epi8(3));
      const __m256i hi = k >= 2 ? _mm256_srli_epi16(hm, k - 2) : _mm256_slli_epi16(hm, 2 - k);
      return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(4)));
    } else if constexpr (Q == kQ4_K) {  // sub-block 2p: low nibbles of qs[32 p..], 2p + 1: high
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (k >> 1)));
      return _mm256_and_si256(k & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    } else if constexpr (Q == kQ6_K) {  // block 4h + s: nibble s / 2 of ql[64 h + 32 (s & 1) + l], bits 2s of qh[32 h + l]
      const int h = k >> 2, s = k & 3;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (s & 1)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i t = s == 0   ? _mm256_slli_epi16(qh, 4)
                        : s == 1 ? _mm256_slli_epi16(qh, 2)
                        : s == 2 ? qh
                                 : _mm256_srli_epi16(qh, 2);
      return _mm256_or_si256(_mm256_and_si256(s >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(15)),
                             _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
    } else if constexpr (Q == kQ5_K) {  // sub-block 2p: low nibbles of qs[32 p..], 2p + 1: high; bit k of qh[l] << 4
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (k >> 1)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i nib = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
      const __m256i bit = _mm256_set1_epi8(char(1 << k));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
      return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    } else if constexpr (Q == kTQ2_0) {  // element 128 c + 32 j + l: bits 2 j of qs[32 c + l] (Q2_K's layout)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * (k >> 2)));
      return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (k & 3)), _mm256_set1_epi8(3));
    } else if constexpr (Q == kTQ1_0) {  // 48 bytes of 5 trits, 4 of 4 (decode_iq_block's layout)
      if (k < 5)  // elements 32 k + m: trit k of byte m
        return trits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), _mm256_set1_epi8(char(kPow3[k])));
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32));  // elements 160 + 16 n + m
      if (k < 7) {  // trits 2 (k - 5), 2 (k - 5) + 1 of bytes 32..47
        const int n = 2 * (k - 5);
        return trits(_mm256_set_m128i(y, y), _mm256_set_m128i(_mm_set1_epi8(char(kPow3[n + 1])), _mm_set1_epi8(char(kPow3[n]))));
      }
      uint32_t h;  // elements 240 + 4 n + m: trit n of byte 48 + m
      std::memcpy(&h, b + 48, 4);
      const __m128i hm = _mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
      return trits(_mm256_set_m128i(_mm_set1_epi32(int(h)), y), _mm256_set_m128i(hm, _mm_set1_epi8(81)));
    } else if constexpr (Q == kIQ1_S) {  // rows of 8 of -1 / 0 / 1: index byte | 3 bits of qh per row
      const uint8_t* qs = b + 2 + 4 * k;
      uint16_t qh;
      std::memcpy(&qh, b + 34 + 2 * k, 2);
      return _mm256_set_epi64x(int64_t(grid_row8(kG1S.v[qs[3] | ((qh >> 1) & 0x700)])),
                               int64_t(grid_row8(kG1S.v[qs[2] | ((qh << 2) & 0x700)])),
                               int64_t(grid_row8(kG1S.v[qs[1] | ((qh << 5) & 0x700)])),
                               int64_t(grid_row8(kG1S.v[qs[0] | ((qh << 8) & 0x700)])));
    } else if constexpr (Q == kIQ1_M) {  // row i = 4 k + r: index byte i | 3 bits of nibble i of qh, delta
      // sign its bit 3; the code 8 g + 1 (delta +1/8) or 8 g - 1 (delta -1/8)
      uint16_t h;
      std::memcpy(&h, b + 32 + 2 * k, 2);  // the 4 nibbles of rows 4 k .. 4 k + 3
      const uint8_t* qs = b + 4 * k;
      uint64_t g[4], dl[4];
      for (int r = 0; r < 4; ++r) {
        const int nib = (h >> (4 * r)) & 15;
        g[r] = grid_row8(kG1S.v[qs[r] | ((nib & 7) << 8)]);
        dl[r] = nib & 8 ? ~uint64_t(0) : 0x0101010101010101ull;
      }
      __m256i v = _mm256_set_epi64x(int64_t(g[3]), int64_t(g[2]), int64_t(g[1]), int64_t(g[0]));
      v = _mm256_add_epi8(v, v);
      v = _mm256_add_epi8(v, v);
      v = _mm256_add_epi8(v, v);
      return _mm256_add_epi8(v, _mm256_set_epi64x(int64_t(dl[3]), int64_t(dl[2]), int64_t(dl[1]), int64_t(dl[0])));
    } else if constexpr (Q == kIQ2_XXS) {  // 4 grid-index bytes, a u32 of 4 x 7 sign-index bits (+ the scale)
      const uint8_t* g = b + 2 + 8 * k;
      uint32_t aux;
      std::memcpy(&aux, g + 4, 4);
      return signed_rows(grid_row8(kG2XXS.v[g[0]]), grid_row8(kG2XXS.v[g[1]]), grid_row8(kG2XXS.v[g[2]]),
                         grid_row8(kG2XXS.v[g[3]]), kSignsK.v[aux & 127], kSignsK.v[(aux >> 7) & 127],
                         kSignsK.v[(aux >> 14) & 127], kSignsK.v[(aux >> 21) & 127]);
    } else if constexpr (Q == kIQ2_XS) {  // per row of 8 a u16: 9-bit grid index, 7-bit sign index
      uint16_t q[4];
      std::memcpy(q, b + 2 + 8 * k, 8);
      return signed_rows(grid_row8(kG2XS.v[q[0] & 511]), grid_row8(kG2XS.v[q[1] & 511]), grid_row8(kG2XS.v[q[2] & 511]),
                         grid_row8(kG2XS.v[q[3] & 511]), kSignsK.v[q[0] >> 9], kSignsK.v[q[1] >> 9],
                         kSignsK.v[q[2] >> 9], kSignsK.v[q[3] >> 9]);
    } else if constexpr (Q == kIQ2_S) {  // index bytes at 2, 2 high bits per row at 66, sign bytes at 34
      const uint8_t* qs = b + 2 + 4 * k;
      const int qh = b[66 + k];
      uint32_t sg;
      std::memcpy(&sg, b + 34 + 4 * k, 4);
      const __m256i g = _mm256_set_epi64x(
          int64_t(grid_row8(kG2S.v[qs[3] | ((qh << 2) & 0x300)])), int64_t(grid_row8(kG2S.v[qs[2] | ((qh << 4) & 0x300)])),
          int64_t(grid_row8(kG2S.v[qs[1] | ((qh << 6) & 0x300)])), int64_t(grid_row8(kG2S.v[qs[0] | ((qh << 8) & 0x300)])));
      return _mm256_sign_epi8(g, sign_bytes(sg));
    } else if constexpr (Q == kIQ3_XXS) {  // 8 index bytes (rows of 4), a u32 of 4 x 7 sign-index bits at 66
      const uint8_t* g = b + 2 + 8 * k;
      uint32_t aux;
      std::memcpy(&aux, b + 66 + 4 * k, 4);
      return signed_rows(grid_rows4(kG3XXS.v[g[0]], kG3XXS.v[g[1]]), grid_rows4(kG3XXS.v[g[2]], kG3XXS.v[g[3]]),
                         grid_rows4(kG3XXS.v[g[4]], kG3XXS.v[g[5]]), grid_rows4(kG3XXS.v[g[6]], kG3XXS.v[g[7]]),
                         kSignsK.v[aux & 127], kSignsK.v[(aux >> 7) & 127], kSignsK.v[(aux >> 14) & 127],
                         kSignsK.v[(aux >> 21) & 127]);
    } else if constexpr (Q == kIQ3_S) {  // 8 index bytes + bit 8 of each from qh[k], 4 sign bytes at 74
      const uint8_t* g = b + 2 + 8 * k;
      const int qh = b[66 + k];
      auto row = [&](int r) { return kG3S.v[g[r] | (((qh >> r) & 1) << 8)]; };
      uint32_t sg;
      std::memcpy(&sg, b + 74 + 4 * k, 4);
      const __m256i gv = _mm256_set_epi64x(int64_t(grid_rows4(row(6), row(7))), int64_t(grid_rows4(row(4), row(5))),
                                           int64_t(grid_rows4(row(2), row(3))), int64_t(grid_rows4(row(0), row(1))));
      return _mm256_sign_epi8(gv, sign_bytes(sg));
    } else {  // IQ4_XS, kOrderK4: sub-blocks 2p, 2p + 1 in 32 bytes, low nibbles (elements 0..15) for
      // block 2p, high ones (16..31) for block 2p + 1, as the activations are laid out
      const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Bytes)));
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * (k >> 1)));
      return _mm256_shuffle_epi8(tab, _mm256_and_si256(k & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15)));
    }
  }
};

// C[MR, NC] (columns j0.. at stride ldc) = Q8_K(X)[MR, K] . W columns j0.. for Q2_K / Q3_K
// / Q5_K / IQ4_XS blocks (w.stride the row's bytes), as ggml's vec_dot: per super-block and
// row an exact integer sum of code x activation x group scale (int16 pair sums, vpmaddubsw,
// times the scales, vpmaddwd / vpdpwssd), then times d dx in float; the mins' term likewise
// from bsums ([MR, K / 16] sums of 16 activation codes, at stride K / 16), times dmin dx.
template <int MR, int NC, int Q>
void k8tile(const QRows& x, const int16_t* bsums, const QCols& w, int64_t j0, int64_t K, float* c, int64_t ldc) {
  static_assert(is_k8tile_kind(Q), "k8tile: a kind of is_k8tile_kind");
  constexpr int BB = block_bytes(Q);
  constexpr bool kUnsigned = has_mins(Q), kMins = uses_bsums(Q);
  const int64_t xq_stride = x.pairs * 64, xd_stride = x.pairs * 8, nbs = K / 16;
  const uint8_t* rows[NC];
  for (int j = 0; j < NC; ++j) rows[j] = reinterpret_cast<const uint8_t*>(w.base + (j0 + j) * w.stride);
  const char* next = w.base + (j0 + NC) * w.stride;  // the next tile's columns, and far_cols into L2
  const char* far = far_cols(w, j0, NC);
  __m256 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    prefetch_kblock<NC, BB>(next, far, w.stride, blk);
    KBlock<Q> kb[NC];
    for (int j = 0; j < NC; ++j) kb[j] = KBlock<Q>::at(rows[j] + blk * BB);
    __m256i isum[MR][NC];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) isum[i][j] = _mm256_setzero_si256();
    // unrolled: constant shifts and scale shuffles, kb[] kept in registers (the loop kept
    // reloads them from the stack and shifts by a variable count)
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      __m256i xv[MR];
      for (int i = 0; i < MR; ++i)
        xv[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + i * xq_stride + 256 * blk + 32 * b));
      for (int j = 0; j < NC; ++j) {
        const __m256i wv = kb[j].code(b), s16 = kb[j].sc.block(b);
        const __m256i aw = kUnsigned ? wv : _mm256_abs_epi8(wv);
        for (int i = 0; i < MR; ++i) {
          const __m256i p16 = _mm256_maddubs_epi16(aw, kUnsigned ? xv[i] : _mm256_sign_epi8(xv[i], wv));
          isum[i][j] = madd_acc(isum[i][j], p16, s16);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const float dx = x.dxv[i * xd_stride + 32 * blk];  // the super-block's d, every block's dx
      __m256i bs{};
      if constexpr (kMins) bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums + i * nbs + 16 * blk));
      for (int j = 0; j < NC; ++j) {
        if constexpr (kMins)
          acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(-(dx * kb[j].dmin)), _mm256_cvtepi32_ps(_mm256_madd_epi16(kb[j].mins, bs)),
                                      acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(dx * kb[j].d), _mm256_cvtepi32_ps(isum[i][j]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j0 + j] = hsum8(acc[i][j]);
}
#endif

// C[m, ncols] = Q8_K(X)[m, K] . W[:, 0 : ncols] for Q2_K / Q3_K / Q5_K / IQ4_XS blocks.
template <int Q>
void int_dot_gguf_k(const QRows& x, const QCols& w, int64_t K, int64_t m, int64_t ncols, float* c, int64_t ldc) {
#if defined(__AVX2__)
  thread_local std::vector<int16_t> bsums;  // sums of 16 activation codes (the mins' / IQ1_S delta's term)
  const int64_t nbs = K / 16;
  bsums.resize(size_t(m * nbs));
  for (int64_t i = 0; i < m && uses_bsums(Q); ++i) {  // (those kinds: the natural order)
    const int8_t* q = x.q + i * x.pairs * 64;
    for (int64_t g = 0; g < nbs; ++g) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += q[16 * g + l];
      bsums[size_t(i * nbs + g)] = int16_t(s);
    }
  }
  int_dot_tiles(m, ncols, [&](auto MRc, auto NCc, int64_t i0, int64_t j0) {
    k8tile<decltype(MRc)::value, decltype(NCc)::value, Q>(x.at(i0), bsums.data() + i0 * nbs, w, j0, K, c + i0 * ldc,
                                                          ldc);
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
