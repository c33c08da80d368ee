// Shared by grouped_swiglu.cc (forward) and grouped_swiglu_bwd.cc (backward) of impl="cpu":
// float vectors of the build's width, bfloat16 / float16 conversions, explicit fused
// multiply-adds, 64-byte aligned scratch vectors, the weight kinds of the custom calls, the
// GGUF block decoders, the dot-product tile along both operands' rows (nt_tile), the
// register-tile steps, the thread-pool loop, and the expert operands' checks and FFI bindings.
// Included inside each library's anonymous namespace, after kernel_prelude.h (the system
// headers and xla/ffi/api/ffi.h with `namespace ffi = xla::ffi`).
// Both libraries are built with -ffp-contract=off (jaxmoe/impls/cpu/build.py): every
// product and sum here rounds as written.
#pragma once

// Asks Linux for transparent huge pages under a result buffer before it is first written
// (best effort; THP in "madvise" mode, the common default; a no-op for pages already
// touched). XLA allocates results fresh for every call; touched in 4 KiB pages, each
// first write costs a page fault, which measured ~2.5 of the ~3.1 s backward of the
// Qwen3.6 layer at T = 64 (weight gradients) and ~65K faults per backward at T = 1024
// (the [P, d] / [P, 2F] rows); 2 MiB pages take 512x fewer faults.
inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!data) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  const uintptr_t a = (begin + kHuge - 1) & ~(kHuge - 1), b = end & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

