// y = x W^T for a few rows of x (M = 1..16) on a GGUF-quantized weight W [N, K] (Q4_0, Q4_1 or Q8_0), fp32 out.
//
// A decode step of a 4-bit model streams 0.6 bytes a weight instead of the 4 of its fp32 copy. Each weight is
// dequantized in registers exactly as the gguf package does it (fp16 scales widened, `d * q` rounded, then `+ m`
// rounded: this file is built with -ffp-contract=off so the compiler does not fuse them), then multiplied into
// every row of x. So the product is the product with the fp32 weights the loader gives the other kernels, up to
// summation order.
//
// Summation order is one fixed sequence per output element, whatever M and however the rows are split into
// passes: 16 partial sums per (row of x, row of W), elements 0-7 and 16-23 of each 32-weight block into sums 0-7,
// 8-15 and 24-31 into sums 8-15, then sum p + sum p + 8 reduced by one fixed tree (see `finish`). So row m of an M-row
// product equals the 1-row product of x[m] bit for bit (a DFLASH verify scores exactly what decode would).
//
// Plain C++ with a C entry point, loaded with ctypes (layers/cpu_gguf_linear.py); AVX-512F, else AVX2 + FMA, with
// F16C where -march=native has them, else a scalar loop with the same summation order.
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__F16C__)
#define SGLITE_GGUF_VECTOR 1
#define SGLITE_GGUF_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SGLITE_GGUF_VECTOR 1
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // weights per block, every type here
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids

inline int block_bytes(int type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef SGLITE_GGUF_VECTOR
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// The block's 32 weights as fp32, element order, exactly as gguf.quants dequantizes them.
inline void dequantize_block_scalar(const uint8_t* b, int type, float* out) {
  const float d = half_to_float(b);
  if (type == kQ8_0) {
    for (int i = 0; i < kBlock; ++i) out[i] = float(int8_t(b[2 + i])) * d;
    return;
  }
  const uint8_t* qs = b + (type == kQ4_1 ? 4 : 2);
  const float m = type == kQ4_1 ? half_to_float(b + 2) : 0.f;
  for (int i = 0; i < 16; ++i) {
    const int lo = qs[i] & 0x0f, hi = qs[i] >> 4;
    if (type == kQ4_1) {
      float a = d * float(lo), c = d * float(hi);
      out[i] = a + m;
      out[i + 16] = c + m;
    } else {
      out[i] = d * float(lo - 8);
      out[i + 16] = d * float(hi - 8);
    }
  }
}

#ifdef SGLITE_GGUF_VECTOR
// One ISA's vectors. Every output element has 16 partial sums, "lanes" p = 0..15: weight k of a block goes to lane
// (k % 8) + 8 * ((k / 8) % 2), i.e. elements 0-7 and 16-23 into lanes 0-7, elements 8-15 and 24-31 into lanes
// 8-15, each lane summed block after block in element order. AVX2 holds the 16 lanes in two registers (kAcc = 2),
// AVX-512 in one; `finish` adds lane p + 8 into lane p and reduces the 8 by one fixed tree. So both builds, and
// the scalar one, give the same bits.
#ifdef SGLITE_GGUF_AVX512
typedef __m512 Vec;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __m256 lanes_folded(const Vec* acc) {
  return _mm256_add_ps(_mm512_castps512_ps256(acc[0]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0]), 1)));
}
#else
typedef __m256 Vec;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 lanes_folded(const Vec* acc) { return _mm256_add_ps(acc[0], acc[1]); }
#endif
constexpr int kVecs = kBlock / kLanes;  // vectors a block of weights fills
constexpr int kAcc = 16 / kLanes;        // registers the 16 partial sums of one output element fill

