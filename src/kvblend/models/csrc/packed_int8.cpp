// kvblend's int8 decode kernels (models/packed.py builds this file once per machine, with
// -march=native and OpenMP; torch's own libgomp is the one loaded, so torch.set_num_threads
// sets their threads too).
//
// int8_linear: y = x (q * scale)^T + bias for x (R, in) float32, q (out, in) int8 and one
// float32 scale per output row; a row's result never depends on the rows beside it. On a CPU
// with AVX-512 VNNI each row of x goes in as two 8-bit rows, itself and what its rounding
// lost (~16 bits together, activation_error), multiplied by VNNI's int8 dot products: a
// decode step's matmul was compute-bound widening int8 weights to float32 (measured on
// SmolLM2's shapes, 2 threads: the layers' matmuls 7.5 -> 4.6 ms, the LM head 1.84 -> 1.05).
// Elsewhere x stays float32 and each weight row is widened to float32 16 (AVX-512) or 8
// (AVX2) at a time into several accumulators. Output rows are split over threads.
//
// decode_project and decode_finish run a whole decoder layer's decode step around the
// attention in two calls (models/transformer.py's DecoderLayer.project and .finish as a
// decode pass reads them): RMS norms, RoPE, the gated MLP's activation and the residual adds
// as loops over a step's few rows, the four matmuls through int8_linear. Dispatched from
// Python a decode step was ~40 small tensor ops a layer, as long as its matmuls.
//
// decode_attend_rows: each decode row's K and V written into its own cache and its one query
// a head attending over it, the softmax in float32 (SDPA's flash kernel took ~100 us a layer
// for one query at 512 keys, as long as the layer's matmuls); decode_layer: one row's
// project, attend_rows and finish in one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec wload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
constexpr int64_t kLanes = 0;  // no vector path: plain loops (the compiler may still vectorise them)
#endif

// The lanes of the vector path this file was built with (0: none).
int64_t simd_lanes() { return kLanes; }

// The largest error of an activation int8_linear multiplies, relative to its row's max |x|:
// half a step of the lo row, 1 / (127 * 254 * 2), on the VNNI path; 0 (float32) otherwise.
double activation_error() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return 1.0 / (127.0 * 254.0 * 2.0);
#else
  return 0.0;
#endif
}

// exp(x), kLanes at a time: 2^n p(r) with x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes'
// degree-6 polynomial (~1 ulp); x clamped to [-87, 88] (e^-87 ~ 1.6e-38 stands for 0).
#if defined(__AVX512F__)
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vclamp(Vec x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {  // 2^n for whole n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec vset(float a) { return _mm256_set1_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec vclamp(Vec x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset(lo)), vset(hi)); }
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline Vec vexp(Vec x) {
  x = vclamp(x, -87.f, 88.f);
  const Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vfma(n, vset(-0.693359375f), x);  // x - n ln 2, ln 2 in two parts
  r = vfma(n, vset(2.12194440e-4f), r);
  Vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.f)));
  return vmul(p, vpow2(n));
}
#endif

// sum_k w[k] x[k] from k0 on, in plain loops (a vector path's tail, or the whole row without one).
inline float dot_tail(const int8_t* w, const float* x, int64_t k0, int64_t n) {
  float s = 0.f;
  for (int64_t k = k0; k < n; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

// One weight row against one input row: four accumulators, so the adds do not wait on each other.
inline float dot1(const int8_t* w, const float* x, int64_t n) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (; k + 4 * kLanes <= n; k += 4 * kLanes) {
    a0 = vfma(wload(w + k), vload(x + k), a0);
    a1 = vfma(wload(w + k + kLanes), vload(x + k + kLanes), a1);
    a2 = vfma(wload(w + k + 2 * kLanes), vload(x + k + 2 * kLanes), a2);
    a3 = vfma(wload(w + k + 3 * kLanes), vload(x + k + 3 * kLanes), a3);
  }
  for (; k + kLanes <= n; k += kLanes) a0 = vfma(wload(w + k), vload(x + k), a0);
  s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#endif
  return s + dot_tail(w, x, k, n);
}

// kJ weight rows (from w, stride n) against kR input rows (from x, stride n): each widened
// weight vector serves every input row. out[j * kR + r].
template <int kJ, int kR>
inline void dot_tile(const int8_t* w, const float* x, int64_t n, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc[kJ][kR];
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r) acc[j][r] = vzero();
  for (; k + kLanes <= n; k += kLanes) {
    Vec xv[kR];
    for (int r = 0; r < kR; ++r) xv[r] = vload(x + r * n + k);
    for (int j = 0; j < kJ; ++j) {
      const Vec wv = wload(w + j * n + k);
      for (int r = 0; r < kR; ++r) acc[j][r] = vfma(wv, xv[r], acc[j][r]);
    }
  }
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r) out[j * kR + r] = vsum(acc[j][r]) + dot_tail(w + j * n, x + r * n, k, n);
#else
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r) out[j * kR + r] = dot_tail(w + j * n, x + r * n, k, n);
#endif
}