#if defined(__AVX512F__)
#define JM_LANES 16
#else
#define JM_LANES 8
#endif
constexpr int kLanes = JM_LANES;
typedef float vf __attribute__((vector_size(JM_LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(JM_LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(JM_LANES * 4)));
typedef int8_t vs8 __attribute__((vector_size(JM_LANES)));
typedef uint8_t vu8 __attribute__((vector_size(JM_LANES)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load(const uint16_t* p) {  // bfloat16 -> float32 is a 16-bit shift
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu w = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline float bf16_to_float(uint16_t h) {
  uint32_t w = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// Every lane = s (exactly: `vf{} + s` rounds -0 to +0, so it cannot be folded into a
// broadcast and costs an add before each one).
inline vf splat(float s) {
#if JM_LANES == 16 && defined(__AVX512F__)
  return (vf)_mm512_set1_ps(s);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(s);
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = s;
  return v;
#endif
}
// a * b + c, fused where the target has FMA. Built with -ffp-contract=off, so the
// compiler fuses nothing on its own: every output element gets one chain of these,
// the same whatever a task's row count (GCC contracted some tile shapes and not others,
// which made a row's result depend on the batch: docs/design.md, batch invariance).
inline vf fmadd(vf a, vf b, vf c) {
#if JM_LANES == 16 && defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif JM_LANES == 8 && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, exact (subnormals, inf, NaN)
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t w;
  if (em >= 0x7c00u) {
    w = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
  } else if (em >= 0x400u) {
    w = sign | ((em + ((127u - 15u) << 10)) << 13);
  } else {
    float f = float(em) * 5.9604644775390625e-08f;  // em * 2^-24
    std::memcpy(&w, &f, 4);
    w |= sign;
  }
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

inline float round_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if ((w & 0x7fffffffu) > 0x7f800000u) return f;
  w = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &w, 4);
  return f;
}

// float32 -> the nearest float16 (ties to even, overflow to inf, subnormals), as float32.
inline float round_f16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  const uint32_t sign = w & 0x80000000u, a = w & 0x7fffffffu;
  if (a >= 0x7f800000u) return f;
  uint32_t b;
  if (a >= 0x38800000u) {  // a normal float16 (|f| >= 2^-14): 10 mantissa bits kept
    b = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;
    if (b >= 0x47800000u) b = 0x7f800000u;  // rounds to 65536 or more: inf
  } else {  // a float16 subnormal: a multiple of 2^-24 (both scalings exact)
    float af;
    std::memcpy(&af, &a, 4);
    const float r = std::nearbyint(af * 16777216.f) * 5.9604644775390625e-08f;
    std::memcpy(&b, &r, 4);
  }
  b |= sign;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

// Scratch buffers of the kernels (tile buffers, reordered activation rows, per-task
// results, converted scales): 64-byte aligned, so a vector load at a multiple of 64 bytes
// from a buffer's start (every load of the tile buffer and of the reordered rows: rows of
// K floats, K a multiple of 32) never straddles two cache lines. glibc's malloc aligns to
// 16 bytes (a large block is mmap'd at a page + 16), and then every 64-byte load of such a
// buffer touches two lines (forward kernel call alone on Zen 5: MLX int4 T = 64 / 256
// 1.13-1.28x, Q4_K T = 256 1.07-1.10x faster aligned).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using fvec = std::vector<float, Aligned64<float>>;

// ---------------------------------------------------------------------------------
// One expert weight operand in its stored format.
enum Kind : int {
  kFloat = 0, kInt8 = 1, kInt4 = 2, kQ4_1 = 3, kQ5_0 = 4, kQ5_1 = 5, kQ4_K = 6, kQ5_K = 7, kQ6_K = 8,
  kQ2_K = 9, kQ3_K = 10, kIQ4_NL = 11, kIQ4_XS = 12, kMXFP4 = 13,
  kIQ2_XXS = 14, kIQ2_XS = 15, kIQ2_S = 16, kIQ3_XXS = 17, kIQ3_S = 18, kIQ1_S = 19, kIQ1_M = 20, kTQ1_0 = 21,
  kTQ2_0 = 22,  // iq_kinds.h
  kQ4_0 = 23
};
constexpr bool is_gguf(int q) { return q >= kQ4_1 && q <= kQ4_0; }
// GGUF block kinds: elements and bytes per block (ggml's GGML_QUANT_SIZES).
constexpr int block_elems(int q) { return q <= kQ5_1 || q == kIQ4_NL || q == kMXFP4 || q == kQ4_0 ? 32 : 256; }
constexpr int block_bytes(int q) {
  return q == kQ4_1   ? 20
         : q == kQ5_0 ? 22
         : q == kQ5_1 ? 24
         : q == kQ4_K ? 144
         : q == kQ5_K ? 176
         : q == kQ6_K ? 210
         : q == kQ2_K ? 84
         : q == kQ3_K ? 110
         : q == kIQ4_NL || q == kQ4_0 ? 18
         : q == kIQ4_XS ? 136
         : q == kIQ2_XXS ? 66
         : q == kIQ2_XS ? 74
         : q == kIQ2_S ? 82
         : q == kIQ3_XXS ? 98
         : q == kIQ3_S ? 110
         : q == kIQ1_S ? 50
         : q == kIQ1_M ? 56
         : q == kTQ1_0 ? 54
         : q == kTQ2_0 ? 66
                        : 17;  // MXFP4
}
enum SType : int { kSF32 = 0, kSF16 = 1, kSBF16 = 2 };

struct Weight {
  int kind;
  bool bf16;            // kind 0: bfloat16 data
  const void* data;
  const void* scales;
  const void* qbias;    // null when absent
  int stype;
  int64_t in, out, group;
  bool int_dot = false;  // forward, int8 / int4 codes: integer dots over int8 activations (int_dot.h)
  int8_t qslot = 0;      // which quantized rows it reads (run_problems: its order and rule)
};

// fn(std::integral_constant<int, Q>{}) for GGUF block kind `kind` (Q a template argument:
// one instantiation of the caller's templates per kind).
template <typename Fn>
inline void with_gguf_kind(int kind, Fn&& fn) {
  switch (kind) {
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ2_K: return fn(std::integral_constant<int, kQ2_K>{});
    case kQ3_K: return fn(std::integral_constant<int, kQ3_K>{});
    case kIQ4_NL: return fn(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return fn(std::integral_constant<int, kIQ4_XS>{});
    case kMXFP4: return fn(std::integral_constant<int, kMXFP4>{});
    case kIQ2_XXS: return fn(std::integral_constant<int, kIQ2_XXS>{});
    case kIQ2_XS: return fn(std::integral_constant<int, kIQ2_XS>{});
    case kIQ2_S: return fn(std::integral_constant<int, kIQ2_S>{});
    case kIQ3_XXS: return fn(std::integral_constant<int, kIQ3_XXS>{});
    case kIQ3_S: return fn(std::integral_constant<int, kIQ3_S>{});
    case kIQ1_S: return fn(std::integral_constant<int, kIQ1_S>{});
    case kIQ1_M: return fn(std::integral_constant<int, kIQ1_M>{});
    case kTQ1_0: return fn(std::integral_constant<int, kTQ1_0>{});
    case kTQ2_0: return fn(std::integral_constant<int, kTQ2_0>{});
    case kQ4_0: return fn(std::integral_constant<int, kQ4_0>{});
    default: return fn(std::integral_constant<int, kQ6_K>{});
  }
}

inline float load_scale(const void* p, int stype, int64_t i) {
  switch (stype) {
    case kSF32: return static_cast<const float*>(p)[i];
    case kSF16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// std::fmin(x, c) / std::fmax(x, c) for a bound c that is not NaN, as one vminss / vmaxss:
// GCC calls libm for std::fmin / std::fmax (their rule for a NaN operand). The same value,
// a NaN x included (it gives c, as fmin and fmax do).
inline float min_bound(float x, float c) { return x < c ? x : c; }
inline float max_bound(float x, float c) { return x > c ? x : c; }

#include "fp8_kind.h"  // block-scaled FP8 E4M3 (kFP8): decode, scale lookup, operand check

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept NaN (quiet)
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if ((w & 0x7fffffffu) > 0x7f800000u) return uint16_t((w >> 16) | 0x40u);
  return uint16_t((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------------
// GGUF block kinds, decoded one block (32 or 256 elements of one column) at a time into
// float32, bit-exact with gguf.quants.dequantize (the same float32 products and sums in
// the same order; -ffp-contract=off keeps `d * q + m` two roundings). AVX-512 and AVX2
// builds decode in vector registers (decode_block's branches); the byte loops after them
// are the portable path (with AVX2 the compiler left them mostly scalar: Q4_1 / Q5_0 /
// Q5_1 kernel calls took 4-10x the vector decoders' time on Zen 3).
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Q4_K / Q5_K: the 8 sub-blocks' scales d * sc_j and mins dmin * mn_j (float32, one
// rounding each, as gguf.quants) from the 12 packed bytes s: sc_j = s[j] & 63 and
// mn_j = s[j + 4] & 63 for j < 4; for j >= 4 the low 4 bits come from s[j + 4] (sc: its
// low nibble, mn: its high one) and the top 2 bits from s[j - 4] (sc) / s[j] (mn) >> 6.
// All 16 six-bit values at once, four bytes per 32-bit word (no per-sub-block branches).
#if defined(__AVX2__)
// The 12 packed bytes at s as 16 bytes: the 6-bit scales 0..7, then the mins 0..7. In
// vector registers (lanes u0 u1 u2 from the 12 bytes; the 16-byte load stays inside the
// block): built as four scalar words and reloaded as one vector, the load could not be
// forwarded from the two 8-byte stores and stalled (~19% of a Q4_K T = 8 call, perf).
inline __m128i k_scale_min_bytes(const uint8_t* s) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i lo = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i b = _mm_srli_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)), 6);
  const __m128i top = _mm_slli_epi32(_mm_and_si128(b, _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4);
  return _mm_or_si128(lo, top);
}
#endif

inline void k_scales_mins(const uint8_t* s, float d, float dmin, float* __restrict dsc, float* __restrict dmn) {
#if defined(__AVX2__)
  const __m128i v = k_scale_min_bytes(s);  // bytes: sc 0..7, mn 0..7
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(d), sc));
  _mm256_storeu_ps(dmn, _mm256_mul_ps(_mm256_set1_ps(dmin), mn));
#else
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t six = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, two = 0x03030303u;
  const uint32_t w[4] = {
      u[0] & six,                                                // sc 0..3
      (u[2] & nib) | (((u[0] >> 6) & two) << 4),                 // sc 4..7
      u[1] & six,                                                // mn 0..3
      ((u[2] >> 4) & nib) | (((u[1] >> 6) & two) << 4),          // mn 4..7
  };
  uint8_t v[16];
  std::memcpy(v, w, 16);
  for (int j = 0; j < 8; ++j) {
    dsc[j] = d * float(v[j]);
    dmn[j] = dmin * float(v[8 + j]);
  }
#endif
}

// Codes (bytes) to float32 in vectors, N of them (a multiple of the vector width), in the
// operations of gguf.quants.dequantize: s q + m, s q - m, or s (q - z) (z a small exact
// constant: float(q - z) == float(q) - z for these codes).
inline vf u8_to_vf(const uint8_t* p) {
#if JM_LANES == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vu8 q;
  std::memcpy(&q, p, kLanes);
  return __builtin_convertvector(q, vf);
#endif
}

enum Affine : int { kScaleAdd, kScaleSub, kScaleShift };  // s q + m | s q - m | s (q - z)

// The affine decode of codes already converted to float (f), in the order of
// gguf.quants.dequantize.
template <int Mode>
inline vf affine(vf f, vf sv, vf mv, vf zv) {
  if constexpr (Mode == kScaleAdd) {
    vf w = sv * f;
    return w + mv;
  } else if constexpr (Mode == kScaleSub) {
    vf w = sv * f;
    return w - mv;
  } else {
    return sv * (f - zv);
  }
}

template <int Mode, int N>
inline void codes_to_float(const uint8_t* q, float s, float m, float z, float* out) {
  static_assert(N % kLanes == 0, "a group fills whole vectors");
  const vf sv = splat(s), mv = splat(m), zv = splat(z);
  for (int l = 0; l < N; l += kLanes) store(out + l, affine<Mode>(u8_to_vf(q + l), sv, mv, zv));
}

#if JM_LANES == 16 && defined(__AVX512F__)
#define JM_LUT16 1
// 4-bit codes by table: the 16 values of s q + m (or s q - m) for q = 0..15, by the same
// affine decode as codes_to_float (so each entry is the same bits as the code's own
// conversion), and a code's value is one permute (vpermps reads the low 4 bits of each
// index lane: no mask). Against widen + convert + multiply + add per vector: Q4_K / int4
// decode ~2x fewer ops. Q5_K's 5-bit codes take two tables (first = 0 and 16) and one
// two-table permute (vpermt2ps reads the low 5 bits).
alignas(64) inline constexpr float kCodes32[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                                   11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                                   22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
template <int Mode>
inline vf lut16(float s, float m, int first = 0) {  // the values of codes first .. first + 15
  static_assert(Mode == kScaleAdd || Mode == kScaleSub, "an affine table");
  return affine<Mode>(load(kCodes32 + first), splat(s), splat(m), vf{});
}

#endif

#if defined(JM_LUT16) || (defined(__AVX2__) && JM_LANES == 8)
#define JM_VDECODE 1
// Codes decoded in vector registers (AVX-512 or AVX2 builds): no byte buffer between a
// block's bytes and its float values; the int4 kinds take the split order (kSplitInt4).

// Q6_K (the layout in decode_block): d * sc_g of the 16 groups (one rounding each).
inline void q6k_scales(const uint8_t* b, float* ds) {
#ifdef JM_LUT16
  store(ds, (vf)_mm512_mul_ps(_mm512_set1_ps(f16_at(b + 208)),
                              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))))));
#else
  const __m256 d = _mm256_set1_ps(f16_at(b + 208));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  store(ds, (vf)_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  store(ds + 8, (vf)_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#endif
}
// The 256 codes q - 32 of a block as bytes (qb[e] for element e = 128 h + 32 s + l), each
// 32 of them built in one 32-byte vector: per half h, its low-nibble bytes
// ql[64 h + 32 (s & 1) + l] (the high nibble for s >= 2) and two-bit pairs
// qh[32 h + l] >> 2 s. Integer operations only, so qb is exactly the codes; a vector of 16
// of them is then widened by q6k_codes_vec. (Built 16 codes at a time from two 16-byte
// loads each, the byte work took ~3x the operations per code.)
inline void q6k_codes(const uint8_t* b, int8_t* __restrict qb) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), z = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i t[4] = {
        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),  // bits 0-1 of qh, as bits 4-5
        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),  // bits 2-3
        _mm256_and_si256(qh, m30),                        // bits 4-5
        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),  // bits 6-7
    };
    const __m256i lo[4] = {
        _mm256_and_si256(l0, m4),
        _mm256_and_si256(l1, m4),
        _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
        _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
    };
    for (int s = 0; s < 4; ++s)
      _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 128 * h + 32 * s),
                         _mm256_sub_epi8(_mm256_or_si256(lo[s], t[s]), z));
  }
}
inline vf q6k_codes_vec(const int8_t* qb) {  // kLanes codes q - 32 (bytes, 16-byte aligned) to float
#ifdef JM_LUT16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qb))));
#else
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb))));
#endif
}

