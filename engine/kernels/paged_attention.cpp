// Attention over a paged KV cache, read in place: for every sequence, its query rows attend the keys and
// values its block table points at, with no gathered copy of the context, no padding across sequences and
// no mask tensor (positions past a row's own are skipped by arithmetic).
//
// Work is split into tasks of (sequence, partition of its context), and long contexts are cut into partitions
// so a batch of one still keeps every thread busy. Within a task, the head sizes compiled in (64, 128) take
// the vectorised passes (`score_rows`, `value_rows`): per KV head, a few query rows at a time walk the
// partition's keys, then its values, with their query and accumulator vectors held in registers, reading
// every head's rows from L2: they were asked for while the thread's previous task computed (`Ahead`; a
// thread's first task asks for its own during its first walk). Other head sizes take a scalar pass in which
// every query row and head shares one walk over each key and value row. A partition leaves its unnormalised
// output with its running max and sum; a second pass merges a sequence's partitions (the
// split-K rescaling of flash-decoding). Accumulation is in float32 whatever the dtypes; the cache may be
// narrower than the queries (a bfloat16 or float16 cache under a float32 model: half the bytes to read; an
// 8-bit float one, e4m3 or e5m2: a quarter).
// NOTE: ATen's tensor and the pybind11 casters only, not <torch/extension.h> (all of libtorch's C++ API):
// each kernel's build (at the first start on a machine) is ~10 s shorter: 28 -> 18 s for gguf_matmul.cpp,
// 39 -> 29 s for paged_attention.cpp on this 2-core machine.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// NOTE: a finite "minus infinity": the file is built with -ffast-math (vectorised exp), which assumes no
// infinities; exp(kMasked - m) is 0 for any real score m.
constexpr float kMasked = -1e30f;

// y += a * x
template <int D>
inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  const int64_t len = D > 0 ? D : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += a * x[i];
}

// NOTE: the next block's rows are asked for while this block's are used: blocks lie anywhere in the
// cache, so the hardware prefetcher, which follows strides, cannot see the next one coming
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

// The next task's keys and values, asked for a few cache lines at a time all through this task's work.
// NOTE: a thread keeps only so many misses in flight (its fill buffers), so prefetching a task's blocks as
// its first walk over the keys reaches them leaves the walks after it (the other heads, the values) with no
// memory traffic under them; spread over every key and value row this task visits, the next task's rows
// arrive while this one computes. Measured (`benchmarks.kernel_compare`, SmolLM2's shapes, 30 layers, 2
// threads, 2026-12-07): batch 32 at 1,024 tokens 94.6 -> 88.9 ms with a float32 cache, 65.9 -> 54.9 with a
// bfloat16 one; batch 8 23.2 -> 21.5 and 16.1 -> 13.4 ms.
struct Ahead {
  const char* const* spans = nullptr;  // the next task's blocks, K then V of each, `span_bytes` apiece
  int64_t num_spans = 0, span_bytes = 0, per_step = 0;  // per_step: lines asked for per row visited
  int64_t i = 0, off = 0;  // the next line to ask for: span i, byte off

  void step() {
    for (int64_t n = 0; n < per_step && i < num_spans; ++n) {
      __builtin_prefetch(spans[i] + off, 0, 2);
      if ((off += 64) >= span_bytes) off = 0, ++i;
    }
  }
};

// D > 0: the head size, known at compile time (the loops unroll into registers); 0: `n` at run time
template <int D>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  const int64_t len = D > 0 ? D : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * b[i];
  return s;
}