constexpr int kTileRows = 4;  // weight rows a task takes at once

// Weight rows [j0, j0 + kTileRows) against every input row, into y (R, outs).
void weight_tile(const int8_t* W, const float* X, int64_t rows, int64_t n, int64_t outs, int64_t j0,
                 const float* scale, const float* bias, float* Y) {
  float acc[kTileRows * 4];
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int rt = static_cast<int>(std::min<int64_t>(4, rows - r0));
    const int8_t* w = W + j0 * n;
    const float* x = X + r0 * n;
    switch (rt) {
      case 1: dot_tile<kTileRows, 1>(w, x, n, acc); break;
      case 2: dot_tile<kTileRows, 2>(w, x, n, acc); break;
      case 3: dot_tile<kTileRows, 3>(w, x, n, acc); break;
      default: dot_tile<kTileRows, 4>(w, x, n, acc); break;
    }
    for (int j = 0; j < kTileRows; ++j)
      for (int r = 0; r < rt; ++r)
        Y[(r0 + r) * outs + j0 + j] = acc[j * rt + r] * scale[j0 + j] + (bias ? bias[j0 + j] : 0.f);
  }
}

const float* optional_weight(const std::optional<at::Tensor>& w, int64_t n, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->numel() == n && w->is_contiguous() && w->scalar_type() == at::kFloat, what,
              " must be contiguous float32 of width ", n);
  return w->const_data_ptr<float>();
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVBLEND_VNNI 1
// Each row of x as two rows of 8-bit integers, hi and lo: x = s (hi + lo / 254), hi and lo
// within [-127, 127] (lo: what rounding hi lost, at most half a step, times 254), so the
// activations keep ~16 bits and the error is the weights' rounding. Stored plus 128 (the
// unsigned operand of AVX-512 VNNI's u8 x s8 dot products); dot_rows takes the 128 back out.
struct QuantizedRows {
  std::vector<uint8_t> hi, lo;
  std::vector<float> scale;
};

QuantizedRows quantize_rows(const float* X, int64_t rows, int64_t n) {
  QuantizedRows out{std::vector<uint8_t>(rows * n), std::vector<uint8_t>(rows * n), std::vector<float>(rows)};
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * n;
    __m512 most = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    float top = _mm512_reduce_max_ps(most);
    for (; k < n; ++k) top = std::max(top, std::fabs(x[k]));
    const float step = top > 0.f ? top / 127.f : 1.f, inv = 1.f / step;
    out.scale[r] = step;
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i offset = _mm512_set1_epi32(128);
    for (k = 0; k + 16 <= n; k += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(inv));
      const __m512 hi = _mm512_roundscale_ps(v, kNearest);
      const __m512 lo = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, hi), _mm512_set1_ps(254.f)), kNearest);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi.data() + r * n + k),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(hi), offset)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo.data() + r * n + k),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(lo), offset)));
    }
    for (; k < n; ++k) {
      const float v = x[k] * inv, hi = std::nearbyint(v);
      out.hi[r * n + k] = static_cast<uint8_t>(static_cast<int32_t>(hi) + 128);
      out.lo[r * n + k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint((v - hi) * 254.f)) + 128);
    }
  }
  return out;
}

