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
// Tiles of four weight rows by two input rows, the weights two tiles ahead prefetched (one
// row: 5.2 -> 2.9 ms for SmolLM2's layers). Where the CPU has AMX, every step multiplies by
// the weight's AMX tiles instead (amx_pack, amx_linear): 8 rows through VNNI were
// compute-bound (10.3 ms against AMX's 6.4 for SmolLM2's layers), and since VNNI reduces
// exact int32 sums one row is faster through AMX too (kAmxMinRows). With AVX2 but no VNNI
// each row of x goes in as one 16-bit row against the weights widened to 16 bits (vpmaddwd;
// KVBLEND_INT16), from int16_pack's tiles where given. Elsewhere x stays float32 and each
// weight row is widened to float32. Output rows are split over threads.
//
// decode_project and decode_finish run a whole decoder layer's decode step around the
// attention in two calls (models/transformer.py's DecoderLayer.project and .finish as a
// decode pass reads them): RMS norms, RoPE, the gated MLP's activation and the residual adds
// as loops over a step's few rows, the four matmuls through int8_linear. Dispatched from
// Python a decode step was ~40 small tensor ops a layer, as long as its matmuls.
//
// decode_attend_rows: each decode row's K and V written into its own cache and its one query
// a head attending over it, the softmax in float32 (SDPA's flash kernel took ~100 us a layer
// for one query at 512 keys, as long as the layer's matmuls): four keys' scores reduced
// together, a value block's weighted sums held in registers across the keys, keys and values
// prefetched (8 rows x 512 keys x 30 layers: 17.6 -> 9.7 ms); over float16 copies of the
// caches where the caller keeps them (models/kv_cache.py KVCache.decode_half: half the bytes,
// 9.8 -> 7.3 ms); decode_layer: the rows' project, attend_rows and finish in one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#endif
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

// The kernels' threads off the main thread. A decode step is ~150 short parallel regions
// (10-100 us each), so waking a sleeping thread for each costs as much as the work:
// libgomp's idle threads sleep almost at once when it manages more threads than CPUs, which
// is the case as soon as a second Python thread (the server's model worker) runs parallel
// regions beside the main thread's (measured on 2 CPUs: a 17 us int8_linear took 88 us from
// a second thread, a SmolLM2 decode step 17.9 against 8.5 ms). These threads spin briefly
// between regions (~0.1-0.3 ms, then block), so a step's regions find them awake. One caller
// at a time: a second one meanwhile runs its loop alone, in its own thread. The main thread
// keeps libgomp (at::parallel_for), whose threads stay awake for it: there ours would spin
// beside libgomp's after torch's own ops (a step 12.3 against 8.5 ms).
class SpinPool {
 public:
  static SpinPool& get() {
    static SpinPool* pool = new SpinPool();  // never destroyed: its threads are detached
    return *pool;
  }

  // f(first, end) over [begin, end) split into one piece per thread (at::get_num_threads()),
  // pieces of at least `grain`; the caller runs the first piece. As at::parallel_for, an
  // exception from any piece is rethrown here once every piece has ended.
  void run(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> f) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t least = std::max<int64_t>(grain, 1);
    int64_t parts = std::min<int64_t>(at::get_num_threads(), (n + least - 1) / least);
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (parts <= 1 || in_worker_ || !busy.owns_lock()) {
      f(begin, end);
      return;
    }
    grow(static_cast<int>(parts - 1));
    parts = std::min<int64_t>(parts, workers_ + 1);
    f_ = &f;
    begin_ = begin;
    end_ = end;
    step_ = (n + parts - 1) / parts;
    parts_ = static_cast<int>(parts);
    error_ = nullptr;
    pending_.store(workers_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    piece(0);
    while (pending_.load(std::memory_order_acquire) != 0) pause();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  SpinPool() { pthread_atfork(nullptr, nullptr, [] { get().after_fork(); }); }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void grow(int want) {
    while (workers_ < want) {
      const int id = ++workers_;
      const uint64_t now = generation_.load(std::memory_order_acquire);  // before this run's: it waits for that
      std::thread([this, id, now] { work(id, now); }).detach();
    }
  }

  void work(int id, uint64_t seen) {
    in_worker_ = true;
    for (;;) {
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen;) {
        if (++spins < kSpins) {
          pause();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (id < parts_) piece(id);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // The run's piece `part`; an exception is kept (the first one) for the caller.
  void piece(int part) noexcept {
    const int64_t first = begin_ + part * step_, last = std::min(end_, first + step_);
    if (first >= last) return;
    try {
      (*f_)(first, last);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock_);
      if (!error_) error_ = std::current_exception();
    }
  }

  // A forked child has none of the parent's threads: start afresh.
  void after_fork() {
    workers_ = 0;
    new (&busy_) std::mutex();
    new (&sleep_) std::mutex();
    new (&error_lock_) std::mutex();
    new (&wake_) std::condition_variable();
  }

  static constexpr int kSpins = 2000;  // pauses before a worker blocks (~0.1-0.3 ms)
  static thread_local bool in_worker_;
  std::mutex busy_, sleep_, error_lock_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  // the run in flight (written before generation_ moves, read after)
  const c10::function_ref<void(int64_t, int64_t)>* f_ = nullptr;
  int64_t begin_ = 0, end_ = 0, step_ = 0;
  std::exception_ptr error_;
  int parts_ = 0;
  int workers_ = 0;
};

thread_local bool SpinPool::in_worker_ = false;

// Whether this is the process's initial thread (elsewhere than Linux and macOS: taken as yes,
// so libgomp runs every loop as before).
bool on_main_thread() {
#if defined(__linux__)
  static thread_local const bool main = syscall(SYS_gettid) == getpid();
#elif defined(__APPLE__)
  static thread_local const bool main = pthread_main_np() != 0;
#else
  constexpr bool main = true;
#endif
  return main;
}

// at::parallel_for's contract (f over pieces of [begin, end) of at least `grain`): libgomp's
// on the main thread, SpinPool's elsewhere.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (on_main_thread()) {
    at::parallel_for(begin, end, grain, f);
  } else {
    SpinPool::get().run(begin, end, grain, f);
  }
}


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
// The four sums of a, b, c, d as one 128-bit vector: pairs added across lanes first, so four
// sums cost about as much as one reduction.
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d per 128 bits
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
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
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {  // a b c d per 128 bits, then the halves added
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#else
constexpr int64_t kLanes = 0;  // no vector path: plain loops (the compiler may still vectorise them)
#endif

// The lanes of the vector path this file was built with (0: none).
int64_t simd_lanes() { return kLanes; }

// exp(x), kLanes at a time: 2^n p(r) with x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes'
// degree-6 polynomial (~1 ulp); x clamped to [-87, 88] (e^-87 ~ 1.6e-38 stands for 0).
#if defined(__AVX512F__)
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vclamp(Vec x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vhmax(Vec a) { return _mm512_reduce_max_ps(a); }
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
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vhmax(Vec a) {
  const __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 n = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(n, _mm_shuffle_ps(n, n, 1)));
}
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The step a row of n activations is quantized with, `levels` steps to its max |x|. NaN where
// the row holds a NaN or an infinity (its outputs are then NaN, as the float32 matmul's are,
// not finite numbers from a saturated conversion); 0 where the row is zero or its max so
// small that 1 / step overflows (the row is taken as zeros: outputs below ~1e-34 are lost).
inline float row_step(const float* x, int64_t n, float levels) {
  Vec most = vzero(), poison = vzero();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const Vec v = vload(x + k);
    most = vmax(most, vmax(v, vsub(vzero(), v)));
    poison = vadd(poison, vmul(v, vzero()));  // 0, or NaN once an element is NaN or infinite
  }
  float top = vhmax(most), bad = vsum(poison);
  for (; k < n; ++k) top = std::max(top, std::fabs(x[k])), bad += x[k] * 0.f;
  if (std::isnan(bad)) return NAN;
  const float step = top / levels;
  return top > 0.f && std::isfinite(1.f / step) ? step : 0.f;
}
#endif

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
    const float step = row_step(x, n, 127.f);
    out.scale[r] = step;
    if (!(step > 0.f)) {  // zeros (or NaN): every input taken as 0, the scale carries a NaN to the outputs
      std::fill_n(out.hi.data() + r * n, n, uint8_t{128});
      std::fill_n(out.lo.data() + r * n, n, uint8_t{128});
      continue;
    }
    const float inv = 1.f / step;
    int64_t k = 0;
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

// The four sums of a, b, c, d (16 int32 lanes each), exactly: vsum4's order on integers.
inline __m128i vsum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512 abf = _mm512_castsi512_ps(ab), cdf = _mm512_castsi512_ps(cd);
  const __m512i abcd = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(abf, cdf, _MM_SHUFFLE(1, 0, 1, 0))),
                                        _mm512_castps_si512(_mm512_shuffle_ps(abf, cdf, _MM_SHUFFLE(3, 2, 3, 2))));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// y for one output from its exact int32 dot products with the hi and lo rows (each still
