// x @ W.T for a weight W kept in llama.cpp's block-quantised formats, with float32 activations and sums;
// and the elementwise passes around such a matrix in a layer (its input's RMSNorm, the gated product).
//
// A GGUF checkpoint stores each row of a matrix in blocks of 32 weights: Q4_1 as a 4-bit code q, a scale d
// and an offset m per block (w = d * q + m, 5 bits a weight), Q8_0 as an 8-bit code and a scale (w = d * q,
// 8.5 bits). The engine used to dequantise them once into a float32 matrix, 6.4x (Q4_1) the bytes, and a
// decode step streams every matrix once: this kernel streams the blocks instead and decodes each weight in
// registers. d * q is exact in float32 (an 11-bit half times a code of at most 8 bits), so fma(d, q, m) is
// the float32 weight the dequantised matrix held, bit for bit; only the order of the sums differs from a
// float32 matmul's. The activations are not quantised (llama.cpp rounds them to 8 bits for its dot products):
// the logits stay those of the float32 model. (Q4_0, w = d * (q - 8), runs as Q4_1 with m = -8d: exact too.)
//
// Layouts (repacked once at load, `engine.quant`): codes [N, K/32, 16] uint8 for Q4_1 (byte j holds weight
// j in its low nibble, weight j + 16 in its high one, as in GGUF), [N, K/32, 32] int8 for Q8_0; scales and
// offsets [N, K/32] float16, as GGUF has them (each widened to float32 as its block is decoded, exactly).
//
// Work: threads split the output columns (rows of W); each task takes NR rows of W and up to MR rows of x at
// a time, decodes a block of each W row once and multiplies it into all MR rows of x, holding NR x MR
// accumulator vectors in registers. Batches wider than MR walk the same W rows again (from cache). NR and MR
// depend on the batch (`linear`); at 29-32 rows a task broadcasts each weight into all of them instead
// (`run_wide`).
// NOTE: ATen's tensor and the pybind11 casters only, not <torch/extension.h> (all of libtorch's C++ API):
// each kernel's build (at the first start on a machine) is ~10 s shorter: 28 -> 18 s for gguf_matmul.cpp,
// 39 -> 29 s for paged_attention.cpp on this 2-core machine.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t s8x16 __attribute__((vector_size(16)));

constexpr int kBlock = 32;

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// The 32 weights of one Q4_1 block as two vectors (weights 0-15, 16-31).
// NOTE: AVX-512 intrinsics where the CPU has them: GCC lowers the vector extensions' byte-to-int widening to
// one insert per lane (4x slower end to end); elsewhere the portable form.
inline void decode_q4_1(const uint8_t* codes, float d, float m, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), vd, vm);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), vd, vm);
#else
  u8x16 b;
  __builtin_memcpy(&b, codes, 16);
  i16 q = __builtin_convertvector(b, i16);
  lo = __builtin_convertvector(q & 15, v16) * d + m;
  hi = __builtin_convertvector(q >> 4, v16) * d + m;
#endif
}

inline void decode_q8_0(const int8_t* codes, float d, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512 vd = _mm512_set1_ps(d);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(codes)))), vd);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(codes + 16)))), vd);
#else
  s8x16 a, b;
  __builtin_memcpy(&a, codes, 16);
  __builtin_memcpy(&b, codes + 16, 16);
  lo = __builtin_convertvector(__builtin_convertvector(a, i16), v16) * d;
  hi = __builtin_convertvector(__builtin_convertvector(b, i16), v16) * d;
#endif
}

// out[m0:m0+mr, n0:n0+nr] = x[m0:m0+mr] @ W[n0:n0+nr].T, W's blocks decoded by `decode(row, block, lo, hi)`
template <int nr, int mr, typename Decode>
inline void tile(const float* x, int64_t K, float* out, int64_t N, int64_t n0, Decode decode) {
  v16 acc[nr][mr];
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < mr; ++i) acc[r][i] = v16{} ;
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    v16 lo[nr], hi[nr];
    for (int r = 0; r < nr; ++r) decode(n0 + r, b, lo[r], hi[r]);
    for (int i = 0; i < mr; ++i) {
      const v16 xl = load16(x + i * K + b * kBlock), xh = load16(x + i * K + b * kBlock + 16);
      for (int r = 0; r < nr; ++r) acc[r][i] += lo[r] * xl + hi[r] * xh;
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < mr; ++i) out[i * N + n0 + r] = hsum(acc[r][i]);
}