// The four sums of a, b, c, d (sixteen lanes each) as one 128-bit vector: pairs added
// across lanes first, so four sums cost about as much as one reduction.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d per 128 bits
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// kJ weight rows (from w, stride n) against kR input rows (hi/lo, stride n): each weight
// vector loaded once serves every input row, each input vector every weight row. out[j * kR
// + r] = hi dot + lo dot / 254, both still holding 128 x sum(w) (x 1 + 1/254 together); the
// int32 partial sums go to float32 before the reduction (exact: below 2^24 a lane up to n = 8,192).
template <int kJ, int kR>
inline void vnni_tile(const int8_t* w, const uint8_t* hi, const uint8_t* lo, int64_t n, float* out, bool prefetch) {
  __m512i ah[kJ][kR], al[kJ][kR];
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r) ah[j][r] = al[j][r] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    __m512i xh[kR], xl[kR];
    for (int r = 0; r < kR; ++r) {
      xh[r] = _mm512_loadu_si512(hi + r * n + k);
      xl[r] = _mm512_loadu_si512(lo + r * n + k);
    }
    for (int j = 0; j < kJ; ++j) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (j + 2 * kJ) * n + k), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(w + j * n + k);
      for (int r = 0; r < kR; ++r) {
        ah[j][r] = _mm512_dpbusd_epi32(ah[j][r], xh[r], wv);
        al[j][r] = _mm512_dpbusd_epi32(al[j][r], xl[r], wv);
      }
    }
  }
  __m512 f[kJ][kR];
  const __m512 lo_weight = _mm512_set1_ps(1.f / 254.f);
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r)
      f[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[j][r]), lo_weight, _mm512_cvtepi32_ps(ah[j][r]));
  for (int r = 0; r < kR; ++r) {
    float sums[kJ];
    if constexpr (kJ == 4) {
      _mm_storeu_ps(sums, sum4(f[0][r], f[1][r], f[2][r], f[3][r]));
    } else {
      for (int j = 0; j < kJ; ++j) sums[j] = _mm512_reduce_add_ps(f[j][r]);
    }
    for (int j = 0; j < kJ; ++j) {
      int32_t th = 0, tl = 0;  // the tail past the last whole 64
      for (int64_t kk = k; kk < n; ++kk) {
        th += static_cast<int32_t>(hi[r * n + kk]) * w[j * n + kk];
        tl += static_cast<int32_t>(lo[r * n + kk]) * w[j * n + kk];
      }
      out[j * kR + r] = sums[j] + static_cast<float>(th) + static_cast<float>(tl) * (1.f / 254.f);
    }
  }
}

constexpr int kVnniRows = 4;  // weight rows a tile takes
constexpr int kVnniInputs = 2;  // input rows a tile takes

// kJ weight rows from j against every input row, into Y.
template <int kJ>
void vnni_weight_rows(const int8_t* W, const QuantizedRows& x, int64_t rows, int64_t n, int64_t outs, int64_t j,
                      const float* scale, const int32_t* rowsum, const float* bias, float* Y) {
  float acc[kJ * kVnniInputs];
  for (int64_t r0 = 0; r0 < rows; r0 += kVnniInputs) {
    const int rt = static_cast<int>(std::min<int64_t>(kVnniInputs, rows - r0));
    const uint8_t* hi = x.hi.data() + r0 * n;
    const uint8_t* lo = x.lo.data() + r0 * n;
    if (rt == 1) {
      vnni_tile<kJ, 1>(W + j * n, hi, lo, n, acc, r0 == 0);
    } else {
      vnni_tile<kJ, kVnniInputs>(W + j * n, hi, lo, n, acc, r0 == 0);
    }
    for (int jj = 0; jj < kJ; ++jj) {
      const float offset = 128.f * static_cast<float>(rowsum[j + jj]) * (1.f + 1.f / 254.f);
      for (int r = 0; r < rt; ++r)
        Y[(r0 + r) * outs + j + jj] =
            (acc[jj * rt + r] - offset) * x.scale[r0 + r] * scale[j + jj] + (bias ? bias[j + jj] : 0.f);
    }
  }
}

