// How fast one thread (or two) pulls cold expert weights through a matrix-vector
// product, by the order its loads take inside each 4 KiB page. Not jaxmoe's kernel: the
// loop shapes it chose between (docs/performance.md, "The order of the reads").
//
//   g++ -O3 -march=native -std=c++17 -pthread -ffp-contract=off benchmarks/stream_order.cc -o /tmp/stream_order
//   /tmp/stream_order 1 30 && /tmp/stream_order 2 30     # THREADS REPEATS
//
// 256 float32 matrices of 2048 x 512 (4 MiB each, 1 GiB in all, random values); every
// repeat multiplies a vector into 24 matrices drawn at random (cold: not in cache), each
// variant in turn, the order rotating. Prints GB/s of the matrices' bytes, best and mean.
//
// Variants (y = x W for W in-major [2048][512]: rows of 2 KiB; out-major: the same bytes
// as rows of L floats, y[f] = W[f] . x):
//   read          a plain sum of the matrix, front to back: the floor
//   in_strips     chunks of 8 rows, each swept in column strips of 128 (8 vector
//                 accumulators in registers): the kernel's few-row order before 5 Dec 2026;
//                 goes back and forth inside every page
//   in_rows       row by row, each row whole, accumulators in an L1 buffer: front to back
//                 (the kernel's order for up to 3 rows since 5 Dec 2026)
//   out_adj<L>    4 adjacent out-major rows side by side (L floats each: 4 rows share a page
//                 when L = 256)
//   out_pages<L>  4 out-major rows a page apart side by side, the next tile the rows after
//                 them: each page read front to back
//   out_rows<L>   one out-major row after the other (one stream front to back, as ggml's
//                 threads read a run of rows)
//   out_adj_pf<L> out_adj with the prefetches of jaxmoe's quantized few-row tiles (the next
//                 tile's rows into L1, the rows 24 KiB ahead into L2)
//   out_rows_pf<L> out_rows with the same prefetches
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
inline v16 ld(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}
inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline float hsum(v16 v) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

constexpr int64_t kExperts = 256, kRows = 2048, kCols = 512, kElems = kRows * kCols;

void read(const float* w, const float*, float* y) {
  v16 a[4] = {};
  for (int64_t i = 0; i < kElems; i += 64)
    for (int q = 0; q < 4; ++q) a[q] += ld(w + i + 16 * q);
  y[0] = hsum(a[0] + a[1] + a[2] + a[3]);
}

void in_strips(const float* w, const float* x, float* y) {
  constexpr int kc = 8, nv = 8;
  std::memset(y, 0, kCols * 4);
  for (int64_t k0 = 0; k0 < kRows; k0 += kc)
    for (int64_t j0 = 0; j0 < kCols; j0 += 16 * nv) {
      v16 acc[nv];
      for (int j = 0; j < nv; ++j) acc[j] = ld(y + j0 + 16 * j);
      for (int64_t k = k0; k < k0 + kc; ++k) {
        const v16 xv = (v16){} + x[k];
        for (int j = 0; j < nv; ++j) acc[j] = fma16(xv, ld(w + k * kCols + j0 + 16 * j), acc[j]);
      }
      for (int j = 0; j < nv; ++j) std::memcpy(y + j0 + 16 * j, &acc[j], 64);
    }
}

void in_rows(const float* w, const float* x, float* y) {
  std::memset(y, 0, kCols * 4);
  for (int64_t k = 0; k < kRows; ++k) {
    const v16 xv = (v16){} + x[k];
    for (int64_t j = 0; j < kCols; j += 16) {
      const v16 a = fma16(xv, ld(w + k * kCols + j), ld(y + j));
      std::memcpy(y + j, &a, 64);
    }
  }
}

template <int L, bool kPages>
void out_tiles(const float* w, const float* x, float* y) {
  constexpr int64_t n = kElems / L, per_page = std::max(1, 1024 / L);
  for (int64_t g = 0; g < n; g += 4 * per_page)
    for (int64_t r = 0; r < per_page; ++r) {
      const float* rows[4];
      for (int s = 0; s < 4; ++s) rows[s] = w + (kPages ? g + r + s * per_page : g + 4 * r + s) * L;
      v16 a[4] = {};
      for (int64_t k = 0; k < L; k += 16)
        for (int s = 0; s < 4; ++s) a[s] = fma16(ld(x + k % kRows), ld(rows[s] + k), a[s]);
      for (int s = 0; s < 4; ++s) y[(g + 4 * r + s) % kRows] = hsum(a[s]);
    }
}