inline float finish(const Vec* acc) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) over l = p + (p + 8)
  const __m256 v = lanes_folded(acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc += one block of x times one block of weights, each vector into its lanes' register.
inline void accumulate(const float* xk, const Vec* w, Vec* acc) {
  for (int g = 0; g < kVecs; ++g) acc[g % kAcc] = vfma(vload(xk + g * kLanes), w[g], acc[g % kAcc]);
}

#ifdef SGLITE_GGUF_AVX512
// The block's weights in two vectors: elements 0-15, 16-31. A 4-bit block has 16 distinct values, so they are
// computed once (`d * q` rounded, then `+ m` rounded, as the gguf package does) and each weight is a table lookup.
template <int TYPE>
inline void dequantize_block(const uint8_t* b, Vec w[kVecs]) {
  const Vec d = _mm512_set1_ps(half_to_float(b));
  if constexpr (TYPE == kQ8_0) {
    for (int g = 0; g < 2; ++g) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * g)));
      w[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
    }
  } else {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec table = TYPE == kQ4_1 ? _mm512_add_ps(_mm512_mul_ps(d, iota), _mm512_set1_ps(half_to_float(b + 2)))
                                    : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)));
    // Byte i holds element i (low nibble) and element i + 16 (high nibble).
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (TYPE == kQ4_1 ? 4 : 2))));
    w[0] = _mm512_permutexvar_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0f)), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
}
#else
// The block's weights in four vectors: elements 0-7, 8-15, 16-23, 24-31.
template <int TYPE>
inline void dequantize_block(const uint8_t* b, Vec w[kVecs]) {
  const Vec d = _mm256_set1_ps(half_to_float(b));
  if constexpr (TYPE == kQ8_0) {
    for (int g = 0; g < 4; ++g) {
      int64_t eight;
      std::memcpy(&eight, b + 2 + 8 * g, 8);
      const __m256i q = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight));
      w[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
  } else {
    // Bytes 0-7 and 8-15 zero-extended to 32-bit lanes straight from memory: the low nibbles are elements 0-7 and
    // 8-15, the high ones 16-23 and 24-31. Two lane-widening shuffles a block instead of six (port-bound on Zen 3).
    const uint8_t* qs = b + (TYPE == kQ4_1 ? 4 : 2);
    int64_t first, second;
    std::memcpy(&first, qs, 8);
    std::memcpy(&second, qs + 8, 8);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(first)), c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(second));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i parts[4] = {_mm256_and_si256(a, mask), _mm256_and_si256(c, mask), _mm256_srli_epi32(a, 4),
                              _mm256_srli_epi32(c, 4)};
    const Vec m = TYPE == kQ4_1 ? _mm256_set1_ps(half_to_float(b + 2)) : _mm256_set1_ps(8.f);
    for (int g = 0; g < 4; ++g) {
      const Vec q = _mm256_cvtepi32_ps(parts[g]);
      if constexpr (TYPE == kQ4_1) {
        w[g] = _mm256_add_ps(_mm256_mul_ps(d, q), m);
      } else {
        w[g] = _mm256_mul_ps(d, _mm256_sub_ps(q, m));
      }
    }
  }
}
#endif

// R rows of W from n0, all M rows of x, accumulators in registers (M * R * kAcc of them).
template <int TYPE, int M, int R>
void rows_in_registers(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                       float* y, int64_t n0) {
  Vec acc[M][R][kAcc];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < kAcc; ++a) acc[m][r][a] = vzero();
  const int bb = block_bytes(TYPE);
  for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = w + (n0 + r) * row_bytes + blk * bb;
      __builtin_prefetch(b + 8 * row_bytes, 0, 3);
      Vec wv[kVecs];
      dequantize_block<TYPE>(b, wv);
      for (int m = 0; m < M; ++m) accumulate(x + m * ldx + k, wv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n0 + r] = finish(acc[m][r]);
}