// y[r, j] for weight rows [j0, j1) and every row r.
void vnni_rows(const int8_t* W, const QuantizedRows& x, int64_t rows, int64_t n, int64_t outs, int64_t j0, int64_t j1,
               const float* scale, const int32_t* rowsum, const float* bias, float* Y) {
  int64_t j = j0;
  for (; j + kVnniRows <= j1; j += kVnniRows) vnni_weight_rows<kVnniRows>(W, x, rows, n, outs, j, scale, rowsum, bias, Y);
  for (; j < j1; ++j) vnni_weight_rows<1>(W, x, rows, n, outs, j, scale, rowsum, bias, Y);
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& rowsum,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "int8_linear takes a 2-d float32 CPU input");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear's weight must be contiguous int8 (out, in) with in = ", x.size(1));
  const int64_t rows = x.size(0), n = x.size(1), outs = q.size(0);
  const float* s = optional_weight(scale, outs, "scale");
  TORCH_CHECK(s != nullptr, "int8_linear needs one scale per output row");
  TORCH_CHECK(rowsum.numel() == outs && rowsum.scalar_type() == at::kInt && rowsum.is_contiguous(),
              "int8_linear needs each weight row's sum (int32)");
  const float* b = optional_weight(bias, outs, "bias");
  const at::Tensor in = x.contiguous();
  at::Tensor y = at::empty({rows, outs}, in.options());
  const int8_t* W = q.const_data_ptr<int8_t>();
  const float* X = in.const_data_ptr<float>();
  float* Y = y.mutable_data_ptr<float>();
#ifdef KVBLEND_VNNI
  const QuantizedRows xq = quantize_rows(X, rows, n);
  const int32_t* sums = rowsum.const_data_ptr<int32_t>();
  at::parallel_for(0, outs, 64, [&](int64_t first, int64_t end) { vnni_rows(W, xq, rows, n, outs, first, end, s, sums, b, Y); });
#else
  const int64_t tiles = outs / kTileRows;  // the last outs % kTileRows rows one at a time below
  at::parallel_for(0, tiles, 16, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t) {
      const int64_t j0 = t * kTileRows;
      if (rows == 1) {
        for (int64_t j = j0; j < j0 + kTileRows; ++j) Y[j] = dot1(W + j * n, X, n) * s[j] + (b ? b[j] : 0.f);
      } else {
        weight_tile(W, X, rows, n, outs, j0, s, b, Y);
      }
    }
  });
  for (int64_t j = tiles * kTileRows; j < outs; ++j)
    for (int64_t r = 0; r < rows; ++r) Y[r * outs + j] = dot1(W + j * n, X + r * n, n) * s[j] + (b ? b[j] : 0.f);
#endif
  return y;
}

// x * rsqrt(mean(x^2) + eps) * w over one row of n (out may be x).
void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  double squares = 0.0;
  for (int64_t j = 0; j < n; ++j) squares += static_cast<double>(x[j]) * x[j];
  const float inv = 1.f / std::sqrt(static_cast<float>(squares / n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * inv * w[j];
}

// Each row of x (R, n) RMS-normed by w into a new tensor.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor in = x.contiguous();
  const int64_t rows = in.size(0), n = in.size(1);
  const float* wn = optional_weight(w, n, "the norm's weight");
  at::Tensor out = at::empty_like(in);
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(in.const_data_ptr<float>() + r * n, wn, static_cast<float>(eps), n, out.mutable_data_ptr<float>() + r * n);
  return out;
}

// One head's values rotated in place by a position's cos/sin (half each); dims past 2 half unchanged.
void rope_head(float* p, const float* cos, const float* sin, int64_t half, bool interleaved) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = p[a], x2 = p[b];
    p[a] = x1 * cos[i] - x2 * sin[i];
    p[b] = x2 * cos[i] + x1 * sin[i];
  }
}