// every row of x against W rows n0..n0+nr, MR rows of x at a time
template <int nr, int MR, typename Decode>
inline void rows_of(const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0, Decode decode) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) tile<nr, MR>(x + m0 * K, K, out + m0 * N, N, n0, decode);
  const float* xr = x + m0 * K;
  float* o = out + m0 * N;
  const int left = static_cast<int>(M - m0);  // the last rows of x, fewer than MR
  if (left == 1) tile<nr, 1>(xr, K, o, N, n0, decode);
  if constexpr (MR > 2) if (left == 2) tile<nr, 2>(xr, K, o, N, n0, decode);
  if constexpr (MR > 3) if (left == 3) tile<nr, 3>(xr, K, o, N, n0, decode);
  if constexpr (MR > 4) if (left == 4) tile<nr, 4>(xr, K, o, N, n0, decode);
  if constexpr (MR > 5) if (left == 5) tile<nr, 5>(xr, K, o, N, n0, decode);
  if constexpr (MR > 6) if (left == 6) tile<nr, 6>(xr, K, o, N, n0, decode);
  if constexpr (MR > 7) if (left == 7) tile<nr, 7>(xr, K, o, N, n0, decode);
  static_assert(MR <= 8, "rows_of: at most 8 rows of x a tile");
}

// GGUF's half-precision scales (and offsets) as float32, `n` of them: each W row's are widened once per use
// of the row, not once per block (a conversion per block per row cost the kernel 8% at batch 1)
inline void widen(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The two formats: a row's scales widened into `s` ([blocks] scales, then [blocks] offsets), and a block of
// row n decoded with them.
struct Q4_1 {
  const uint8_t* codes;
  const at::Half* d;
  const at::Half* m;
  int64_t blocks;
  void scales(int64_t n, float* s) const {
    widen(d + n * blocks, s, blocks);
    widen(m + n * blocks, s + blocks, blocks);
  }
  void block(int64_t n, int64_t b, const float* s, v16& lo, v16& hi) const {
    decode_q4_1(codes + (n * blocks + b) * 16, s[b], s[blocks + b], lo, hi);
  }
};

struct Q8_0 {
  const int8_t* codes;
  const at::Half* d;
  int64_t blocks;
  void scales(int64_t n, float* s) const { widen(d + n * blocks, s, blocks); }
  void block(int64_t n, int64_t b, const float* s, v16& lo, v16& hi) const {
    decode_q8_0(codes + (n * blocks + b) * 32, s[b], lo, hi);
  }
};

// out[:, n0:n0+nr] = x @ W[n0:n0+nr].T; `scales`: room for nr rows' widened scales, `scratch`: nr x K floats
template <int nr, int MR, typename Format>
inline void rows(const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0, const Format& fmt,
                 float* scales, float* scratch) {
  const int64_t blocks = K / kBlock;
  for (int r = 0; r < nr; ++r) fmt.scales(n0 + r, scales + r * 2 * blocks);
  const Format f = fmt;  // (by value: the lambda below must not reach it through a reference every block)
  auto decode = [=](int64_t n, int64_t b, v16& lo, v16& hi) {
    f.block(n, b, scales + (n - n0) * 2 * blocks, lo, hi);
  };
  if (M > MR) {
    // NOTE: a wide batch walks these rows once per MR rows of x: decode them once into a float32 scratch
    // that stays in L1/L2 (nr x K floats), and let every pass read it there
    for (int r = 0; r < nr; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        v16 lo, hi;
        decode(n0 + r, b, lo, hi);
        __builtin_memcpy(scratch + r * K + b * kBlock, &lo, sizeof(lo));
        __builtin_memcpy(scratch + r * K + b * kBlock + 16, &hi, sizeof(hi));
      }
    auto decoded = [=](int64_t n, int64_t b, v16& lo, v16& hi) {
      lo = load16(scratch + (n - n0) * K + b * kBlock);
      hi = load16(scratch + (n - n0) * K + b * kBlock + 16);
    };
    rows_of<nr, MR>(x, M, K, out, N, n0, decoded);
  } else {
    rows_of<nr, MR>(x, M, K, out, N, n0, decode);
  }
}

// out = x @ W.T, NR rows of W and up to MR rows of x a tile; the last N % NR rows of W one at a time
template <int NR, int MR, typename Format>
void run(const float* x, int64_t M, int64_t K, float* out, int64_t N, const Format& fmt) {
  const int64_t groups = N / NR, tasks = groups + N % NR;
  // (at least 32 rows of W a thread's chunk, whatever NR: ATen runs a call serially below one grain)
  at::parallel_for(0, tasks, std::max<int64_t>(1, 32 / NR), [&](int64_t begin, int64_t end) {
    std::vector<float> scales(NR * 2 * (K / kBlock));
    std::vector<float> scratch(M > MR ? NR * K : 0);
    for (int64_t t = begin; t < end; ++t) {
      if (t < groups) rows<NR, MR>(x, M, K, out, N, t * NR, fmt, scales.data(), scratch.data());
      else rows<1, MR>(x, M, K, out, N, groups * NR + (t - groups), fmt, scales.data(), scratch.data());
    }
  });
}

// -- batches of 29-32 rows: broadcasts, no sums across lanes --------------------------------------------
// NOTE: the tiles above end every (x row, W row) dot product in a sum across a vector's lanes, 8-10
// instructions an output beside its 36 FMAs at SmolLM2's K = 576. Here x is transposed once a
// call (xt: [K, 32], two vectors of x rows a column, zeros past M) and each weight of kWideNR W rows is
// broadcast and multiplied into all 32 rows at once: kWideNR x 2 accumulator vectors hold the task's whole
// output across K, and each 32-column block of its W rows is decoded into a buffer that stays in L1.
// Measured against the 4 x 4 tiles (`benchmarks.gguf_compare`, SmolLM2's matrices, 2 threads, 2026-12-07;
// benchmarks/results/gguf-wide-2026-12-07): a step's matmuls at 32 rows 1.17x (lm_head 1.45x, the layers'
// 1.10-1.14x); behind at 28 rows and below in ad hoc runs (32 rows a tile whatever M: at 20, 40% padding).
// Only where AVX-512 gives it 32 vector registers: its 24 accumulators would spill from AVX2's 16.
constexpr int kWideNR = 12, kWideRows = 32;

// out[:, n0:n0+nr] = x @ W[n0:n0+nr].T (nr <= kWideNR) from xt; `scales`: room for kWideNR rows' widened
// scales
template <typename Format>
void wide_rows(const float* xt, int64_t M, int64_t K, float* out, int64_t N, int64_t n0, int nr,
               const Format& fmt, float* scales) {
  const int64_t blocks = K / kBlock;
  // (rows past nr, in the last task only, repeat row nr - 1: computed, never stored)
  int64_t row[kWideNR];
  for (int r = 0; r < kWideNR; ++r) {
    row[r] = n0 + std::min(r, nr - 1);
    fmt.scales(row[r], scales + r * 2 * blocks);
  }
  v16 acc[kWideNR][2];
  for (int r = 0; r < kWideNR; ++r) acc[r][0] = acc[r][1] = v16{};
  alignas(64) float wb[2][kWideNR][16];  // block b of every row: its columns 0-15, then 16-31
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < kWideNR; ++r) {
      v16 lo, hi;
      fmt.block(row[r], b, scales + r * 2 * blocks, lo, hi);
      __builtin_memcpy(wb[0][r], &lo, sizeof(lo));
      __builtin_memcpy(wb[1][r], &hi, sizeof(hi));
    }
    for (int half = 0; half < 2; ++half) {
      const float* xc = xt + (b * kBlock + 16 * half) * kWideRows;
      for (int k = 0; k < 16; ++k) {
        const v16 x0 = load16(xc + k * kWideRows), x1 = load16(xc + k * kWideRows + 16);
        for (int r = 0; r < kWideNR; ++r) {
          const v16 w = v16{} + wb[half][r][k];
          acc[r][0] += w * x0;
          acc[r][1] += w * x1;
        }
      }
    }
  }
  // out[i, n0 + r] = acc[r][i / 16] lane i % 16, through memory (a lane at a time from registers was slower)
  float t[kWideNR][kWideRows];
  for (int r = 0; r < kWideNR; ++r) __builtin_memcpy(t[r], acc[r], sizeof(t[r]));
  for (int64_t i = 0; i < M; ++i)
    for (int r = 0; r < nr; ++r) out[i * N + n0 + r] = t[r][i];
}

