// Paged causal attention for the compiled CPU forwards of several new tokens a request (prefills, mixed steps, verify
// blocks), fp32. A decode step (one token a request) is served too, though the decode graph keeps the torch formulation.
//
// Traced by Inductor, the torch formulation (layers/attention/compiled_decode.py) computes every score as its own
// 64-wide dot product with a horizontal sum, for every key of the longest sequence (masked ones included), and a
// prompt token re-gathers its request's keys: a 1,024-token SmolLM2 prompt took 1.9x as long as with this kernel
// (docs/benchmarks.md, "A paged attention kernel for prefills, mixed steps and verify blocks"). Here one task is a
// (request, KV head) pair: each key row is read from the pool once per new token and multiplied into all of the query
// heads that share it, only the causal (and sliding-window) range is scored, and the softmax's exp is a vectorised
// polynomial.
//
// Layouts: q [T, H, D], out [T, H, Dv], the pool's k [slots, Hkv, D] and v [slots, Hkv, Dv], all contiguous;
// kv_indices [B, row_stride] (request b's keys are its first seq_lens[b] entries, its new tokens last). Token t
// belongs to request token_rows[t] (request-major: a request's tokens are consecutive) and sees the keys up to its
// own index token_key_index[t]; with both null (a decode step) token t is request t and sees all of its keys.
// D and Dv are 16, 32, 64, 96, 128 or 256 (the instantiations); H / Hkv (the group) at most kMaxGroup. The caller
// checks these (cpu_paged_attention.kernel_serves).
//
// Plain C++ with a C entry point, loaded with ctypes (layers/attention/cpu_paged_attention.py), built like the other
// kernels (layers/cpu_kernel_build.py). Threads from OpenMP (torch's libgomp): one task per (request, KV head).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "vec16.h"