// h (R, D): norm, the fused q|k|v projection, per-head q/k norms, RoPE on q and k, q scaled
// by q_mult. Returns (R, (Hq + 2 Hkv) d): q and k rotated, v as projected.
at::Tensor decode_project(const at::Tensor& h, const at::Tensor& norm_w, double eps, const at::Tensor& qkv,
                          const at::Tensor& qkv_scale, const at::Tensor& qkv_rowsum, const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                          const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, bool interleaved,
                          const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                          double q_mult) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_project takes a 2-d float32 h");
  const int64_t rows = h.size(0), width = (heads + 2 * kv_heads) * head_dim, half = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && sin.sizes() == cos.sizes() && 2 * half <= head_dim &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be float32 (R, rotary_dim / 2) with rotary_dim <= head_dim");
  TORCH_CHECK(qkv.size(0) == width, "the q|k|v weight has ", qkv.size(0), " outputs, expected ", width);
  at::Tensor y = int8_linear(rms_norm_rows(h, norm_w, eps), qkv, qkv_scale, qkv_rowsum, bias);
  const float* qn = optional_weight(q_norm, head_dim, "q_norm");
  const float* kn = optional_weight(k_norm, head_dim, "k_norm");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const float mult = static_cast<float>(q_mult), e = static_cast<float>(eps);
  float* out = y.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c.const_data_ptr<float>() + r * half;
    const float* sr = s.const_data_ptr<float>() + r * half;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      float* p = out + r * width + head * head_dim;
      const bool query = head < heads;
      const float* norm = query ? qn : kn;
      if (norm) rms_norm_row(p, norm, e, head_dim, p);
      rope_head(p, cr, sr, half, interleaved);
      if (query && mult != 1.f)
        for (int64_t j = 0; j < head_dim; ++j) p[j] *= mult;
    }
  }
  return y;
}

// After attention: h + o(attn) (the o branch normed first where attn_out_norm is given), then
// + down(act(gate) * up) of its post norm (normed by mlp_out_norm where given). act: SiLU, or
// GELU's tanh form where gelu. Returns the new h (R, D).
at::Tensor decode_finish(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o, const at::Tensor& o_scale,
                         const at::Tensor& o_rowsum, const std::optional<at::Tensor>& o_bias,
                         const std::optional<at::Tensor>& attn_out_norm, const at::Tensor& post_norm_w, double eps,
                         const at::Tensor& gate_up, const at::Tensor& gate_up_scale, const at::Tensor& gate_up_rowsum,
                         const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                         const at::Tensor& down_scale, const at::Tensor& down_rowsum,
                         const std::optional<at::Tensor>& down_bias, const std::optional<at::Tensor>& mlp_out_norm,
                         bool gelu) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_finish takes a 2-d float32 h");
  const int64_t rows = h.size(0), dim = h.size(1);
  TORCH_CHECK(o.size(0) == dim && down.size(0) == dim && gate_up.size(0) == 2 * down.size(1),
              "decode_finish's weights do not fit a hidden size of ", dim);
  const float e = static_cast<float>(eps);
  at::Tensor out = int8_linear(attn, o, o_scale, o_rowsum, o_bias);  // (R, D): becomes the new h
  const float* an = optional_weight(attn_out_norm, dim, "attn_out_norm");
  const float* mn = optional_weight(mlp_out_norm, dim, "mlp_out_norm");
  const at::Tensor hc = h.contiguous();
  float* hn = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = hn + r * dim;
    if (an) rms_norm_row(row, an, e, dim, row);
    const float* res = hc.const_data_ptr<float>() + r * dim;
    for (int64_t j = 0; j < dim; ++j) row[j] += res[j];
  }
  const at::Tensor gu = int8_linear(rms_norm_rows(out, post_norm_w, eps), gate_up, gate_up_scale, gate_up_rowsum,
                                    gate_up_bias);
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, out.options());
  const float* g = gu.const_data_ptr<float>();
  float* a = act.mutable_data_ptr<float>();
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; j + 16 <= inter; j += 16) {
      const __m512 x = _mm512_loadu_ps(g + r * 2 * inter + j), up = _mm512_loadu_ps(g + r * 2 * inter + inter + j);
      __m512 f;
      if (gelu) {  // 0.5 x (1 + tanh(z)), tanh(z) = 1 - 2 / (e^2z + 1)
        const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi),
                                       _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
        const __m512 e = vexp(_mm512_add_ps(z, z));
        const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
        f = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, tanh));
      } else {  // x / (1 + e^-x)
        f = _mm512_div_ps(x, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      }
      _mm512_storeu_ps(a + r * inter + j, _mm512_mul_ps(f, up));
    }