// out = x @ W.T for M <= kWideRows, kWideNR rows of W a task
template <typename Format>
void run_wide(const float* x, int64_t M, int64_t K, float* out, int64_t N, const Format& fmt) {
  std::vector<float> xt(K * kWideRows, 0.f);
  at::parallel_for(0, K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = begin; k < end; ++k) xt[k * kWideRows + m] = x[m * K + k];
  });
  const int64_t tasks = (N + kWideNR - 1) / kWideNR;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scales(kWideNR * 2 * (K / kBlock));
    for (int64_t t = begin; t < end; ++t) {
      const int nr = static_cast<int>(std::min<int64_t>(kWideNR, N - t * kWideNR));
      wide_rows(xt.data(), M, K, out, N, t * kWideNR, nr, fmt, scales.data());
    }
  });
}

template <typename Format>
at::Tensor linear(const at::Tensor& x, int64_t N, const Format& fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(K % kBlock == 0, "the inner dimension (", K, ") must be a multiple of ", kBlock);
  at::Tensor out = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // NOTE: the tile by batch, measured on SmolLM2's matrices (2 threads, 2026-12-07, a step's matmuls against
  // 2 W rows x 8 x rows for every batch): 1-2 rows are bound by decoding, and 8 W rows a tile keep 8 decodes
  // in flight (12.0 -> 7.7 ms at one row, 10.5 -> 6.8 at two); 3-4 rows, 6 W rows (12.5 -> 10.8 at four);
  // 5-8 rows, 2 W rows x 8 x rows (6 W rows: 15.1 -> 18.6 ms at eight); wider, 4 x 4 tiles over W rows
  // decoded into scratch (48.6 -> 45.3 ms at 32), and at 29-32 rows the broadcasts (`run_wide`)
  if (M <= 2) run<8, 2>(xp, M, K, op, N, fmt);
  else if (M <= 4) run<6, 4>(xp, M, K, op, N, fmt);
  else if (M <= 8) run<2, 8>(xp, M, K, op, N, fmt);
#if defined(__AVX512F__)
  else if (M > 28 && M <= kWideRows) run_wide(xp, M, K, op, N, fmt);
#endif
  else run<4, 4>(xp, M, K, op, N, fmt);
  return out;
}

