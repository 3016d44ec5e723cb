// inference::quant_linear: y = x @ W.T for W in 4- or 8-bit groups of 32 along the input
// dimension, each group with a float32 scale (and, for 4 bits, a minimum):
//   bits 4: w = q * scale + min, q in [0, 15]      (GGUF's Q4_1)
//   bits 8: w = q * scale,       q in [-128, 127]  (GGUF's Q8_0)
// The input rows are quantised in two terms of 8 bits a group of 32, x ~ d1 q1 + d2 q2 (q2 the
// rounding left by q1, with its own scale): one 8-bit term alone (llama.cpp's Q8_1) cost the
// packaged SmolLM2 its top-1 agreement with float32 (0.961, against 0.986 for torch's int4
// kernel); two give it back (0.986). The products are integer dot products of 4 (u8 x s8 ->
// s16 pairs -> s32), each group's sum then scaled in float32. For 4 bits the sum is taken
// over q - 8 (centred: the rounding of x weighs about half as much as over q) and the
// minimums' term, (min + 8 scale) times each group's exact float32 sum of x, adds the rest.
//
// x [..., K] float32 or bfloat16. The weights in blocks of 8 output rows, laid out so one
// 32-byte vector holds the 8 rows' weights at 4 consecutive input indices (the layout of
// x86's u8 x s8 dot products: no horizontal sums):
//   bits 4: q uint8 [N / 8, K / 8, 32]: byte i of chunk c is row i / 4 at input index
//           8c + i % 4 in its low nibble and at 8c + 4 + i % 4 in its high nibble
//   bits 8: q int8 [N / 8, K / 4, 32]: byte i of step t is row i / 4 at input 4t + i % 4
//   scales, mins: float32 [N / 8, K / 32, 8]   (mins: an empty tensor for 8 bits)
// (inference_svc/models/weights.py packs them.) Returns [..., N] in x's dtype.
//
// A task takes blocks of weight rows and every input row, so each weight is read from memory
// once per call; input rows go 2 at a time (4 quantised rows) against a block that stays in
// L1. AVX2 (also what an AVX-512 CPU runs here); the same integer arithmetic one value at a
// time elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define QL_AVX2 1
#endif

namespace {

using at::Tensor;
constexpr int64_t GROUP = 32;
constexpr int64_t NB = 8;  // output rows per block
constexpr int64_t RP = 4;  // quantised rows per pass: two input rows' two terms

// Input rows quantised, two rows per input row (its first term, then the rounding left):
// xq int8 [2M, K]; per group [2M, K / 32] the scale dx, the exact sum of x xs (0 for the
// second term: the minimums' term is taken once) and the sum of xq qs.
struct Quantised {
  std::vector<int8_t> xq;
  std::vector<float> dx, xs, qs;
};

Quantised quantise(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / GROUP;
  Quantised out{std::vector<int8_t>(2 * M * K), std::vector<float>(2 * M * G),
                std::vector<float>(2 * M * G), std::vector<float>(2 * M * G)};
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    float r[GROUP];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / G, g = i % G;
      const float* xg = x + i * GROUP;  // group g of row m is at m * K + g * 32 = i * 32
      float sum = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) {
        r[j] = xg[j];
        sum += xg[j];
      }
      for (int64_t term = 0; term < 2; ++term) {  // r: what is left to quantise
        const int64_t row = 2 * m + term, at = row * G + g;
        float amax = 0.f;
        for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(r[j]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t qsum = 0;
        int8_t* q = out.xq.data() + row * K + g * GROUP;
        for (int64_t j = 0; j < GROUP; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(r[j] * inv));
          qsum += q[j];
          r[j] -= d * static_cast<float>(q[j]);
        }
        out.dx[at] = d;
        out.xs[at] = term == 0 ? sum : 0.f;
        out.qs[at] = static_cast<float>(qsum);
      }
    }
  });
  return out;
}

inline int32_t four(const int8_t* p) {  // 4 int8 as one int32 (for a broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef QL_AVX2

// Quantised rows 2i and 2i + 1 (an input row's two terms) summed into output row i.
template <int R>
inline void store_pairs(const __m256* tot, float* out, int64_t ldo) {
  for (int r = 0; r < R; r += 2) {
    _mm256_storeu_ps(out + (r / 2) * ldo, _mm256_add_ps(tot[r], tot[r + 1]));
  }
}

// R input rows against one 4-bit block: int16 sums over a group (8 products of <= 3810 each
// stay below 32767), widened once per group.
template <int R>
inline void block4(const uint8_t* q, const float* sc, const float* mn, const int8_t* xq,
                   const float* dx, const float* xs, const float* qs, int64_t K, float* out,
                   int64_t ldo) {
  const int64_t G = K / GROUP;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (g * 4 + c) * 32));
      const __m256i a = _mm256_and_si256(v, low);
      const __m256i b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* x8 = xq + r * K + g * GROUP + c * 8;
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(a, _mm256_set1_epi32(four(x8))));
        acc[r] = _mm256_add_epi16(acc[r],
                                  _mm256_maddubs_epi16(b, _mm256_set1_epi32(four(x8 + 4))));
      }
    }
    const __m256 s = _mm256_loadu_ps(sc + g * NB);
    const __m256 m = _mm256_fmadd_ps(_mm256_set1_ps(8.f), s, _mm256_loadu_ps(mn + g * NB));
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones)),
                                       _mm256_set1_ps(8.f * qs[r * G + g]));
      tot[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(dx[r * G + g])), tot[r]);
      tot[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * G + g]), tot[r]);
    }
  }
  store_pairs<R>(tot, out, ldo);
}

