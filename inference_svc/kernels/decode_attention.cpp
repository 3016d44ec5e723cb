// inference::decode_attention: one new token per row attends to its row of the KV cache.
//
// q [B, KV, G, D] (the G query heads that share each KV head side by side); k, v [B, KV, L, D]
// views of the cache (any strides, last dim contiguous); pos [B] int64: row b attends to
// slots max(0, pos[b] - window + 1) .. min(pos[b], L - 1) (window <= 0: from slot 0).
// Returns [B, KV, G, D] in q's dtype. q float32 or bfloat16; the cache (k, v) in q's dtype or
// float16 (--kv-cache-dtype float16: half the bytes a step reads); scores, softmax and sums
// in float32.
//
// Why: torch's CPU SDPA (flash kernel) reads a decode step's cache at 4-6x its bytes' time
// (bench/decode_attention.py). Here each task reads its slice of keys, then of values, once
// from memory: on AVX-512 with head size 64 and up to 3 query heads a KV head, all of them in
// one pass over each (heads_fused); elsewhere one query head at a time over a block that
// stays in cache (bfloat16 and float16 converted into it first). A row's visible slots are
// split into chunks when rows x KV heads alone leave threads idle (one row, 3 KV heads, 2
// threads); the chunks' partial softmax (max, sum, weighted values) are merged after
// (flash-decoding). Built with the vector ISA inductor picks for this CPU (CPU_CAPABILITY_*
// and its -m flags, models/../kernels/__init__.py): at::vec is AVX-512, AVX2 or scalar.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// One row of D values as float32 (float16 with F16C's 8-wide conversion: at::vec's own
// ran the float16 cache at half the float32 cache's speed on AVX2).
template <typename T>
inline void row_to_float(const T* x, float* out, int64_t D) {
  at::vec::convert(x, out, D);
}
#ifdef __F16C__
template <>
inline void row_to_float<c10::Half>(const c10::Half* x, float* out, int64_t D) {
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(x + i))));
  }
  for (; i < D; ++i) out[i] = static_cast<float>(x[i]);
}
#endif

// Rows [0, m) of a [slots, D] block with row stride ``stride``, as float32: the block itself
// for float32; bfloat16 and float16 are converted once into ``buf`` (then read G times from
// cache).
template <typename T>
inline const float* rows_as_float(const T* x, int64_t stride, int64_t m, int64_t D,
                                  std::vector<float>& buf, int64_t* out_stride) {
  buf.resize(m * D);
  for (int64_t j = 0; j < m; ++j) row_to_float(x + j * stride, buf.data() + j * D, D);
  *out_stride = D;
  return buf.data();
}
template <>
inline const float* rows_as_float<float>(const float* x, int64_t stride, int64_t, int64_t,
                                         std::vector<float>&, int64_t* out_stride) {
  *out_stride = stride;
  return x;
}

// Scores s[0, m) with their max into exp(s - max) in place; their sum.
inline float softmax_numerators(float* s, int64_t m, float mx) {
  constexpr int64_t W = Vec::size();
  const Vec top(mx);
  Vec sums(0.f);
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    const Vec e = (Vec::loadu(s + j) - top).exp_u20();
    e.store(s + j);
    sums = sums + e;
  }
  if (j < m) {
    const Vec e = (Vec::loadu(s + j, m - j) - top).exp_u20();
    e.store(s + j, m - j);
    sums = sums + Vec::set(Vec(0.f), e, m - j);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sums);
}

// One query head over a block of m slots: scores, their max and exp-sum, the weighted sum
// of values into r = [max, sum, D values]. D a multiple of the vector width here.
template <int64_t D>
inline void head_block(const float* qg, const float* kf, int64_t kst, const float* vf,
                       int64_t vst, int64_t m, float* s, float* r) {
  constexpr int64_t W = Vec::size(), N = D / W;
  Vec qv[N];
  for (int64_t i = 0; i < N; ++i) qv[i] = Vec::loadu(qg + i * W);
  float mx = -INFINITY;
  for (int64_t j = 0; j < m; ++j) {
    const float* kj = kf + j * kst;
    Vec acc = qv[0] * Vec::loadu(kj);
    for (int64_t i = 1; i < N; ++i) acc = at::vec::fmadd(qv[i], Vec::loadu(kj + i * W), acc);
    const float d = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
    s[j] = d;
    mx = std::max(mx, d);
  }
  r[0] = mx;
  r[1] = softmax_numerators(s, m, mx);
  Vec acc[N];
  for (int64_t i = 0; i < N; ++i) acc[i] = Vec(0.f);
  for (int64_t t = 0; t < m; ++t) {
    const float* vj = vf + t * vst;
    const Vec w(s[t]);
    for (int64_t i = 0; i < N; ++i) acc[i] = at::vec::fmadd(w, Vec::loadu(vj + i * W), acc[i]);
  }
  for (int64_t i = 0; i < N; ++i) acc[i].store(r + 2 + i * W);
}

