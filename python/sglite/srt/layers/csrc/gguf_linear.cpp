// y = x W^T for a few rows of x (M = 1..16) on a GGUF-quantized weight W [N, K] (Q4_0, Q4_1 or Q8_0), fp32 out.
//
// A decode step of a 4-bit model streams 0.6 bytes a weight instead of the 4 of its fp32 copy. Each weight is
// dequantized in registers exactly as the gguf package does it (fp16 scales widened, `d * q` rounded, then `+ m`
// rounded: this file is built with -ffp-contract=off so the compiler does not fuse them), then multiplied into
// every row of x. So the product is the product with the fp32 weights the loader gives the other kernels, up to
// summation order.
//
// Summation order is one fixed sequence per output element, whatever M and however the rows are split into
// passes: two 8-lane partial sums per (row of x, row of W), lanes 0-7 and 16-23 of each 32-weight block into the
// first, 8-15 and 24-31 into the second, then (first + second) reduced by one fixed tree. So row m of an M-row
// product equals the 1-row product of x[m] bit for bit (a DFLASH verify scores exactly what decode would).
//
// Plain C++ with a C entry point, loaded with ctypes (layers/cpu_gguf_linear.py); AVX2 + FMA + F16C where
// -march=native has them, else a scalar loop with the same summation order.
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SGLITE_GGUF_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // weights per block, every type here
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids

inline int block_bytes(int type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef SGLITE_GGUF_AVX2
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

#ifdef SGLITE_GGUF_AVX2
typedef __m256 Vec;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The block's weights in four vectors: elements 0-7, 8-15, 16-23, 24-31.
template <int TYPE>
inline void dequantize_block(const uint8_t* b, Vec w[4]) {
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

// R rows of W from n0, all M rows of x, accumulators in registers (M * R * 2 of them: 8 at 1-4 rows of x; at 5-8
// rows some spill, still faster than row_through_buffer on an AVX2 EPYC).
template <int TYPE, int M, int R>
void rows_in_registers(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                       float* y, int64_t n0) {
  Vec acc[M][R][2];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r][0] = acc[m][r][1] = vzero();
  const int bb = block_bytes(TYPE);
  for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = w + (n0 + r) * row_bytes + blk * bb;
      __builtin_prefetch(b + 8 * row_bytes, 0, 3);
      Vec wv[4];
      dequantize_block<TYPE>(b, wv);
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * ldx + k;
        acc[m][r][0] = vfma(vload(xm), wv[0], acc[m][r][0]);
        acc[m][r][1] = vfma(vload(xm + 8), wv[1], acc[m][r][1]);
        acc[m][r][0] = vfma(vload(xm + 16), wv[2], acc[m][r][0]);
        acc[m][r][1] = vfma(vload(xm + 24), wv[3], acc[m][r][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n0 + r] = vsum(vadd(acc[m][r][0], acc[m][r][1]));
}

// One row of W for 9-16 rows of x: the row dequantized once into `buf` (K floats, L1/L2), then passes of up to
// kRowsPerPass rows of x over it, with the same per-element sequence as rows_in_registers.
constexpr int kRowsPerPass = 4;

template <int TYPE>
void row_through_buffer(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                        float* y, int64_t n, int64_t M, float* buf) {
  const int bb = block_bytes(TYPE);
  const uint8_t* row = w + n * row_bytes;
  __builtin_prefetch(row + 4 * row_bytes, 0, 3);
  for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
    Vec wv[4];
    dequantize_block<TYPE>(row + blk * bb, wv);
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(buf + k + 8 * g, wv[g]);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int rows = int(M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass);
    Vec acc[kRowsPerPass][2];
    for (int m = 0; m < kRowsPerPass; ++m) acc[m][0] = acc[m][1] = vzero();
    for (int64_t k = 0; k < K; k += kBlock) {
      const Vec w0 = vload(buf + k), w1 = vload(buf + k + 8), w2 = vload(buf + k + 16), w3 = vload(buf + k + 24);
      for (int m = 0; m < kRowsPerPass; ++m) {
        if (m >= rows) break;
        const float* xm = x + (m0 + m) * ldx + k;
        acc[m][0] = vfma(vload(xm), w0, acc[m][0]);
        acc[m][1] = vfma(vload(xm + 8), w1, acc[m][1]);
        acc[m][0] = vfma(vload(xm + 16), w2, acc[m][0]);
        acc[m][1] = vfma(vload(xm + 24), w3, acc[m][1]);
      }
    }
    for (int m = 0; m < rows; ++m) y[(m0 + m) * N + n] = vsum(vadd(acc[m][0], acc[m][1]));
  }
}

template <int TYPE, int M>
void linear_small(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
  const int64_t row_bytes = K / kBlock * block_bytes(TYPE), blocks = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) rows_in_registers<TYPE, M, R>(x, ldx, w, row_bytes, N, K, y, b * R);
  for (int64_t n = blocks * R; n < N; ++n) rows_in_registers<TYPE, M, 1>(x, ldx, w, row_bytes, N, K, y, n);
}

template <int TYPE>
void linear_buffered(const float* x, int64_t ldx, const uint8_t* w, int64_t N, int64_t K, float* y, int64_t M) {
  const int64_t row_bytes = K / kBlock * block_bytes(TYPE);
#pragma omp parallel
  {
    std::vector<float> buf(K);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) row_through_buffer<TYPE>(x, ldx, w, row_bytes, N, K, y, n, M, buf.data());
  }
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
    default: return linear_buffered<TYPE>(x, ldx, w, N, K, y, M);
  }
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
#ifdef SGLITE_GGUF_AVX2
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
