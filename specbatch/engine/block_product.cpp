// y = x @ W.T for a float32 weight W stored in llama.cpp's blocks of 32 inputs (engine/blocks.py):
//   Q4_1: w = d * q + m, q in 0..15, d and m float16 values (6 bits a weight as read here);
//   Q8_0: w = d * q, q in -128..127, d a float16 value (9 bits a weight);
//   Q6_K: w = d * q, q in -32..31 (held in 8 bits), d a float32 value per 16 inputs (10 bits a weight):
//   llama.cpp's K-quants (engine/gguf_blocks.py) scale blocks by float32 products, so d and m are
//   float32 here for every form.
// Each weight is made again in a register, bitwise W's float32 value: q * d is exact (a 4- or
// 8-bit integer times an 11-bit significand), so fma(q, d, m) rounds once, as the float32 copy
// was made (fl(q * d + m)), and Q8_0's q * d needs no rounding. Each output y[r, n] is one chain
// of fmas over k = 0 .. K-1 in order, the same whatever rows share the call: batch-invariant by
// construction. The AVX-512 and AVX2 versions compute each output by the same fmas in the same
// order, so every CPU with either gives the same bits (tests/engine/test_blocks.py compares them).
//
// Layout (engine/blocks.py, ``split``), outputs in tiles of 32: Q4_1's q (N/32, K, 16) uint8, byte
// j of (t, k) holding output 32t + 2j in its low nibble and 32t + 2j + 1 in its high one; Q8_0's q
// (N/32, K, 32) int8 (Q6_K's too); d and m (N/32, K/32, 32) float32 (Q6_K's d (N/32, K/16, 32)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

namespace {

// A tile of 32 outputs is made block by block: a block's 32 x 32 weights are made once into a
// panel (4 KB, in L1), then every group of rows multiplies by the panel, its accumulators carried
// in y from one block to the next (a float32 stored and read back is the same float: each output
// stays one fma chain in k's order).
constexpr int64_t kPanel = 32 * 32;

// the forms: 4-bit q with d and m per 32 inputs; 8-bit q with d per 32 inputs; 8-bit q with d per 16
enum Form { kQ4_1, kQ8_0, kQ6_K };
constexpr bool eight_bit(Form f) { return f != kQ4_1; }
constexpr int64_t per_d(Form f) { return f == kQ6_K ? 16 : 32; }    // inputs one d covers

// ---- AVX-512: a row's 32 outputs as two vectors, up to 12 rows a group (2 x 12 accumulators)

constexpr int64_t kRows512 = 12;

template <Form F>
AVX512 void panel512(const uint8_t* q, const float* d, const float* m, int64_t K, int64_t t, int64_t b,
                     float* panel) {
  constexpr bool Q8 = eight_bit(F);
  const int64_t at = (t * (K / per_d(F)) + b * (32 / per_d(F))) * 32;
  __m512 d0 = _mm512_loadu_ps(d + at), d1 = _mm512_loadu_ps(d + at + 16);
  const __m512 m0 = Q8 ? d0 : _mm512_loadu_ps(m + at), m1 = Q8 ? d1 : _mm512_loadu_ps(m + at + 16);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t kk = 0; kk < 32; ++kk) {
    const int64_t k = t * K + b * 32 + kk;
    if (F == kQ6_K && kk == 16) {     // the block's second 16 inputs: their own d
      d0 = _mm512_loadu_ps(d + at + 32);
      d1 = _mm512_loadu_ps(d + at + 48);
    }
    __m512 w0, w1;
    if constexpr (Q8) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 32));
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))), d0);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))), d1);
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
      const __m128i lo = _mm_and_si128(raw, nibble);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))), d0, m0);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))), d1, m1);
    }
    _mm512_store_ps(panel + kk * 32, w0);
    _mm512_store_ps(panel + kk * 32 + 16, w1);
  }
}