// A row of the cache as float32: the row itself for a float32 cache, else converted into `buf`.
template <int D, typename T>
inline const float* as_float(const T* __restrict row, float* __restrict buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t len = D > 0 ? D : n;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

struct Task {
  int64_t seq, t0, t1;
};

// -- the vectorised passes: head sizes known at compile time and a multiple of 16 --------------------------
// A dot product per key row ends in a reduction across vector lanes; one per key and query head was most of
// the kernel's time (batch 8 at 1,024 tokens of context read its KV at 15 GB/s whether the cache was float32
// or bfloat16). Here a tile of 16 keys leaves 16 partial vectors per query row, and `reduce16` sums them in one
// transposing tree (15 shuffles-and-adds for 16 dots). The value pass keeps a few query rows' accumulators in
// registers over a whole partition. GCC/Clang vector extensions: 16 floats are one AVX-512 register, two AVX2
// ones, four NEON ones.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// 2^e as a float, at compile time
constexpr float pow2(int e) {
  float f = 1.f;
  for (; e > 0; --e) f *= 2.f;
  for (; e < 0; ++e) f *= .5f;
  return f;
}

// 16 values of an 8-bit float row as float32, for M mantissa bits and exponent bias B (e4m3: 3, 7; e5m2:
// 2, 15). A normal byte's magnitude bits move into float32's places and an integer add rebiases the
// exponent; a subnormal one (exponent 0) is its mantissa times 2^(1 - B - M), converted. No float32
// subnormal is ever made: those cost the CPU a microcode assist per vector (half the speed of e4m3, whose
// subnormals are the values below 2^-6).
// NOTE: the special bytes (e5m2's infinities and NaNs, e4m3's NaN) read as large finite values. Writes
// saturate (`engine.kv_cache.as_cache_dtype`), so only a NaN in K or V makes one, and reading them as torch
// does cost 15% of the kernel's time, measured.
template <int M, int B>
inline v16 widen8(const void* p) {
  typedef uint8_t b16 __attribute__((vector_size(16)));
  typedef uint16_t h16 __attribute__((vector_size(32)));
  typedef uint32_t u16 __attribute__((vector_size(64)));
  typedef int32_t i16 __attribute__((vector_size(64)));
  b16 b;
  std::memcpy(&b, p, sizeof(b));
  // (through 16-bit lanes: in one step GCC 12 converts lane by lane)
  const u16 w = __builtin_convertvector(__builtin_convertvector(b, h16), u16);
  const u16 mag = w & 0x7fu;
  const u16 normal = (mag << (23 - M)) + static_cast<uint32_t>((127 - B) << 23);
  const v16 tiny = __builtin_convertvector((i16)(mag & ((1u << M) - 1)), v16) * pow2(1 - B - M);
  u16 sub;
  std::memcpy(&sub, &tiny, sizeof(sub));
  const u16 is_sub = (u16)((mag >> M) == 0);  // all ones where the exponent is 0
  const u16 bits = (sub & is_sub) | (normal & ~is_sub) | ((w & 0x80u) << 24);
  v16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// 16 values of a cache row as float32: bfloat16 is float32's upper half, widened by a shift in registers
template <typename C>
inline v16 load16(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return load16(static_cast<const float*>(p));
  } else if constexpr (std::is_same_v<C, at::Float8_e4m3fn>) {
    return widen8<3, 7>(p);
  } else if constexpr (std::is_same_v<C, at::Float8_e5m2>) {
    return widen8<2, 15>(p);
  } else if constexpr (std::is_same_v<C, at::BFloat16>) {
    typedef uint16_t h16 __attribute__((vector_size(32)));
    typedef uint32_t u16 __attribute__((vector_size(64)));
    h16 h;
    std::memcpy(&h, p, sizeof(h));
    const u16 bits = __builtin_convertvector(h, u16) << 16;
    v16 v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  } else {
    float f[16];
    for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
    return load16(f);
  }
}

// lane j of the result: the sum of x[j]'s lanes. Each round halves the lanes a key keeps and packs two
// vectors into one: 16 keys x 16 lanes, 8 x (2 x 8), 4 x (4 x 4), 2 x (8 x 2), 1 x (16 x 1).
inline v16 reduce16(v16* x) {
  for (int k = 0; k < 8; ++k)
    x[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    x[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    x[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// the largest of x[0, n)
// NOTE: by lanes, by hand: GCC compiles `omp simd reduction(max)` over std::max to a scalar max an element,
// each waiting on the last: a fifth of the kernel's time with the KV in L2, 1.04-1.10x from memory
// (float32 caches; benchmarks/results/attention-max-2026-12-07)
inline float max_of(const float* x, int64_t n) {
  v16 m = v16{} + kMasked;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16 v = load16(x + j);
    m = v > m ? v : m;
  }
  float lanes[16];
  store16(lanes, m);
  float r = kMasked;
  for (int i = 0; i < 16; ++i) r = std::max(r, lanes[i]);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
}

// A query row of one task: where its scores and output go, and the last position it may see.
struct Row {
  int64_t r, limit;
};

// query rows of one KV head attended together: their accumulators stay in registers (4 x 64 or 2 x 128)
template <int D>
constexpr int kRowsAtOnce = D <= 64 ? 4 : 2;

// NR query rows (at most kRowsAtOnce<D>) at once, as a compile-time count: f(std::integral_constant<int, NR>)
template <int D, typename F>
inline void by_rows(int nrows, F&& f) {
  switch (nrows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: if constexpr (kRowsAtOnce<D> >= 3) return f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (kRowsAtOnce<D> >= 4) return f(std::integral_constant<int, 4>{}); break;
  }
  TORCH_CHECK(false, "paged_attention: ", nrows, " rows at once");
}

// scores[row.r * len + pos - t0] for R query rows over the task's keys of KV head h
template <int D, typename C, int R>
void score_rows(const Row* rows, const float* qbuf, float* scores, int64_t len, int64_t t0, int64_t t1,
                const C* kp, int64_t ks0, int64_t ks1, int64_t h_off, const int32_t* table, int64_t block_size,
                const C* vp, int64_t vs0, int64_t prefetch_bytes, Ahead& ahead) {
  constexpr int NC = D / 16;
  v16 qv[R][NC];
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < NC; ++c) qv[rr][c] = load16(qbuf + rows[rr].r * D + 16 * c);
  v16 part[R][16];
  for (int64_t b0 = t0; b0 < t1; b0 += block_size) {
    const C* block = kp + table[b0 / block_size] * ks0 + h_off;
    const int64_t n = std::min(block_size, t1 - b0);
    if (prefetch_bytes) {  // the first pass over a partition: every head's keys two blocks ahead, these values
      if (b0 + 2 * block_size < t1) prefetch_block(kp + table[b0 / block_size + 2] * ks0, prefetch_bytes);
      prefetch_block(vp + table[b0 / block_size] * vs0, prefetch_bytes);
    }
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - j0));
      for (int j = 0; j < 16; ++j) {
        if (j >= m) {
          for (int rr = 0; rr < R; ++rr) part[rr][j] = v16{};
          continue;
        }
        const C* key = block + (j0 + j) * ks1;
        ahead.step();
        v16 kv[NC];
        for (int c = 0; c < NC; ++c) kv[c] = load16(key + 16 * c);
        for (int rr = 0; rr < R; ++rr) {
          v16 a = qv[rr][0] * kv[0], b = v16{};  // two chains: the FMAs overlap
          for (int c = 1; c < NC; ++c) {
            if (c % 2) b += qv[rr][c] * kv[c];
            else a += qv[rr][c] * kv[c];
          }
          part[rr][j] = a + b;
        }
      }
      const int64_t pos0 = b0 + j0;
      for (int rr = 0; rr < R; ++rr) {
        float sums[16];
        store16(sums, reduce16(part[rr]));
        float* dst = scores + rows[rr].r * len + (pos0 - t0);
        for (int j = 0; j < m; ++j) dst[j] = pos0 + j <= rows[rr].limit ? sums[j] : kMasked;
      }
    }
  }
}