// Any head size: plain loops.
inline void head_block_any(const float* qg, const float* kf, int64_t kst, const float* vf,
                           int64_t vst, int64_t m, int64_t D, float* s, float* r) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < m; ++j) {
    const float* kj = kf + j * kst;
    float d = 0.f;
    for (int64_t x = 0; x < D; ++x) d += qg[x] * kj[x];
    s[j] = d;
    mx = std::max(mx, d);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < m; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  float* acc = r + 2;
  std::fill(acc, acc + D, 0.f);
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t x = 0; x < D; ++x) acc[x] += s[j] * vf[j * vst + x];
  }
  r[0] = mx;
  r[1] = sum;
}

#ifdef CPU_CAPABILITY_AVX512
// AVX-512, head size 64 and up to 3 query heads a KV head (SmolLM2's 3, Qwen's 2...): all G
// heads in one pass over a chunk's keys and one over its values, each slot's row loaded
// (and converted from the cache's type) once, and the scores of 4 slots reduced together
// (a horizontal sum a slot costs more than its 4 FMAs).
// (--kv-cache-dtype auto picks float16 where this path runs: generative.kv_cache_dtype
// states the same condition.)
constexpr int64_t FUSED_D = 64;
constexpr int64_t FUSED_G = 3;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The four sums of a, b, c, d (16 lanes each) as one 4-lane vector.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // u: in each 128-bit lane, partial sums of a, b, c, d; add the four lanes
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One query head's products with one key row (k: its 4 vectors), still 16 lanes.
inline __m512 products(const __m512* q, const __m512* k) {
  return _mm512_fmadd_ps(q[3], k[3], _mm512_fmadd_ps(q[2], k[2],
                         _mm512_fmadd_ps(q[1], k[1], _mm512_mul_ps(q[0], k[0]))));
}

// G (<= 3) query heads qf [G, 64] (scaled) over m slots of keys kp and values vp (row
// strides kst, vst): per head r = [max, sum, 64 weighted values]; s: G * m scratch.
template <typename T, int G>
void heads_fused(const float* qf, const T* kp, int64_t kst, const T* vp, int64_t vst,
                 int64_t m, float* s, float* res, int64_t part) {
  __m512 q[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) q[g][i] = _mm512_loadu_ps(qf + g * FUSED_D + i * 16);
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    __m512 p[G][4];
    for (int jj = 0; jj < 4; ++jj) {
      const T* kj = kp + (j + jj) * kst;
      const __m512 k[4] = {load16(kj), load16(kj + 16), load16(kj + 32), load16(kj + 48)};
      for (int g = 0; g < G; ++g) p[g][jj] = products(q[g], k);
    }
    for (int g = 0; g < G; ++g) {
      _mm_storeu_ps(s + g * m + j, sum4(p[g][0], p[g][1], p[g][2], p[g][3]));
    }
  }
  for (; j < m; ++j) {  // the last 1-3 slots, one at a time
    const T* kj = kp + j * kst;
    const __m512 k[4] = {load16(kj), load16(kj + 16), load16(kj + 32), load16(kj + 48)};
    for (int g = 0; g < G; ++g) s[g * m + j] = _mm512_reduce_add_ps(products(q[g], k));
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * m;
    float mx = -INFINITY;
    for (int64_t t = 0; t < m; ++t) mx = std::max(mx, sg[t]);
    res[g * part] = mx;
    res[g * part + 1] = softmax_numerators(sg, m, mx);
  }
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < m; ++t) {
    const T* vt = vp + t * vst;
    const __m512 v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * m + t]);
      acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(res + g * part + 2 + i * 16, acc[g][i]);
}
#endif

// DC = the head size when it is a multiple of the vector width known here (unrolled, the
// sums in registers), else 0 (any size).
template <typename TQ, typename T, int64_t DC>
void attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos,
            int64_t window, double scale, const Tensor& out) {
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t L = k.size(2);
  const TQ* qp = q.const_data_ptr<TQ>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  TQ* op = out.mutable_data_ptr<TQ>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  // Chunks per (row, KV head): enough tasks for every thread twice over, none under 32 slots.
  const int64_t threads = at::get_num_threads();
  const int64_t want = (2 * threads + B * KV - 1) / (B * KV);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(want, L / 32));
  const int64_t part = D + 2;  // per query head and chunk: max, sum, weighted values
  std::vector<float> parts(B * KV * chunks * G * part);
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, qf(G * D), kbuf, vbuf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t % chunks, h = (t / chunks) % KV, b = t / (chunks * KV);
      const int64_t last = std::min<int64_t>(pp[b], L - 1);
      const int64_t first = window > 0 ? std::max<int64_t>(0, pp[b] - window + 1) : 0;
      const int64_t n = std::max<int64_t>(0, last - first + 1);
      const int64_t lo = first + n * c / chunks, hi = first + n * (c + 1) / chunks;
      float* res = parts.data() + t * G * part;
      if (hi <= lo) {  // nothing visible in this chunk: an empty partial result
        for (int64_t g = 0; g < G; ++g) {
          float* r = res + g * part;
          r[0] = -INFINITY;
          std::fill(r + 1, r + part, 0.f);
        }
        continue;
      }
      const int64_t m = hi - lo;
      const TQ* qb = qp + (b * KV + h) * G * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qb[i]) * sc;