template <int R>
AVX512 void rows512(const float* x, int64_t K, const float* panel, int64_t k0, float* y, int64_t N, bool first) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * N);
    acc1[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * N + 16);
  }
  for (int64_t kk = 0; kk < 32; ++kk) {
    const __m512 w0 = _mm512_load_ps(panel + kk * 32), w1 = _mm512_load_ps(panel + kk * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k0 + kk]);
      acc0[r] = _mm512_fmadd_ps(xr, w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(xr, w1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * N, acc0[r]);
    _mm512_storeu_ps(y + r * N + 16, acc1[r]);
  }
}

using Rows = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool);
constexpr Rows kRowsOf512[kRows512 + 1] = {nullptr, rows512<1>, rows512<2>, rows512<3>, rows512<4>, rows512<5>,
                                           rows512<6>, rows512<7>, rows512<8>, rows512<9>, rows512<10>,
                                           rows512<11>, rows512<12>};

// ---- AVX2: a row's 32 outputs as two halves of 16 (two vectors each), up to 6 rows a group

constexpr int64_t kRows256 = 6;

// Input k's 16 weights of one half of a tile (outputs half * 16 ..), made in two AVX2 vectors: the
// one way both the panel and the one- and two-row path make them (their bits must agree).
template <Form F>
AVX2 inline void make256(const uint8_t* q, int64_t k, int half, __m256 d0, __m256 d1, __m256 m0, __m256 m1,
                         __m256& w0, __m256& w1) {
  if constexpr (eight_bit(F)) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 32 + half * 16));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), d1);
  } else {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 16 + half * 8));
    const __m128i lo = _mm_and_si128(raw, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    const __m128i both = _mm_unpacklo_epi8(lo, hi);    // this half's 16 outputs in order
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both)), d0, m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))), d1, m1);
  }
}

template <Form F>
AVX2 void panel256(const uint8_t* q, const float* d, const float* m, int64_t K, int64_t t, int64_t b,
                   float* panel) {
  constexpr bool Q8 = eight_bit(F);
  const int64_t at = (t * (K / per_d(F)) + b * (32 / per_d(F))) * 32;
  for (int half = 0; half < 2; ++half) {
    __m256 d0 = _mm256_loadu_ps(d + at + half * 16), d1 = _mm256_loadu_ps(d + at + half * 16 + 8);
    const __m256 m0 = Q8 ? d0 : _mm256_loadu_ps(m + at + half * 16);
    const __m256 m1 = Q8 ? d1 : _mm256_loadu_ps(m + at + half * 16 + 8);
    for (int64_t kk = 0; kk < 32; ++kk) {
      const int64_t k = t * K + b * 32 + kk;
      if (F == kQ6_K && kk == 16) {   // the block's second 16 inputs: their own d
        d0 = _mm256_loadu_ps(d + at + 32 + half * 16);
        d1 = _mm256_loadu_ps(d + at + 32 + half * 16 + 8);
      }
      __m256 w0, w1;
      make256<F>(q, k, half, d0, d1, m0, m1, w0, w1);
      _mm256_store_ps(panel + kk * 32 + half * 16, w0);
      _mm256_store_ps(panel + kk * 32 + half * 16 + 8, w1);
    }
  }
}

template <int R>
AVX2 void rows256(const float* x, int64_t K, const float* panel, int64_t k0, float* y, int64_t N, bool first) {
  for (int half = 0; half < 2; ++half) {
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
      acc0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * N + half * 16);
      acc1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * N + half * 16 + 8);
    }
    for (int64_t kk = 0; kk < 32; ++kk) {
      const __m256 w0 = _mm256_load_ps(panel + kk * 32 + half * 16);
      const __m256 w1 = _mm256_load_ps(panel + kk * 32 + half * 16 + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * K + k0 + kk]);
        acc0[r] = _mm256_fmadd_ps(xr, w0, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(xr, w1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * N + half * 16, acc0[r]);
      _mm256_storeu_ps(y + r * N + half * 16 + 8, acc1[r]);
    }
  }
}