// acc[row.r * D ...] = R query rows' probabilities over the task's values of KV head h
template <int D, typename C, int R>
void value_rows(const Row* rows, const float* scores, float* acc, int64_t len, int64_t t0, int64_t t1,
                const C* vp, int64_t vs0, int64_t vs1, int64_t h_off, const int32_t* table,
                int64_t block_size, Ahead& ahead) {
  constexpr int NC = D / 16;
  v16 av[R][NC];
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < NC; ++c) av[rr][c] = v16{};
  const float* prob[R];
  for (int rr = 0; rr < R; ++rr) prob[rr] = scores + rows[rr].r * len;
  for (int64_t b0 = t0; b0 < t1; b0 += block_size) {
    const C* block = vp + table[b0 / block_size] * vs0 + h_off;
    const int64_t n = std::min(block_size, t1 - b0);
    for (int64_t off = 0; off < n; ++off) {
      const C* value = block + off * vs1;
      ahead.step();
      v16 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(value + 16 * c);
      for (int rr = 0; rr < R; ++rr) {
        const float p = prob[rr][b0 - t0 + off];
        for (int c = 0; c < NC; ++c) av[rr][c] += p * vv[c];
      }
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < NC; ++c) store16(acc + rows[rr].r * D + 16 * c, av[rr][c]);
}