#endif
    for (; j < inter; ++j) {
      const float x = g[r * 2 * inter + j], up = g[r * 2 * inter + inter + j];
      const float f = gelu ? 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)))
                           : x / (1.f + std::exp(-x));
      a[r * inter + j] = f * up;
    }
  }
  at::Tensor d = int8_linear(act, down, down_scale, down_rowsum, down_bias);  // (R, D)
  float* dd = d.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = dd + r * dim;
    if (mn) rms_norm_row(row, mn, e, dim, row);
    float* target = hn + r * dim;
    for (int64_t j = 0; j < dim; ++j) target[j] += row[j];
  }
  return out;
}

// sum_j a[j] b[j] over n floats.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc = vzero();
  for (; j + kLanes <= n; j += kLanes) acc = vfma(vload(a + j), vload(b + j), acc);
  s = vsum(acc);
#endif
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// y[j] += p x[j] over n floats.
inline void axpy_f32(float p, const float* x, float* y, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const Vec pv = vset(p);
  for (; j + kLanes <= n; j += kLanes) vstore(y + j, vfma(pv, vload(x + j), vload(y + j)));
#endif
  for (; j < n; ++j) y[j] += p * x[j];
}

// x[i] = exp(x[i] - top) over n floats; returns their sum.
inline float exp_shifted(float* x, int64_t n, float top) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc = vzero();
  for (; i + kLanes <= n; i += kLanes) {
    const Vec e = vexp(vsub(vload(x + i), vset(top)));
    vstore(x + i, e);
    acc = vadd(acc, e);
  }
  total = vsum(acc);
#endif
  for (; i < n; ++i) total += x[i] = std::exp(x[i] - top);
  return total;
}

constexpr int64_t kKeyChunk = 256;  // keys a task takes: a cache's keys split over threads

// One row's attention: its query heads (heads x d, contiguous) against n keys and values
// (per KV head, keys `key_stride` apart from `kv_head_stride` apart bases), into out (heads x d).
struct AttendJob {
  const float* q;
  const float* k;
  const float* v;
  int64_t n, kv_head_stride_k, key_stride_k, kv_head_stride_v, key_stride_v;
  float* out;
};