#if !defined(JM_LUT16)
// Q4_K / Q5_K codes of elements 32 s + 8 h .. 32 s + 8 h + 7 of a block (sub-block s, the
// layout in decode_block) as float, in 8 lanes: the 8 bytes of their nibbles widened (one
// byte per 32-bit lane), the low nibble for even s, the high one for odd s; Q5_K ORs in
// bit s of qh[8 h + l] as bit 4. Integer operations, then one exact conversion: the same
// floats as the byte loops' u8_to_vf.
template <int Q>
inline vf k_codes8(const uint8_t* b, int s, int h) {
  constexpr int kQs = Q == kQ5_K ? 48 : 16;  // where the nibbles start
  const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kQs + 32 * (s >> 1) + 8 * h)));
  __m256i q = s & 1 ? _mm256_srli_epi32(z, 4) : _mm256_and_si256(z, _mm256_set1_epi32(15));
  if constexpr (Q == kQ5_K) {
    const __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * h)));
    const __m256i bit = _mm256_slli_epi32(_mm256_srl_epi32(hb, _mm_cvtsi32_si128(s)), 4);
    q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi32(16)));
  }
  return (vf)_mm256_cvtepi32_ps(q);
}
#endif
#endif

// IQ4_NL / IQ4_XS / MXFP4 / Q4_0: the 4-bit codes index a table of signed values (ggml's
// kvalues_iq4nl; MXFP4: twice the E2M1 values, kvalues_mxfp4; Q4_0: q - 8), and the scale of
// sub-block j (32 elements) is: IQ4_NL, Q4_0 d (f16); IQ4_XS d * (ls_j - 32) (6-bit ls_j: low 4 bits from
// nibble j % 2 of byte 4 + j / 2, top 2 from bits 2 j of the u16 at byte 2); MXFP4 the
// E8M0 exponent e of byte 0 halved (ggml_e8m0_to_fp32_half: 2^(e - 128), subnormal for e < 2).
alignas(64) inline constexpr float kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};
alignas(64) inline constexpr float kFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(64) inline constexpr float kQ40Values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// The 32-element table kinds (one scale per block, codes from byte 2 or 1).
constexpr bool is_table32(int q) { return q == kIQ4_NL || q == kMXFP4 || q == kQ4_0; }
// MXFP4's halved E8M0 scales, the 256 of them (one load per block where the bit arithmetic
// took a compare and several scalar ops).
struct E8M0Half {
  alignas(64) float v[256];
  E8M0Half() {
    for (uint32_t e = 0; e < 256; ++e) {
      const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
      std::memcpy(&v[e], &bits, 4);
    }
  }
};
inline const E8M0Half kE8M0Half{};
template <int Q>
inline float table_scale(const uint8_t* b, int j) {
  if constexpr (Q == kMXFP4) {
    return kE8M0Half.v[b[0]];
  } else if constexpr (Q == kIQ4_NL || Q == kQ4_0) {
    return f16_at(b);
  } else {
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const int ls = ((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
    return f16_at(b) * float(ls - 32);
  }
}

#include "iq_kinds.h"  // IQ2_XXS ... TQ2_0 (kinds 14-22): decode_iq_block

template <int Q>
inline void decode_kq_block(const uint8_t* b, float* __restrict out) {
#ifdef JM_LUT16
  if constexpr (is_table32(Q) || Q == kIQ4_XS) {  // per 32 codes a table, per 16 a permute
    const vf vals = load(Q == kMXFP4 ? kFP4Values : Q == kQ4_0 ? kQ40Values : kIQ4Values);
    const uint8_t* qs = b + (Q == kIQ4_XS ? 8 : Q == kMXFP4 ? 1 : 2);
    for (int j = 0; j < (Q == kIQ4_XS ? 8 : 1); ++j) {  // the table's entries: one rounding of s * v each
      const vf t = splat(table_scale<Q>(b, j)) * vals;
      const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j)));
      store(out + 32 * j, (vf)_mm512_permutexvar_ps(z, (__m512)t));  // low nibbles (vpermps reads 4 bits)
      store(out + 32 * j + 16, (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), (__m512)t));
    }
    return;
  }
  if constexpr (Q == kQ4_K) {  // the layout below; per sub-block a table, per 16 codes a permute
    alignas(32) float dsc[8], dmn[8];
    k_scales_mins(b + 4, f16_at(b), f16_at(b + 2), dsc, dmn);
    const uint8_t* qs = b + 16;
    for (int p = 0; p < 4; ++p) {
      const vf t0 = lut16<kScaleSub>(dsc[2 * p], dmn[2 * p]);
      const vf t1 = lut16<kScaleSub>(dsc[2 * p + 1], dmn[2 * p + 1]);
      for (int l = 0; l < 32; l += 16) {  // 16 bytes widened once, both nibbles looked up
        const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * p + l)));
        store(out + 64 * p + l, (vf)_mm512_permutexvar_ps(z, (__m512)t0));                            // low
        store(out + 64 * p + 32 + l, (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), (__m512)t1));  // high
      }
    }
    return;
  }
  if constexpr (Q == kQ4_1 || Q == kQ5_0 || Q == kQ5_1) {  // the layouts below, 16 codes per vector
    const int o = Q == kQ4_1 ? 4 : Q == kQ5_1 ? 8 : 6;  // where the nibbles start
    const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + o)));
    __m512i lo = _mm512_and_si512(z, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(z, 4);  // elements 0.., 16..
    if constexpr (Q != kQ4_1) {  // the fifth bit of element l is bit l of qh
      uint32_t qh;
      std::memcpy(&qh, b + o - 4, 4);
      const __m512i v16 = _mm512_set1_epi32(16);
      lo = _mm512_mask_or_epi32(lo, __mmask16(qh & 0xffffu), lo, v16);
      hi = _mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, v16);
    }
    const float d = f16_at(b), m = Q == kQ5_0 ? 0.f : f16_at(b + 2), zc = Q == kQ5_0 ? 16.f : 0.f;
    constexpr int Mode = Q == kQ5_0 ? kScaleShift : kScaleAdd;
    store(out, affine<Mode>((vf)_mm512_cvtepi32_ps(lo), splat(d), splat(m), splat(zc)));
    store(out + 16, affine<Mode>((vf)_mm512_cvtepi32_ps(hi), splat(d), splat(m), splat(zc)));
    return;
  }