// holding 128 x sum(w), `offset`): the same float operations as amx_linear's, so a row's
// result is the same whichever path (and however many rows beside it) computed it.
inline float vnni_output(int32_t hi_dot, int32_t lo_dot, int32_t offset, float x_scale, float w_scale, float bias) {
  const float dot = std::fma(static_cast<float>(lo_dot - offset), 1.f / 254.f, static_cast<float>(hi_dot - offset));
  return std::fma(dot * x_scale, w_scale, bias);
}

// kJ weight rows (from w, stride n) against kR input rows (hi/lo, stride n): each weight
// vector loaded once serves every input row, each input vector every weight row. dh/dl[j *
// kR + r]: the exact int32 hi and lo dot products, four weight rows' reduced together.
template <int kJ, int kR>
inline void vnni_tile(const int8_t* w, const uint8_t* hi, const uint8_t* lo, int64_t n, int32_t* dh, int32_t* dl,
                      bool prefetch) {
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
      if (prefetch) __builtin_prefetch(w + (j + 2 * kJ) * n + k, 0, 3);
      const __m512i wv = _mm512_loadu_si512(w + j * n + k);
      for (int r = 0; r < kR; ++r) {
        ah[j][r] = _mm512_dpbusd_epi32(ah[j][r], xh[r], wv);
        al[j][r] = _mm512_dpbusd_epi32(al[j][r], xl[r], wv);
      }
    }
  }
  for (int r = 0; r < kR; ++r) {
    int32_t sh[kJ], sl[kJ];
    if constexpr (kJ == 4) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sh), vsum4_epi32(ah[0][r], ah[1][r], ah[2][r], ah[3][r]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sl), vsum4_epi32(al[0][r], al[1][r], al[2][r], al[3][r]));
    } else {
      for (int j = 0; j < kJ; ++j) sh[j] = _mm512_reduce_add_epi32(ah[j][r]), sl[j] = _mm512_reduce_add_epi32(al[j][r]);
    }
    for (int j = 0; j < kJ; ++j) {
      for (int64_t kk = k; kk < n; ++kk) {  // the tail past the last whole 64
        sh[j] += static_cast<int32_t>(hi[r * n + kk]) * w[j * n + kk];
        sl[j] += static_cast<int32_t>(lo[r * n + kk]) * w[j * n + kk];
      }
      dh[j * kR + r] = sh[j];
      dl[j * kR + r] = sl[j];
    }
  }
}

constexpr int kVnniRows = 4;  // weight rows a tile takes
constexpr int kVnniInputs = 2;  // input rows a tile takes

// kJ weight rows from j against every input row, into Y.
template <int kJ>
void vnni_weight_rows(const int8_t* W, const QuantizedRows& x, int64_t rows, int64_t n, int64_t outs, int64_t j,
                      const float* scale, const int32_t* rowsum, const float* bias, float* Y) {
  int32_t dh[kJ * kVnniInputs], dl[kJ * kVnniInputs];
  for (int64_t r0 = 0; r0 < rows; r0 += kVnniInputs) {
    const int rt = static_cast<int>(std::min<int64_t>(kVnniInputs, rows - r0));
    const uint8_t* hi = x.hi.data() + r0 * n;
    const uint8_t* lo = x.lo.data() + r0 * n;
    if (rt == 1) {
      vnni_tile<kJ, 1>(W + j * n, hi, lo, n, dh, dl, r0 == 0);
    } else {
      vnni_tile<kJ, kVnniInputs>(W + j * n, hi, lo, n, dh, dl, r0 == 0);
    }
    for (int jj = 0; jj < kJ; ++jj)
      for (int r = 0; r < rt; ++r)
        Y[(r0 + r) * outs + j + jj] = vnni_output(dh[jj * rt + r], dl[jj * rt + r], 128 * rowsum[j + jj],
                                                  x.scale[r0 + r], scale[j + jj], bias ? bias[j + jj] : 0.f);
  }
}

