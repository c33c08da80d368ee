// Block-scaled FP8 E4M3 weights (kind kFP8, jaxmoe.quant's kind="fp8_e4m3": DeepSeek-V3 /
// Qwen3 FP8 safetensors), read in place by both custom calls. Included by kernel_common.h
// (inside each library's anonymous namespace) after the vector types and `Weight`.
//
// Operands: data [E, out, in] float8_e4m3fn as stored (or its bytes as uint8; passed as
// float8: an XLA bitcast-convert to uint8 was a copy of every expert per call), scales [E, ceil(out / b), ceil(in / b)] float32 | float16 | bfloat16 (one
// per b x b block over [out, in]; the last blocks of a row or column may be partial), qbias
// empty; group = b. W[i, o] = float(q[o, i]) * float(scales[o / b, i / b]): the code's
// exact float32 value times the scale, one rounding (as jaxmoe.quant.dequantize_fp8_blocks).
// The kernels take b and in as multiples of 32 (whole vectors of codes per block).
#pragma once

constexpr int kFP8 = 40;  // outside the GGUF block kinds' numbers (is_gguf)

// E4M3 (ml_dtypes float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 NaN) -> float32, exactly, by bit arithmetic in vectors (GCC vector
// extensions: AVX-512, AVX2 or SSE, whatever the build targets): a normal code's exponent
// and mantissa move into float32's fields (exponent + 120); a subnormal one (exponent 0) is
// its mantissa times 2^-9, an exact integer conversion and power-of-two product (no
// float32 subnormal appears, so DAZ / FTZ cannot change a code's value).
inline vf fp8_codes_vf(vu x) {
  const vu mag = x & 0x7fu, sign = (x & 0x80u) << 24;
  const vu normal = (mag << 20) + (120u << 23);
  const vf subf = __builtin_convertvector(mag, vf) * 0.001953125f;  // mag < 8: mantissa * 2^-9
  vu sub;
  std::memcpy(&sub, &subf, sizeof(sub));
  vu r = mag < 8u ? sub : normal;
  r = mag == 0x7fu ? vu{} + 0x7fc00000u : r;
  r |= sign;
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// kLanes codes at p to float32 (each exact). AVX-512 / AVX2: the same operations in
// intrinsics (GCC's __builtin_convertvector of 16 bytes to 32-bit lanes was not a single
// widening instruction here: the generic form took ~15x the int8 kernel's time on Zen 4).
inline vf fp8_to_vf(const uint8_t* p) {
#if JM_LANES == 16 && defined(__AVX512F__)
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f)));
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7fc00000));
  r = _mm512_or_si512(r, _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24));
  return (vf)_mm512_castsi512_ps(r);
#elif JM_LANES == 8 && defined(__AVX2__)
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f)));
  __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
  r = _mm256_or_si256(r, _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24));
  return (vf)_mm256_castsi256_ps(r);
#else
  vu8 b;
  std::memcpy(&b, p, kLanes);
  return fp8_codes_vf(__builtin_convertvector(b, vu));
#endif
}

inline float fp8_to_float(uint8_t c) {  // one code (scalar reference of fp8_codes_vf)
  const uint32_t mag = c & 0x7fu, sign = uint32_t(c & 0x80u) << 24;
  uint32_t r;
  if (mag == 0x7fu) {
    r = 0x7fc00000u;
  } else if (mag < 8u) {
    const float f = float(mag) * 0.001953125f;
    std::memcpy(&r, &f, 4);
  } else {
    r = (mag << 20) + (120u << 23);
  }
  r |= sign;
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

// 32 codes q[0, 32) times the scale sc into o[0, 32) (the backward's decode_int_slice).
inline void scale_fp8_32(const uint8_t* __restrict q, float sc, float* __restrict o) {
  const vf sv = splat(sc);
  for (int l = 0; l < 32; l += kLanes) store(o + l, fp8_to_vf(q + l) * sv);
}

// Scale blocks of an FP8 weight: rows (ceil(out / b)) and columns (ceil(in / b)).
inline int64_t fp8_scale_rows(const Weight& w) { return (w.out + w.group - 1) / w.group; }
inline int64_t fp8_scale_cols(const Weight& w) { return (w.in + w.group - 1) / w.group; }

// The scale of stored row `col` (= e * out + o) of an FP8 weight at input element i.
inline float fp8_scale_at(const Weight& w, int64_t col, int64_t i) {
  const int64_t e = col / w.out, o = col - e * w.out;
  return load_scale(w.scales, w.stype, (e * fp8_scale_rows(w) + o / w.group) * fp8_scale_cols(w) + i / w.group);
}

// Why an FP8 operand (logical [E, in, out]) is malformed, or "" (check_weight).
inline std::string fp8_operand_problem(int32_t group, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer qbias,
                                       int64_t E, int64_t in, int64_t out) {
  const std::string what = "block-scaled FP8 E4M3 (kind " + std::to_string(kFP8) + ", blocks of " +
                           std::to_string(group) + " x " + std::to_string(group) + "), logical [" +
                           std::to_string(E) + ", " + std::to_string(in) + ", " + std::to_string(out) + "]";
  if (group <= 0 || group % 32 != 0 || in % 32 != 0)
    return what + ": the block edge and the input width must be multiples of 32";
  const auto dd = data.dimensions();
  const auto ct = data.element_type();
  if ((ct != ffi::DataType::F8E4M3FN && ct != ffi::DataType::U8) || dd.size() != 3 || dd[0] != E || dd[1] != out ||
      dd[2] != in)
    return what + ": codes must be float8_e4m3fn (or their bytes as uint8) [E, out, in]";
  const auto st = scales.element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16 && st != ffi::DataType::BF16)
    return what + ": scales must be float32, float16 or bfloat16";
  const auto sd = scales.dimensions();
  if (sd.size() != 3 || sd[0] != E || sd[1] != (out + group - 1) / group || sd[2] != (in + group - 1) / group)
    return what + ": scales must be [E, ceil(out / b), ceil(in / b)]";
  if (qbias.element_count() != 0) return what + ": block-scaled FP8 has no quantization biases (pass empty ones)";
  return "";
}
