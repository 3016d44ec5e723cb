// inference::int8_linear: y = x @ W.T with W in 8-bit groups of 32 along the input dimension,
// one float32 scale per group (GGUF's Q8_0 layout: w = q * scale).
//
// x [..., K] float32 or bfloat16; q [N, K] int8; scales [N, K / 32] float32. Returns
// [..., N] in x's dtype; products and sums in float32. For the output layer of a small LM
// (SmolLM2: 49152 x 576), where a decode step of few rows is bound by the weights' bytes:
// half of bfloat16's. Each task takes a block of weight rows and every input row, so each
// weight is read from memory once per call; the weights are scaled per group once, then
// multiplied into each input row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t GROUP = 32;
constexpr int64_t ROWS = 8;  // input rows multiplied together (accumulators in registers)

// Weight row n times input rows x[0..mr) (float32, row stride K): out[m] for each.
inline void row_dot(const int8_t* q, const float* scales, const float* x, int64_t K,
                    int64_t mr, float* out) {
  constexpr int64_t W = Vec::size();
  Vec acc[ROWS];
  for (int64_t m = 0; m < mr; ++m) acc[m] = Vec(0.f);
  float w[GROUP];
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const int8_t* qg = q + g * GROUP;
    const float s = scales[g];
    for (int64_t i = 0; i < GROUP; ++i) w[i] = static_cast<float>(qg[i]) * s;
    for (int64_t i = 0; i < GROUP; i += W) {
      const Vec wv = Vec::loadu(w + i);
      for (int64_t m = 0; m < mr; ++m) {
        acc[m] = at::vec::fmadd(wv, Vec::loadu(x + m * K + g * GROUP + i), acc[m]);
      }
    }
  }
  for (int64_t m = 0; m < mr; ++m) {
    out[m] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m]);
  }
}

template <typename T>
void run(const Tensor& x2, const Tensor& q, const Tensor& scales, const Tensor& y2) {
  const int64_t M = x2.size(0), K = x2.size(1), N = q.size(0);
  std::vector<float> xf(M * K);  // the input rows as float32, once
  const T* xp = x2.const_data_ptr<T>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  T* yp = y2.mutable_data_ptr<T>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float out[ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {  // the weights stay in cache between blocks
      const int64_t mr = std::min<int64_t>(ROWS, M - m0);
      for (int64_t n = begin; n < end; ++n) {
        row_dot(qp + n * K, sp + n * (K / GROUP), xf.data() + m0 * K, K, mr, out);
        for (int64_t m = 0; m < mr; ++m) yp[(m0 + m) * N + n] = static_cast<T>(out[m]);
      }
    }
  });
}

Tensor int8_linear(const Tensor& x, const Tensor& q, const Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q: [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of ", GROUP);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / GROUP,
              "scales: [N, K / 32] float32");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: x float32 or bfloat16, not ", x.scalar_type());
  const Tensor qc = q.contiguous(), sc = scales.contiguous();
  const Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  Tensor y = at::empty(shape, x.options());
  const Tensor y2 = y.view({-1, N});
  if (x.scalar_type() == at::kFloat) {
    run<float>(x2, qc, sc, y2);
  } else {
    run<c10::BFloat16>(x2, qc, sc, y2);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inference, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(inference, CPU, m) { m.impl("int8_linear", &int8_linear); }