// Register blocking, per ISA (AVX-512's 32 registers hold more accumulators than AVX2's 16):
// - kRowsOfW<M>(): rows of W that rows_in_registers holds at M rows of x;
// - kMaxRowsInRegisters: the most rows of x whose accumulators stay in registers; more take rows_through_buffer,
//   which holds kBufferedRowsOfW rows of W and passes over x kRowsPerPass rows at a time.
// Chosen by timing SmolLM2's layers (benchmark/profile_cpu_decode.py gemm --gguf) on a Zen 3 (AVX2) and a Zen 4.
#ifdef SGLITE_GGUF_AVX512
constexpr int kMaxRowsInRegisters = 12, kBufferedRowsOfW = 2, kRowsPerPass = 8;
template <int M>
constexpr int kRowsOfW() { return M == 1 ? 4 : 2; }
#else
constexpr int kMaxRowsInRegisters = 8, kBufferedRowsOfW = 1, kRowsPerPass = 4;
template <int M>
constexpr int kRowsOfW() { return M == 1 ? 4 : M == 2 ? 2 : 1; }
#endif

// RB rows of W for more rows of x than stay in registers: the rows dequantized once into `buf` (RB * K floats,
// L1/L2), then passes of up to kRowsPerPass rows of x over them (each x vector loaded once for the RB rows), with
// the same per-element sequence as rows_in_registers.

template <int TYPE, int RB>
void rows_through_buffer(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                         float* y, int64_t n0, int64_t M, float* buf) {
  const int bb = block_bytes(TYPE);
  for (int r = 0; r < RB; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    __builtin_prefetch(row + 4 * RB * row_bytes, 0, 3);
    for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
      Vec wv[kVecs];
      dequantize_block<TYPE>(row + blk * bb, wv);
      for (int g = 0; g < kVecs; ++g) vstore(buf + r * K + k + g * kLanes, wv[g]);
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int rows = int(M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass);
    Vec acc[kRowsPerPass][RB][kAcc];
    for (int m = 0; m < kRowsPerPass; ++m)
      for (int r = 0; r < RB; ++r)
        for (int a = 0; a < kAcc; ++a) acc[m][r][a] = vzero();
    for (int64_t k = 0; k < K; k += kBlock) {
      for (int r = 0; r < RB; ++r) {
        Vec wv[kVecs];
        for (int g = 0; g < kVecs; ++g) wv[g] = vload(buf + r * K + k + g * kLanes);
        for (int m = 0; m < kRowsPerPass; ++m) {
          if (m >= rows) break;
          accumulate(x + (m0 + m) * ldx + k, wv, acc[m][r]);
        }
      }
    }
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < RB; ++r) y[(m0 + m) * N + n0 + r] = finish(acc[m][r]);
  }
}

template <int TYPE, int M>
void linear_small(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y) {
  constexpr int R = kRowsOfW<M>();
  const int64_t row_bytes = K / kBlock * block_bytes(TYPE), blocks = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) rows_in_registers<TYPE, M, R>(x, ldx, w, row_bytes, N, K, y, b * R);
  for (int64_t n = blocks * R; n < N; ++n) rows_in_registers<TYPE, M, 1>(x, ldx, w, row_bytes, N, K, y, n);
}

template <int TYPE>
void linear_buffered(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y, int64_t M) {
  const int64_t row_bytes = K / kBlock * block_bytes(TYPE), groups = N / kBufferedRowsOfW;
#pragma omp parallel
  {
    std::vector<float> buf(kBufferedRowsOfW * K);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g)
      rows_through_buffer<TYPE, kBufferedRowsOfW>(x, ldx, w, row_bytes, N, K, y, g * kBufferedRowsOfW, M, buf.data());
  }
  std::vector<float> buf(K);
  for (int64_t n = groups * kBufferedRowsOfW; n < N; ++n) rows_through_buffer<TYPE, 1>(x, ldx, w, row_bytes, N, K, y, n, M, buf.data());
}

