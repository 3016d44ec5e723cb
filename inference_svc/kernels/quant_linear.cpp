// inference::quant_linear: y = x @ W.T for W in 4- or 8-bit groups of 32 along the input
// dimension, each group with a float16 scale (and, for 4 bits, a minimum; GGUF's own types):
//   bits 4: w = q * scale + min, q in [0, 15]      (GGUF's Q4_1)
//   bits 8: w = q * scale,       q in [-128, 127]  (GGUF's Q8_0)
// The input rows are quantised in two terms of 8 bits a group of 32, x ~ d1 q1 + d2 q2 (q2 the
// rounding left by q1, with its own scale): one 8-bit term alone (llama.cpp's Q8_1) cost the
// packaged SmolLM2 its top-1 agreement with float32 (0.961, against 0.986 for torch's int4
// kernel); two give it back (0.986). The products are integer dot products of 4 (u8 x s8
// into int32), each group's sum then scaled in float32. For 4 bits the sum is taken
// over q - 8 (centred: the rounding of x weighs about half as much as over q) and the
// minimums' term, (min + 8 scale) times each group's exact float32 sum of x, adds the rest.
//
// x [..., K] float32 or bfloat16. The weights in blocks of 8 output rows, laid out so one
// 32-byte vector holds the 8 rows' weights at 4 consecutive input indices (the layout of
// x86's u8 x s8 dot products: no horizontal sums):
//   bits 4: q uint8 [N / 8, K / 8, 32]: byte i of chunk c is row i / 4 at input index
//           8c + i % 4 in its low nibble and at 8c + 4 + i % 4 in its high nibble
//   bits 8: q int8 [N / 8, K / 4, 32]: byte i of step t is row i / 4 at input 4t + i % 4
//   scales, mins: float16 [N / 8, K / 32, 8]   (mins: an empty tensor for 8 bits)
// (inference_svc/models/weights.py packs them.) Returns [..., N] in x's dtype.
//
// A task takes blocks of weight rows and every input row, so each weight is read from memory
// once per call; input rows go up to 4 at a time (2 with AVX2's 16 vector registers) against
// a step of blocks that stays in L1. x86 kernels (quant_linear_x86.h): AVX2, and with
// AVX512-VNNI its dot-product instruction, on 512-bit vectors two blocks a step. Elsewhere the
// same arithmetic one value at a time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define QL_AVX2 1
#endif

namespace {

using at::Tensor;
constexpr int64_t GROUP = 32;
constexpr int64_t NB = 8;  // output rows per block
using Half = uint16_t;     // float16's bits: the scales and minimums

// Input rows quantised, each in two 8-bit terms (its first, then the rounding it left): xq
// int8 [2M, K], row 2m input row m's first term and 2m + 1 its second. Per input row and
// group ([M, K / 32]): the terms' scales d1 and d2, the exact float32 sum of x xs, and
//   e = 8 (xs - d1 qs1 - d2 qs2)        (qs: the sum of a term's q)
// so that for 4 bits, with dot the integer sum over the raw q in [0, 15],
//   sum (q - 8) xhat + 8 sum x = d1 dot1 + d2 dot2 + e
// and a group's two terms cost two conversions and four FMAs together.
// Kept per calling thread and grown as needed: a decode step calls the op ~120 times, none
// of which allocates them again (perf counted malloc and free ~4 % of a one-row step, these
// among them; AMD EPYC).
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> per_group;  // d1, d2, xs, e: M * G each
};

// A term's scale d = max|r| / 127 and its inverse (0 for a group of zeros): one definition for
// both implementations of quantise_group below.
struct TermScale {
  float d, inv;
  explicit TermScale(float amax) : d(amax / 127.f), inv(amax > 0.f ? 127.f / amax : 0.f) {}
};

// One group of 32 values of x into its two terms (q1, q2: 32 int8 each) and its d1, d2, sum
// and e (see Scratch). The rounding is to nearest, ties to even, as std::nearbyint's.
#ifdef QL_AVX2
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum(__m256i v) {
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
}