// y[r, j] for weight rows [j0, j1) and every row r.
void vnni_rows(const int8_t* W, const QuantizedRows& x, int64_t rows, int64_t n, int64_t outs, int64_t j0, int64_t j1,
               const float* scale, const int32_t* rowsum, const float* bias, float* Y) {
  int64_t j = j0;
  for (; j + kVnniRows <= j1; j += kVnniRows) vnni_weight_rows<kVnniRows>(W, x, rows, n, outs, j, scale, rowsum, bias, Y);
  for (; j < j1; ++j) vnni_weight_rows<1>(W, x, rows, n, outs, j, scale, rowsum, bias, Y);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define KVBLEND_AMX 1
// AMX: a weight as tiles of 16 output rows x 64 inputs (amx_pack), each row of x as its hi and
// lo rows of one A tile (up to 8 rows of x a tile), TDPBUSD's 16 x 16 int32 dot products
// exact. A decode step of 8 rows through VNNI was compute-bound (~1.7 cycles a 64-wide dot
// product); one TDPBUSD does 256 of them.

// Linux hands out the tile registers' state on request, once per process.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: two output tiles' sums (2 rt rows x 16 int32); tmm2 | tmm5: the rows' hi|lo
// bytes (2 rt x 64) of even | odd input columns; tmm3, tmm4 | tmm6, tmm7: the two weight tiles
// (16 x 64, four inputs of 16 outputs a row) of even | odd columns. Tiles are not renamed:
// loading one waits for the product reading it, so consecutive columns load into others.
void configure_tiles(int rt) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 5}) cfg.rows[t] = static_cast<uint8_t>(2 * rt), cfg.colsb[t] = 64;
  for (int t : {3, 4, 6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Column k of a pair of output tiles: A (a, stride) against the weight tiles w0 and w1, into
// tmm0 and tmm1, through tiles tA, tB0, tB1 (GCC's tile intrinsics take literal numbers).
#define KVBLEND_AMX_COLUMN(tA, tB0, tB1, a, stride, w0, w1) \
  do {                                                      \
    _tile_loadd(tA, a, stride);                             \
    _tile_loadd(tB0, w0, 64);                               \
    _tile_loadd(tB1, w1, 64);                               \
    _tile_dpbusd(0, tA, tB0);                               \
    _tile_dpbusd(1, tA, tB1);                               \
  } while (0)

alignas(64) const int8_t kZeroTile[1024] = {};  // the second tile of a pair past the last output tile

constexpr int64_t kAmxRows = 8;  // rows of x an A tile holds (with their lo rows: 16)
constexpr int64_t kAmxAhead = 16;  // weight tiles a stream is fetched ahead

// q (out, in) int8 -> (ceil(out / 16), ceil(in / 64), 1024): tile (b, c) row kk holds inputs
// c 64 + 4 kk .. + 3 of outputs b 16 .. + 15, four bytes an output (TDPBUSD's B layout);
// zero past the weight's edges.
at::Tensor amx_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "amx_pack takes contiguous int8 (out, in)");
  const int64_t outs = q.size(0), n = q.size(1), nb = (outs + 15) / 16, kb = (n + 63) / 64;
  at::Tensor tiles = at::zeros({nb, kb, 1024}, q.options());
  const int8_t* w = q.const_data_ptr<int8_t>();
  int8_t* t = tiles.mutable_data_ptr<int8_t>();
  parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < kb; ++c)
        for (int64_t kk = 0; kk < 16; ++kk)
          for (int64_t o = 0; o < 16 && b * 16 + o < outs; ++o)
            for (int64_t i = 0; i < 4 && c * 64 + 4 * kk + i < n; ++i)
              t[(b * kb + c) * 1024 + kk * 64 + o * 4 + i] = w[(b * 16 + o) * n + c * 64 + 4 * kk + i];
  });
  return tiles;
}

// y = x W^T + b for tiles (nb, kb, 1024) of W (outs, n): rows of x in groups of kAmxRows, each
// group's hi and lo rows one A buffer (2 rt x kb 64 bytes); pairs of output tiles over threads.
void amx_linear(const at::Tensor& tiles, const QuantizedRows& x, int64_t rows, int64_t n, int64_t outs,
                const float* scale, const int32_t* rowsum, const float* bias, float* Y) {
  const int64_t nb = tiles.size(0), kb = tiles.size(1), stride = kb * 64, groups = (rows + kAmxRows - 1) / kAmxRows;
  std::vector<uint8_t> a(groups * 2 * kAmxRows * stride, 128);  // 128: the unsigned zero (the weights there are 0)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * kAmxRows, rt = std::min(kAmxRows, rows - r0);
    uint8_t* ag = a.data() + g * 2 * kAmxRows * stride;
    for (int64_t r = 0; r < rt; ++r) {
      std::copy_n(x.hi.data() + (r0 + r) * n, n, ag + r * stride);
      std::copy_n(x.lo.data() + (r0 + r) * n, n, ag + (rt + r) * stride);
    }
  }
  const int8_t* T = tiles.const_data_ptr<int8_t>();
  parallel_for(0, (nb + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t c[2][16 * 16];
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * kAmxRows;
      const int rt = static_cast<int>(std::min(kAmxRows, rows - r0));
      configure_tiles(rt);
      const uint8_t* ag = a.data() + g * 2 * kAmxRows * stride;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = 2 * p;
        const bool two = b + 1 < nb;
        const int8_t* t0 = T + b * kb * 1024;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < kb; ++k) {
          if (g == 0)  // both streams' tiles kAmxAhead on (past a row's end: the next pair's)
            for (int64_t line = 0; line < 1024; line += 64) {
              __builtin_prefetch(t0 + (k + kAmxAhead) * 1024 + line, 0, 3);
              __builtin_prefetch(t0 + (kb + k + kAmxAhead) * 1024 + line, 0, 3);
            }
          const int8_t* w1 = two ? t0 + (kb + k) * 1024 : kZeroTile;
          if (k % 2 == 0) {
            KVBLEND_AMX_COLUMN(2, 3, 4, ag + k * 64, stride, t0 + k * 1024, w1);
          } else {
            KVBLEND_AMX_COLUMN(5, 6, 7, ag + k * 64, stride, t0 + k * 1024, w1);
          }
        }
        _tile_stored(0, c[0], 64);
        if (two) _tile_stored(1, c[1], 64);
        for (int half = 0; half < (two ? 2 : 1); ++half) {  // 16 outputs a vector, masked at the edge
          const int64_t j = (b + half) * 16;
          const __mmask16 m = static_cast<__mmask16>(outs - j >= 16 ? 0xFFFF : (1u << (outs - j)) - 1);
          const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, rowsum + j), 7);  // 128 sum(w)
          const __m512 sc = _mm512_maskz_loadu_ps(m, scale + j);
          const __m512 bi = bias ? _mm512_maskz_loadu_ps(m, bias + j) : _mm512_setzero_ps();
          for (int r = 0; r < rt; ++r) {
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c[half] + r * 16), offset));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c[half] + (rt + r) * 16), offset));
            const __m512 dot = _mm512_fmadd_ps(lo, _mm512_set1_ps(1.f / 254.f), hi);
            _mm512_mask_storeu_ps(Y + (r0 + r) * outs + j, m,
                                  _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.scale[r0 + r])), sc, bi));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif
#endif

#if !defined(KVBLEND_VNNI) && defined(__AVX2__) && defined(__FMA__)
#define KVBLEND_INT16 1
// Without VNNI (AVX2 hosts, AVX-512 without VNNI): each row of x as 16-bit integers over its
// max |x| (x = s q, |q| <= 32767: the error half a step, 1 / 65534 of the max), multiplied by
// vpmaddwd against the int8 weights widened to 16 bits. Widening int8 weights to float32 made
// a decode step compute-bound on a 2-core Zen 3 (AVX2): an int16 product pair costs one
// vpmaddwd where float32 cost two conversions and an FMA per eight. The sums are exact
// integers (int32 lanes over chunks of kInt16Chunk inputs, which cannot overflow: 256 pair
// sums of at most 2 x 128 x 32767 each, then int64), so a row's result is the same at any
// row count.
struct Int16Rows {
  std::vector<int16_t> q;
  std::vector<float> scale;
};

constexpr int64_t kInt16Chunk = 4096;  // inputs a lane sums in int32: 4096 / 16 = 256 pair sums

Int16Rows quantize_rows16(const float* X, int64_t rows, int64_t n) {
  Int16Rows out{std::vector<int16_t>(rows * n), std::vector<float>(rows)};
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * n;
    const float step = row_step(x, n, 32767.f);
    out.scale[r] = step;
    int16_t* q = out.q.data() + r * n;
    if (!(step > 0.f)) {  // zeros (or NaN): every input taken as 0, the scale carries a NaN to the outputs
      std::fill_n(q, n, int16_t{0});
      continue;
    }
    const float inv = 1.f / step;
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv), kNearest));
      const __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv), kNearest));
      // packs works within 128-bit halves (a0-3 b0-3 a4-7 b4-7): the 64-bit quarters put back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    for (; k < n; ++k) q[k] = static_cast<int16_t>(std::clamp(std::lrint(x[k] * inv), -32767L, 32767L));
  }
  return out;
}

