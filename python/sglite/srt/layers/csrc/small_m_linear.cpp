// y = x W^T for a few rows of x (M = 1..16), fp32, on a row-major [out, in] weight or a column-major one.
//
// At decode and verify batch sizes a linear layer is a stream of its weight from memory. The BLAS packs do
// several passes of compute per weight block and let the stream stall while they run (docs/benchmarks.md,
// "A small-M CPU kernel"). Here every weight element is loaded once and multiplied into all M rows while it
// is in a register, and the weight is prefetched ahead of the loop, so the cost stays close to the
// bandwidth-bound M = 1 gemv. Vector width comes from GCC's vector extension: AVX-512 where -march=native
// has it, else split by the compiler (AVX2).
//
// Plain C++ with a C entry point, loaded with ctypes (layers/cpu_small_m.py): without torch's headers it compiles
// in ~3 s instead of ~25. Threads come from OpenMP; the process already has torch's libgomp.so.1 loaded, so the
// loops share torch's pool and its set_num_threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_get_num_threads() { return 1; }
inline int omp_get_thread_num() { return 0; }
#endif
#include "vec16.h"

namespace {

constexpr int kRowsPerBlock = 4;
constexpr int kMaxRowsPerCall = 8;

// Row-major weight (a tied LM head's embedding): rows [n0, n0 + R) of y for all M rows of x, with M x R
// vector accumulators and one lane sum each; prefetches the rows one block further on.
template <int M, int R>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y, int64_t n0) {
  vec16 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vec16{};
  const int64_t prefetch_row = n0 + kRowsPerBlock < N ? n0 + kRowsPerBlock : n0;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec16 wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = load(w + (n0 + r) * K + k);
      __builtin_prefetch(w + (prefetch_row + r) * K + k, 0, 3);
    }
    for (int m = 0; m < M; ++m) {
      const vec16 xv = load(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = lane_sum(acc[m][r]);
      for (int64_t t = k; t < K; ++t) s += x[m * ldx + t] * w[(n0 + r) * K + t];
      y[m * N + n0 + r] = s;
    }
  }
}

// Up to 8 rows of x per call of rows_block (their accumulators fill the vector registers); more rows take a
// second call on the same weight block while it is still in L1.
template <int M, int R>
void rows_block_all(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y, int64_t n0) {
  if constexpr (M <= kMaxRowsPerCall) {
    rows_block<M, R>(x, ldx, w, N, K, y, n0);
  } else {
    rows_block<kMaxRowsPerCall, R>(x, ldx, w, N, K, y, n0);
    rows_block<M - kMaxRowsPerCall, R>(x + kMaxRowsPerCall * ldx, ldx, w, N, K, y + kMaxRowsPerCall * N, n0);
  }
}

template <int M>
void small_m(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y) {
  const int64_t blocks = N / kRowsPerBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) rows_block_all<M, kRowsPerBlock>(x, ldx, w, N, K, y, b * kRowsPerBlock);
  for (int64_t n = blocks * kRowsPerBlock; n < N; ++n) rows_block_all<M, 1>(x, ldx, w, N, K, y, n);
}


// The same product on the column-major weight (the transpose of a contiguous [in, out] tensor, the CPU layout
// of layers/utils.new_weight_matrix). Its k-rows are read in order, kKRows at a time, each over the thread's
// whole column range, so the weight is one sequential stream per k-row; y's rows (M x N floats, in L1/L2)
// take the sums, one load and store per kKRows weight vectors. The k-rows kPrefetchPasses passes ahead are
// prefetched at the same columns (5 rows: 39.7 -> 35.0 ms over SmolLM2's 30 layers; 1 or 4 passes ahead
// did no better).
constexpr int kKRows = 8;
constexpr int kPrefetchPasses = 2;