// 256-bit vectors (AVX2 and AVX-512 builds): ~0.7 ns a value against the scalar loop's ~2.5-3
// (a quarter of the kernel's time at 8 rows and K = 1536 with the scalar loop; AMD EPYC).
void quantise_group(const float* xg, int8_t* q1, int8_t* q2, float& d1, float& d2, float& xs,
                    float& e) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 r[4];
  for (int j = 0; j < 4; ++j) r[j] = _mm256_loadu_ps(xg + 8 * j);
  xs = hsum(_mm256_add_ps(_mm256_add_ps(r[0], r[1]), _mm256_add_ps(r[2], r[3])));
  double quantised = 0.;
  for (int term = 0; term < 2; ++term) {
    const __m256 amaxv = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, r[0]), _mm256_andnot_ps(sign, r[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, r[2]), _mm256_andnot_ps(sign, r[3])));
    const TermScale scale(hmax(amaxv));
    (term == 0 ? d1 : d2) = scale.d;
    const __m256 inv = _mm256_set1_ps(scale.inv), dv = _mm256_set1_ps(scale.d);
    __m256i qi[4];
    __m256i qsum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 qf = _mm256_round_ps(_mm256_mul_ps(r[j], inv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[j] = _mm256_cvtps_epi32(qf);
      qsum = _mm256_add_epi32(qsum, qi[j]);
      r[j] = _mm256_fnmadd_ps(dv, qf, r[j]);
    }
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(term == 0 ? q1 : q2),
                        _mm256_permutevar8x32_epi32(bytes, order));
    quantised += static_cast<double>(scale.d) * hsum(qsum);
  }
  e = static_cast<float>(8. * (static_cast<double>(xs) - quantised));
}
#else
void quantise_group(const float* xg, int8_t* q1, int8_t* q2, float& d1, float& d2, float& xs,
                    float& e) {
  float r[GROUP];
  float sum = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) {
    r[j] = xg[j];
    sum += xg[j];
  }
  double quantised = 0.;  // d1 qs1 + d2 qs2
  for (int64_t term = 0; term < 2; ++term) {  // r: what is left to quantise
    float amax = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(r[j]));
    const TermScale scale(amax);
    (term == 0 ? d1 : d2) = scale.d;
    int32_t qsum = 0;
    int8_t* q = term == 0 ? q1 : q2;
    for (int64_t j = 0; j < GROUP; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(r[j] * scale.inv));
      qsum += q[j];
      r[j] -= scale.d * static_cast<float>(q[j]);
    }
    quantised += static_cast<double>(scale.d) * qsum;
  }
  xs = sum;
  e = static_cast<float>(8. * (static_cast<double>(sum) - quantised));
}
#endif

// Input rows m0... of the quantised input (Scratch): their two terms' rows and their per-group
// values.
struct Rows {
  const int8_t* xq;
  const float *d1, *d2, *xs, *e;
  int64_t K, G;

  Rows at(int64_t m) const {
    return {xq + 2 * m * K, d1 + m * G, d2 + m * G, xs + m * G, e + m * G, K, G};
  }
};

#ifdef QL_AVX2
#include "quant_linear_x86.h"
#ifdef QL_VNNI
// Two blocks a step where a task has two left, from 2 input rows (one row ran 1.12x faster
// on 256-bit steps: AMD EPYC, AVX512-VNNI).
using Wide = Z;
constexpr int64_t WIDE_ROWS = 2;
#else
using Wide = Y;
constexpr int64_t WIDE_ROWS = 1;
#endif

#else  // no AVX2: the same arithmetic, one value at a time (correct, not fast)

constexpr int PMAX = 1;
struct Y {
  static constexpr int64_t BLOCKS = 1;
};
using Wide = Y;
constexpr int64_t WIDE_ROWS = 1;

inline float half(Half h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

template <class, int BITS>
void rows(int64_t n, const uint8_t* q, const Half* sc, const Half* mn, int64_t, int64_t,
          const Rows& x, float* out, int64_t ldo) {
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t j = 0; j < NB; ++j) {
      float tot = 0.f;
      for (int64_t g = 0; g < x.G; ++g) {
        int32_t dot[2] = {0, 0};
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; ++i) {
          int32_t w;
          if constexpr (BITS == 4) {
            const uint8_t byte = q[(i / 8) * 32 + j * 4 + i % 4];
            w = (i % 8) < 4 ? byte & 0x0F : byte >> 4;
          } else {
            w = static_cast<int8_t>(q[(i / 4) * 32 + j * 4 + i % 4]);
          }
          for (int64_t term = 0; term < 2; ++term) dot[term] += w * x.xq[(2 * p + term) * x.K + i];
        }
        const int64_t at = p * x.G + g;
        const float s = half(sc[g * NB + j]), one = static_cast<float>(dot[0]),
                    two = static_cast<float>(dot[1]);
        if constexpr (BITS == 4) {  // the vector kernels' order of operations
          const float t = std::fma(one, x.d1[at], std::fma(two, x.d2[at], x.e[at]));
          tot = std::fma(half(mn[g * NB + j]), x.xs[at], std::fma(t, s, tot));
        } else {
          tot = std::fma(std::fma(two, x.d2[at], one * x.d1[at]), s, tot);
        }
      }
      out[p * ldo + j] = tot;
    }
  }
}