template <int TYPE>
void linear_typed(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y, int64_t M) {
  switch (M) {
    case 1: return linear_small<TYPE, 1>(x, ldx, w, N, K, y);
    case 2: return linear_small<TYPE, 2>(x, ldx, w, N, K, y);
    case 3: return linear_small<TYPE, 3>(x, ldx, w, N, K, y);
    case 4: return linear_small<TYPE, 4>(x, ldx, w, N, K, y);
    case 5: return linear_small<TYPE, 5>(x, ldx, w, N, K, y);
    case 6: return linear_small<TYPE, 6>(x, ldx, w, N, K, y);
    case 7: return linear_small<TYPE, 7>(x, ldx, w, N, K, y);
    case 8: return linear_small<TYPE, 8>(x, ldx, w, N, K, y);
    default: break;
  }
  if constexpr (kMaxRowsInRegisters >= 12) {
    switch (M) {
      case 9: return linear_small<TYPE, 9>(x, ldx, w, N, K, y);
      case 10: return linear_small<TYPE, 10>(x, ldx, w, N, K, y);
      case 11: return linear_small<TYPE, 11>(x, ldx, w, N, K, y);
      case 12: return linear_small<TYPE, 12>(x, ldx, w, N, K, y);
      default: break;
    }
  }
  linear_buffered<TYPE>(x, ldx, w, N, K, y, M);
}

#else  // scalar: the same two partial sums of 8 lanes and the same final tree per output element

inline float tree8(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

void linear_scalar(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y, int64_t M, int type) {
  const int64_t row_bytes = K / kBlock * block_bytes(type);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> row(K);
    for (int64_t blk = 0; blk < K / kBlock; ++blk)
      dequantize_block_scalar(w + n * row_bytes + blk * block_bytes(type), type, row.data() + blk * kBlock);
    for (int64_t m = 0; m < M; ++m) {
      float a[8] = {}, c[8] = {};
      for (int64_t k = 0; k < K; k += kBlock)
        for (int l = 0; l < 8; ++l) {
          const float* xm = x + m * ldx + k;
          a[l] = __builtin_fmaf(xm[l], row[k + l], a[l]);
          c[l] = __builtin_fmaf(xm[8 + l], row[k + 8 + l], c[l]);
          a[l] = __builtin_fmaf(xm[16 + l], row[k + 16 + l], a[l]);
          c[l] = __builtin_fmaf(xm[24 + l], row[k + 24 + l], c[l]);
        }
      float s[8];
      for (int l = 0; l < 8; ++l) s[l] = a[l] + c[l];
      y[m * N + n] = tree8(s);
    }
  }
}
#endif

}  // namespace

// y[M, N] = x[M, K] (rows ldx floats apart) times W^T, W [N, K] in GGML type `type` (rows of K / 32 blocks).
// The caller checks shapes and 1 <= M <= 16; returns 0, or -1 for an unsupported type, M or K.
extern "C" int sglite_gguf_linear(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y,
                                  int64_t M, int type) {
  if (M < 1 || M > 16 || K % kBlock != 0 || (type != kQ4_0 && type != kQ4_1 && type != kQ8_0)) return -1;
#ifdef SGLITE_GGUF_VECTOR
  switch (type) {
    case kQ4_0: linear_typed<kQ4_0>(x, ldx, w, N, K, y, M); break;
    case kQ4_1: linear_typed<kQ4_1>(x, ldx, w, N, K, y, M); break;
    default: linear_typed<kQ8_0>(x, ldx, w, N, K, y, M); break;
  }
#else
  linear_scalar(x, ldx, w, N, K, y, M, type);
#endif
  return 0;
}

// out[N, K] = W dequantized to fp32, bit-equal to gguf.quants.dequantize. Returns 0, or -1 for an unsupported type.
extern "C" int sglite_gguf_dequantize(const uint8_t* w, int64_t N, int64_t K, float* out, int type) {
  if (K % kBlock != 0 || (type != kQ4_0 && type != kQ4_1 && type != kQ8_0)) return -1;
  const int bb = block_bytes(type);
  const int64_t blocks = N * (K / kBlock);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < blocks; ++i) dequantize_block_scalar(w + i * bb, type, out + i * kBlock);
  return 0;
}