template <int M, int KB>
void k_rows(const float* x, int64_t ldx, const float* wt, int64_t N, int64_t K, int64_t k, int64_t n0, int64_t n1, float* y) {
  const bool prefetch = k + (kPrefetchPasses + 1) * KB <= K;
  vec16 xs[M][KB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < KB; ++j) xs[m][j] = vec16{} + x[m * ldx + k + j];
  int64_t n = n0;
  for (; n + kLanes <= n1; n += kLanes) {
    vec16 wv[KB];
    for (int j = 0; j < KB; ++j) wv[j] = load(wt + (k + j) * N + n);
    if (prefetch)
      for (int j = 0; j < KB; ++j) __builtin_prefetch(wt + (k + kPrefetchPasses * KB + j) * N + n, 0, 3);
    for (int m = 0; m < M; ++m) {
      vec16 acc = load(y + m * N + n);
      for (int j = 0; j < KB; ++j) acc += xs[m][j] * wv[j];
      std::memcpy(y + m * N + n, &acc, sizeof(acc));
    }
  }
  for (; n < n1; ++n)  // the range's last columns, fewer than a vector
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < KB; ++j) y[m * N + n] += x[m * ldx + k + j] * wt[(k + j) * N + n];
}

// More rows than kColRowsPerCall take further calls over the same k-rows while they are still in L2 (their
// broadcast x values and accumulators must fit the vector registers).
constexpr int kColRowsPerCall = 8;

template <int M, int KB>
void k_rows_all(const float* x, int64_t ldx, const float* wt, int64_t N, int64_t K, int64_t k, int64_t n0, int64_t n1, float* y) {
  if constexpr (M <= kColRowsPerCall) {
    k_rows<M, KB>(x, ldx, wt, N, K, k, n0, n1, y);
  } else {
    k_rows<kColRowsPerCall, KB>(x, ldx, wt, N, K, k, n0, n1, y);
    k_rows_all<M - kColRowsPerCall, KB>(x + kColRowsPerCall * ldx, ldx, wt, N, K, k, n0, n1, y + kColRowsPerCall * N);
  }
}

template <int M>
void small_m_t(const float* x, int64_t ldx, const float* wt, int64_t N, int64_t K, float* y) {
  std::memset(y, 0, sizeof(float) * M * N);
  // Each thread takes one contiguous range of columns (whole vectors): the longer each k-row's run, the better
  // the stream (256-column chunks made 5 rows 1.5x slower on one thread).
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t vectors = (N + kLanes - 1) / kLanes;
    const int64_t n0 = std::min<int64_t>(N, vectors * t / threads * kLanes);
    const int64_t n1 = t + 1 == threads ? N : std::min<int64_t>(N, vectors * (t + 1) / threads * kLanes);
    int64_t k = 0;
    for (; k + kKRows <= K; k += kKRows) k_rows_all<M, kKRows>(x, ldx, wt, N, K, k, n0, n1, y);
    for (; k < K; ++k) k_rows_all<M, 1>(x, ldx, wt, N, K, k, n0, n1, y);
  }
}

}  // namespace

// y[M, N] = x[M, K] (rows ldx floats apart) times w^T, w row-major [N, K] (row_major != 0) or column-major
// (w^T contiguous, [K, N]). The caller checks shapes, dtypes and 1 <= M <= 16; returns 0, or -1 for another M.
extern "C" int sglite_small_m_linear(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y,
                                     int64_t M, int row_major) {
#define SGLITE_SMALL_M_CASE(ROWS) \
  case ROWS: \
    if (row_major) small_m<ROWS>(x, ldx, w, N, K, y); else small_m_t<ROWS>(x, ldx, w, N, K, y); \
    return 0;
  switch (M) {
    SGLITE_SMALL_M_CASE(1)
    SGLITE_SMALL_M_CASE(2)
    SGLITE_SMALL_M_CASE(3)
    SGLITE_SMALL_M_CASE(4)
    SGLITE_SMALL_M_CASE(5)
    SGLITE_SMALL_M_CASE(6)
    SGLITE_SMALL_M_CASE(7)
    SGLITE_SMALL_M_CASE(8)
    SGLITE_SMALL_M_CASE(9)
    SGLITE_SMALL_M_CASE(10)
    SGLITE_SMALL_M_CASE(11)
    SGLITE_SMALL_M_CASE(12)
    SGLITE_SMALL_M_CASE(13)
    SGLITE_SMALL_M_CASE(14)
    SGLITE_SMALL_M_CASE(15)
    SGLITE_SMALL_M_CASE(16)
    default: return -1;
  }
#undef SGLITE_SMALL_M_CASE
}