// R input rows against one 8-bit block: |w| x (x with w's sign) keeps u8 x s8 (a pair sums
// to <= 32512), widened to int32 at each step.
template <int R>
inline void block8(const uint8_t* q, const float* sc, const float*, const int8_t* xq,
                   const float* dx, const float*, const float*, int64_t K, float* out,
                   int64_t ldo) {
  const int64_t G = K / GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t t = 0; t < GROUP / 4; ++t) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (g * 8 + t) * 32));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(four(xq + r * K + g * GROUP + t * 4));
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 s = _mm256_loadu_ps(sc + g * NB);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(acc[r]);
      tot[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(dx[r * G + g])), tot[r]);
    }
  }
  store_pairs<R>(tot, out, ldo);
}

template <int BITS>
void rows(int64_t n, const uint8_t* q, const float* sc, const float* mn, const int8_t* xq,
          const float* dx, const float* xs, const float* qs, int64_t K, float* out,
          int64_t ldo) {
  auto run = [&](auto kernel) { kernel(q, sc, mn, xq, dx, xs, qs, K, out, ldo); };
  if constexpr (BITS == 4) {
    return n == 2 ? run(block4<2>) : run(block4<4>);
  }
  return n == 2 ? run(block8<2>) : run(block8<4>);
}

#else  // no AVX2: the same integer arithmetic, one value at a time (correct, not fast)

template <int BITS>
void rows(int64_t n, const uint8_t* q, const float* sc, const float* mn, const int8_t* xq,
          const float* dx, const float* xs, const float* qs, int64_t K, float* out,
          int64_t ldo) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < n; r += 2) {
    for (int64_t j = 0; j < NB; ++j) out[(r / 2) * ldo + j] = 0.f;
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < NB; ++j) {
      float tot = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; ++i) {
          int32_t w;
          if constexpr (BITS == 4) {
            const uint8_t byte = q[(i / 8) * 32 + j * 4 + i % 4];
            w = ((i % 8) < 4 ? byte & 0x0F : byte >> 4) - 8;
          } else {
            w = static_cast<int8_t>(q[(i / 4) * 32 + j * 4 + i % 4]);
          }
          dot += w * xq[r * K + i];
        }
        const float s = sc[g * NB + j];
        tot += static_cast<float>(dot) * (s * dx[r * G + g]);
        if constexpr (BITS == 4) tot += (mn[g * NB + j] + 8.f * s) * xs[r * G + g];
      }
      out[(r / 2) * ldo + j] += tot;  // the two terms of input row r / 2 (zeroed before)
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
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.sizes() == sshape &&
                  scales.is_contiguous(),
              "scales: [N / 8, K / 32, 8] float32");
  if (bits == 4) {
    TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.sizes() == sshape &&
                    mins.is_contiguous(),
                "mins: [N / 8, K / 32, 8] float32");
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
  const Quantised xq = quantise(xf.const_data_ptr<float>(), M, K);
  const auto* qp = static_cast<const uint8_t*>(q.const_data_ptr());
  const float* sp = scales.const_data_ptr<float>();
  const float* mp = bits == 4 ? mins.const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  const int64_t qblock = K * NB * bits / 8;  // bytes of one block
  at::parallel_for(0, NBLK, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* qb = qp + b * qblock;
      const float* sb = sp + b * G * NB;
      const float* mb = mp ? mp + b * G * NB : nullptr;
      for (int64_t r = 0; r < 2 * M; r += RP) {  // quantised rows; input row r / 2
        const int64_t n = std::min(RP, 2 * M - r);
        const int8_t* xr = xq.xq.data() + r * K;
        const float *dr = xq.dx.data() + r * G, *sr = xq.xs.data() + r * G,
                    *qr = xq.qs.data() + r * G;
        float* out = yp + (r / 2) * N + b * NB;
        if (bits == 4) {
          rows<4>(n, qb, sb, mb, xr, dr, sr, qr, K, out, N);
        } else {
          rows<8>(n, qb, sb, mb, xr, dr, sr, qr, K, out, N);
        }
      }
    }
  });
  return y.view(shape).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inference, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(inference, CPU, m) { m.impl("quant_linear", &quant_linear); }
