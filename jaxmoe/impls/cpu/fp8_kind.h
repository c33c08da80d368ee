// Block-scaled FP8 E4M3 weights (kind kFP8, jaxmoe.quant's kind="fp8_e4m3": DeepSeek-V3 /
// Qwen3 FP8 safetensors), read in place by both custom calls. Included by kernel_common.h
// (inside each library's anonymous namespace) after the vector types and `Weight`.
//
// Operands: data [E, out, in] uint8 (the float8_e4m3fn codes' bytes, a free bitcast on the
// Python side), scales [E, ceil(out / b), ceil(in / b)] float32 | float16 | bfloat16 (one
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

// kLanes codes at p to float32 (each exact).
inline vf fp8_to_vf(const uint8_t* p) {
  vu8 b;
  std::memcpy(&b, p, kLanes);
  return fp8_codes_vf(__builtin_convertvector(b, vu));
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
  if (data.element_type() != ffi::DataType::U8 || dd.size() != 3 || dd[0] != E || dd[1] != out || dd[2] != in)
    return what + ": codes must be uint8 (the float8_e4m3fn bytes) [E, out, in]";
  const auto st = scales.element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16 && st != ffi::DataType::BF16)
    return what + ": scales must be float32, float16 or bfloat16";
  const auto sd = scales.dimensions();
  if (sd.size() != 3 || sd[0] != E || sd[1] != (out + group - 1) / group || sd[2] != (in + group - 1) / group)
    return what + ": scales must be [E, ceil(out / b), ceil(in / b)]";
  if (qbias.element_count() != 0) return what + ": block-scaled FP8 has no quantization biases (pass empty ones)";
  return "";
}
