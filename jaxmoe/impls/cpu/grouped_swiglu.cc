// Grouped SwiGLU experts for XLA:CPU, as an XLA FFI custom call (impl="cpu").
//
// Why: XLA:CPU never feeds a dot from a slice of a larger array in place; every
// expert `W[e]` becomes a copy before its dot (benchmarks/README.md). This kernel
// reads each selected expert's weights where they lie, once per call, the way
// llama.cpp's selected-expert path and torch's `F.linear(x, W[e])` do.
//
// Inputs (sorted pair order, see jaxmoe/dispatch.py):
//   xs      [P, d]    f32     rows sorted by expert (the token rows, gathered)
//   offsets [E]       s32     first sorted row of each expert
//   sizes   [E]       s32     rows of each expert
//   w_gate  [E, d, F] f32|bf16
//   w_up    [E, d, F] f32|bf16
//   w_down  [E, F, d] f32|bf16
//   b_gate  [E, F] | [0]  f32   biases (size 0 when the model has none)
//   b_up    [E, F] | [0]  f32
//   b_down  [E, d] | [0]  f32
// Output:
//   ys      [P, d]    f32     ys[r] = down(act(gate(xs[r]), up(xs[r]))) of r's expert
// Attributes:
//   act      0 = silu(g) * u, 1 = gpt-oss (clip(u,-L,L)+1) * g' * sigmoid(alpha g'), g' = min(g, L)
//   alpha, limit  the gpt-oss constants
//   round_h  1: round the hidden activations to bfloat16 before the down projection
//            (what the jnp reference does in a bf16 compute dtype)
//
// Work: phase 1 = tasks (expert, block of F columns) computing h; phase 2 = tasks
// (expert, block of d columns) computing y. Each task streams its block of the
// expert's weights once and holds an MR x (16 NV) register tile of accumulators
// (float32, FMA along d or F in order). Tasks run on XLA's intra-op thread pool;
// the calling thread takes tasks too. Rows past sum(sizes) are left untouched
// by the kernel and zeroed here, so the output is always fully written.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

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
inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) {
  uint32_t w = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline float round_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if ((w & 0x7fffffffu) > 0x7f800000u) return f;
  w = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &w, 4);
  return f;
}

// C[MR, 16*NV] = A[MR, K] (row stride lda) @ B[K, 16*NV] (row stride ldb).
constexpr int64_t kAhead = 16;  // rows of B prefetched ahead when B is streamed from memory

template <int MR, int NV, bool Prefetch, typename W>
inline void tile(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * ldb;
    if (Prefetch)
      for (int j = 0; j < NV * kLanes * int(sizeof(W)); j += 64) __builtin_prefetch((const char*)(bk + kAhead * ldb) + j);
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = load(bk + j * kLanes);
    for (int i = 0; i < MR; ++i) {
      const float ai = a[i * lda + k];
      for (int j = 0; j < NV; ++j) acc[i][j] += ai * bv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store(c + i * ldc + j * kLanes, acc[i][j]);
}

// Columns that do not fill a vector: plain loops (C[m, ncols]).
template <typename W>
void tile_scalar(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols,
                 float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < ncols; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += a[i * lda + k] * scalar(b + k * ldb + j);
      c[i * ldc + j] = s;
    }
}

template <int MR, bool Prefetch, typename W>
void tile_nv(int nv, const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  switch (nv) {
    case 1: return tile<MR, 1, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 2: return tile<MR, 2, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 3: return tile<MR, 3, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 4: return tile<MR, 4, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 5: return tile<MR, 5, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 6: return tile<MR, 6, Prefetch>(a, lda, b, ldb, K, c, ldc);
    case 7: return tile<MR, 7, Prefetch>(a, lda, b, ldb, K, c, ldc);
    default: return tile<MR, 8, Prefetch>(a, lda, b, ldb, K, c, ldc);
  }
}

// C[m, ncols] = A[m, K] @ B[K, ncols] for any m, ncols: register tiles of at most
// 24 accumulators (MR x NV = 1x8, 2x8, 3x4 .. 6x4), scalar tail columns. Prefetch:
// B is streamed from memory (read once), so rows kAhead ahead are prefetched.
template <bool Prefetch, typename W>
void block_matmul(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols,
                  float* c, int64_t ldc) {
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  for (int64_t i0 = 0; i0 < m;) {
    const int64_t mr = std::min<int64_t>(6, m - i0);
    const int max_nv = mr <= 2 ? 8 : 4;
    for (int64_t j0 = 0; j0 < vec_cols;) {
      const int nv = int(std::min<int64_t>(max_nv, (vec_cols - j0) / kLanes));
      const float* ai = a + i0 * lda;
      float* ci = c + i0 * ldc + j0;
      switch (mr) {
        case 1: tile_nv<1, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
        case 2: tile_nv<2, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
        case 3: tile_nv<3, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
        case 4: tile_nv<4, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
        case 5: tile_nv<5, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
        default: tile_nv<6, Prefetch>(nv, ai, lda, b + j0, ldb, K, ci, ldc); break;
      }
      j0 += int64_t(nv) * kLanes;
    }
    if (vec_cols < ncols)
      tile_scalar(a + i0 * lda, lda, b + vec_cols, ldb, K, mr, ncols - vec_cols, c + i0 * ldc + vec_cols, ldc);
    i0 += mr;
  }
}