void check_weights(const at::Tensor& codes, const at::Tensor& scales, int64_t bytes, int64_t K) {
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), "the blocks must be CPU tensors");
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(2) == bytes, "codes must be [N, K/32, ",
              bytes, "] and contiguous");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.sizes() == codes.sizes().slice(0, 2),
              "scales and offsets must be float16 [N, K/32] and contiguous");
  TORCH_CHECK(codes.size(1) * kBlock == K, "x's inner dimension (", K, ") does not match the weight's (",
              codes.size(1) * kBlock, ")");
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& offsets) {
  check_weights(codes, scales, 16, x.size(-1));
  check_weights(codes, offsets, 16, x.size(-1));
  TORCH_CHECK(codes.scalar_type() == at::kByte, "Q4_1 codes must be uint8");
  return linear(x, codes.size(0), Q4_1{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                                      offsets.data_ptr<at::Half>(), codes.size(1)});
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_weights(codes, scales, 32, x.size(-1));
  TORCH_CHECK(codes.scalar_type() == at::kChar, "Q8_0 codes must be int8");
  return linear(x, codes.size(0), Q8_0{codes.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), codes.size(1)});
}

// The float32 matrix [N, K] the blocks encode (for wide batches, which a float32 matmul runs faster).
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& offsets) {
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(q4 == offsets.has_value(), "Q4_1 blocks (uint8 codes) come with offsets, Q8_0 (int8) without");
  const int64_t K = codes.size(1) * kBlock;
  check_weights(codes, scales, q4 ? 16 : 32, K);
  if (q4) check_weights(codes, *offsets, 16, K);
  const int64_t N = codes.size(0), blocks = codes.size(1);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const at::Half* d = scales.data_ptr<at::Half>();
  const at::Half* m = q4 ? offsets->data_ptr<at::Half>() : nullptr;
  const uint8_t* c4 = q4 ? codes.data_ptr<uint8_t>() : nullptr;
  const int8_t* c8 = q4 ? nullptr : codes.data_ptr<int8_t>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      v16 lo, hi;
      if (q4) decode_q4_1(c4 + i * 16, static_cast<float>(d[i]), static_cast<float>(m[i]), lo, hi);
      else decode_q8_0(c8 + i * 32, static_cast<float>(d[i]), lo, hi);
      __builtin_memcpy(o + i * kBlock, &lo, sizeof(lo));
      __builtin_memcpy(o + i * kBlock + 16, &hi, sizeof(hi));
    }
  });
  return out;
}