constexpr Rows kRowsOf256[kRows256 + 1] = {nullptr, rows256<1>, rows256<2>, rows256<3>, rows256<4>, rows256<5>,
                                           rows256<6>};

// One or two rows on AVX2 (a decode step of one sequence): each weight made as panel256 makes it,
// then multiplied at once, its tile's accumulators kept in registers over every block: the same
// fmas in the same order as the panel, without storing the panel and reading it back (on AVX2 CPUs
// making the weights bounds a step of one row).
template <Form F, int R>
AVX2 void direct256(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, int64_t t,
                    float* y, int64_t N) {
  constexpr bool Q8 = eight_bit(F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; ++b) {
      const int64_t at = (t * (K / per_d(F)) + b * (32 / per_d(F))) * 32;
      __m256 d0 = _mm256_loadu_ps(d + at + half * 16), d1 = _mm256_loadu_ps(d + at + half * 16 + 8);
      const __m256 m0 = Q8 ? d0 : _mm256_loadu_ps(m + at + half * 16);
      const __m256 m1 = Q8 ? d1 : _mm256_loadu_ps(m + at + half * 16 + 8);
      for (int64_t kk = 0; kk < 32; ++kk) {
        const int64_t k = t * K + b * 32 + kk;
        if (F == kQ6_K && kk == 16) {
          d0 = _mm256_loadu_ps(d + at + 32 + half * 16);
          d1 = _mm256_loadu_ps(d + at + 32 + half * 16 + 8);
        }
        __m256 w0, w1;
        make256<F>(q, k, half, d0, d1, m0, m1, w0, w1);
        for (int r = 0; r < R; ++r) {
          const __m256 xr = _mm256_set1_ps(x[r * K + b * 32 + kk]);
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

using Panel = void (*)(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t, float*);

// ---- the ops

// isa: 512 or 256 where the caller asks for one (tests compare the two), 0 for the widest this CPU has
template <Form F>
at::Tensor product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t isa) {
  constexpr bool Q8 = eight_bit(F);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous (rows, K) float32");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == (Q8 ? 32 : 16)
              && q.scalar_type() == (Q8 ? at::kChar : at::kByte), "q: (N/32, K, 16) uint8 or (N/32, K, 32) int8");
  const int64_t M = x.size(0), K = x.size(1), tiles = q.size(0), N = tiles * 32;
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K, "q does not match x's K");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == tiles * K * 32 / per_d(F),
              "d: (N/32, K/32, 32) float32 (Q6_K: (N/32, K/16, 32))");
  TORCH_CHECK(Q8 || (m.scalar_type() == at::kFloat && m.is_contiguous() && m.numel() == tiles * K),
              "m: (N/32, K/32, 32) float32");
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 0) isa = has512 ? 512 : 256;
  TORCH_CHECK((isa == 512 && has512) || (isa == 256 && has256), "this CPU has no ", isa == 512 ? "AVX-512" : "AVX2");
  const Panel panel_of = isa == 512 ? Panel(panel512<F>) : Panel(panel256<F>);
  const Rows* rows_of = isa == 512 ? kRowsOf512 : kRowsOf256;
  const int64_t most = isa == 512 ? kRows512 : kRows256;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = Q8 ? nullptr : m.data_ptr<float>();
  if (isa == 256 && M <= 2) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        (M == 1 ? direct256<F, 1> : direct256<F, 2>)(xp, K, qp, dp, mp, t, yp, N);
    });
    return y;
  }
  // rows in even groups of at most ``most``
  const int64_t groups = (M + most - 1) / most, per = (M + groups - 1) / groups;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float panel[kPanel];
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < K / 32; ++b) {
        panel_of(qp, dp, mp, K, t, b, panel);
        for (int64_t r0 = 0; r0 < M; r0 += per)
          rows_of[std::min(per, M - r0)](xp + r0 * K, K, panel, b * 32, yp + r0 * N + t * 32, N, b == 0);
      }
  });
  return y;
}