// The eight int32 lanes of a summed in int64.
inline int64_t hsum_epi64(__m256i a) {
  const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                        _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
  const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  return _mm_cvtsi128_si64(half) + _mm_extract_epi64(half, 1);
}

// Weight rows as the int16 kernels read them: row-major q (out, in), or int16_pack's tiles,
// where a tile's four rows' 16 inputs lie in one 64-byte line, so a tile streams as one run
// of lines (the row-major rows were four short streams that the hardware prefetcher followed
// late: SmolLM2's gate|up at one row, weights from memory, 97 -> 67 us in a one-off C++ probe).
struct RowMajor {
  static const int8_t* at(const int8_t* w, int64_t n, int j, int64_t k) { return w + j * n + k; }
  template <int kJ>
  static void prefetch(const int8_t* w, int64_t n, int64_t k) {  // the same inputs two tiles on
#pragma GCC unroll 4
    for (int j = 0; j < kJ; ++j) __builtin_prefetch(w + (j + 2 * kJ) * n + k, 0, 3);
  }
};
struct Tiled {  // w: a tile's first line; only kJ = 4
  static const int8_t* at(const int8_t* w, int64_t, int j, int64_t k) {  // k >= 0: unsigned, so / and % are a shift and a mask
    const uint64_t u = static_cast<uint64_t>(k);
    return w + 64 * (u / 16) + 16 * j + u % 16;
  }
  template <int kJ>
  static void prefetch(const int8_t* w, int64_t, int64_t k) { __builtin_prefetch(w + 4 * k + 1024, 0, 3); }  // 16 lines on
};

// One 16-input step of kJ weight rows against kR input rows into acc (int32 pair sums).
template <class L, int kJ, int kR>
__attribute__((always_inline)) inline void int16_step(const int8_t* w, const int16_t* x, int64_t n, int64_t k,
                                                      __m256i (&acc)[kJ][kR]) {
  __m256i xv[kR];
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * n + k));
#pragma GCC unroll 4
  for (int j = 0; j < kJ; ++j) {
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(L::at(w, n, j, k))));
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) acc[j][r] = _mm256_add_epi32(acc[j][r], _mm256_madd_epi16(wv, xv[r]));
  }
}

// kJ weight rows (from w, laid out as L) against kR input rows (x, stride n) over inputs
// [k0, k1), at most kInt16Chunk of them, added to dot[j * kR + r] exactly; each widened weight
// vector serves every input row, the weights ahead prefetched where `prefetch`.
template <class L, int kJ, int kR>
inline void int16_chunk(const int8_t* w, const int16_t* x, int64_t n, int64_t k0, int64_t k1, int64_t* dot,
                        bool prefetch) {
  __m256i acc[kJ][kR];
#pragma GCC unroll 4
  for (int j = 0; j < kJ; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) acc[j][r] = _mm256_setzero_si256();
  int64_t k = k0;
  if (prefetch) {
    for (; k + 16 <= k1; k += 16) {
      L::template prefetch<kJ>(w, n, k);
      int16_step<L, kJ, kR>(w, x, n, k, acc);
    }
  }
  for (; k + 16 <= k1; k += 16) int16_step<L, kJ, kR>(w, x, n, k, acc);
  for (int j = 0; j < kJ; ++j)
    for (int r = 0; r < kR; ++r) {
      int64_t s = hsum_epi64(acc[j][r]);
      for (int64_t kk = k; kk < k1; ++kk) s += static_cast<int64_t>(*L::at(w, n, j, kk)) * x[r * n + kk];  // the tail
      dot[j * kR + r] += s;
    }
}

// kJ weight rows against kR input rows: dot[j * kR + r], the exact integer dot products.
template <class L, int kJ, int kR>
inline void int16_tile(const int8_t* w, const int16_t* x, int64_t n, int64_t* dot, bool prefetch) {
  for (int i = 0; i < kJ * kR; ++i) dot[i] = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kInt16Chunk)
    int16_chunk<L, kJ, kR>(w, x, n, c0, std::min(n, c0 + kInt16Chunk), dot, prefetch);
}

constexpr int kInt16Rows = 4;  // weight rows a tile takes
constexpr int kInt16Inputs = 2;  // input rows a tile takes

// kJ weight rows from j (their first at w) against every input row, into Y (rows past outs skipped).
template <class L, int kJ>
void int16_weight_rows(const int8_t* w, const Int16Rows& x, int64_t rows, int64_t n, int64_t outs, int64_t j,
                       int64_t j1, const float* scale, const float* bias, float* Y) {
  int64_t dot[kJ * kInt16Inputs];
  const int jt = static_cast<int>(std::min<int64_t>(kJ, j1 - j));  // rows from j1 on are another piece's
  for (int64_t r0 = 0; r0 < rows; r0 += kInt16Inputs) {
    const int rt = static_cast<int>(std::min<int64_t>(kInt16Inputs, rows - r0));
    const int16_t* xq = x.q.data() + r0 * n;
    if (rt == 1) {
      int16_tile<L, kJ, 1>(w, xq, n, dot, r0 == 0);
    } else {
      int16_tile<L, kJ, kInt16Inputs>(w, xq, n, dot, r0 == 0);
    }
    for (int jj = 0; jj < jt; ++jj)
      for (int r = 0; r < rt; ++r)
        Y[(r0 + r) * outs + j + jj] = std::fma(static_cast<float>(dot[jj * rt + r]) * x.scale[r0 + r], scale[j + jj],
                                               bias ? bias[j + jj] : 0.f);
  }
}

// y[r, j] for weight rows [j0, j1) and every row r: from int16_pack's tiles where given (j0
// a whole tile), else from row-major W.
void int16_rows(const int8_t* W, const int8_t* tiles, const Int16Rows& x, int64_t rows, int64_t n, int64_t outs,
                int64_t j0, int64_t j1, const float* scale, const float* bias, float* Y) {
  int64_t j = j0;
  if (tiles) {
    for (; j < j1; j += kInt16Rows) int16_weight_rows<Tiled, kInt16Rows>(tiles + j * n, x, rows, n, outs, j, j1, scale, bias, Y);
    return;
  }
  for (; j + kInt16Rows <= j1; j += kInt16Rows)
    int16_weight_rows<RowMajor, kInt16Rows>(W + j * n, x, rows, n, outs, j, j1, scale, bias, Y);
  for (; j < j1; ++j) int16_weight_rows<RowMajor, 1>(W + j * n, x, rows, n, outs, j, j1, scale, bias, Y);
}

// q (out, in) int8, in a multiple of 16 -> (ceil(out / 4), in / 16, 64): tile b's line c holds
// inputs 16 c .. 16 c + 15 of outputs 4 b .. 4 b + 3, 16 bytes an output; zero past out.
at::Tensor int16_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) % 16 == 0,
              "int16_pack takes contiguous int8 (out, in) with in a multiple of 16");
  const int64_t outs = q.size(0), n = q.size(1), nb = (outs + kInt16Rows - 1) / kInt16Rows, kb = n / 16;
  at::Tensor tiles = at::zeros({nb, kb, 64}, q.options());
  const int8_t* w = q.const_data_ptr<int8_t>();
  int8_t* t = tiles.mutable_data_ptr<int8_t>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t o = 0; o < kInt16Rows && b * kInt16Rows + o < outs; ++o)
      for (int64_t c = 0; c < kb; ++c)
        std::copy_n(w + (b * kInt16Rows + o) * n + 16 * c, 16, t + (b * kb + c) * 64 + 16 * o);
  return tiles;
}
#endif