#endif
#ifdef JM_VDECODE
  if constexpr (Q == kQ6_K) {  // the layout below; q - 32 built as bytes (q6k_codes), widened a vector at a time
    alignas(64) float ds[16];
    q6k_scales(b, ds);
    alignas(64) int8_t qb[256];
    q6k_codes(b, qb);
#pragma GCC unroll 32
    for (int e = 0; e < 256; e += kLanes) store(out + e, q6k_codes_vec(qb + e) * ds[e / 16]);
    return;
  }
#endif
#if defined(JM_VDECODE) && !defined(JM_LUT16)
  if constexpr (Q == kQ4_1 || Q == kQ5_0 || Q == kQ5_1) {  // AVX2: the layouts below, 8 codes per vector
    const int o = Q == kQ4_1 ? 4 : Q == kQ5_1 ? 8 : 6;  // where the nibbles start
    const float d = f16_at(b), m = Q == kQ5_0 ? 0.f : f16_at(b + 2), zc = Q == kQ5_0 ? 16.f : 0.f;
    constexpr int Mode = Q == kQ5_0 ? kScaleShift : kScaleAdd;
    const vf dv = splat(d), mv = splat(m), zv = splat(zc);
    uint32_t qh = 0;
    if constexpr (Q != kQ4_1) std::memcpy(&qh, b + o - 4, 4);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2; ++h) {  // bytes 8 h ..: elements 8 h .. (low nibbles) and 16 + 8 h .. (high ones)
      const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + o + 8 * h)));
      __m256i lo = _mm256_and_si256(z, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(z, 4);
      if constexpr (Q != kQ4_1) {  // the fifth bit of element l is bit l of qh
        const __m256i v = _mm256_set1_epi32(int(qh)), v16 = _mm256_set1_epi32(16);
        const __m256i bl = _mm256_srlv_epi32(v, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)));
        const __m256i bh = _mm256_srlv_epi32(v, _mm256_add_epi32(lane, _mm256_set1_epi32(16 + 8 * h)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(bl, 4), v16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(bh, 4), v16));
      }
      store(out + 8 * h, affine<Mode>((vf)_mm256_cvtepi32_ps(lo), dv, mv, zv));
      store(out + 16 + 8 * h, affine<Mode>((vf)_mm256_cvtepi32_ps(hi), dv, mv, zv));
    }
    return;
  }
  if constexpr (Q == kQ4_K || Q == kQ5_K) {  // AVX2: the layout below, 8 codes per vector (k_codes8)
    alignas(32) float dsc[8], dmn[8];
    k_scales_mins(b + 4, f16_at(b), f16_at(b + 2), dsc, dmn);
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const vf sv = splat(dsc[s]), mv = splat(dmn[s]);
      for (int h = 0; h < 4; ++h) store(out + 32 * s + 8 * h, affine<kScaleSub>(k_codes8<Q>(b, s, h), sv, mv, vf{}));
    }
    return;
  }