// Every job's attention (scores scaled by 1/sqrt(d), every key visible; query head h reads KV
// head h / (heads / kv_heads)). Tasks are (job, KV head, chunk of keys), split over threads:
// each key and value is read once for the query heads that share it, and a job's chunks'
// partial softmaxes are merged by their maxima and sums.
void attend_jobs(const std::vector<AttendJob>& jobs, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> first_task(jobs.size() + 1, 0), chunks(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    chunks[j] = (jobs[j].n + kKeyChunk - 1) / kKeyChunk;
    first_task[j + 1] = first_task[j] + kv_heads * chunks[j];
  }
  const int64_t tasks = first_task.back();
  // per (task, head of its group): the chunk's max score, sum of exps and unnormalised output
  std::vector<float> top(tasks * group), total(top.size()), part(top.size() * d, 0.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t end) {
    std::vector<float> scores(group * kKeyChunk);
    size_t j = std::upper_bound(first_task.begin(), first_task.end(), first) - first_task.begin() - 1;
    for (int64_t t = first; t < end; ++t) {
      while (t >= first_task[j + 1]) ++j;
      const AttendJob& job = jobs[j];
      const int64_t local = t - first_task[j], g = local / chunks[j], i0 = (local % chunks[j]) * kKeyChunk;
      const int64_t len = std::min(kKeyChunk, job.n - i0);
      const float* kg = job.k + g * job.kv_head_stride_k + i0 * job.key_stride_k;
      const float* vg = job.v + g * job.kv_head_stride_v + i0 * job.key_stride_v;
      for (int64_t i = 0; i < len; ++i)
        for (int64_t h = 0; h < group; ++h)
          scores[h * kKeyChunk + i] = dot_f32(job.q + (g * group + h) * d, kg + i * job.key_stride_k, d) * scale;
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * kKeyChunk;
        const float m = *std::max_element(sh, sh + len);
        top[t * group + h] = m;
        total[t * group + h] = exp_shifted(sh, len, m);
      }
      float* out = part.data() + t * group * d;
      for (int64_t i = 0; i < len; ++i)
        for (int64_t h = 0; h < group; ++h)
          axpy_f32(scores[h * kKeyChunk + i], vg + i * job.key_stride_v, out + h * d, d);
    }
  });
  for (size_t j = 0; j < jobs.size(); ++j)
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t h = 0; h < group; ++h) {
        const int64_t base = first_task[j] + g * chunks[j];
        float m = -INFINITY;
        for (int64_t c = 0; c < chunks[j]; ++c) m = std::max(m, top[(base + c) * group + h]);
        float sum = 0.f;
        float* oh = jobs[j].out + (g * group + h) * d;
        std::fill_n(oh, d, 0.f);
        for (int64_t c = 0; c < chunks[j]; ++c) {
          const int64_t at = (base + c) * group + h;
          const float w = std::exp(top[at] - m);
          sum += total[at] * w;
          axpy_f32(w, part.data() + at * d, oh, d);
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < d; ++i) oh[i] *= inv;
      }
}

// Several decode rows at once, each of its own cache: qkv (R, (Hq + 2 Hkv) d) as decode_project
// returns it; row r's K and V are written at slots[r] of k_caches[r]/v_caches[r] (Hkv,
// capacity, d), and its queries attend over slots firsts[r]..slots[r]. Returns (R, Hq d).
at::Tensor decode_attend_rows(const at::Tensor& qkv, at::TensorList k_caches, at::TensorList v_caches,
                              at::IntArrayRef slots, at::IntArrayRef firsts, int64_t heads, int64_t kv_heads,
                              int64_t head_dim) {
  const int64_t rows = qkv.size(0), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == width && qkv.scalar_type() == at::kFloat,
              "decode_attend_rows takes decode_project's contiguous float32 (R, (Hq + 2 Hkv) d)");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == rows && static_cast<int64_t>(v_caches.size()) == rows &&
                  static_cast<int64_t>(slots.size()) == rows && static_cast<int64_t>(firsts.size()) == rows,
              "decode_attend_rows takes one cache, slot and first slot per row");
  TORCH_CHECK(heads % kv_heads == 0, "decode_attend_rows needs whole groups of query heads");
  const float* in = qkv.const_data_ptr<float>();
  at::Tensor result = at::empty({rows, heads * head_dim}, qkv.options());
  std::vector<AttendJob> jobs;
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor& kc = k_caches[r];
    const at::Tensor& vc = v_caches[r];
    TORCH_CHECK(kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.size(0) == kv_heads && kc.size(2) == head_dim &&
                    kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.stride(2) == 1 &&
                    vc.stride(2) == 1,
                "decode_attend_rows' caches must be float32 (Hkv, capacity, head_dim)");
    TORCH_CHECK(0 <= firsts[r] && firsts[r] <= slots[r] && slots[r] < kc.size(1), "a row's slot is outside its cache");
    for (int64_t r2 = 0; r2 < r; ++r2)
      TORCH_CHECK(!k_caches[r2].is_same(kc), "a cache appears twice in one batch");
    float* K = kc.mutable_data_ptr<float>();
    float* V = vc.mutable_data_ptr<float>();
    const float* row = in + r * width;
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::copy_n(row + (heads + g) * head_dim, head_dim, K + g * kc.stride(0) + slots[r] * kc.stride(1));
      std::copy_n(row + (heads + kv_heads + g) * head_dim, head_dim, V + g * vc.stride(0) + slots[r] * vc.stride(1));
    }
    jobs.push_back(AttendJob{row, K + firsts[r] * kc.stride(1), V + firsts[r] * vc.stride(1), slots[r] + 1 - firsts[r],
                             kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                             result.mutable_data_ptr<float>() + r * heads * head_dim});
  }
  attend_jobs(jobs, heads, kv_heads, head_dim);
  return result;
}