// NC out-major rows side by side (NC = 1: row after row, one stream front to back), with
// (kPrefetch) the quantized tiles' software prefetches of jaxmoe's kernel (qtile / itile):
// each 64 bytes, the same bytes of the next tile's rows into L1 and of the rows kFar bytes
// ahead (at least two tiles) into L2.
template <int L, int NC, bool kPrefetch>
void out_rows(const float* w, const float* x, float* y) {
  constexpr int64_t n = kElems / L, kFar = 24 << 10, far_rows = std::max<int64_t>(2 * NC, kFar / (L * 4));
  for (int64_t g = 0; g < n; g += NC) {
    v16 a[NC] = {};
    const float* next = w + (g + NC) * L;
    const float* far = w + (g + far_rows) * L;
    for (int64_t k = 0; k < L; k += 16) {
      if (kPrefetch && g + far_rows + NC <= n)
        for (int s = 0; s < NC; ++s) {
          __builtin_prefetch(next + s * L + k);
          __builtin_prefetch(far + s * L + k, 0, 2);
        }
      for (int s = 0; s < NC; ++s) a[s] = fma16(ld(x + k % kRows), ld(w + (g + s) * L + k), a[s]);
    }
    for (int s = 0; s < NC; ++s) y[(g + s) % kRows] = hsum(a[s]);
  }
}

struct Variant {
  const char* name;
  void (*fn)(const float*, const float*, float*);
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1, repeats = argc > 2 ? std::atoi(argv[2]) : 30;
  const size_t n = size_t(kExperts) * kElems;
  float* w = static_cast<float*>(std::aligned_alloc(1 << 21, n * 4));
  std::mt19937 rng(1);
  for (size_t i = 0; i < n; ++i) w[i] = float(rng() & 0xffff) * 1e-6f;
  std::vector<float> x(kRows);
  for (float& v : x) v = float(rng() & 0xff) * 1e-3f;
  const Variant vs[] = {{"read", read},
                        {"in_strips", in_strips},
                        {"in_rows", in_rows},
                        {"out_adj<256>", out_tiles<256, false>},
                        {"out_pages<256>", out_tiles<256, true>},
                        {"out_adj<512>", out_tiles<512, false>},
                        {"out_pages<512>", out_tiles<512, true>},
                        {"out_rows<256>", out_rows<256, 1, false>},
                        {"out_rows<512>", out_rows<512, 1, false>},
                        {"out_adj_pf<256>", out_rows<256, 4, true>},
                        {"out_adj_pf<512>", out_rows<512, 4, true>},
                        {"out_rows_pf<256>", out_rows<256, 1, true>},
                        {"out_rows_pf<512>", out_rows<512, 1, true>}};
  constexpr int nv = sizeof(vs) / sizeof(vs[0]), kPerCall = 24;
  double best[nv], total[nv] = {};
  std::fill(best, best + nv, 1e30);
  float sink = 0.f;
  for (int it = 0; it <= repeats; ++it)
    for (int v0 = 0; v0 < nv; ++v0) {
      const int v = (v0 + it) % nv;
      std::vector<int64_t> ex(kPerCall);
      for (int64_t& e : ex) e = int64_t(rng() % kExperts);
      std::atomic<int> next{0};
      std::vector<float> sums(threads);
      auto work = [&](int t) {
        alignas(64) float y[kRows];
        for (int i; (i = next.fetch_add(1)) < kPerCall;) {
          vs[v].fn(w + ex[i] * kElems, x.data(), y);
          sums[t] += y[3];
        }
      };
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
      work(0);
      for (auto& th : pool) th.join();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      for (float s : sums) sink += s;
      if (it > 0) {  // the first round warms the code and the thread start-up
        best[v] = std::min(best[v], ms);
        total[v] += ms;
      }
    }
  const double bytes = double(kPerCall) * kElems * 4;
  for (int v = 0; v < nv; ++v)
    std::printf("%-15s threads %d  best %6.1f GB/s  mean %6.1f GB/s\n", vs[v].name, threads, bytes / best[v] / 1e6,
                bytes / (total[v] / repeats) / 1e6);
  return sink == 12345.f;  // keeps the sums alive
}