#endif
  alignas(64) uint8_t q[256];  // the block's codes, one byte each (byte loops vectorize)
  // Q2_K, Q3_K (and IQ4_NL, IQ4_XS, MXFP4 without AVX-512's table path above): codes built as
  // bytes, then widened and scaled a vector at a time by codes_to_float (AVX2 / portable). A signed code v is stored as
  // v + z and decoded as s ((v + z) - z): the subtraction is exact, so each element is the
  // one rounding of gguf.quants' s * v.
  if constexpr (Q == kQ2_K) {  // scales 16 bytes (low nibble scale, high min), qs 64, d f16, dmin f16
    const uint8_t* sc = b;
    const uint8_t* qs = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int c = 0; c < 2; ++c)  // elements 128 c + 32 j + l: bits 2 j of qs[32 c + l]
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) q[128 * c + 32 * j + l] = uint8_t((qs[32 * c + l] >> (2 * j)) & 3);
    for (int g = 0; g < 16; ++g)  // w = (d sc) q - (dmin m)
      codes_to_float<kScaleSub, 16>(q + 16 * g, d * float(sc[g] & 15), dmin * float(sc[g] >> 4), 0.f, out + 16 * g);
    return;
  }
  if constexpr (Q == kQ3_K) {  // hmask 32 bytes, qs 64, 12 packed 6-bit scales, d f16
    const uint8_t* hm = b;
    const uint8_t* qs = b + 32;
    const uint8_t* s = b + 96;
    const float d = f16_at(b + 108);
    for (int c = 0; c < 2; ++c)  // element 32 k + l (k = 4 c + j): low bits 2 j of qs[32 c + l], bit k of hm[l]
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          const int k = 4 * c + j;
          q[32 * k + l] = uint8_t(((qs[32 * c + l] >> (2 * j)) & 3) | (((hm[l] >> k) & 1) << 2));  // q + 4
        }
    for (int g = 0; g < 16; ++g) {  // scale g: low 4 bits from s[g % 8] (nibble g / 8), top 2 from s[8 + g % 4]
      const int lo = (s[g & 7] >> (4 * (g >> 3))) & 15, hi = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
      codes_to_float<kScaleShift, 16>(q + 16 * g, d * float((lo | (hi << 4)) - 32), 0.f, 4.f, out + 16 * g);
    }
    return;
  }
  if constexpr (is_table32(Q) || Q == kIQ4_XS) {
    // 4-bit codes indexing a table of signed values (stored + z): IQ4 kvalues_iq4nl (z = 128),
    // MXFP4 twice the E2M1 values (z = 12) with the E8M0 scale halved (ggml_e8m0_to_fp32_half),
    // Q4_0 the code itself (z = 8: d (q - 8))
    static constexpr uint8_t kIQ4[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
    static constexpr uint8_t kFP4[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    static constexpr uint8_t kQ40[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const uint8_t* tab = Q == kMXFP4 ? kFP4 : Q == kQ4_0 ? kQ40 : kIQ4;
    const float z = Q == kMXFP4 ? 12.f : Q == kQ4_0 ? 8.f : 128.f;
    const int nsub = Q == kIQ4_XS ? 8 : 1;
    const uint8_t* qs = b + (Q == kIQ4_XS ? 8 : Q == kMXFP4 ? 1 : 2);
    for (int j = 0; j < nsub; ++j)  // 32 elements per 16 bytes: low nibbles, then high ones
      for (int l = 0; l < 16; ++l) {
        q[32 * j + l] = tab[qs[16 * j + l] & 15];
        q[32 * j + 16 + l] = tab[qs[16 * j + l] >> 4];
      }
    for (int j = 0; j < nsub; ++j)
      codes_to_float<kScaleShift, 32>(q + 32 * j, table_scale<Q>(b, j), 0.f, z, out + 32 * j);
    return;
  }
  if constexpr (Q == kQ4_1) {  // d f16, m f16, 16 bytes of nibbles: w = d q + m
    const uint8_t* qs = b + 4;
    for (int l = 0; l < 16; ++l) {
      q[l] = qs[l] & 15;
      q[l + 16] = qs[l] >> 4;
    }
    codes_to_float<kScaleAdd, 32>(q, f16_at(b), f16_at(b + 2), 0.f, out);
  } else if constexpr (Q == kQ5_0 || Q == kQ5_1) {  // d f16, [m f16], qh u32, 16 bytes of nibbles
    const int o = Q == kQ5_1 ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, b + o, 4);
    const uint8_t* qs = b + o + 4;
    for (int l = 0; l < 16; ++l) {
      q[l] = uint8_t((qs[l] & 15) | (((qh >> l) & 1u) << 4));
      q[l + 16] = uint8_t((qs[l] >> 4) | (((qh >> (l + 16)) & 1u) << 4));
    }
    if constexpr (Q == kQ5_0)
      codes_to_float<kScaleShift, 32>(q, f16_at(b), 0.f, 16.f, out);  // d (q - 16)
    else
      codes_to_float<kScaleAdd, 32>(q, f16_at(b), f16_at(b + 2), 0.f, out);
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // d f16, dmin f16, 12 scale bytes, [qh 32 bytes (Q5_K)], qs 128 bytes; 8 sub-blocks of
    // 32: sub-block 2p = low nibbles of qs[32p..], 2p+1 = their high nibbles;
    // w = (d sc) q - (dmin mn), Q5_K's fifth bit j of sub-block j from qh[l].
    alignas(32) float dsc[8], dmn[8];
    k_scales_mins(b + 4, f16_at(b), f16_at(b + 2), dsc, dmn);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16);
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) {
        q[64 * p + l] = qs[32 * p + l] & 15;
        q[64 * p + 32 + l] = qs[32 * p + l] >> 4;
      }
    if constexpr (Q == kQ5_K)
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) q[32 * j + l] |= uint8_t(((qh[l] >> j) & 1) << 4);
    for (int j = 0; j < 8; ++j) codes_to_float<kScaleSub, 32>(q + 32 * j, dsc[j], dmn[j], 0.f, out + 32 * j);
  } else {  // Q6_K: ql 128 bytes, qh 64 bytes, 16 int8 scales, d f16; w = (d sc) (q - 32)
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s) {  // elements 128 h + 32 s + l
        const uint8_t* lo = ql + 64 * h + 32 * (s & 1);
        const uint8_t* hi = qh + 32 * h;
        const int nib = 4 * (s >> 1), hs = 2 * s;
        for (int l = 0; l < 32; ++l) q[128 * h + 32 * s + l] = uint8_t(((lo[l] >> nib) & 15) | (((hi[l] >> hs) & 3) << 4));
      }
    for (int g = 0; g < 16; ++g) codes_to_float<kScaleShift, 16>(q + 16 * g, d * float(sc[g]), 0.f, 32.f, out + 16 * g);
  }
}