// The largest error of an activation int8_linear multiplies, relative to its row's max |x|:
// half a step of the lo row, 1 / (127 * 254 * 2), on the VNNI path; half a step of the 16-bit
// row, 1 / 65534, on the AVX2 path; 0 (float32) otherwise.
double activation_error() {
#if defined(KVBLEND_VNNI)
  return 1.0 / (127.0 * 254.0 * 2.0);
#elif defined(KVBLEND_INT16)
  return 1.0 / (32767.0 * 2.0);
#else
  return 0.0;
#endif
}

// The layout int8_linear takes `tiles` in here: "amx" (amx_pack's: built with AMX and granted
// the tiles), "int16" (int16_pack's) or "" (none: q only).
std::string tiles_kind() {
#ifdef KVBLEND_AMX
  if (amx_granted()) return "amx";
#endif
#ifdef KVBLEND_INT16
  return "int16";
#else
  return "";
#endif
}

// Whether int8_linear takes amx_pack's tiles here: built with AMX and granted the tiles.
bool amx_available() {
#ifdef KVBLEND_AMX
  return amx_granted();
#else
  return false;
#endif
}

constexpr int64_t kAmxMinRows = 1;  // every row count: since the VNNI loop reduces exact int32 sums (for batch invariance) it is
                                     // 3-6 % slower than AMX at one row and 15-25 % at two or three (SmolLM2 shapes)

// y (R, out) = x (R, in) W^T + bias for W as int8 q (out, in) with one float32 scale per
// output row (rowsum: each row's sum); with amx_pack's tiles of q (where amx_available),
// kAmxMinRows rows or more are multiplied by them; on the AVX2 path, with int16_pack's tiles
// (tiles_kind), every row count.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& rowsum,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "int8_linear takes a 2-d float32 CPU input");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear's weight must be contiguous int8 (out, in) with in = ", x.size(1));
  const int64_t rows = x.size(0), n = x.size(1), outs = q.size(0);
  const bool tiled = tiles.has_value() && tiles->defined();
#ifdef KVBLEND_INT16
  TORCH_CHECK(!tiled || (tiles->dim() == 3 && tiles->scalar_type() == at::kChar && tiles->is_contiguous() &&
                         tiles->size(0) == (outs + kInt16Rows - 1) / kInt16Rows && tiles->size(1) * 16 == n &&
                         tiles->size(2) == 64),
              "int8_linear's tiles must be int16_pack's of its weight");
#else
  TORCH_CHECK(!tiled || (tiles->dim() == 3 && tiles->scalar_type() == at::kChar && tiles->is_contiguous() &&
                         tiles->size(0) == (outs + 15) / 16 && tiles->size(1) == (n + 63) / 64 && tiles->size(2) == 1024),
              "int8_linear's tiles must be amx_pack's of its weight");
  TORCH_CHECK(!tiled || amx_available(), "int8_linear got AMX tiles on a build or process without AMX");
#endif
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
#ifdef KVBLEND_AMX
  if (tiled && rows >= kAmxMinRows) {
    amx_linear(*tiles, xq, rows, n, outs, s, sums, b, Y);
    return y;
  }
#endif
  // split at whole tiles (each output's sums are exact integers, so this is for the tiles' speed)
  parallel_for(0, (outs + kVnniRows - 1) / kVnniRows, 16, [&](int64_t first, int64_t end) {
    vnni_rows(W, xq, rows, n, outs, first * kVnniRows, std::min(outs, end * kVnniRows), s, sums, b, Y);
  });
#elif defined(KVBLEND_INT16)
  const Int16Rows xq = quantize_rows16(X, rows, n);
  const int8_t* T = tiled ? tiles->const_data_ptr<int8_t>() : nullptr;
  parallel_for(0, (outs + kInt16Rows - 1) / kInt16Rows, 16, [&](int64_t first, int64_t end) {
    int16_rows(W, T, xq, rows, n, outs, first * kInt16Rows, std::min(outs, end * kInt16Rows), s, b, Y);
  });
#else
  const int64_t whole = outs / kTileRows;  // the last outs % kTileRows rows one at a time below
  parallel_for(0, whole, 16, [&](int64_t first, int64_t end) {
    // one row too through the tiles: an output's sum order is then the same at any row count
    for (int64_t t = first; t < end; ++t) weight_tile(W, X, rows, n, outs, t * kTileRows, s, b, Y);
  });
  for (int64_t j = whole * kTileRows; j < outs; ++j)
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
                          const at::Tensor& qkv_scale, const at::Tensor& qkv_rowsum, const std::optional<at::Tensor>& qkv_tiles,
                          const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                          const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, bool interleaved,
                          const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                          double q_mult) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_project takes a 2-d float32 h");
  const int64_t rows = h.size(0), width = (heads + 2 * kv_heads) * head_dim, half = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && sin.sizes() == cos.sizes() && 2 * half <= head_dim &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be float32 (R, rotary_dim / 2) with rotary_dim <= head_dim");
  TORCH_CHECK(qkv.size(0) == width, "the q|k|v weight has ", qkv.size(0), " outputs, expected ", width);
  at::Tensor y = int8_linear(rms_norm_rows(h, norm_w, eps), qkv, qkv_scale, qkv_rowsum, bias, qkv_tiles);
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
                         const at::Tensor& o_rowsum, const std::optional<at::Tensor>& o_tiles, const std::optional<at::Tensor>& o_bias,
                         const std::optional<at::Tensor>& attn_out_norm, const at::Tensor& post_norm_w, double eps,
                         const at::Tensor& gate_up, const at::Tensor& gate_up_scale, const at::Tensor& gate_up_rowsum,
                         const std::optional<at::Tensor>& gate_up_tiles, const std::optional<at::Tensor>& gate_up_bias,
                         const at::Tensor& down, const at::Tensor& down_scale, const at::Tensor& down_rowsum,
                         const std::optional<at::Tensor>& down_tiles, const std::optional<at::Tensor>& down_bias, const std::optional<at::Tensor>& mlp_out_norm,
                         bool gelu) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_finish takes a 2-d float32 h");
  const int64_t rows = h.size(0), dim = h.size(1);
  TORCH_CHECK(o.size(0) == dim && down.size(0) == dim && gate_up.size(0) == 2 * down.size(1),
              "decode_finish's weights do not fit a hidden size of ", dim);
  const float e = static_cast<float>(eps);
  at::Tensor out = int8_linear(attn, o, o_scale, o_rowsum, o_bias, o_tiles);  // (R, D): becomes the new h
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
                                    gate_up_bias, gate_up_tiles);
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
  at::Tensor d = int8_linear(act, down, down_scale, down_rowsum, down_bias, down_tiles);  // (R, D)
  float* dd = d.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = dd + r * dim;
    if (mn) rms_norm_row(row, mn, e, dim, row);
    float* target = hn + r * dim;
    for (int64_t j = 0; j < dim; ++j) target[j] += row[j];
  }
  return out;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// kLanes cached keys or values as float32: float32 as they are, float16 widened.
inline Vec kvload(const float* p) { return vload(p); }
inline Vec kvload(const at::Half* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float wide[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) wide[i] = static_cast<float>(p[i]);
  return vload(wide);
#endif
}
#endif