namespace {

constexpr int kMaxGroup = 16;

inline void store(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

inline vec16 splat(float x) { return vec16{} + x; }

typedef int32_t vec16i __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp(x) for x <= 0 (scores minus their max), 16 lanes, to ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two
// parts, so r is exact), exp(r) by Cephes' expf polynomial, times 2^n through the exponent field. In GCC vector
// arithmetic (no libm call), so it stays vectorised.
inline vec16 exp_nonpositive(vec16 x) {
  const vec16 lowest = splat(-87.0f);  // below, exp underflows to a denormal: zero is as good for a softmax weight
  x = x < lowest ? lowest : x;
  const vec16 t = x * 1.44269504088896341f + 0.5f;
  vec16i n = __builtin_convertvector(t, vec16i);  // truncates towards zero: one too high for negative fractions
  n += __builtin_convertvector(n, vec16) > t;  // a true comparison lane is -1: n = floor(t), x / ln2 rounded
  const vec16 nf = __builtin_convertvector(n, vec16);
  const vec16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vec16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vec16i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += n << 23;  // n >= -126: times 2^n in the exponent field
  vec16 y;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}

const vec16i kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline float lane_max(vec16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// Ask for the cache lines of a row of `vecs` 16-float vectors (one line each).
inline void prefetch_row(const float* row, int64_t vecs) {
  for (int64_t c = 0; c < vecs; ++c) __builtin_prefetch(row + c * kLanes, 0, 3);
}

// What every task reads: the queries, the pool's K/V, the geometry, and where the outputs go.
struct Problem {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  int64_t num_heads, num_kv_heads, head_dim, v_head_dim;
  float scaling;
  float* out;
};

// Scores of one new token's G query heads (those of KV head g) against keys [lo, lo + n): each key row is loaded once
// and dotted with every query head that shares it. DV = head_dim / 16, a constant, so the row stays in registers.
template <int DV>
void score_keys(const Problem& p, const int64_t* __restrict keys, int64_t t, int64_t g, int64_t group, int64_t lo,
                int64_t n, int64_t stride, float* __restrict scores, const int64_t* __restrict next_keys, int64_t next_n) {
  const int64_t k_row = p.num_kv_heads * p.head_dim;
  vec16 qv[kMaxGroup][DV];
  for (int64_t j = 0; j < group; ++j) {
    const float* qrow = p.q + (t * p.num_heads + g * group + j) * p.head_dim;
    for (int c = 0; c < DV; ++c) qv[j][c] = load(qrow + c * kLanes) * p.scaling;
  }
  const int64_t v_row = p.num_kv_heads * p.v_head_dim;
  for (int64_t l = 0; l < n; ++l) {
    // A request's keys come from DRAM (the weights streamed through the caches since they were written): while this
    // request computes, fetch the next one's rows of this KV head, a key at a time, spread over the compute.
    if (l < next_n) {
      prefetch_row(p.k_cache + next_keys[l] * k_row + g * p.head_dim, DV);
      prefetch_row(p.v_cache + next_keys[l] * v_row + g * p.v_head_dim, p.v_head_dim / kLanes);
    }
    const float* krow = p.k_cache + keys[lo + l] * k_row + g * p.head_dim;
    vec16 kv[DV];
    for (int c = 0; c < DV; ++c) kv[c] = load(krow + c * kLanes);
    for (int64_t j = 0; j < group; ++j) {
      vec16 acc = qv[j][0] * kv[0];
      for (int c = 1; c < DV; ++c) acc += qv[j][c] * kv[c];
      scores[j * stride + l] = lane_sum(acc);
    }
  }
}

// out[t, head] = sum_l weights[head][l] * v[l] * inv_sum[head] for the G heads of KV head g: each value row is loaded
// once and accumulated into every head's output. DVV = v_head_dim / 16.
template <int DVV>
void weigh_values(const Problem& p, const int64_t* __restrict keys, int64_t t, int64_t g, int64_t group, int64_t lo,
                  int64_t n, int64_t stride, const float* __restrict weights, const float* inv_sum) {
  const int64_t v_row = p.num_kv_heads * p.v_head_dim;
  vec16 acc[kMaxGroup][DVV];
  for (int64_t j = 0; j < group; ++j)
    for (int c = 0; c < DVV; ++c) acc[j][c] = vec16{};
  for (int64_t l = 0; l < n; ++l) {
    const float* vrow = p.v_cache + keys[lo + l] * v_row + g * p.v_head_dim;
    vec16 vv[DVV];
    for (int c = 0; c < DVV; ++c) vv[c] = load(vrow + c * kLanes);
    for (int64_t j = 0; j < group; ++j) {
      const vec16 w = splat(weights[j * stride + l]);
      for (int c = 0; c < DVV; ++c) acc[j][c] += w * vv[c];
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* orow = p.out + (t * p.num_heads + g * group + j) * p.v_head_dim;
    for (int c = 0; c < DVV; ++c) store(orow + c * kLanes, acc[j][c] * inv_sum[j]);
  }
}

// Softmax of each head's score row in place, 16 lanes at a time; rows are `stride` floats apart, padded to a multiple
// of 16 whose tail weights come out 0. 1 / sum per head into inv_sum.
void softmax_rows(float* __restrict scores, int64_t group, int64_t n, int64_t stride, float* inv_sum) {
  const int64_t full = n / kLanes * kLanes;
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores + j * stride;
    for (int64_t l = n; l < stride; ++l) s[l] = -INFINITY;  // the padding: no effect on the max
    vec16 m = load(s);
    for (int64_t l = kLanes; l < stride; l += kLanes) {
      const vec16 v = load(s + l);
      m = v > m ? v : m;
    }
    const vec16 row_max = splat(lane_max(m));
    vec16 sum = vec16{};
    for (int64_t l = 0; l < stride; l += kLanes) {
      vec16 e = exp_nonpositive(load(s + l) - row_max);
      if (l >= full) e = kLaneIndex < static_cast<int32_t>(n - l) ? e : vec16{};  // padding lanes weigh exactly 0
      store(s + l, e);
      sum += e;
    }
    inv_sum[j] = 1.0f / lane_sum(sum);
  }
}

typedef void (*ScoreFn)(const Problem&, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*,
                        const int64_t*, int64_t);
typedef void (*WeighFn)(const Problem&, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        const float*, const float*);

// The instantiation for a head size (a multiple of 16), or null: 16, 32, 64, 96, 128 and 256 have one.
template <template <int> class F, typename Fn>
Fn for_dim(int64_t dim) {
  switch (dim / kLanes) {
    case 1: return F<1>::fn;
    case 2: return F<2>::fn;
    case 4: return F<4>::fn;
    case 6: return F<6>::fn;
    case 8: return F<8>::fn;
    case 16: return F<16>::fn;
    default: return nullptr;
  }
}
template <int DV>
struct Score {
  static constexpr ScoreFn fn = score_keys<DV>;
};
template <int DVV>
struct Weigh {
  static constexpr WeighFn fn = weigh_values<DVV>;
};

}  // namespace

// Returns 0, or 1 when the shapes are outside what the kernel serves (the caller checked them: a bug), or 2 when
// token_rows is not request-major.
extern "C" int sglite_paged_attention(const float* q, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                      const float* k_cache, const float* v_cache, int64_t num_kv_heads,
                                      int64_t v_head_dim, const int64_t* kv_indices, int64_t num_reqs,
                                      int64_t row_stride, const int64_t* seq_lens, const int64_t* token_rows,
                                      const int64_t* token_key_index, float scaling, int64_t sliding_window,
                                      float* out) {
  // Head sizes: multiples of 16 here, and for_dim below refuses those it has no instantiation for.
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup ||
      head_dim % kLanes != 0 || v_head_dim % kLanes != 0 || (token_rows == nullptr) != (token_key_index == nullptr) ||
      (token_rows == nullptr && num_tokens != num_reqs))
    return 1;
  // Each request's first new token: tokens are request-major, so one pass finds the ranges.
  std::vector<int64_t> first(static_cast<size_t>(num_reqs + 1), 0);
  if (token_rows == nullptr) {
    for (int64_t b = 0; b <= num_reqs; ++b) first[b] = b;
  } else {
    int64_t b = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t r = token_rows[t];
      if (r < b || r >= num_reqs) return 2;
      while (b < r) first[++b] = t;
    }
    while (b < num_reqs) first[++b] = num_tokens;
  }
  const ScoreFn score = for_dim<Score, ScoreFn>(head_dim);
  const WeighFn weigh = for_dim<Weigh, WeighFn>(v_head_dim);
  if (score == nullptr || weigh == nullptr) return 1;
  const Problem p{q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, v_head_dim, scaling, out};
  const int64_t tasks = num_reqs * num_kv_heads, group = num_heads / num_kv_heads;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> scores;
    float inv_sum[kMaxGroup];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t* keys = kv_indices + b * row_stride;
      for (int64_t t = first[b]; t < first[b + 1]; ++t) {
        const int64_t hi = token_key_index == nullptr ? seq_lens[b] - 1 : token_key_index[t];
        const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, hi - sliding_window + 1) : 0;
        const int64_t n = hi - lo + 1, stride = (n + kLanes - 1) / kLanes * kLanes;
        if (static_cast<int64_t>(scores.size()) < group * stride) scores.resize(static_cast<size_t>(group * stride));
        // The next request's keys are fetched during this request's first token (its later ones hit the caches).
        const bool fetch_next = t == first[b] && b + 1 < num_reqs;
        score(p, keys, t, g, group, lo, n, stride, scores.data(), fetch_next ? keys + row_stride : nullptr,
              fetch_next ? seq_lens[b + 1] : 0);
        softmax_rows(scores.data(), group, n, stride, inv_sum);
        weigh(p, keys, t, g, group, lo, n, stride, scores.data(), inv_sum);
      }
    }
  }
  return 0;
}