template <int Q>
inline void decode_block(const uint8_t* b, float* __restrict out) {
  if constexpr (Q >= kIQ2_XXS && Q <= kTQ2_0)
    decode_iq_block<Q>(b, out);
  else
    decode_kq_block<Q>(b, out);
}

// Why a GGUF block operand of kind `kind` (logical [E, in, out], stored [E, out, in / B * BB]
// uint8, scales inside the blocks) is malformed, or "" (both kernels' bind_weight).
inline std::string gguf_operand_problem(int kind, int32_t group, ffi::AnyBuffer data, ffi::AnyBuffer scales,
                                        ffi::AnyBuffer qbias, int64_t E, int64_t in, int64_t out) {
  const int64_t B = block_elems(kind), BB = block_bytes(kind);
  const auto dd = data.dimensions();
  const std::string what = "GGUF kind " + std::to_string(kind) + " (block " + std::to_string(B) + " in " +
                           std::to_string(BB) + " bytes), logical [" + std::to_string(E) + ", " + std::to_string(in) +
                           ", " + std::to_string(out) + "]";
  if (group != B || in % B != 0) return what + ": the input width must be a multiple of the block";
  if (data.element_type() != ffi::DataType::U8 || dd.size() != 3 || dd[0] != E || dd[1] != out || dd[2] != in / B * BB)
    return what + ": block bytes must be uint8 [E, out, in / block * block_bytes]";
  if (scales.element_count() != 0 || qbias.element_count() != 0)
    return what + ": scales live inside the blocks (pass empty scales / biases)";
  return "";
}

