// y = x @ W.T for a float32 weight W stored in llama.cpp's blocks of 32 inputs (engine/blocks.py):
//   Q4_1: w = d * q + m, q in 0..15, d and m float16 values (6 bits a weight as read here);
//   Q8_0: w = d * q, q in -128..127, d a float16 value (9 bits a weight).
// Each weight is made again in a register, bitwise W's float32 value: q * d is exact (a 4- or
// 8-bit integer times an 11-bit significand), so fma(q, d, m) rounds once, as the float32 copy
// was made (fl(q * d + m)), and Q8_0's q * d needs no rounding. Each output y[r, n] is one chain
// of fmas over k = 0 .. K-1 in order, the same whatever rows share the call: batch-invariant by
// construction. The AVX-512 and AVX2 versions compute each output by the same fmas in the same
// order, so every CPU with either gives the same bits (tests/engine/test_blocks.py compares them).
//
// Layout (engine/blocks.py, ``split``), outputs in tiles of 32: Q4_1's q (N/32, K, 16) uint8, byte
// j of (t, k) holding output 32t + 2j in its low nibble and 32t + 2j + 1 in its high one; Q8_0's q
// (N/32, K, 32) int8; d and m (N/32, K/32, 32) float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

namespace {

using Tile = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, float*, int64_t, int64_t);

// ---- AVX-512: a tile's 32 outputs as two vectors, up to 12 rows (2 x 12 accumulators)

constexpr int64_t kRows512 = 12;

template <bool Q8>
AVX512 inline void weights512(const uint8_t* q, int64_t at, __m512 d0, __m512 d1, __m512 m0, __m512 m1,
                              __m512& w0, __m512& w1) {
  if constexpr (Q8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at * 32));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))), d0);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))), d1);
  } else {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at * 16));
    const __m128i lo = _mm_and_si128(raw, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))), d0, m0);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))), d1, m1);
  }
}

template <bool Q8, int R>
AVX512 void tile512(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, float* y,
                    int64_t N, int64_t t) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = (t * blocks + b) * 32;
    const __m512 d0 = _mm512_loadu_ps(d + at), d1 = _mm512_loadu_ps(d + at + 16);
    const __m512 m0 = Q8 ? d0 : _mm512_loadu_ps(m + at), m1 = Q8 ? d1 : _mm512_loadu_ps(m + at + 16);
    for (int64_t k = b * 32; k < b * 32 + 32; ++k) {
      __m512 w0, w1;
      weights512<Q8>(q, t * K + k, d0, d1, m0, m1, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * K + k]);
        acc0[r] = _mm512_fmadd_ps(xr, w0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(xr, w1, acc1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * N + t * 32, acc0[r]);
    _mm512_storeu_ps(y + r * N + t * 32 + 16, acc1[r]);
  }
}

template <bool Q8>
constexpr Tile kTiles512[kRows512 + 1] = {
    nullptr, tile512<Q8, 1>, tile512<Q8, 2>, tile512<Q8, 3>, tile512<Q8, 4>, tile512<Q8, 5>, tile512<Q8, 6>,
    tile512<Q8, 7>, tile512<Q8, 8>, tile512<Q8, 9>, tile512<Q8, 10>, tile512<Q8, 11>, tile512<Q8, 12>};

// ---- AVX2: a tile's 32 outputs as two halves of 16 (two vectors each), up to 5 rows (2 x 5 accumulators)

constexpr int64_t kRows256 = 5;

template <bool Q8>
AVX2 inline void weights256(const uint8_t* q, int64_t at, int half, __m256 d0, __m256 d1, __m256 m0, __m256 m1,
                            __m256& w0, __m256& w1) {
  if constexpr (Q8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at * 32 + half * 16));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), d1);
  } else {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + at * 16 + half * 8));
    const __m128i lo = _mm_and_si128(raw, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    const __m128i both = _mm_unpacklo_epi8(lo, hi);    // this half's 16 outputs in order
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both)), d0, m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))), d1, m1);
  }
}

template <bool Q8, int R>
AVX2 void tile256(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, float* y,
                  int64_t N, int64_t t) {
  const int64_t blocks = K / 32;
  for (int half = 0; half < 2; ++half) {
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_setzero_ps();
      acc1[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (t * blocks + b) * 32 + half * 16;
      const __m256 d0 = _mm256_loadu_ps(d + at), d1 = _mm256_loadu_ps(d + at + 8);
      const __m256 m0 = Q8 ? d0 : _mm256_loadu_ps(m + at), m1 = Q8 ? d1 : _mm256_loadu_ps(m + at + 8);
      for (int64_t k = b * 32; k < b * 32 + 32; ++k) {
        __m256 w0, w1;
        weights256<Q8>(q, t * K + k, half, d0, d1, m0, m1, w0, w1);
        for (int r = 0; r < R; ++r) {
          const __m256 xr = _mm256_set1_ps(x[r * K + k]);
          acc0[r] = _mm256_fmadd_ps(xr, w0, acc0[r]);
          acc1[r] = _mm256_fmadd_ps(xr, w1, acc1[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * N + t * 32 + half * 16, acc0[r]);
      _mm256_storeu_ps(y + r * N + t * 32 + half * 16 + 8, acc1[r]);
    }
  }
}

template <bool Q8>
constexpr Tile kTiles256[kRows256 + 1] = {nullptr, tile256<Q8, 1>, tile256<Q8, 2>, tile256<Q8, 3>,
                                          tile256<Q8, 4>, tile256<Q8, 5>};

// ---- the ops

// isa: 512 or 256 where the caller asks for one (tests compare the two), 0 for the widest this CPU has
template <bool Q8>
at::Tensor product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous (rows, K) float32");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == (Q8 ? 32 : 16)
              && q.scalar_type() == (Q8 ? at::kChar : at::kByte), "q: (N/32, K, 16) uint8 or (N/32, K, 32) int8");
  const int64_t M = x.size(0), K = x.size(1), tiles = q.size(0), N = tiles * 32;
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K, "q does not match x's K");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == tiles * K, "d: (N/32, K/32, 32) float32");
  TORCH_CHECK(Q8 || (m.scalar_type() == at::kFloat && m.is_contiguous() && m.numel() == tiles * K),
              "m: (N/32, K/32, 32) float32");
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 0) isa = has512 ? 512 : 256;
  TORCH_CHECK((isa == 512 && has512) || (isa == 256 && has256), "this CPU has no ", isa == 512 ? "AVX-512" : "AVX2");
  const Tile* kinds = isa == 512 ? kTiles512<Q8> : kTiles256<Q8>;
  const int64_t most = isa == 512 ? kRows512 : kRows256;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = Q8 ? nullptr : m.data_ptr<float>();
  // rows in even groups of at most ``most``: every group makes again the weights it reads
  const int64_t groups = (M + most - 1) / most, per = (M + groups - 1) / groups;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < M; r0 += per)
        kinds[std::min(per, M - r0)](xp + r0 * K, K, qp, dp, mp, yp + r0 * N, N, t);
  });
  return y;
}

at::Tensor q4_1(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t isa) {
  return product<false>(x, q, d, m, isa);
}

at::Tensor q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t isa) {
  return product<true>(x, q, d, d, isa);
}

}  // namespace

TORCH_LIBRARY(specbatch_blocks, lib) {
  lib.def("q4_1(Tensor x, Tensor q, Tensor d, Tensor m, int isa=0) -> Tensor", &q4_1);
  lib.def("q8_0(Tensor x, Tensor q, Tensor d, int isa=0) -> Tensor", &q8_0);
}