// -- the elementwise work around a quantised layer's matmuls --------------------------------------------
// NOTE: a quantised matrix cannot take an RMSNorm's weight into its columns as the float32 ones do, so its
// input is normed and scaled per call; in torch ops that is 5 ops a matrix (11 us at 8 rows here), and the
// gated MLP's silu and product 2 more (15 us). One pass each here, a few microseconds: at batch 8 and short
// contexts a decode step is about a third elementwise ops and their dispatch.

// x[r] * (1 / sqrt(sum(x[r]^2) + eps)) * scale: RMSNorm with its weight (and sqrt(hidden), with eps
// pre-multiplied, as engine.models.llama.unit_rms has them) in `scale`, row by row.
at::Tensor rms_scale(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == x.size(1) &&
                  scale.is_contiguous() && scale.device().is_cpu(),
              "scale must be a contiguous float32 CPU vector of x's width");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor out = at::empty({M, K}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * K;
      float* o = op + r * K;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < K; ++i) squares += row[i] * row[i];
      const float inv = 1.f / std::sqrt(squares + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < K; ++i) o[i] = row[i] * inv * sp[i];
    }
  });
  return out;
}

// [M, 2I] (gate then up, one fused matmul's output) -> [M, I]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.device().is_cpu() &&
                  gate_up.is_contiguous(),
              "gate_up must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width (", gate_up.size(1), ") must be even: [gate; up]");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* o = op + r * I;
      // (exp's argument held under float32's overflow: -ffast-math divides by a reciprocal estimate, and
      // 1 / inf made NaN where silu is -0; past 80 the quotient is below 1e-33 either way)
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
    }
  });
  return out;
}

}  // namespace

// NOTE: the GIL is released while a call runs (it touches no Python object): a decode step's matmuls are
// most of its time, and the worker's other threads (gRPC, liveness, KV transfer) must run meanwhile
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("q4_1_linear", &q4_1_linear, "x @ W.T, W in Q4_1 blocks (codes, scales, offsets); float32 sums",
        release());
  m.def("q8_0_linear", &q8_0_linear, "x @ W.T, W in Q8_0 blocks (codes, scales); float32 sums", release());
  m.def("dequantize", &dequantize, "Q4_1 or Q8_0 blocks -> the float32 matrix they encode",
        py::arg("codes"), py::arg("scales"), py::arg("offsets") = py::none(), release());
  m.def("rms_scale", &rms_scale, "x * rsqrt(sum(x^2) + eps) * scale, by rows", release());
  m.def("silu_mul", &silu_mul, "[M, 2I] -> silu(first half) * second half", release());
}