// sum_j a[j] b[j] over n entries (b float32, or float16 cached keys).
template <typename T>
inline float dot_f32(const float* a, const T* b, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc = vzero();
  for (; j + kLanes <= n; j += kLanes) acc = vfma(vload(a + j), kvload(b + j), acc);
  s = vsum(acc);
#endif
  for (; j < n; ++j) s += a[j] * static_cast<float>(b[j]);
  return s;
}

// y[j] += p x[j] over n entries (x float32, or float16 cached values).
template <typename T>
inline void axpy_f32(float p, const T* x, float* y, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const Vec pv = vset(p);
  for (; j + kLanes <= n; j += kLanes) vstore(y + j, vfma(pv, kvload(x + j), vload(y + j)));
#endif
  for (; j < n; ++j) y[j] += p * static_cast<float>(x[j]);
}

// The largest of n floats (n >= 1).
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float top = x[0];
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (n >= kLanes) {
    Vec m = vload(x);
    for (i = kLanes; i + kLanes <= n; i += kLanes) m = vmax(m, vload(x + i));
    top = vhmax(m);
  }
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
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

// Keys (and values) a chunk's loops fetch ahead of the one they read.
constexpr int64_t kFetchAhead = 8;

// A row of d entries fetched towards L1 (near) or L2, a cache line at a time.
template <typename T>
inline void prefetch_row(const T* p, int64_t d, bool near) {
  for (int64_t j = 0; j < d; j += 64 / static_cast<int64_t>(sizeof(T)))
    near ? __builtin_prefetch(p + j, 0, 3) : __builtin_prefetch(p + j, 0, 2);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Scores of kH query heads (q, stride d) against keys i..i+3 (k0, stride ks), scaled: each
// key vector loaded (and widened) once for the kH heads, the four keys' sums reduced together.
template <int kH, typename T>
inline void scores_quad(const float* q, const T* k0, int64_t ks, int64_t d, __m128 scale, float* s) {
  Vec acc[kH][4];
  for (int h = 0; h < kH; ++h)
    for (int r = 0; r < 4; ++r) acc[h][r] = vzero();
  for (int64_t j = 0; j < d; j += kLanes) {
    const Vec k[4] = {kvload(k0 + j), kvload(k0 + ks + j), kvload(k0 + 2 * ks + j), kvload(k0 + 3 * ks + j)};
    for (int h = 0; h < kH; ++h) {
      const Vec qv = vload(q + h * d + j);
      for (int r = 0; r < 4; ++r) acc[h][r] = vfma(qv, k[r], acc[h][r]);
    }
  }
  for (int h = 0; h < kH; ++h)
    _mm_storeu_ps(s + h * kKeyChunk, _mm_mul_ps(vsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), scale));
}
#endif

// s[h * kKeyChunk + i] = scale q_h . k_i for `group` query heads (q, stride d) and len keys
// (k, key stride ks); four keys at a time for up to four heads (scores_quad). The chunk's
// values (v, stride vs) are fetched towards L2 meanwhile, for chunk_values.
template <typename T>
void chunk_scores(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t len, int64_t group,
                  int64_t d, float scale, float* s) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (d % kLanes == 0) {
    const __m128 sc = _mm_set1_ps(scale);
    for (; i + 4 <= len; i += 4) {
      for (int64_t r = 0; r < 4; ++r) {
        prefetch_row(k + (i + r + kFetchAhead) * ks, d, true);
        prefetch_row(v + (i + r) * vs, d, false);
      }
      for (int64_t h0 = 0; h0 < group; h0 += 4) {
        const float* qh = q + h0 * d;
        float* sh = s + h0 * kKeyChunk + i;
        switch (std::min<int64_t>(4, group - h0)) {
          case 1: scores_quad<1>(qh, k + i * ks, ks, d, sc, sh); break;
          case 2: scores_quad<2>(qh, k + i * ks, ks, d, sc, sh); break;
          case 3: scores_quad<3>(qh, k + i * ks, ks, d, sc, sh); break;
          default: scores_quad<4>(qh, k + i * ks, ks, d, sc, sh); break;
        }
      }
    }
  }
#endif
  for (; i < len; ++i)
    for (int64_t h = 0; h < group; ++h) s[h * kKeyChunk + i] = dot_f32(q + h * d, k + i * ks, d) * scale;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// kH heads' weighted sums of len values (v, stride vs) over kV vectors of d from j: out[h d
// + j ...] = sum_i p[h kKeyChunk + i] v_i[j ...], held in registers across the keys.
template <int kH, int kV, typename T>
void values_block(const float* p, const T* v, int64_t vs, int64_t len, int64_t d, int64_t j, float* out) {
  Vec acc[kH][kV];
  for (int h = 0; h < kH; ++h)
    for (int x = 0; x < kV; ++x) acc[h][x] = vzero();
  for (int64_t i = 0; i < len; ++i) {
    const T* vi = v + i * vs + j;
    __builtin_prefetch(vi + kFetchAhead * vs, 0, 3);
    Vec vv[kV];
    for (int x = 0; x < kV; ++x) vv[x] = kvload(vi + x * kLanes);
    for (int h = 0; h < kH; ++h) {
      const Vec ph = vset(p[h * kKeyChunk + i]);
      for (int x = 0; x < kV; ++x) acc[h][x] = vfma(ph, vv[x], acc[h][x]);
    }
  }
  for (int h = 0; h < kH; ++h)
    for (int x = 0; x < kV; ++x) vstore(out + h * d + j + x * kLanes, acc[h][x]);
}

constexpr int kValueVecs = kLanes == 16 ? 4 : 2;  // vectors of d a block holds per head (registers: AVX2 has 16)

template <int kH, typename T>
void values_heads(const float* p, const T* v, int64_t vs, int64_t len, int64_t d, float* out) {
  int64_t j = 0;
  for (; j + kValueVecs * kLanes <= d; j += kValueVecs * kLanes) values_block<kH, kValueVecs, T>(p, v, vs, len, d, j, out);
  for (; j < d; j += kLanes) values_block<kH, 1, T>(p, v, vs, len, d, j, out);
}
#endif

// out[h d ...] = sum_i p[h kKeyChunk + i] v_i for `group` heads over len values (v, stride vs).
template <typename T>
void chunk_values(const float* p, const T* v, int64_t vs, int64_t len, int64_t group, int64_t d, float* out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (d % kLanes == 0) {
    for (int64_t h0 = 0; h0 < group; h0 += 4) {  // heads four at a time: their sums stay in registers
      const float* ph = p + h0 * kKeyChunk;
      float* oh = out + h0 * d;
      switch (std::min<int64_t>(4, group - h0)) {
        case 1: values_heads<1, T>(ph, v, vs, len, d, oh); break;
        case 2: values_heads<2, T>(ph, v, vs, len, d, oh); break;
        case 3: values_heads<3, T>(ph, v, vs, len, d, oh); break;
        default: values_heads<4, T>(ph, v, vs, len, d, oh); break;
      }
    }
    return;
  }
#endif
  std::fill_n(out, group * d, 0.f);
  for (int64_t i = 0; i < len; ++i)
    for (int64_t h = 0; h < group; ++h) axpy_f32(p[h * kKeyChunk + i], v + i * vs, out + h * d, d);
}

// One row's attention: its query heads (heads x d, contiguous) against n keys and values
// (per KV head, keys `key_stride` apart from `kv_head_stride` apart bases), into out (heads x d).
template <typename T>
struct AttendJob {
  const float* q;
  const T* k;
  const T* v;
  int64_t n, kv_head_stride_k, key_stride_k, kv_head_stride_v, key_stride_v;
  float* out;
};

