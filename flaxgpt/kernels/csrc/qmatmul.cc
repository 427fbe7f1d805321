// y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] with int8 or bfloat16 weights: XLA CPU custom
// calls (jax.ffi) for weight-only quantized decoding. Built on first use by flaxgpt/qmatmul.py.
//
// Why a kernel: XLA on CPU has no fast path for a matrix-vector product with int8 or bf16
// weights. It converts the whole weight matrix to float32 before the dot (batch 1), or hands
// it to a library that repacks it on every call (2+ rows); either way a decoding step costs
// more than with float32 weights (docs/benchmarks.md has the measurements). Here each weight
// row is read once in its compact form, widened to float32 in registers and used for every
// row of x, so a batch-1 step reads 1 (int8) or 2 (bf16) bytes per weight.
//
// Rows of w are output channels (torch Linear's [N, K] layout, and GPT-2's embedding table,
// so a tied LM head needs no copy). Blocks of outputs are spread over XLA's intra-op thread
// pool; the calling thread claims blocks too, so it never waits on a task no thread can run.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec load(const float* x) { return _mm512_loadu_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec widen(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline Vec widen(const uint16_t* w) {  // bfloat16: the high half of a float32
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
#else  // AVX2
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec load(const float* x) { return _mm256_loadu_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline Vec widen(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline Vec widen(const uint16_t* w) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
#endif

inline float scalar(int8_t w) { return static_cast<float>(w); }
inline float scalar(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out[r * M + m] = sum_k x[m, k] * w[r, k] for R weight rows and M rows of x. One row of x:
// four accumulators per weight row hide the FMA latency. Several: two weight rows share each
// load of x, and the R * M accumulators are independent chains already.
template <int M, int R, typename W>
inline void dot_rows(const float* x, int64_t K, const W* w, float* out) {
  constexpr int U = M == 1 ? 4 : 1;
  Vec acc[R][M][U];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[r][m][u] = zero();
  int64_t k = 0;
  for (; k + U * kLanes <= K; k += U * kLanes) {
    for (int u = 0; u < U; ++u) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = widen(w + r * K + k + u * kLanes);
      for (int m = 0; m < M; ++m) {
        const Vec xv = load(x + m * K + k + u * kLanes);
        for (int r = 0; r < R; ++r) acc[r][m][u] = fma(wv[r], xv, acc[r][m][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      Vec a = acc[r][m][0];
      for (int u = 1; u < U; ++u) a = add(a, acc[r][m][u]);
      float s = hsum(a);
      for (int64_t kk = k; kk < K; ++kk) s += scalar(w[r * K + kk]) * x[m * K + kk];
      out[r * M + m] = s;
    }
  }
}

template <int M, typename W>
void run_rows(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 1 : 2;
  float out[R * M];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    dot_rows<M, R>(x, K, w + n * K, out);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = out[r * M + m] * scale[n + r];
  }
  for (; n < n1; ++n) {
    dot_rows<M, 1>(x, K, w + n * K, out);
    for (int m = 0; m < M; ++m) y[m * N + n] = out[m] * scale[n];
  }
}

constexpr int64_t kMaxRows = 8;  // rows of x per pass over w
constexpr int64_t kBlock = 64;   // output channels per unit of work

template <typename W>
void block(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t K,
           int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min(kMaxRows, M - m0)) {
      case 1: run_rows<1>(xm, w, scale, ym, K, N, n0, n1); break;
      case 2: run_rows<2>(xm, w, scale, ym, K, N, n0, n1); break;
      case 3: run_rows<3>(xm, w, scale, ym, K, N, n0, n1); break;
      case 4: run_rows<4>(xm, w, scale, ym, K, N, n0, n1); break;
      case 5: run_rows<5>(xm, w, scale, ym, K, N, n0, n1); break;
      case 6: run_rows<6>(xm, w, scale, ym, K, N, n0, n1); break;
      case 7: run_rows<7>(xm, w, scale, ym, K, N, n0, n1); break;
      default: run_rows<8>(xm, w, scale, ym, K, N, n0, n1); break;
    }
  }
}

// Shared by the caller and the pool tasks: blocks are claimed with fetch_add.
template <typename W>
struct Work {
  const float* x;
  const W* w;
  const float* scale;
  float* y;
  int64_t M, K, N, n_blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    for (int64_t b; (b = next.fetch_add(1)) < n_blocks;) {
      block(x, w, scale, y, M, K, N, b * kBlock, std::min(N, (b + 1) * kBlock));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename W, typename WBuffer>
ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuffer w,
                  ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || scale.element_count() != wd[0]) {
    return ffi::Error::InvalidArgument("qmatmul: want x [M, K], w [N, K], scale [N]");
  }
  auto work = std::make_shared<Work<W>>();
  work->x = x.typed_data();
  work->w = reinterpret_cast<const W*>(w.untyped_data());
  work->scale = scale.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->K = xd[1];
  work->N = wd[0];
  work->n_blocks = (work->N + kBlock - 1) / kBlock;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->n_blocks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->n_blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return matmul<int8_t>(pool, x, w, scale, y);
}

ffi::Error Bf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return matmul<uint16_t>(pool, x, w, scale, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxgptInt8Matmul, Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxgptBf16Matmul, Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