// C[m, n] = A[m, K] @ W[n, K]^T with both operands in their row layout: A rows at
// a + i * lda, W rows (float32 or bfloat16, widened in registers) at w + j * ldw, and
// optionally a second pair (a2, w2) of K2 columns continuing the same sums (the backward's
// [dgate | dup] [W_g | W_u]^T). Each element is kLanes partial sums over its k's (lane l
// takes k = l mod kLanes, in order), summed by `hsum`, then the scalar tail k's in order:
// one fixed sequence whatever m, n, the tile or the thread (deterministic; a row's result
// does not depend on the other rows). Reads each W row once per MR rows of A, no packing.
// The backward's input gradients and the forward's packed path (pblock) run on it.
template <typename T, int MR, int NR>
inline void nt_tile(const float* a, int64_t lda, const T* w, int64_t ldw, int64_t K, const float* a2, const T* w2,
                    int64_t K2, float* c, int64_t ldc) {
  vf acc[MR][NR];
  float tail[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vf{}, tail[i][j] = 0.f;
  for (int seg = 0; seg < 2; ++seg) {
    const float* as = seg ? a2 : a;
    const T* ws = seg ? w2 : w;
    const int64_t Ks = seg ? K2 : K, kv = Ks / kLanes * kLanes;
    if (!ws) break;
    for (int64_t k = 0; k < kv; k += kLanes) {
      vf wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = load(ws + j * ldw + k);
      for (int i = 0; i < MR; ++i) {
        const vf av = load(as + i * lda + k);
        for (int j = 0; j < NR; ++j) acc[i][j] = fmadd(av, wv[j], acc[i][j]);
      }
    }
    for (int64_t k = kv; k < Ks; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) tail[i][j] = fmadd(as[i * lda + k], scalar(ws + j * ldw + k), tail[i][j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = hsum(acc[i][j]) + tail[i][j];
}

// ---------------------------------------------------------------------------------
// Register tiles: one k step of an MR x NV tile, acc[i][j] += a[i * sa] * b[j-th vector]
// (a rounded multiply, then a rounded add: fmadd), and the tile's store to C[MR, NV vectors].
template <int MR, int NV, typename W>
__attribute__((always_inline)) inline void tile_step(vf (&acc)[MR][NV], const float* a, int64_t sa, const W* b) {
  vf bv[NV];
  for (int j = 0; j < NV; ++j) bv[j] = load(b + j * kLanes);
  for (int i = 0; i < MR; ++i) {
    const vf av = splat(a[i * sa]);
    for (int j = 0; j < NV; ++j) acc[i][j] = fmadd(av, bv[j], acc[i][j]);
  }
}

template <int MR, int NV>
__attribute__((always_inline)) inline void store_tile(const vf (&acc)[MR][NV], float* c, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store(c + i * ldc + j * kLanes, acc[i][j]);
}

// Calls fn(std::integral_constant<int, R>{}) with R = rows for rows 1 .. Max - 1, else
// R = Max: a tile's row count as a template argument (a switch with `Max` as its default).
template <int Max, int R = 1, typename Fn>
__attribute__((always_inline)) inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (R == Max) {
    fn(std::integral_constant<int, R>{});
  } else if (rows == R) {
    fn(std::integral_constant<int, R>{});
  } else {
    with_rows<Max, R + 1>(rows, fn);
  }
}

// The row tiles of an m-row product, Max rows each but the last: fn(rows, i0) for each,
// first to last, with `rows` a std::integral_constant of the tile's row count (with_rows)
// and i0 its first row.
template <int Max, typename Fn>
__attribute__((always_inline)) inline void for_row_tiles(int64_t m, Fn&& fn) {
  for (int64_t i0 = 0; i0 < m;) {
    const int64_t mr = std::min<int64_t>(Max, m - i0);
    with_rows<Max>(mr, [&](auto rows) { fn(rows, i0); });
    i0 += mr;
  }
}

// ---------------------------------------------------------------------------------
// Runs fn(i) for every i < n on the intra-op pool plus the calling thread; returns when
// all are done. The caller claims indices until none is left, then waits for the claimed
// ones; a worker that starts after that finds no index and touches only `state` (its
// reference to `fn` is used only for a claimed index).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &fn]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule(decltype(work)(work));  // a copy per worker
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// ---------------------------------------------------------------------------------
// The operands of one set of experts, as both custom calls take them: expert e owns the
// sorted rows offsets[e] .. + sizes[e]; the gate / up / down weights ([d, F], [d, F],
// [F, d]); their float32 biases [E, F] / [E, F] / [E, d] (null: none); the activation
// (act, alpha, limit) and whether h is rounded to bfloat16 (round_h).
struct Experts {
  const int32_t* offsets;
  const int32_t* sizes;
  Weight wg, wu, wd;
  const float* bg;
  const float* bu;
  const float* bd;
  int64_t d, F;
  int act;
  float alpha, limit;
  bool round_h;
};

// Sets the widths and the activation attributes of `p`.
inline void set_expert_attrs(Experts& p, int64_t d, int64_t F, int act, float alpha, float limit, int32_t round_h) {
  p.d = d;
  p.F = F;
  p.act = act;
  p.alpha = alpha;
  p.limit = limit;
  p.round_h = round_h != 0;
}

// Checks one weight operand against its logical [E, in, out] shape; fills `w`. Errors
// name the custom call `op` and the operand `name`; a quantized (int8 / int4) kind's group
// size must be a positive multiple of `group_step` dividing `in` (`group_rule`: how the
// error says so).
inline ffi::Error check_weight(const char* op, int32_t group_step, const char* group_rule, const char* name,
                               ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer qbias, int32_t kind,
                               int32_t group, int64_t E, int64_t in, int64_t out, Weight& w) {
  auto fail = [op, name](const std::string& why) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + ": " + why);
  };
  const auto dd = data.dimensions();
  w = Weight{};
  w.kind = kind;
  w.in = in;
  w.out = out;
  w.data = data.untyped_data();
  if (kind == kFloat) {
    const auto t = data.element_type();
    if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) return fail("float weights must be float32 or bfloat16");
    if (dd.size() != 3 || dd[0] != E || dd[1] != in || dd[2] != out) return fail("float weights must be [E, in, out]");
    w.bf16 = t == ffi::DataType::BF16;
    return ffi::Error::Success();
  }
  if (is_gguf(kind)) {
    const std::string why = gguf_operand_problem(kind, group, data, scales, qbias, E, in, out);
    if (!why.empty()) return fail(why);
    w.group = block_elems(kind);
    return ffi::Error::Success();
  }
  if (kind == kFP8) {
    const std::string why = fp8_operand_problem(group, data, scales, qbias, E, in, out);
    if (!why.empty()) return fail(why);
    const auto st = scales.element_type();
    w.stype = st == ffi::DataType::F32 ? kSF32 : st == ffi::DataType::F16 ? kSF16 : kSBF16;
    w.scales = scales.untyped_data();
    w.group = group;
    return ffi::Error::Success();
  }
  if (kind != kInt8 && kind != kInt4) return fail("unknown weight kind " + std::to_string(kind));
  if (group < group_step || group % group_step != 0 || in % group != 0)
    return fail("group size " + std::to_string(group) + " must be " + group_rule + " in=" + std::to_string(in));
  const int64_t per_byte = kind == kInt4 ? 2 : 1;
  const auto want_t = kind == kInt4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if (data.element_type() != want_t || dd.size() != 3 || dd[0] != E || dd[1] != out || dd[2] * per_byte != in)
    return fail(kind == kInt4 ? "int4 codes must be uint8 [E, out, in/2]" : "int8 codes must be int8 [E, out, in]");
  const auto st = scales.element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16 && st != ffi::DataType::BF16)
    return fail("scales must be float32, float16 or bfloat16");
  const auto sd = scales.dimensions();
  if (sd.size() != 3 || sd[0] != E || sd[1] != out || sd[2] != in / group) return fail("scales must be [E, out, in/g]");
  w.stype = st == ffi::DataType::F32 ? kSF32 : st == ffi::DataType::F16 ? kSF16 : kSBF16;
  w.scales = scales.untyped_data();
  w.group = group;
  if (qbias.element_count() != 0) {
    if (qbias.element_type() != st || qbias.element_count() != scales.element_count())
      return fail("quantization biases must match the scales' shape and dtype");
    w.qbias = qbias.untyped_data();
  } else if (kind == kInt4) {
    return fail("int4 weights need quantization biases");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------
// FFI bindings of the operands and attributes both custom calls share, appended to `b`:
// one set of expert weights (per weight: data, scales, quantization biases; then the three
// float32 biases), the routing plan before them (offsets, sizes), and the expert attributes.
template <typename B>
auto bind_weights(B&& b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // w_gate data
      .template Arg<ffi::AnyBuffer>()         // w_gate scales
      .template Arg<ffi::AnyBuffer>()         // w_gate qbias
      .template Arg<ffi::AnyBuffer>()         // w_up data
      .template Arg<ffi::AnyBuffer>()         // w_up scales
      .template Arg<ffi::AnyBuffer>()         // w_up qbias
      .template Arg<ffi::AnyBuffer>()         // w_down data
      .template Arg<ffi::AnyBuffer>()         // w_down scales
      .template Arg<ffi::AnyBuffer>()         // w_down qbias
      .template Arg<ffi::Buffer<ffi::F32>>()  // b_gate
      .template Arg<ffi::Buffer<ffi::F32>>()  // b_up
      .template Arg<ffi::Buffer<ffi::F32>>();  // b_down
}

template <typename B>
auto bind_experts(B&& b) {
  return bind_weights(std::move(b)
                          .template Arg<ffi::Buffer<ffi::S32>>()    // offsets
                          .template Arg<ffi::Buffer<ffi::S32>>());  // sizes
}

template <typename B>
auto bind_expert_attrs(B&& b) {
  return std::move(b)
      .template Attr<int32_t>("act")
      .template Attr<float>("alpha")
      .template Attr<float>("limit")
      .template Attr<int32_t>("round_h")
      .template Attr<int32_t>("kind_gate")
      .template Attr<int32_t>("kind_up")
      .template Attr<int32_t>("kind_down")
      .template Attr<int32_t>("group_gate")
      .template Attr<int32_t>("group_up")
      .template Attr<int32_t>("group_down");
}