// Every job's attention (scores scaled by 1/sqrt(d), every key visible; query head h reads KV
// head h / (heads / kv_heads)). Tasks are (job, KV head, chunk of keys), split over threads:
// each key and value is read once for the query heads that share it, and a job's chunks'
// partial softmaxes are merged by their maxima and sums.
template <typename T>
void attend_jobs(const std::vector<AttendJob<T>>& jobs, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> first_task(jobs.size() + 1, 0), chunks(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    chunks[j] = (jobs[j].n + kKeyChunk - 1) / kKeyChunk;
    first_task[j + 1] = first_task[j] + kv_heads * chunks[j];
  }
  const int64_t tasks = first_task.back();
  // per (task, head of its group): the chunk's max score, sum of exps and unnormalised output
  std::vector<float> top(tasks * group), total(top.size()), part(top.size() * d);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  parallel_for(0, tasks, 1, [&](int64_t first, int64_t end) {
    std::vector<float> scores(group * kKeyChunk);
    size_t j = std::upper_bound(first_task.begin(), first_task.end(), first) - first_task.begin() - 1;
    for (int64_t t = first; t < end; ++t) {
      while (t >= first_task[j + 1]) ++j;
      const AttendJob<T>& job = jobs[j];
      const int64_t local = t - first_task[j], g = local / chunks[j], i0 = (local % chunks[j]) * kKeyChunk;
      const int64_t len = std::min(kKeyChunk, job.n - i0);
      const T* kg = job.k + g * job.kv_head_stride_k + i0 * job.key_stride_k;
      const T* vg = job.v + g * job.kv_head_stride_v + i0 * job.key_stride_v;
      const float* q = job.q + g * group * d;
      chunk_scores(q, kg, job.key_stride_k, vg, job.key_stride_v, len, group, d, scale, scores.data());
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * kKeyChunk;
        const float m = max_of(sh, len);
        top[t * group + h] = m;
        total[t * group + h] = exp_shifted(sh, len, m);
      }
      chunk_values(scores.data(), vg, job.key_stride_v, len, group, d, part.data() + t * group * d);
    }
  });
  parallel_for(0, static_cast<int64_t>(jobs.size()) * kv_heads, 4, [&](int64_t first, int64_t end) {
    for (int64_t jg = first; jg < end; ++jg) {
      const int64_t j = jg / kv_heads, g = jg % kv_heads;
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
  });
}

// Several decode rows at once, each of its own cache: qkv (R, (Hq + 2 Hkv) d) as decode_project
// returns it; row r's K and V are written at slots[r] of k_caches[r]/v_caches[r] (Hkv,
// capacity, d), and its queries attend over slots firsts[r]..slots[r]. With float16 copies
// of the caches (k_halves/v_halves, as many slots or more; none: attend over float32), the
// row attends over its copy instead: slots synced[r]..slots[r]-1 are first converted from
// float32 (the copy holds the slots below synced[r] already), and slots[r] is written to both
// (a step then reads half the bytes; models/kv_cache.py KVCache.decode_half keeps them).
// Returns (R, Hq d).
at::Tensor decode_attend_rows(const at::Tensor& qkv, at::TensorList k_caches, at::TensorList v_caches,
                              at::TensorList k_halves, at::TensorList v_halves, at::IntArrayRef synced,
                              at::IntArrayRef slots, at::IntArrayRef firsts, int64_t heads, int64_t kv_heads,
                              int64_t head_dim) {
  const int64_t rows = qkv.size(0), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == width && qkv.scalar_type() == at::kFloat,
              "decode_attend_rows takes decode_project's contiguous float32 (R, (Hq + 2 Hkv) d)");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == rows && static_cast<int64_t>(v_caches.size()) == rows &&
                  static_cast<int64_t>(slots.size()) == rows && static_cast<int64_t>(firsts.size()) == rows,
              "decode_attend_rows takes one cache, slot and first slot per row");
  const bool half = !k_halves.empty();
  TORCH_CHECK(!half || (static_cast<int64_t>(k_halves.size()) == rows &&
                        static_cast<int64_t>(v_halves.size()) == rows && static_cast<int64_t>(synced.size()) == rows),
              "decode_attend_rows takes float16 copies and their synced slots for every row or for none");
  TORCH_CHECK(heads % kv_heads == 0, "decode_attend_rows needs whole groups of query heads");
  const float* in = qkv.const_data_ptr<float>();
  at::Tensor result = at::empty({rows, heads * head_dim}, qkv.options());
  std::vector<AttendJob<float>> jobs;
  std::vector<AttendJob<at::Half>> half_jobs;
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
    float* out = result.mutable_data_ptr<float>() + r * heads * head_dim;
    if (!half) {
      jobs.push_back(AttendJob<float>{row, K + firsts[r] * kc.stride(1), V + firsts[r] * vc.stride(1),
                                      slots[r] + 1 - firsts[r], kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                                      out});
      continue;
    }
    const at::Tensor& kh = k_halves[r];
    const at::Tensor& vh = v_halves[r];
    TORCH_CHECK(kh.dim() == 3 && kh.sizes() == vh.sizes() && kh.size(0) == kv_heads && kh.size(2) == head_dim &&
                    kh.size(1) > slots[r] && kh.scalar_type() == at::kHalf && vh.scalar_type() == at::kHalf &&
                    kh.stride(2) == 1 && vh.stride(2) == 1,
                "decode_attend_rows' float16 copies must be float16 (Hkv, capacity, head_dim) holding the row's slot");
    TORCH_CHECK(0 <= synced[r] && synced[r] <= slots[r], "a row's synced slots lie past its slot");
    if (synced[r] < slots[r]) {  // the float32 slots the copy lacks
      kh.slice(1, synced[r], slots[r]).copy_(kc.slice(1, synced[r], slots[r]));
      vh.slice(1, synced[r], slots[r]).copy_(vc.slice(1, synced[r], slots[r]));
    }
    at::Half* KH = kh.mutable_data_ptr<at::Half>();
    at::Half* VH = vh.mutable_data_ptr<at::Half>();
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t j = 0; j < head_dim; ++j) {
        KH[g * kh.stride(0) + slots[r] * kh.stride(1) + j] = static_cast<at::Half>(row[(heads + g) * head_dim + j]);
        VH[g * vh.stride(0) + slots[r] * vh.stride(1) + j] =
            static_cast<at::Half>(row[(heads + kv_heads + g) * head_dim + j]);
      }
    half_jobs.push_back(AttendJob<at::Half>{row, KH + firsts[r] * kh.stride(1), VH + firsts[r] * vh.stride(1),
                                            slots[r] + 1 - firsts[r], kh.stride(0), kh.stride(1), vh.stride(0),
                                            vh.stride(1), out});
  }
  if (half) {
    attend_jobs(half_jobs, heads, kv_heads, head_dim);
  } else {
    attend_jobs(jobs, heads, kv_heads, head_dim);
  }
  return result;
}

// The weights decode_layer takes, in this order (models/transformer.py DecoderLayer.native_weights).
enum LayerWeight {
  kInputNorm, kQkv, kQkvScale, kQkvRowsum, kQkvBias, kQNorm, kKNorm, kO, kOScale, kORowsum, kOBias, kAttnOutNorm,
  kPostNorm, kGateUp, kGateUpScale, kGateUpRowsum, kGateUpBias, kDown, kDownScale, kDownRowsum, kDownBias,
  kMlpOutNorm, kQkvTiles, kOTiles, kGateUpTiles, kDownTiles, kLayerWeights
};