// Rows at or above which a task first packs its block of B into a contiguous float32
// buffer (read once from memory, then re-read from cache by every row tile).
constexpr int64_t kPackRows = 8;

template <typename W>
void matmul(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t K, int64_t m, int64_t ncols, float* c,
            int64_t ldc, std::vector<float>& pack) {
  if (m < kPackRows) return block_matmul<true>(a, lda, b, ldb, K, m, ncols, c, ldc);
  pack.resize(size_t(K) * ncols);
  const int64_t vec_cols = (ncols / kLanes) * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * ldb;
    if (k + kAhead < K)
      for (int64_t j = 0; j < ncols * int64_t(sizeof(W)); j += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(bk + kAhead * ldb) + j);
    float* pk = pack.data() + k * ncols;
    for (int64_t j = 0; j < vec_cols; j += kLanes) store(pk + j, load(bk + j));
    for (int64_t j = vec_cols; j < ncols; ++j) pk[j] = scalar(bk + j);
  }
  block_matmul<false>(a, lda, pack.data(), ncols, K, m, ncols, c, ldc);
}

struct Problem {
  const float* xs;
  const int32_t* offsets;
  const int32_t* sizes;
  const void* wg;
  const void* wu;
  const void* wd;
  bool bf16;
  const float* bg;
  const float* bu;
  const float* bd;
  float* h;   // [P, F] scratch
  float* ys;  // [P, d]
  int64_t d, F;
  int act;
  float alpha, limit;
  bool round_h;
};

constexpr int64_t kRowChunk = 128;  // rows per task at most (keeps the tile buffers small)

struct Task {
  int32_t expert;
  int32_t row0, rows;
  int32_t col0, cols;
};

template <typename W>
void run_gate_up(const Problem& p, const Task& t) {
  thread_local std::vector<float> gbuf, ubuf;
  const int64_t e = t.expert, d = p.d, F = p.F;
  const W* wg = static_cast<const W*>(p.wg) + e * d * F + t.col0;
  const W* wu = static_cast<const W*>(p.wu) + e * d * F + t.col0;
  const float* x = p.xs + int64_t(t.row0) * d;
  gbuf.resize(size_t(t.rows) * t.cols);
  ubuf.resize(size_t(t.rows) * t.cols);
  thread_local std::vector<float> pack;
  matmul(x, d, wg, F, d, t.rows, t.cols, gbuf.data(), t.cols, pack);
  matmul(x, d, wu, F, d, t.rows, t.cols, ubuf.data(), t.cols, pack);
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
        g = std::fmin(g, p.limit);
        u = std::fmax(std::fmin(u, p.limit), -p.limit);
        hv = (u + 1.f) * (g / (1.f + std::exp(-p.alpha * g)));
      }
      hrow[j] = p.round_h ? round_bf16(hv) : hv;
    }
  }
}

template <typename W>
void run_down(const Problem& p, const Task& t) {
  const int64_t e = t.expert, d = p.d, F = p.F;
  const W* wd = static_cast<const W*>(p.wd) + e * F * d + t.col0;
  float* y = p.ys + int64_t(t.row0) * d + t.col0;
  thread_local std::vector<float> pack;
  matmul(p.h + int64_t(t.row0) * F, F, wd, d, F, t.rows, t.cols, y, d, pack);
  if (p.bd)
    for (int64_t i = 0; i < t.rows; ++i)
      for (int64_t j = 0; j < t.cols; ++j) y[i * d + j] += p.bd[e * d + t.col0 + j];
}

// Tasks over (expert, row chunk, column block) for experts with rows, in expert order.
std::vector<Task> make_tasks(const Problem& p, int64_t E, int64_t ncols, int64_t block) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t n = p.sizes[e];
    for (int32_t r = 0; r < n; r += kRowChunk)
      for (int64_t c = 0; c < ncols; c += block)
        tasks.push_back(Task{int32_t(e), p.offsets[e] + r, int32_t(std::min<int64_t>(kRowChunk, n - r)), int32_t(c),
                             int32_t(std::min<int64_t>(block, ncols - c))});
  }
  return tasks;
}