// The weights decode_layer takes, in this order (models/transformer.py DecoderLayer.native_weights).
enum LayerWeight {
  kInputNorm, kQkv, kQkvScale, kQkvRowsum, kQkvBias, kQNorm, kKNorm, kO, kOScale, kORowsum, kOBias, kAttnOutNorm,
  kPostNorm, kGateUp, kGateUpScale, kGateUpRowsum, kGateUpBias, kDown, kDownScale, kDownRowsum, kDownBias,
  kMlpOutNorm, kLayerWeights
};

// One decode step of a decoder layer for one row h (1, D) at cache slot `slot`: project,
// write its K and V at the slot of k_cache/v_cache (Hkv, capacity, d), attend over slots
// first..slot, finish. Returns the new h (1, D).
at::Tensor decode_layer(const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, int64_t slot, int64_t first, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, bool interleaved, double eps, double q_mult, bool gelu) {
  TORCH_CHECK(weights.size() == kLayerWeights, "decode_layer takes ", static_cast<int>(kLayerWeights), " weights");
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "decode_layer takes one row");
  auto w = [&](LayerWeight i) -> std::optional<at::Tensor> { return weights.get(i); };
  const at::Tensor qkv = decode_project(h, *w(kInputNorm), eps, *w(kQkv), *w(kQkvScale), *w(kQkvRowsum), w(kQkvBias), cos, sin,
                                        heads, kv_heads, head_dim, interleaved, w(kQNorm), w(kKNorm), q_mult);
  const at::Tensor attn = decode_attend_rows(qkv, {k_cache}, {v_cache}, {slot}, {first}, heads, kv_heads, head_dim);
  return decode_finish(h, attn, *w(kO), *w(kOScale), *w(kORowsum), w(kOBias), w(kAttnOutNorm), *w(kPostNorm), eps,
                       *w(kGateUp), *w(kGateUpScale), *w(kGateUpRowsum), w(kGateUpBias), *w(kDown), *w(kDownScale),
                       *w(kDownRowsum), w(kDownBias), w(kMlpOutNorm), gelu);
}

}  // namespace

TORCH_LIBRARY(kvblend_packed, m) {
  m.def("simd_lanes() -> int", &simd_lanes);
  m.def("activation_error() -> float", &activation_error);
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor rowsum, Tensor? bias) -> Tensor", &int8_linear);
  m.def("decode_layer(Tensor h, Tensor?[] weights, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int slot, int first, int heads, int kv_heads, int head_dim, bool interleaved, float eps, float q_mult, "
        "bool gelu) -> Tensor", &decode_layer);
  m.def("decode_attend_rows(Tensor qkv, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] slots, int[] firsts, "
        "int heads, int kv_heads, int head_dim) -> Tensor", &decode_attend_rows);
  m.def("decode_project(Tensor h, Tensor norm_w, float eps, Tensor qkv, Tensor qkv_scale, Tensor qkv_rowsum, "
        "Tensor? bias, Tensor cos, "
        "Tensor sin, int heads, int kv_heads, int head_dim, bool interleaved, Tensor? q_norm, Tensor? k_norm, "
        "float q_mult) -> Tensor", &decode_project);
  m.def("decode_finish(Tensor h, Tensor attn, Tensor o, Tensor o_scale, Tensor o_rowsum, Tensor? o_bias, "
        "Tensor? attn_out_norm, Tensor post_norm_w, float eps, Tensor gate_up, Tensor gate_up_scale, "
        "Tensor gate_up_rowsum, Tensor? gate_up_bias, Tensor down, Tensor down_scale, Tensor down_rowsum, "
        "Tensor? down_bias, Tensor? mlp_out_norm, bool gelu) -> Tensor", &decode_finish);
}
