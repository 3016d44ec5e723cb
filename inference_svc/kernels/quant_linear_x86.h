// quant_linear's x86 kernels (included by quant_linear.cpp, which defines GROUP, NB, Half and
// Rows):
// P input rows (2P quantised rows: their two terms) against the weights of one step of
// blocks, written once for two vector widths:
//   Y: 256-bit vectors, one block (8 output rows) a step. AVX2's u8 x s8 -> s16 pairs, or
//      with AVX512-VNNI one instruction for 4 products into int32 lanes.
//   Z: 512-bit vectors (AVX512-VNNI), two adjacent blocks (16 output rows) a step: half the
//      broadcasts and unpacking a product.
// A step reads its weights once, in groups of 32 inputs; each group's integer sums are scaled
// in float32 (see Quantised for e). Where one row's dependency chains would wait on the dot
// products' latency (VNNI, P <= 2) each term keeps two accumulators. The next step's weights
// are prefetched a group at a time (at one row the kernel is bound by memory, not arithmetic).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QL_VNNI 1
#endif

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

struct Y {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t BLOCKS = 1;
  static I load(const uint8_t* p, int64_t) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F load(const Half* p, int64_t) {  // 8 float16 as float32
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static I zero() { return _mm256_setzero_si256(); }
  static F zerof() { return _mm256_setzero_ps(); }
  static I bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static I low(I v, I mask) { return _mm256_and_si256(v, mask); }
  static I high(I v, I mask) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), mask); }
  static I four(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static I magnitude(I w) { return _mm256_abs_epi8(w); }
  static I signs(I w) { return w; }
  static I with_sign(I x, I w) { return _mm256_sign_epi8(x, w); }  // x * sign(w)
#ifdef QL_VNNI
  static constexpr bool CHAINED = true;  // a dot product waits on the one before
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I dot4(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static I widen4(I acc) { return acc; }
  static I dot8(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static I dot4m(I acc, I u, const int8_t* p) {  // dot4 with p's 4 bytes in every lane
    // the broadcast inside the dot product (EVEX's {1to8}): the compiler emits a separate
    // vpbroadcastd for _mm256_set1_epi32; 1.04-1.08x at 4-64 rows (AMD EPYC)
    __asm__("vpdpbusd %[x]%{1to8%}, %[u], %[acc]"
            : [acc] "+v"(acc)
            : [u] "v"(u), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
#else
  // pairs into int16: for 4 bits a group's 8 sums of <= 3810 stay below 32767 (widened once
  // a group); for 8 bits a pair sums to <= 32512, widened at each step
  static constexpr bool CHAINED = false;
  static I add(I a, I b) { return _mm256_add_epi16(a, b); }
  static I dot4(I acc, I u, I s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
  static I widen4(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  static I dot8(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
  }
  static I dot4m(I acc, I u, const int8_t* p) { return dot4(acc, u, four(p)); }
#endif
};

#ifdef QL_VNNI
struct Z {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t BLOCKS = 2;
  static constexpr bool CHAINED = true;
  static I load(const uint8_t* p, int64_t next) {  // p's 32 bytes, then those a block on
    return _mm512_inserti64x4(_mm512_castsi256_si512(Y::load(p, 0)), Y::load(p + next, 0), 1);
  }
  static F load(const Half* p, int64_t next) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + next));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I zero() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static I bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static I low(I v, I mask) { return _mm512_and_si512(v, mask); }
  static I high(I v, I mask) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), mask); }
  static I four(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static I magnitude(I w) { return _mm512_abs_epi8(w); }
  static __mmask64 signs(I w) { return _mm512_movepi8_mask(w); }
  static I with_sign(I x, __mmask64 neg) {  // no byte sign instruction: negate under a mask
    return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I widen4(I acc) { return acc; }
  static I dot8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dot4m(I acc, I u, const int8_t* p) {
    __asm__("vpdpbusd %[x]%{1to16%}, %[u], %[acc]"
            : [acc] "+v"(acc)
            : [u] "v"(u), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
};
#endif

#ifdef __AVX512VL__
constexpr int PMAX = 4;  // input rows a pass: 32 vector registers hold 8 accumulators
#else
constexpr int PMAX = 2;  // 16 registers
#endif

// Per quantised row two accumulators (one per half of the group's products) where SPLIT.
template <class V, int P, bool SPLIT = V::CHAINED && P <= 2>
struct Sums {
  typename V::I a[2 * P], b[SPLIT ? 2 * P : 1];
  Sums() {
    for (int r = 0; r < 2 * P; ++r) a[r] = V::zero();
    if constexpr (SPLIT) {
      for (int r = 0; r < 2 * P; ++r) b[r] = V::zero();
    }
  }
  typename V::I& second(int r) {
    if constexpr (SPLIT) return b[r];
    return a[r];
  }
  typename V::I total(int r) const {
    if constexpr (SPLIT) return V::add(a[r], b[r]);
    return a[r];
  }
};

// 4 bits: q the step's first block, qb (sb) the bytes (scales) from one block to the next.
template <class V, int P>
inline void block4(const uint8_t* q, const Half* sc, const Half* mn, int64_t qb, int64_t sb,
                   const Rows& x, float* out, int64_t ldo) {
  const typename V::I mask = V::bytes(0x0F);
  typename V::F tot[P];
  for (int p = 0; p < P; ++p) tot[p] = V::zerof();
  const uint8_t* ahead = q + V::BLOCKS * qb;  // the next step's weights
  for (int64_t g = 0; g < x.G; ++g) {
    for (int64_t blk = 0; blk < V::BLOCKS; ++blk) {
      prefetch(ahead + blk * qb + g * 128);
      prefetch(ahead + blk * qb + g * 128 + 64);
      if (g % 4 == 0) {  // a line holds 4 groups' scales
        prefetch(sc + (V::BLOCKS + blk) * sb + g * NB);
        prefetch(mn + (V::BLOCKS + blk) * sb + g * NB);
      }
    }
    Sums<V, P> acc;
    for (int64_t c = 0; c < 4; ++c) {
      const typename V::I v = V::load(q + (g * 4 + c) * 32, qb);
      const typename V::I lo = V::low(v, mask), hi = V::high(v, mask);
      for (int r = 0; r < 2 * P; ++r) {
        const int8_t* x8 = x.xq + r * x.K + g * GROUP + c * 8;
        acc.a[r] = V::dot4m(acc.a[r], lo, x8);
        acc.second(r) = V::dot4m(acc.second(r), hi, x8 + 4);
      }
    }
    const typename V::F s = V::load(sc + g * NB, sb), m = V::load(mn + g * NB, sb);
    for (int p = 0; p < P; ++p) {
      const int64_t at = p * x.G + g;
      typename V::F t = V::fmadd(V::cvt(V::widen4(acc.total(2 * p + 1))), V::set1(x.d2[at]),
                                 V::set1(x.e[at]));
      t = V::fmadd(V::cvt(V::widen4(acc.total(2 * p))), V::set1(x.d1[at]), t);
      tot[p] = V::fmadd(m, V::set1(x.xs[at]), V::fmadd(t, s, tot[p]));
    }
  }
  for (int p = 0; p < P; ++p) V::store(out + p * ldo, tot[p]);
}

// 8 bits: |w| x (x with w's sign) keeps u8 x s8.
template <class V, int P>
inline void block8(const uint8_t* q, const Half* sc, const Half*, int64_t qb, int64_t sb,
                   const Rows& x, float* out, int64_t ldo) {
  typename V::F tot[P];
  for (int p = 0; p < P; ++p) tot[p] = V::zerof();
  const uint8_t* ahead = q + V::BLOCKS * qb;
  for (int64_t g = 0; g < x.G; ++g) {
    for (int64_t blk = 0; blk < V::BLOCKS; ++blk) {
      for (int64_t line = 0; line < 4; ++line) prefetch(ahead + blk * qb + g * 256 + line * 64);
      if (g % 4 == 0) prefetch(sc + (V::BLOCKS + blk) * sb + g * NB);
    }
    Sums<V, P> acc;
    for (int64_t t = 0; t < GROUP / 4; ++t) {
      const typename V::I w = V::load(q + (g * 8 + t) * 32, qb);
      const typename V::I mag = V::magnitude(w);
      const auto sign = V::signs(w);
      for (int r = 0; r < 2 * P; ++r) {
        const typename V::I xv = V::with_sign(V::four(x.xq + r * x.K + g * GROUP + t * 4), sign);
        if (t % 2 == 0) {
          acc.a[r] = V::dot8(acc.a[r], mag, xv);
        } else {
          acc.second(r) = V::dot8(acc.second(r), mag, xv);
        }
      }
    }
    const typename V::F s = V::load(sc + g * NB, sb);
    for (int p = 0; p < P; ++p) {
      const int64_t at = p * x.G + g;
      const typename V::F t =
          V::fmadd(V::cvt(acc.total(2 * p + 1)), V::set1(x.d2[at]),
                   V::mul(V::cvt(acc.total(2 * p)), V::set1(x.d1[at])));
      tot[p] = V::fmadd(t, s, tot[p]);
    }
  }
  for (int p = 0; p < P; ++p) V::store(out + p * ldo, tot[p]);
}

// n (1..PMAX) input rows against one step of V::BLOCKS blocks, in the pass of the largest
// P <= n.
template <class V, int BITS, int P = PMAX>
void rows(int64_t n, const uint8_t* q, const Half* sc, const Half* mn, int64_t qb,
          int64_t sb, const Rows& x, float* out, int64_t ldo) {
  if constexpr (P > 1) {
    if (n < P) return rows<V, BITS, P - 1>(n, q, sc, mn, qb, sb, x, out, ldo);
  }
  if constexpr (BITS == 4) {
    block4<V, P>(q, sc, mn, qb, sb, x, out, ldo);
  } else {
    block8<V, P>(q, sc, mn, qb, sb, x, out, ldo);
  }
}