#ifdef CPU_CAPABILITY_AVX512
      if (DC == FUSED_D && G <= FUSED_G) {
        s.resize(G * m);
        const T* kb = kp + b * ks0 + h * ks1 + lo * ks2;
        const T* vb = vp + b * vs0 + h * vs1 + lo * vs2;
        auto fused = [&](auto kernel) { kernel(qf.data(), kb, ks2, vb, vs2, m, s.data(), res, part); };
        G == 1 ? fused(heads_fused<T, 1>) : G == 2 ? fused(heads_fused<T, 2>) : fused(heads_fused<T, 3>);
        continue;
      }
#endif
      int64_t kst = 0, vst = 0;
      const float* kf = rows_as_float(kp + b * ks0 + h * ks1 + lo * ks2, ks2, m, D, kbuf, &kst);
      const float* vf = rows_as_float(vp + b * vs0 + h * vs1 + lo * vs2, vs2, m, D, vbuf, &vst);
      s.resize(m);
      for (int64_t g = 0; g < G; ++g) {  // one query head at a time: the block stays in cache
        if constexpr (DC > 0) {
          head_block<DC>(qf.data() + g * D, kf, kst, vf, vst, m, s.data(), res + g * part);
        } else {
          head_block_any(qf.data() + g * D, kf, kst, vf, vst, m, D, s.data(), res + g * part);
        }
      }
    }
  });

  // Merge each query head's chunks: rescale to the largest max, divide by the total sum.
  at::parallel_for(0, B * KV * G, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i % G, bh = i / G;
      const float* first = parts.data() + bh * chunks * G * part + g * part;
      float mx = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, first[c * G * part]);
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      if (mx != -INFINITY) {
        for (int64_t c = 0; c < chunks; ++c) {
          const float* r = first + c * G * part;
          const float w = std::exp(r[0] - mx);
          sum += w * r[1];
          for (int64_t x = 0; x < D; ++x) acc[x] += w * r[2 + x];
        }
      }
      TQ* o = op + i * D;  // out is contiguous [B, KV, G, D]: index (bh * G + g) = i
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t x = 0; x < D; ++x) o[x] = static_cast<TQ>(acc[x] * inv);
    }
  });
}

template <int64_t DC>
void run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos, int64_t window,
         double scale, const Tensor& out) {
  const bool half = k.scalar_type() == at::kHalf;
  if (q.scalar_type() == at::kBFloat16) {
    half ? attend<c10::BFloat16, c10::Half, DC>(q, k, v, pos, window, scale, out)
         : attend<c10::BFloat16, c10::BFloat16, DC>(q, k, v, pos, window, scale, out);
  } else {
    half ? attend<float, c10::Half, DC>(q, k, v, pos, window, scale, out)
         : attend<float, float, DC>(q, k, v, pos, window, scale, out);
  }
}

Tensor decode_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos,
                        int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: 4 dimensions each");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "k [B, KV, L, D] against q [B, KV, G, D]");
  TORCH_CHECK(v.sizes() == k.sizes(), "v and k differ in shape");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v: last dimension contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v in one dtype");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() || k.scalar_type() == at::kHalf,
              "the cache (k, v) in q's dtype or float16, not ", k.scalar_type());
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(0), "pos: one position per row");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: float32 or bfloat16, not ", q.scalar_type());
  const Tensor qc = q.contiguous();
  const Tensor pc = pos.to(at::kLong).contiguous();
  Tensor out = at::empty(q.sizes(), q.options());
  constexpr int64_t W = Vec::size();
  if (q.size(3) == 64 && 64 % W == 0) {
    run<64>(qc, k, v, pc, window, scale, out);
  } else if (q.size(3) == 128 && 128 % W == 0) {
    run<128>(qc, k, v, pc, window, scale, out);
  } else {
    run<0>(qc, k, v, pc, window, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inference, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor pos, int window, float scale)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(inference, CPU, m) { m.impl("decode_attention", &decode_attention); }