#endif

Tensor quant_linear(const Tensor& x, const Tensor& q, const Tensor& scales, const Tensor& mins,
                    int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits 4 or 8, not ", bits);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == 32,
              "q: [N / 8, K / 8 or K / 4, 32] contiguous");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "q: uint8 for 4 bits, int8 for 8 bits");
  const int64_t NBLK = q.size(0), K = q.size(1) * (bits == 4 ? 8 : 4), N = NBLK * NB;
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of ", GROUP);
  const int64_t G = K / GROUP;
  const std::vector<int64_t> sshape{NBLK, G, NB};
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.sizes() == sshape &&
                  scales.is_contiguous(),
              "scales: [N / 8, K / 32, 8] float16");
  if (bits == 4) {
    TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.sizes() == sshape &&
                    mins.is_contiguous(),
                "mins: [N / 8, K / 32, 8] float16");
  }
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x float32 or bfloat16, not ", x.scalar_type());
  const Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y.view(shape).to(x.scalar_type());
  thread_local Scratch scratch;
  const int64_t MG = M * G;
  if (static_cast<int64_t>(scratch.xq.size()) < 2 * M * K) scratch.xq.resize(2 * M * K);
  if (static_cast<int64_t>(scratch.per_group.size()) < 4 * MG) scratch.per_group.resize(4 * MG);
  int8_t* xq = scratch.xq.data();
  float* d1 = scratch.per_group.data();
  const Rows all{xq, d1, d1 + MG, d1 + 2 * MG, d1 + 3 * MG, K, G};
  const float* xp = xf.const_data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(q.const_data_ptr());
  const auto* sp = static_cast<const Half*>(scales.const_data_ptr());
  const auto* mp = bits == 4 ? static_cast<const Half*>(mins.const_data_ptr()) : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  const int64_t qblock = K * NB * bits / 8, sblock = G * NB;  // one block's bytes, scales
  const auto blocks = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const bool wide = Wide::BLOCKS == 2 && b + 1 < b1 && M >= WIDE_ROWS;
      const uint8_t* qb = qp + b * qblock;
      const Half* sb = sp + b * sblock;
      const Half* mb = mp ? mp + b * sblock : nullptr;
      for (int64_t m = 0; m < M; m += PMAX) {
        const int64_t n = std::min<int64_t>(PMAX, M - m);
        float* out = yp + m * N + b * NB;
        auto run = [&](auto kernel) { kernel(n, qb, sb, mb, qblock, sblock, all.at(m), out, N); };
        if (wide) {
          bits == 4 ? run(rows<Wide, 4>) : run(rows<Wide, 8>);
        } else {
          bits == 4 ? run(rows<Y, 4>) : run(rows<Y, 8>);
        }
      }
      b += wide ? 2 : 1;
    }
  };
  // One parallel region a call (one wake of the team, one wait at its end): each thread
  // quantises its share of the input's groups, waits for the others, then runs its share of
  // the weight blocks (contiguous, as at::parallel_for's with a grain of 8 blocks).
  const int64_t threads =
      at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), (NBLK + 7) / 8);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    for (int64_t i = MG * t / team; i < MG * (t + 1) / team; ++i) {
      // group g of row m (i = m G + g): at m * K + g * 32 = i * 32 in x, its terms' bytes at
      // 2 m K + g * 32 and K on
      int8_t* q1 = xq + 2 * (i / G) * K + (i % G) * GROUP;
      quantise_group(xp + i * GROUP, q1, q1 + K, d1[i], d1[MG + i], d1[2 * MG + i],
                     d1[3 * MG + i]);
    }
#pragma omp barrier
    const int64_t chunk = (NBLK + team - 1) / team;
    blocks(std::min(NBLK, t * chunk), std::min(NBLK, (t + 1) * chunk));
  }
  return y.view(shape).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inference, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(inference, CPU, m) { m.impl("quant_linear", &quant_linear); }