// Runs fn(task) for every task on the intra-op pool plus the calling thread; returns
// when all are done. The caller claims tasks until none is left, then waits for the
// claimed ones; a worker that starts after that finds no task and touches only `state`
// (its references to `tasks` and `fn` are used only for a claimed task).
template <typename Fn>
void parallel_tasks(ffi::ThreadPool& pool, const std::vector<Task>& tasks, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  const int64_t n = int64_t(tasks.size());
  auto work = [state, n, &tasks, &fn]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      fn(tasks[size_t(i)]);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule(decltype(work)(work));  // a copy per worker
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Phase 1 (h for every task of up_tasks), then phase 2 (y), W the weights' storage type.
template <typename W>
void run_phases(ffi::ThreadPool& pool, const Problem& p, const std::vector<Task>& up_tasks,
                const std::vector<Task>& down_tasks) {
  parallel_tasks(pool, up_tasks, [&p](const Task& t) { run_gate_up<W>(p, t); });
  parallel_tasks(pool, down_tasks, [&p](const Task& t) { run_down<W>(p, t); });
}

ffi::Error GroupedSwigluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> offsets,
                             ffi::Buffer<ffi::S32> sizes, ffi::AnyBuffer wg, ffi::AnyBuffer wu, ffi::AnyBuffer wd,
                             ffi::Buffer<ffi::F32> bg, ffi::Buffer<ffi::F32> bu, ffi::Buffer<ffi::F32> bd,
                             ffi::ResultBuffer<ffi::F32> ys, int32_t act, float alpha, float limit, int32_t round_h,
                             int32_t up_block, int32_t down_block) {
  auto xd = xs.dimensions();
  auto gd = wg.dimensions();
  if (xd.size() != 2 || gd.size() != 3)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: xs must be [P, d] and w_gate [E, d, F]");
  const int64_t P = xd[0], d = xd[1], E = gd[0], F = gd[2];
  if (gd[1] != d) return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: w_gate [E, d, F] does not match xs [P, d]");
  auto ud = wu.dimensions(), dd = wd.dimensions();
  if (ud.size() != 3 || ud[0] != E || ud[1] != d || ud[2] != F || dd.size() != 3 || dd[0] != E || dd[1] != F ||
      dd[2] != d)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: w_up must be [E, d, F] and w_down [E, F, d]");
  const auto wt = wg.element_type();
  if (wu.element_type() != wt || wd.element_type() != wt ||
      (wt != ffi::DataType::F32 && wt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: weights must all be float32 or all bfloat16");
  if (offsets.element_count() != size_t(E) || sizes.element_count() != size_t(E))
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: offsets and sizes must be [E]");
  const bool has_bias = bg.element_count() != 0;
  if (has_bias && (bg.element_count() != size_t(E * F) || bu.element_count() != size_t(E * F) ||
                   bd.element_count() != size_t(E * d)))
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: biases must be [E, F], [E, F], [E, d] or empty");

  Problem p{};
  p.xs = xs.typed_data();
  p.offsets = offsets.typed_data();
  p.sizes = sizes.typed_data();
  int64_t covered = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = p.offsets[e], n = p.sizes[e];
    if (n < 0 || o < 0 || o + n > P)
      return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: an expert's rows run outside xs");
    covered += n;
  }
  p.wg = wg.untyped_data();
  p.wu = wu.untyped_data();
  p.wd = wd.untyped_data();
  p.bf16 = wt == ffi::DataType::BF16;
  p.bg = has_bias ? bg.typed_data() : nullptr;
  p.bu = has_bias ? bu.typed_data() : nullptr;
  p.bd = has_bias ? bd.typed_data() : nullptr;
  p.ys = ys->typed_data();
  p.d = d;
  p.F = F;
  p.act = act;
  p.alpha = alpha;
  p.limit = limit;
  p.round_h = round_h != 0;
  std::vector<float> h(size_t(P) * F);
  p.h = h.data();
  if (covered < P) std::memset(p.ys, 0, sizeof(float) * size_t(P) * d);  // rows no expert owns

  if (up_block < 1 || down_block < 1)
    return ffi::Error::InvalidArgument("jaxmoe_grouped_swiglu: up_block and down_block must be positive");
  const auto up_tasks = make_tasks(p, E, F, up_block);
  const auto down_tasks = make_tasks(p, E, d, down_block);
  if (p.bf16)
    run_phases<uint16_t>(pool, p, up_tasks, down_tasks);
  else
    run_phases<float>(pool, p, up_tasks, down_tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeGroupedSwiglu, GroupedSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // xs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sizes
                                  .Arg<ffi::AnyBuffer>()         // w_gate
                                  .Arg<ffi::AnyBuffer>()         // w_up
                                  .Arg<ffi::AnyBuffer>()         // w_down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_down
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ys
                                  .Attr<int32_t>("act")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<int32_t>("round_h")
                                  .Attr<int32_t>("up_block")
                                  .Attr<int32_t>("down_block"));