at::Tensor q4_1(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t isa) {
  return product<kQ4_1>(x, q, d, m, isa);
}

at::Tensor q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t isa) {
  return product<kQ8_0>(x, q, d, d, isa);
}

at::Tensor q6_k(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t isa) {
  return product<kQ6_K>(x, q, d, d, isa);
}

// q of a weight whose scales are given (engine/blocks.py, ``with_scales``): w (N, K) float32, d
// (N, K/per) and, for Q4_K's form, m (N, K/32); q = round((w - m) / d) in 0..15 (without m:
// round(w / d) in -32..31, per 16), kept only where fma(q, d, m) (q * d) is every w: else an empty
// tensor. One vector pass in place of the eight of torch's operators (22 s for the Qwen 1.5B's
// weights on a 2-core EPYC). Every CPU the product runs on has AVX2.
template <bool Offset>
AVX2 bool recover_row(const float* w, const float* d, const float* m, uint8_t* q, int64_t K) {
  constexpr int64_t per = Offset ? 32 : 16;
  const __m256 lo = _mm256_set1_ps(Offset ? 0.0f : -32.0f), hi = _mm256_set1_ps(Offset ? 15.0f : 31.0f);
  int bad = 0;
  alignas(32) int32_t ints[8];
  for (int64_t b = 0; b < K / per; ++b) {
    const float dd = d[b];
    const __m256 vd = _mm256_set1_ps(dd), step = _mm256_set1_ps(dd == 0.0f ? 1.0f : dd);
    const __m256 vm = _mm256_set1_ps(Offset ? m[b] : 0.0f);
    for (int64_t j = b * per; j < (b + 1) * per; j += 8) {
      const __m256 x = _mm256_loadu_ps(w + j);
      __m256 v = _mm256_div_ps(Offset ? _mm256_sub_ps(x, vm) : x, step);
      v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m256 made = Offset ? _mm256_fmadd_ps(v, vd, vm) : _mm256_mul_ps(v, vd);
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(made, x, _CMP_NEQ_UQ));
      _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_cvtps_epi32(v));
      for (int i = 0; i < 8; ++i) q[j + i] = static_cast<uint8_t>(ints[i]);
    }
  }
  return bad == 0;
}

at::Tensor recover(const at::Tensor& w, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: contiguous (N, K) float32");
  const bool offset = m.has_value();
  const int64_t N = w.size(0), K = w.size(1), per = offset ? 32 : 16;
  TORCH_CHECK(K % 32 == 0 && d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == N * K / per,
              "d: (N, K/per) float32");
  TORCH_CHECK(!offset || (m->scalar_type() == at::kFloat && m->is_contiguous() && m->numel() == N * K / 32),
              "m: (N, K/32) float32");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU has no AVX2");
  at::Tensor q = at::empty({N, K}, w.options().dtype(offset ? at::kByte : at::kChar));
  const float* wp = w.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = offset ? m->data_ptr<float>() : nullptr;
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end && ok.load(std::memory_order_relaxed); ++r) {
      const bool row = offset ? recover_row<true>(wp + r * K, dp + r * K / per, mp + r * K / 32, qp + r * K, K)
                              : recover_row<false>(wp + r * K, dp + r * K / per, nullptr, qp + r * K, K);
      if (!row) ok = false;
    }
  });
  return ok ? q : at::empty({0}, q.options());
}

}  // namespace

TORCH_LIBRARY(specbatch_blocks, lib) {
  lib.def("q4_1(Tensor x, Tensor q, Tensor d, Tensor m, int isa=0) -> Tensor", &q4_1);
  lib.def("q8_0(Tensor x, Tensor q, Tensor d, int isa=0) -> Tensor", &q8_0);
  lib.def("q6_k(Tensor x, Tensor q, Tensor d, int isa=0) -> Tensor", &q6_k);
  lib.def("recover(Tensor w, Tensor d, Tensor? m) -> Tensor", &recover);
}