// T: the queries' and output's dtype; C: the cache's (T, or a 16- or 8-bit type under float32 queries)
template <typename T, typename C, int D>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seqs,
         double scale, int64_t partition) {
  const int64_t num_heads = q.size(1), d = D > 0 ? D : q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t group = num_heads / kv_heads;
  partition = (partition + block_size - 1) / block_size * block_size;  // partitions start on a block
  const int64_t num_seqs = seqs.size(0), table_width = block_tables.size(1);
  const int32_t* info = seqs.data_ptr<int32_t>();  // [S, 3]: q_start, q_len, ctx_len
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  // one block's rows, all KV heads (contiguous in pdserve's own cache; in a strided view, the span)
  const int64_t block_bytes = ((block_size - 1) * ks1 + (kv_heads - 1) * ks2 + d) * sizeof(C);

  // a task is a partition of one sequence's context, every head: it reads each of its key and value rows
  // (all KV heads of a token, contiguous in a block) once
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(num_seqs), num_parts(num_seqs);
  int64_t max_rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = info[3 * s + 2];
    num_parts[s] = std::max<int64_t>(1, (ctx + partition - 1) / partition);
    first_task[s] = static_cast<int64_t>(tasks.size());
    max_rows = std::max<int64_t>(max_rows, info[3 * s + 1] * num_heads);
    for (int64_t p = 0; p < num_parts[s]; ++p)
      tasks.push_back({s, p * partition, std::min(ctx, (p + 1) * partition)});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // per task and query row: d accumulated values, the max and the sum (read where a sequence has partitions)
  std::vector<float> partial(static_cast<size_t>(num_tasks * max_rows * (d + 2)));

  constexpr bool kVector = D > 0 && D % 16 == 0;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, scores, acc, maxes, sums, row(d);
    std::vector<Row> hrows;
    std::vector<const char*> spans;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& t = tasks[ti];
      // (the vectorised walks ask for the next task's rows as they go; this thread's first task asks for
      // its own as its first walk reaches them, as the scalar walks do for every task)
      const bool first = ti == begin || !kVector;
      Ahead ahead;
      if (kVector && ti + 1 < end) {
        const Task& next = tasks[ti + 1];
        const int32_t* next_table = tables + next.seq * table_width;
        spans.clear();
        for (int64_t b = next.t0; b < next.t1; b += block_size) {
          spans.push_back(reinterpret_cast<const char*>(kp + next_table[b / block_size] * ks0));
          spans.push_back(reinterpret_cast<const char*>(vp + next_table[b / block_size] * vs0));
        }
        ahead.spans = spans.data();
        ahead.num_spans = static_cast<int64_t>(spans.size());
        ahead.span_bytes = block_bytes;
        const int64_t lines = ahead.num_spans * ((block_bytes + 63) / 64);
        const int64_t visits = 2 * kv_heads * (t.t1 - t.t0);  // each KV head walks its keys, then values
        ahead.per_step = (lines + visits - 1) / std::max<int64_t>(1, visits);
      }
      const int64_t q_start = info[3 * t.seq], q_len = info[3 * t.seq + 1], ctx = info[3 * t.seq + 2];
      const int64_t rows = q_len * num_heads, len = t.t1 - t.t0;
      const int32_t* table = tables + t.seq * table_width;
      qbuf.resize(rows * d);
      scores.resize(rows * len);
      acc.assign(rows * d, 0.f);
      maxes.assign(rows, kMasked);
      sums.assign(rows, 0.f);
      // row r = i * num_heads + head: query row q_start + i at position ctx - q_len + i; head reads KV head
      // head / group (GQA)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t hd = 0; hd < num_heads; ++hd) {
          const T* src = qp + (q_start + i) * qs0 + hd * qs1;
          float* dst = qbuf.data() + (i * num_heads + hd) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<float>(src[x]) * static_cast<float>(scale);
        }
      if (first)
        for (int64_t b = t.t0; b < std::min(t.t1, t.t0 + 2 * block_size); b += block_size)
          prefetch_block(kp + table[b / block_size] * ks0, block_bytes);
      if constexpr (kVector) {
        // the query rows of each KV head, a few at a time (row r = i * num_heads + head)
        for (int64_t h = 0; h < kv_heads; ++h) {
          hrows.clear();
          for (int64_t i = 0; i < q_len; ++i)
            for (int64_t g = 0; g < group; ++g) hrows.push_back({i * num_heads + h * group + g, ctx - q_len + i});
          for (size_t k = 0; k < hrows.size(); k += kRowsAtOnce<D>) {
            const int nr = static_cast<int>(std::min<size_t>(kRowsAtOnce<D>, hrows.size() - k));
            by_rows<D>(nr, [&](auto n) {
              score_rows<D, C, decltype(n)::value>(hrows.data() + k, qbuf.data(), scores.data(), len, t.t0, t.t1,
                                                   kp, ks0, ks1, h * ks2, table, block_size, vp, vs0,
                                                   first && h == 0 && k == 0 ? block_bytes : 0, ahead);
            });
          }
        }
      } else {
        for (int64_t b0 = t.t0; b0 < t.t1; b0 += block_size) {  // partitions start on block boundaries
          const int64_t block = table[b0 / block_size], n = std::min(block_size, t.t1 - b0);
          // keys two blocks ahead; this block's values, for the value pass to find in L2
          if (b0 + 2 * block_size < t.t1) prefetch_block(kp + table[b0 / block_size + 2] * ks0, block_bytes);
          prefetch_block(vp + block * vs0, block_bytes);
          for (int64_t off = 0; off < n; ++off) {
            const int64_t pos = b0 + off;
            for (int64_t h = 0; h < kv_heads; ++h) {
              const float* key = as_float<D>(kp + block * ks0 + off * ks1 + h * ks2, row.data(), d);
              for (int64_t i = 0; i < q_len; ++i) {
                const bool visible = pos <= ctx - q_len + i;
                for (int64_t g = 0; g < group; ++g) {
                  const int64_t r = i * num_heads + h * group + g;
                  scores[r * len + (pos - t.t0)] = visible ? dot<D>(qbuf.data() + r * d, key, d) : kMasked;
                }
              }
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * len;
        const float m = max_of(sr, len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) {
          sr[j] = std::exp(sr[j] - m);
          sum += sr[j];
        }
        maxes[r] = m;
        sums[r] = m == kMasked ? 0.f : sum;  // a partition wholly past the row's position adds nothing
      }
      if constexpr (kVector) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          hrows.clear();
          for (int64_t i = 0; i < q_len; ++i)
            for (int64_t g = 0; g < group; ++g) hrows.push_back({i * num_heads + h * group + g, 0});
          for (size_t k = 0; k < hrows.size(); k += kRowsAtOnce<D>) {
            const int nr = static_cast<int>(std::min<size_t>(kRowsAtOnce<D>, hrows.size() - k));
            by_rows<D>(nr, [&](auto n) {
              value_rows<D, C, decltype(n)::value>(hrows.data() + k, scores.data(), acc.data(), len, t.t0, t.t1,
                                                   vp, vs0, vs1, h * vs2, table, block_size, ahead);
            });
          }
        }
      } else {
        for (int64_t b0 = t.t0; b0 < t.t1; b0 += block_size) {
          const int64_t block = table[b0 / block_size], n = std::min(block_size, t.t1 - b0);
          for (int64_t off = 0; off < n; ++off) {
            const int64_t pos = b0 + off;
            for (int64_t h = 0; h < kv_heads; ++h) {
              const float* value = as_float<D>(vp + block * vs0 + off * vs1 + h * vs2, row.data(), d);
              for (int64_t i = 0; i < q_len; ++i)
                for (int64_t g = 0; g < group; ++g) {
                  const int64_t r = i * num_heads + h * group + g;
                  const float p = scores[r * len + (pos - t.t0)];
                  if (p != 0.f) axpy<D>(acc.data() + r * d, p, value, d);
                }
            }
          }
        }
      }
      if (num_parts[t.seq] == 1) {
        for (int64_t r = 0; r < rows; ++r) {
          T* dst = op + (q_start + r / num_heads) * os0 + (r % num_heads) * os1;
          const float inv = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
          for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(acc[r * d + x] * inv);
        }
      } else {
        float* dst = partial.data() + ti * max_rows * (d + 2);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy(acc.data() + r * d, acc.data() + (r + 1) * d, dst + r * (d + 2));
          dst[r * (d + 2) + d] = maxes[r];
          dst[r * (d + 2) + d + 1] = sums[r];
        }
      }
    }
  });

  // merge the partitions of each sequence that had more than one
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t parts = num_parts[s];
      if (parts == 1) continue;
      const int64_t q_start = info[3 * s], rows = info[3 * s + 1] * num_heads, base = first_task[s];
      for (int64_t r = 0; r < rows; ++r) {
        float m = kMasked;
        for (int64_t p = 0; p < parts; ++p)
          m = std::max(m, partial[((base + p) * max_rows + r) * (d + 2) + d]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const float* src = partial.data() + ((base + p) * max_rows + r) * (d + 2);
          const float w = std::exp(src[d] - m);
          sum += w * src[d + 1];
          axpy<D>(acc.data(), w, src, d);
        }
        T* dst = op + (q_start + r / num_heads) * os0 + (r % num_heads) * os1;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(acc[x] * inv);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seqs,
                   double scale, int64_t partition) {
  switch (q.size(2)) {
    case 64: return run<T, C, 64>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
    case 128: return run<T, C, 128>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
    default: return run<T, C, 0>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
  }
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor seqs, double scale, int64_t partition) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: the CPU kernel got a tensor on ", q.device());
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention: q and out are [tokens, heads, head_dim], the caches "
              "[blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention: head_dim must be the innermost, contiguous dimension");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(qt == out.scalar_type() && ct == v_cache.scalar_type(),
              "paged_attention: q and out must share one dtype, and the two caches another");
  const bool narrow = ct == at::kBFloat16 || ct == at::kHalf || ct == at::kFloat8_e4m3fn ||
                      ct == at::kFloat8_e5m2;
  TORCH_CHECK(ct == qt || (qt == at::kFloat && narrow),
              "paged_attention: the caches must have q's dtype, or be bfloat16/float16/float8 under float32 "
              "q; got q ", qt, ", caches ", ct);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seqs.scalar_type() == at::kInt && seqs.is_contiguous() && seqs.size(1) == 3,
              "paged_attention: block_tables [S, W] and seqs [S, 3] are contiguous int32");
  TORCH_CHECK(partition > 0, "paged_attention: partition must be positive");
  if (qt == at::kFloat && ct == at::kBFloat16)
    return dispatch_head<float, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
  if (qt == at::kFloat && ct == at::kHalf)
    return dispatch_head<float, at::Half>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
  if (qt == at::kFloat && ct == at::kFloat8_e4m3fn)
    return dispatch_head<float, at::Float8_e4m3fn>(out, q, k_cache, v_cache, block_tables, seqs, scale,
                                                   partition);
  if (qt == at::kFloat && ct == at::kFloat8_e5m2)
    return dispatch_head<float, at::Float8_e5m2>(out, q, k_cache, v_cache, block_tables, seqs, scale,
                                                 partition);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qt, "paged_attention", [&] {
    dispatch_head<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, seqs, scale, partition);
  });
}

}  // namespace

// NOTE: the GIL is released while it runs (it touches no Python object), so the worker's other threads run
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "out[q rows of each sequence] = softmax(q k^T * scale) v over the sequence's blocks, in place",
        py::call_guard<py::gil_scoped_release>());
}