// One decode step of a decoder layer for decode rows h (R, D), row r at slot slots[r] of its
// own cache k_caches[r]/v_caches[r] (Hkv, capacity, d): project, write each row's K and V at
// its slot, attend over slots firsts[r]..slots[r] (over float16 copies where given, synced as
// in decode_attend_rows), finish. Returns the new h (R, D).
at::Tensor decode_layer(const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
                        const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                        at::TensorList k_halves, at::TensorList v_halves, at::IntArrayRef synced,
                        at::IntArrayRef slots, at::IntArrayRef firsts, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, bool interleaved, double eps, double q_mult, bool gelu) {
  TORCH_CHECK(weights.size() == kLayerWeights, "decode_layer takes ", static_cast<int>(kLayerWeights), " weights");
  TORCH_CHECK(h.dim() == 2, "decode_layer takes rows (R, D)");
  auto w = [&](LayerWeight i) -> std::optional<at::Tensor> { return weights.get(i); };
  const at::Tensor qkv = decode_project(h, *w(kInputNorm), eps, *w(kQkv), *w(kQkvScale), *w(kQkvRowsum), w(kQkvTiles),
                                        w(kQkvBias), cos, sin, heads, kv_heads, head_dim, interleaved, w(kQNorm),
                                        w(kKNorm), q_mult);
  const at::Tensor attn = decode_attend_rows(qkv, k_caches, v_caches, k_halves, v_halves, synced, slots, firsts, heads,
                                             kv_heads, head_dim);
  return decode_finish(h, attn, *w(kO), *w(kOScale), *w(kORowsum), w(kOTiles), w(kOBias), w(kAttnOutNorm), *w(kPostNorm),
                       eps, *w(kGateUp), *w(kGateUpScale), *w(kGateUpRowsum), w(kGateUpTiles), w(kGateUpBias), *w(kDown),
                       *w(kDownScale), *w(kDownRowsum), w(kDownTiles), w(kDownBias), w(kMlpOutNorm), gelu);
}

// Every layer of one decode step in one call (the weights and lists of decode_layer, laid end
// to end: a step then pays the arguments' conversion and the Python around a call once, not
// once a layer). Layer l's weights are weights[l * kLayerWeights, (l + 1) * kLayerWeights), its
// rotary tables cos[l]/sin[l]; row r's buffers, copies, synced slots and first slots are the
// lists' entries l * R + r (R = slots.size()); the copies are given for every layer or none.
// Returns the last layer's h (R, D).
at::Tensor decode_layers(const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
                         at::TensorList cos, at::TensorList sin, at::TensorList k_caches, at::TensorList v_caches,
                         at::TensorList k_halves, at::TensorList v_halves, at::IntArrayRef synced,
                         at::IntArrayRef slots, at::IntArrayRef firsts, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, bool interleaved, double eps, double q_mult, bool gelu) {
  const int64_t layers = static_cast<int64_t>(cos.size()), rows = static_cast<int64_t>(slots.size());
  const bool half = !k_halves.empty();
  TORCH_CHECK(static_cast<int64_t>(sin.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kLayerWeights,
              "decode_layers takes one rotary table pair and ", static_cast<int>(kLayerWeights), " weights a layer");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers * rows &&
                  static_cast<int64_t>(v_caches.size()) == layers * rows &&
                  static_cast<int64_t>(firsts.size()) == layers * rows,
              "decode_layers takes one cache and first slot per layer and row");
  TORCH_CHECK(!half || (static_cast<int64_t>(k_halves.size()) == layers * rows &&
                        static_cast<int64_t>(v_halves.size()) == layers * rows &&
                        static_cast<int64_t>(synced.size()) == layers * rows),
              "decode_layers takes float16 copies and their synced slots per layer and row, or none");
  at::Tensor out = h;
  c10::List<std::optional<at::Tensor>> w;
  w.reserve(kLayerWeights);
  for (int64_t l = 0; l < layers; ++l) {
    w.clear();
    for (int64_t i = 0; i < kLayerWeights; ++i) w.push_back(weights.get(l * kLayerWeights + i));
    const auto layer_part = [&](at::TensorList list) { return half ? list.slice(l * rows, rows) : list; };
    out = decode_layer(out, w, cos[l], sin[l], k_caches.slice(l * rows, rows), v_caches.slice(l * rows, rows),
                       layer_part(k_halves), layer_part(v_halves), half ? synced.slice(l * rows, rows) : synced, slots,
                       firsts.slice(l * rows, rows), heads, kv_heads, head_dim, interleaved, eps, q_mult, gelu);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvblend_packed, m) {
  m.def("simd_lanes() -> int", &simd_lanes);
  m.def("activation_error() -> float", &activation_error);
  m.def("tiles_kind() -> str", &tiles_kind);
#ifdef KVBLEND_INT16
  m.def("int16_pack(Tensor q) -> Tensor", &int16_pack);
#endif
#ifdef KVBLEND_AMX
  m.def("amx_pack(Tensor q) -> Tensor", &amx_pack);
#endif
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor rowsum, Tensor? bias, Tensor? tiles=None) -> Tensor",
        &int8_linear);
  m.def("decode_layer(Tensor h, Tensor?[] weights, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor(c!)[] k_halves, Tensor(d!)[] v_halves, int[] synced, int[] slots, int[] firsts, "
        "int heads, int kv_heads, int head_dim, bool interleaved, float eps, float q_mult, bool gelu) -> Tensor",
        &decode_layer);
  m.def("decode_layers(Tensor h, Tensor?[] weights, Tensor[] cos, Tensor[] sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor(c!)[] k_halves, Tensor(d!)[] v_halves, int[] synced, int[] slots, int[] firsts, "
        "int heads, int kv_heads, int head_dim, bool interleaved, float eps, float q_mult, bool gelu) -> Tensor",
        &decode_layers);
  m.def("decode_attend_rows(Tensor qkv, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!)[] k_halves, "
        "Tensor(d!)[] v_halves, int[] synced, int[] slots, int[] firsts, int heads, int kv_heads, int head_dim) -> Tensor",
        &decode_attend_rows);
  m.def("decode_project(Tensor h, Tensor norm_w, float eps, Tensor qkv, Tensor qkv_scale, Tensor qkv_rowsum, "
        "Tensor? qkv_tiles, Tensor? bias, Tensor cos, "
        "Tensor sin, int heads, int kv_heads, int head_dim, bool interleaved, Tensor? q_norm, Tensor? k_norm, "
        "float q_mult) -> Tensor", &decode_project);
  m.def("decode_finish(Tensor h, Tensor attn, Tensor o, Tensor o_scale, Tensor o_rowsum, Tensor? o_tiles, "
        "Tensor? o_bias, Tensor? attn_out_norm, Tensor post_norm_w, float eps, Tensor gate_up, Tensor gate_up_scale, "
        "Tensor gate_up_rowsum, Tensor? gate_up_tiles, Tensor? gate_up_bias, Tensor down, Tensor down_scale, "
        "Tensor down_rowsum, Tensor? down_tiles, Tensor? down_bias, Tensor? mlp_out_norm, bool gelu) -> Tensor",
        &decode_finish);
}
