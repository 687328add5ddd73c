// Fused CPU kernels for gradcompress codecs (issue 7).
//
// Plain C ABI, loaded with ctypes by gradcompress/codecs/fast.py: no Python, pybind11 or
// torch headers, so it compiles in about a second with any C++17 compiler. Threads are
// std::threads started per call (no OpenMP runtime next to torch's own).
//
// Every kernel reads contiguous float32 input and writes into buffers the caller
// allocated (torch tensors), except the candidate collection of the sparsifiers, whose
// size is only known at the end (a handle: begin / size / finish).
//
// Numerics follow the plain-torch reference path operation by operation (same float32
// divisions, round-half-to-even, no FMA contraction: build with -ffp-contract=off) so
// the deterministic codecs give identical codes. Exceptions: bucket sums and norms are
// accumulated in double (the reference sums in float32 in another order), and the
// stochastic codecs draw their noise from a counter-based 32-bit hash of the seed's key
// and the element index (uniform32) instead of torch.rand. Streaming stores (large outputs
// not read back in the call) and fused passes change memory traffic, never a value.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define GC_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int64_t BLOCK = 256;  // elements per inner block (a multiple of 8)
constexpr float ROUND_MAGIC = 12582912.0f;  // 1.5 * 2^23: (y + M) - M rounds half to even for |y| < 2^22

// Static partition of [0, items) over up to nthreads threads: fn(begin, end, thread_index).
template <class F>
void parallel_for(int64_t items, int nthreads, F fn) {
  if (items <= 0) return;
  int t = nthreads < 1 ? 1 : nthreads;
  if (t > items) t = static_cast<int>(items);
  if (t == 1) {
    fn(int64_t(0), items, 0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (int i = 1; i < t; ++i) {
    const int64_t b = items * i / t, e = items * (i + 1) / t;
    pool.emplace_back([&fn, b, e, i] { fn(b, e, i); });
  }
  fn(int64_t(0), items / t, 0);
  for (auto& th : pool) th.join();
}

// Outputs of at least this many bytes are written with streaming (non-temporal) stores where nothing reads them
// back in the same call: far larger than the L2 cache, so they would leave it anyway, and a streaming store skips
// reading each destination line before overwriting it (a third of the memory traffic of a decode).
constexpr int64_t STREAM_MIN_BYTES = int64_t(4) << 20;

// dst[0..len) = src[0..len) (src: a small buffer in L1), with streaming stores on the aligned part of dst.
// Call stream_fence() before the written memory is handed to anyone else (other threads, the caller).
inline void stream_copy(float* __restrict dst, const float* __restrict src, int64_t len) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j < len && (reinterpret_cast<uintptr_t>(dst + j) & 63); ++j) dst[j] = src[j];
  for (; j + 16 <= len; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#elif defined(__AVX__)
  for (; j < len && (reinterpret_cast<uintptr_t>(dst + j) & 31); ++j) dst[j] = src[j];
  for (; j + 8 <= len; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#elif defined(__SSE2__)
  for (; j < len && (reinterpret_cast<uintptr_t>(dst + j) & 15); ++j) dst[j] = src[j];
  for (; j + 4 <= len; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
#endif
  for (; j < len; ++j) dst[j] = src[j];
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

inline uint32_t abs_key(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b & 0x7fffffffu;  // the order of these keys is the order of |v|, NaN above +Inf
}

inline float key_float(uint32_t k) {
  float f;
  std::memcpy(&f, &k, 4);
  return f;
}

inline uint64_t mix64(uint64_t z) {  // SplitMix64's output function
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

inline uint32_t hash32(uint32_t z) {  // "lowbias32" (C. Wellons): a multiply-xorshift bijection of 32 bits
  z ^= z >> 16;
  z *= 0x7FEB352Du;
  z ^= z >> 15;
  z *= 0x846CA68Bu;
  return z ^ (z >> 16);
}

// Counter-based uniform noise of element i (a 32-bit counter) for the 64-bit stream key: two hash32 rounds,
// the key's low half XOR-ed into the counter before the first and its high half added before the second;
// the top 24 bits as a float in [0, 1), like torch.rand. Plain uint32 arithmetic without branches, so that a
// loop over consecutive counters vectorises (SSE2 emulates the 32-bit multiplies, AVX2 and wider have them).
inline float uniform32(uint32_t k0, uint32_t k1, uint32_t i) {
  return static_cast<float>(hash32(hash32(i ^ k0) + k1) >> 8) * 0x1p-24f;
}

// u[j] = the noise of counter base + j (mod 2^32) for j < len <= BLOCK.
void fill_uniform(uint64_t key, uint32_t base, int64_t len, float* __restrict u) {
  const uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32), n = uint32_t(len);
  for (uint32_t j = 0; j < n; ++j) u[j] = uniform32(k0, k1, base + j);
}

inline float round_even(float y) { return (y + ROUND_MAGIC) - ROUND_MAGIC; }

// floor(y) for |y| < 2^22, as an int. (The comparison becomes an int before any arithmetic: a float select such
// as r - float(r > y), which GCC folds into a conditional subtraction, does not vectorise without AVX-512 masks.)
inline int floor_small(float y) {
  const float r = round_even(y);
  const int above = r > y;
  return int(r) - above;
}

// Unbiased stochastic rounding of y (|y| < 2^22) with the uniform u in [0, 1): floor(y) + 1 when u < y - floor(y),
// else floor(y).
inline int round_stochastic(float y, float u) {
  const int f = floor_small(y);
  const int up = u < y - float(f);
  return f + up;
}

enum Kind { UNIFORM = 0, QSGD = 1, TERNGRAD = 2, SIGN = 3 };

struct QParams {
  int kind;
  int bits;
  int qmax;  // UNIFORM: qmax; QSGD: levels
  int stochastic;
  uint64_t key;
};

// ----------------------------------------------------------------------------- packing
// codes[0..len) (each < 2^BITS) into the bytes at out, code i at bits [i*BITS, (i+1)*BITS)
// of the little-endian stream; a partial last byte has its high bits zero.
template <int BITS>
void pack_block(const uint8_t* c, int64_t len, uint8_t* out) {
  if (BITS == 8) {
    std::memcpy(out, c, len);
    return;
  }
  const int64_t full = len / 8;
  if (BITS == 1) {
    for (int64_t g = 0; g < full; ++g) {
      const uint8_t* s = c + 8 * g;
      out[g] = uint8_t(s[0] | s[1] << 1 | s[2] << 2 | s[3] << 3 | s[4] << 4 | s[5] << 5 | s[6] << 6 | s[7] << 7);
    }
  } else if (BITS == 2) {
    for (int64_t j = 0; j < full * 2; ++j) {
      const uint8_t* s = c + 4 * j;
      out[j] = uint8_t(s[0] | s[1] << 2 | s[2] << 4 | s[3] << 6);
    }
  } else if (BITS == 4) {
    for (int64_t j = 0; j < full * 4; ++j) out[j] = uint8_t(c[2 * j] | c[2 * j + 1] << 4);
  } else {
    for (int64_t g = 0; g < full; ++g) {
      uint64_t w = 0;
      for (int k = 0; k < 8; ++k) w |= uint64_t(c[8 * g + k]) << (k * BITS);
      std::memcpy(out + g * BITS, &w, BITS);  // little-endian: the low BITS bytes
    }
  }
  const int64_t rem = len - full * 8;
  if (rem) {
    uint64_t w = 0;
    for (int64_t k = 0; k < rem; ++k) w |= uint64_t(c[8 * full + k]) << (k * BITS);
    std::memcpy(out + full * BITS, &w, (rem * BITS + 7) / 8);
  }
}

template <int BITS>
void unpack_block(const uint8_t* in, int64_t len, uint8_t* c) {
  if (BITS == 8) {
    std::memcpy(c, in, len);
    return;
  }
  constexpr uint64_t mask = (uint64_t(1) << BITS) - 1;
  const int64_t full = len / 8;
  if (BITS == 1) {
    for (int64_t g = 0; g < full; ++g)
      for (int k = 0; k < 8; ++k) c[8 * g + k] = (in[g] >> k) & 1;
  } else if (BITS == 2) {
    for (int64_t j = 0; j < full * 2; ++j)
      for (int k = 0; k < 4; ++k) c[4 * j + k] = (in[j] >> (2 * k)) & 3;
  } else if (BITS == 4) {
    for (int64_t j = 0; j < full * 4; ++j) {
      c[2 * j] = in[j] & 15;
      c[2 * j + 1] = in[j] >> 4;
    }
  } else {
    for (int64_t g = 0; g < full; ++g) {
      uint64_t w = 0;
      std::memcpy(&w, in + g * BITS, BITS);
      for (int k = 0; k < 8; ++k) c[8 * g + k] = uint8_t((w >> (k * BITS)) & mask);
    }
  }
  const int64_t rem = len - full * 8;
  if (rem) {
    uint64_t w = 0;
    std::memcpy(&w, in + full * BITS, (rem * BITS + 7) / 8);
    for (int64_t k = 0; k < rem; ++k) c[8 * full + k] = uint8_t((w >> (k * BITS)) & mask);
  }
}

// ----------------------------------------------------------------------------- quantisers
// The bucket's scale (what the payload sends): UNIFORM amax / qmax, QSGD the L2 norm,
// TERNGRAD amax, SIGN mean |x|. Non-finite buckets give a non-finite scale.
float bucket_scale(const float* x, int64_t len, const QParams& p) {
  if (p.kind == SIGN) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += std::fabs(double(x[i + l]));
    for (; i < len; ++i) acc[0] += std::fabs(double(x[i]));
    const double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    return float(s / double(len));
  }
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t k = abs_key(x[i]);
    m = k > m ? k : m;
  }
  if (p.kind == QSGD) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int l = 0; l < 8; ++l) {
        const double v = x[i + l];
        acc[l] += v * v;
      }
    for (; i < len; ++i) {
      const double v = x[i];
      acc[0] += v * v;
    }
    if (m >= 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();  // as the reference's bucket_norm
    const double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    return float(std::sqrt(s));
  }
  const float amax = key_float(m);  // NaN if the bucket holds a NaN (amax propagates it)
  return p.kind == UNIFORM ? amax / float(p.qmax) : amax;
}

// Codes of one block (x[0..len), len <= BLOCK, noise counter of x[0] is base) in [0, 2^bits) (int8: two's
// complement). (Parameters are copied to locals and pointers are __restrict: c is a char type, which may
// alias anything, and would otherwise force reloads per element and no vectorisation.) The stochastic kinds
// draw the block's noise first (fill_uniform), then quantise with it: two loops that each vectorise.
void block_codes(const float* __restrict x, int64_t len, uint32_t base, float s, const QParams p,
                 uint8_t* __restrict c) {
  const bool ok = s > 0.0f && s < std::numeric_limits<float>::infinity();
  alignas(64) float u[BLOCK];
  if (ok && (p.stochastic || p.kind == QSGD || p.kind == TERNGRAD)) fill_uniform(p.key, base, len, u);
  switch (p.kind) {
    case UNIFORM: {
      const float q = float(p.qmax);
      const int off = p.bits == 8 ? 0 : p.qmax + 1;
      if (!ok) {
        std::memset(c, off, len);
        return;
      }
      if (!p.stochastic) {
        for (int64_t j = 0; j < len; ++j) {
          float r = round_even(x[j] / s);
          r = r < -q ? -q : (r > q ? q : r);
          c[j] = uint8_t(int(r) + off);
        }
      } else {
        const int qi = p.qmax;
        for (int64_t j = 0; j < len; ++j) {
          int r = round_stochastic(x[j] / s, u[j]);
          r = r < -qi ? -qi : r;
          r = r > qi ? qi : r;
          c[j] = uint8_t(r + off);
        }
      }
      return;
    }
    case QSGD: {
      const int L = p.qmax;
      if (!ok) {
        std::memset(c, L, len);
        return;
      }
      const float lv = float(L);
      for (int64_t j = 0; j < len; ++j) {
        int level = round_stochastic((std::fabs(x[j]) / s) * lv, u[j]);
        level = level > L ? L : level;
        c[j] = uint8_t(level * (1 - 2 * int(x[j] < 0.0f)) + L);  // branch-free: vectorises
      }
      return;
    }
    case TERNGRAD: {
      if (!ok) {
        std::memset(c, 1, len);
        return;
      }
      for (int64_t j = 0; j < len; ++j) {
        const float prob = std::fabs(x[j]) / s;
        const int keep = u[j] < prob;
        c[j] = uint8_t(1 + keep * (1 - 2 * int(x[j] < 0.0f)));  // 0, 1 or 2, branch-free: vectorises
      }
      return;
    }
    default:  // SIGN
      for (int64_t j = 0; j < len; ++j) c[j] = uint8_t(x[j] >= 0.0f);
      return;
  }
}

// How codes decode: float(code * mul - offset) * (scale / div); int8 codes (is_signed) are two's complement.
struct Decode {
  int is_signed;
  int mul;
  int offset;
  float div;
};

// Residual storage: float32, or bfloat16 (the upper 16 bits of a float32; stored rounded to nearest even, NaN as
// 0x7FC0, as torch's float -> bfloat16 conversion does).
inline float load_res(const float* r, int64_t i) { return r[i]; }
inline float load_res(const uint16_t* r, int64_t i) {
  const uint32_t u = uint32_t(r[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store_res(float* r, int64_t i, float v) { r[i] = v; }
inline void store_res(uint16_t* r, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  r[i] = std::isnan(v) ? uint16_t(0x7FC0) : uint16_t((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

// The mean of W payloads of one codec, bucket by bucket: (decode(payload 0) + ... + decode(payload W-1)) / divisor,
// summed left to right in float32 and divided once in float32 — the values of dequantize_impl into a buffer, W - 1
// accumulating dequantize_impl calls and torch's div_ of the buffer (a power-of-two divisor multiplies by its
// inverse: the same real number, rounded once, so the same float).
struct MeanSource {
  const uint8_t* const* codes;  // W payloads' codes, element 0 of each at the same element
  const float* const* scale;    // their scales, bucket 0 of each at the same bucket
  int world;
  float divisor;
  Decode d;
  bool exact_inverse;
  float inverse;

  MeanSource(const uint8_t* const* c, const float* const* s, int w, float div, const Decode& dec)
      : codes(c), scale(s), world(w), divisor(div), d(dec) {
    int exponent = 0;
    exact_inverse = std::frexp(divisor, &exponent) == 0.5f && exponent > -125 && exponent < 126;
    inverse = 1.0f / divisor;
  }

  // y[0..len) = the mean of bucket b (its first element is element start).
  template <int BITS>
  void fill(int64_t b, int64_t start, int64_t len, float* __restrict y) const {
    alignas(64) uint8_t c[BLOCK];
    alignas(64) float v[BLOCK];
    alignas(64) float acc[BLOCK];
    const int mul = d.mul, offset = d.offset;
    for (int64_t o = 0; o < len; o += BLOCK) {
      const int64_t l = std::min(BLOCK, len - o);
      for (int i = 0; i < world; ++i) {
        const float s = scale[i][b] / d.div;
        float* __restrict dst = i ? v : acc;
        if (BITS == 8 && d.is_signed) {
          const int8_t* ci = reinterpret_cast<const int8_t*>(codes[i]) + start + o;
          for (int64_t j = 0; j < l; ++j) dst[j] = float(ci[j]) * s;
        } else {
          unpack_block<BITS>(codes[i] + (start + o) * BITS / 8, l, c);
          for (int64_t j = 0; j < l; ++j) dst[j] = float(int(c[j]) * mul - offset) * s;
        }
        if (i)
          for (int64_t j = 0; j < l; ++j) acc[j] += v[j];
      }
      float* __restrict yo = y + o;
      if (exact_inverse)
        for (int64_t j = 0; j < l; ++j) yo[j] = acc[j] * inverse;
      else
        for (int64_t j = 0; j < l; ++j) yo[j] = acc[j] / divisor;
    }
  }
};

// quantize_impl for int8 codes rounded to nearest (UNIFORM, 8 bits, not stochastic, decoded as float(c) * scale):
// per bucket one pass that adds the residual and takes the abs-max, one that writes the codes straight into the
// payload and the new residual (streamed for large tensors when float32). The same operations on every element
// as block_codes, pack_block<8> and the residual loop of quantize_impl, in fewer passes over the bucket.
template <class R>
void int8_uniform(const float* x, const R* r, int64_t n, int64_t bucket, int qmax, int8_t* codes, float* scale,
                  R* rout, const MeanSource* mean, int nthreads) {
  const int64_t nb = (n + bucket - 1) / bucket;
  const bool stream = std::is_same<R, float>::value && rout && n * int64_t(sizeof(float)) >= STREAM_MIN_BYTES;
  parallel_for(nb, nthreads, [&](int64_t b0, int64_t b1, int) {
    std::vector<float> sum(r || mean ? bucket : 0), fed(stream ? bucket : 0);
    const float q = float(qmax);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bucket, len = std::min(bucket, n - start);
      const float* y = mean ? sum.data() : x + start;  // may alias rout (not __restrict): read before written
      uint32_t m = 0;
      if (mean) {
        mean->fill<8>(b, start, len, sum.data());
        for (int64_t j = 0; j < len; ++j) {
          const uint32_t k = abs_key(y[j]);
          m = k > m ? k : m;
        }
      } else if (r) {
        float* __restrict t = sum.data();
        const float* __restrict xs = x + start;
        const R* __restrict rs = r + start;
        for (int64_t j = 0; j < len; ++j) {
          t[j] = xs[j] + load_res(rs, j);
          const uint32_t k = abs_key(t[j]);
          m = k > m ? k : m;
        }
        y = t;
      } else {
        for (int64_t j = 0; j < len; ++j) {
          const uint32_t k = abs_key(y[j]);
          m = k > m ? k : m;
        }
      }
      const float s = key_float(m) / q;  // NaN if the bucket holds a NaN (bucket_scale's UNIFORM scale)
      scale[b] = s;
      const float sd = s / 1.0f;
      int8_t* __restrict c = codes + start;
      if (s > 0.0f && s < std::numeric_limits<float>::infinity()) {
        for (int64_t j = 0; j < len; ++j) {
          float v = round_even(y[j] / s);
          v = v < -q ? -q : (v > q ? q : v);
          c[j] = int8_t(int(v));
        }
      } else {
        std::memset(c, 0, len);
      }
      if (!rout) continue;
      if (stream) {
        float* __restrict f = fed.data();
        for (int64_t j = 0; j < len; ++j) f[j] = y[j] - float(c[j]) * sd;
        stream_copy(reinterpret_cast<float*>(rout) + start, f, len);
      } else {
        R* ro = rout + start;
        for (int64_t j = 0; j < len; ++j) store_res(ro, j, y[j] - float(c[j]) * sd);
      }
    }
    if (stream) stream_fence();
  });
}

// Codes and scales of x + r (r may be null: x alone). With rout (error feedback fused into the encode):
// rout = (x + r) - decode(codes), element by element, in the same pass; x + r is never materialised
// beyond one bucket. rout may alias x or r (each bucket is read whole before any of it is written).
// mean (may be null): encode the mean of W payloads of this codec (MeanSource; x and r unused) instead of x + r.
template <int BITS, class R>
void quantize_impl(const float* x, const R* r, int64_t n, int64_t bucket, const QParams& p, const Decode& d,
                   uint8_t* codes, float* scale, R* rout, uint64_t index0, const MeanSource* mean, int nthreads) {
  const int64_t nb = (n + bucket - 1) / bucket;
  if (BITS == 8 && p.kind == UNIFORM && !p.stochastic && d.is_signed && d.mul == 1 && d.offset == 0 &&
      d.div == 1.0f) {  // int8 (round to nearest): its own two-pass loop, the same values
    int8_uniform(x, r, n, bucket, p.qmax, reinterpret_cast<int8_t*>(codes), scale, rout, mean, nthreads);
    return;
  }
  parallel_for(nb, nthreads, [&](int64_t b0, int64_t b1, int) {
    alignas(64) uint8_t c[BLOCK];
    std::vector<float> sum(r || mean ? bucket : 0);
    const int mul = d.mul, offset = d.offset;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bucket, len = std::min(bucket, n - start);
      const float* y = x + start;
      if (mean) {
        mean->fill<BITS>(b, start, len, sum.data());
        y = sum.data();
      } else if (r) {
        float* __restrict t = sum.data();
        const float* __restrict xs = x + start;
        const R* __restrict rs = r + start;
        for (int64_t j = 0; j < len; ++j) t[j] = xs[j] + load_res(rs, j);
        y = t;
      }
      const float s = bucket_scale(y, len, p);
      scale[b] = s;
      const float sd = s / d.div;
      for (int64_t o = 0; o < len; o += BLOCK) {
        const int64_t l = std::min(BLOCK, len - o);
        block_codes(y + o, l, uint32_t(index0 + uint64_t(start + o)), s, p, c);
        pack_block<BITS>(c, l, codes + (start + o) * BITS / 8);  // start + o is a multiple of 8 when BITS < 8
        if (!rout) continue;
        R* ro = rout + start + o;
        const float* yo = y + o;
        if (BITS == 8 && d.is_signed) {
          for (int64_t j = 0; j < l; ++j) store_res(ro, j, yo[j] - float(int8_t(c[j])) * sd);
        } else {
          for (int64_t j = 0; j < l; ++j) store_res(ro, j, yo[j] - float(int(c[j]) * mul - offset) * sd);
        }
      }
    }
  });
}

// y = float(code * mul - offset) * (scale[b] / div) (accumulate: y += that); int8 codes (BITS 8, is_signed) are
// two's complement.
template <int BITS>
void dequantize_impl(const uint8_t* codes, const float* scale, int64_t n, int64_t bucket, const Decode& d,
                     int accumulate, float* out, int nthreads) {
  const int64_t nb = (n + bucket - 1) / bucket;
  const int mul = d.mul, offset = d.offset;
  const bool stream = !accumulate && n * int64_t(sizeof(float)) >= STREAM_MIN_BYTES;
  parallel_for(nb, nthreads, [&](int64_t b0, int64_t b1, int) {
    alignas(64) uint8_t c[BLOCK];
    alignas(64) float v[BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bucket, len = std::min(bucket, n - start);
      const float s = scale[b] / d.div;
      for (int64_t o = 0; o < len; o += BLOCK) {
        const int64_t l = std::min(BLOCK, len - o);
        float* y = out + start + o;
        float* dst = accumulate || stream ? v : y;
        if (BITS == 8 && d.is_signed) {
          const int8_t* ci = reinterpret_cast<const int8_t*>(codes) + start + o;
          for (int64_t j = 0; j < l; ++j) dst[j] = float(ci[j]) * s;
        } else {
          unpack_block<BITS>(codes + (start + o) * BITS / 8, l, c);
          for (int64_t j = 0; j < l; ++j) dst[j] = float(int(c[j]) * mul - offset) * s;
        }
        if (accumulate)
          for (int64_t j = 0; j < l; ++j) y[j] += v[j];
        else if (stream)
          stream_copy(y, v, l);
      }
    }
    if (stream) stream_fence();
  });
}

// out = (decode(payload 0) + ... + decode(payload W-1)) / divisor for all n elements (MeanSource).
template <int BITS>
void dequantize_mean_impl(const MeanSource& src, int64_t n, int64_t bucket, float* out, int nthreads) {
  const int64_t nb = (n + bucket - 1) / bucket;
  parallel_for(nb, nthreads, [&](int64_t b0, int64_t b1, int) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bucket;
      src.fill<BITS>(b, start, std::min(bucket, n - start), out + start);
    }
  });
}

// ----------------------------------------------------------------------------- sparsifiers
// Indices i (ascending) with abs_key(x[i]) >= tkey, i.e. !(|x[i]| < t), NaN included.
struct Collected {
  static constexpr int64_t CHUNK = int64_t(1) << 16;
  std::vector<std::vector<std::vector<int32_t>>> per_thread;  // thread -> list of chunks
  int64_t total = 0;
};

void collect_range(const float* x, int64_t b, int64_t e, uint32_t tkey, std::vector<std::vector<int32_t>>& chunks) {
  constexpr int64_t W = 1024;
  std::vector<int32_t>* cur = nullptr;
  int64_t fill = Collected::CHUNK;
  alignas(64) int32_t tmp[W];
  for (int64_t o = b; o < e; o += W) {
    const int64_t l = std::min(W, e - o);
    const float* xs = x + o;
    int32_t cnt = 0;  // keys and tkey are below 2^31: a signed compare, which SSE2 vectorises
    for (int64_t j = 0; j < l; ++j) cnt += int32_t(abs_key(xs[j])) >= int32_t(tkey);
    if (!cnt) continue;
    int64_t w = 0;
    if (cnt * 16 < l) {  // sparse block (top-k's usual case): a well-predicted branch beats a store per element
      for (int64_t j = 0; j < l; ++j)
        if (abs_key(xs[j]) >= tkey) tmp[w++] = int32_t(o + j);
    } else {
      for (int64_t j = 0; j < l; ++j) {
        tmp[w] = int32_t(o + j);
        w += abs_key(xs[j]) >= tkey;
      }
    }
    for (int64_t j = 0; j < w;) {
      if (fill == Collected::CHUNK) {
        chunks.emplace_back();
        cur = &chunks.back();
        cur->resize(Collected::CHUNK);
        fill = 0;
      }
      const int64_t take = std::min(w - j, Collected::CHUNK - fill);
      std::memcpy(cur->data() + fill, tmp + j, take * 4);
      fill += take;
      j += take;
    }
  }
  if (cur) cur->resize(fill);
}

// k largest of keys (ascending positions cand, or 0..c-1 when cand is null) -> out (ascending).
int64_t select_top(const float* x, const int32_t* cand, int64_t c, int64_t k, int32_t* out) {
  if (k <= 0) return 0;
  std::vector<uint32_t> keys(c);
  for (int64_t i = 0; i < c; ++i) keys[i] = abs_key(x[cand ? cand[i] : i]);
  uint32_t kth;
  int64_t greater = 0;
  if (k >= c) {
    kth = 0;
    greater = 0;
  } else {
    std::nth_element(keys.begin(), keys.begin() + (c - k), keys.end());
    kth = keys[c - k];
    for (int64_t i = c - k + 1; i < c; ++i) greater += keys[i] > kth;  // the k - 1 above position c - k are >= kth
    for (int64_t i = 0; i < c; ++i) keys[i] = abs_key(x[cand ? cand[i] : i]);  // restore the order
  }
  int64_t ties = k - greater, w = 0;
  for (int64_t i = 0; i < c && w < k; ++i) {
    const uint32_t key = keys[i];
    if (key > kth || (key == kth && ties > 0)) {
      if (key == kth) --ties;
      out[w++] = cand ? cand[i] : int32_t(i);
    }
  }
  return w;
}

}  // namespace

// ============================================================================= C API
GC_API int gc_version() { return 10; }

#define GC_BITS_SWITCH(CALL)           \
  switch (bits) {                      \
    case 1: CALL(1); break;            \
    case 2: CALL(2); break;            \
    case 3: CALL(3); break;            \
    case 4: CALL(4); break;            \
    case 5: CALL(5); break;            \
    case 6: CALL(6); break;            \
    case 7: CALL(7); break;            \
    default: CALL(8); break;           \
  }

// codes: int8 (bits 8, UNIFORM), uint8 otherwise, packed to ceil(n * bits / 8) bytes (bits < 8 needs bucket % 8 == 0).
// Encodes x + r (r may be null); rout (may be null) receives (x + r) - decode(codes), decoded as gc_dequantize does
// with (is_signed, mul, offset, div); r and rout hold float32, or bfloat16 when res_bf16. Element i draws the noise
// of counter index0 + i (a piece of a longer tensor draws what the whole tensor would); the counter is 32 bits, so
// index0 + n <= 2^32.
GC_API int gc_quantize(const float* x, const void* r, int64_t n, int64_t bucket, int kind, int bits, int qmax,
                       int stochastic, uint64_t key, void* codes, float* scale, void* rout, int is_signed, int mul,
                       int offset, float div, uint64_t index0, int res_bf16, int nthreads) {
  if (bits < 1 || bits > 8 || (bits < 8 && bucket % 8) || bucket < 1) return -1;
  if (n < 0 || index0 > (uint64_t(1) << 32) - uint64_t(n)) return -2;
  const QParams p{kind, bits, qmax, stochastic, key};
  const Decode d{is_signed, mul, offset, div};
  uint8_t* c = static_cast<uint8_t*>(codes);
  if (res_bf16) {
    const uint16_t* rr = static_cast<const uint16_t*>(r);
    uint16_t* ro = static_cast<uint16_t*>(rout);
#define GC_Q(B) quantize_impl<B, uint16_t>(x, rr, n, bucket, p, d, c, scale, ro, index0, nullptr, nthreads)
    GC_BITS_SWITCH(GC_Q)
#undef GC_Q
  } else {
    const float* rr = static_cast<const float*>(r);
    float* ro = static_cast<float*>(rout);
#define GC_Q(B) quantize_impl<B, float>(x, rr, n, bucket, p, d, c, scale, ro, index0, nullptr, nthreads)
    GC_BITS_SWITCH(GC_Q)
#undef GC_Q
  }
  return 0;
}

// out = decoded codes (accumulate: out += them).
GC_API int gc_dequantize(const void* codes, const float* scale, int64_t n, int64_t bucket, int bits, int is_signed,
                         int mul, int offset, float div, int accumulate, float* out, int nthreads) {
  if (bits < 1 || bits > 8 || (bits < 8 && bucket % 8) || bucket < 1) return -1;
  const Decode d{is_signed, mul, offset, div};
  const uint8_t* c = static_cast<const uint8_t*>(codes);
#define GC_D(B) dequantize_impl<B>(c, scale, n, bucket, d, accumulate, out, nthreads)
  GC_BITS_SWITCH(GC_D)
#undef GC_D
  return 0;
}

// out = the mean of world payloads of n elements (codes[i], scale[i]): dequantize_mean_impl.
GC_API int gc_dequantize_mean(const void* const* codes, const float* const* scale, int world, int64_t n,
                              int64_t bucket, int bits, int is_signed, int mul, int offset, float div, float divisor,
                              float* out, int nthreads) {
  if (bits < 1 || bits > 8 || (bits < 8 && bucket % 8) || bucket < 1 || world < 1) return -1;
  const MeanSource src(reinterpret_cast<const uint8_t* const*>(codes), scale, world, divisor,
                       Decode{is_signed, mul, offset, div});
#define GC_M(B) dequantize_mean_impl<B>(src, n, bucket, out, nthreads)
  GC_BITS_SWITCH(GC_M)
#undef GC_M
  return 0;
}

// codes_out, scale_out = the encode (as gc_quantize without residuals) of the mean of world payloads of this codec
// (codes[i], scale[i]: n elements each, decoded with is_signed, mul, offset, div; summed in order, divided by
// divisor): the codes and scales of gc_dequantize_mean into a buffer and gc_quantize of it, without the buffer.
GC_API int gc_quantize_mean(const void* const* codes, const float* const* scale, int world, float divisor, int64_t n,
                            int64_t bucket, int kind, int bits, int qmax, int stochastic, uint64_t key,
                            void* codes_out, float* scale_out, int is_signed, int mul, int offset, float div,
                            uint64_t index0, int nthreads) {
  if (bits < 1 || bits > 8 || (bits < 8 && bucket % 8) || bucket < 1 || world < 1) return -1;
  if (n < 0 || index0 > (uint64_t(1) << 32) - uint64_t(n)) return -2;
  const QParams p{kind, bits, qmax, stochastic, key};
  const Decode d{is_signed, mul, offset, div};
  const MeanSource src(reinterpret_cast<const uint8_t* const*>(codes), scale, world, divisor, d);
  uint8_t* c = static_cast<uint8_t*>(codes_out);
#define GC_Q(B) quantize_impl<B, float>(nullptr, nullptr, n, bucket, p, d, c, scale_out, nullptr, index0, &src, nthreads)
  GC_BITS_SWITCH(GC_Q)
#undef GC_Q
  return 0;
}

// pack / unpack of uint8 codes (packing.pack / packing.unpack for large tensors).
GC_API int gc_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out, int nthreads) {
  if (bits < 1 || bits > 8) return -1;
  const int64_t groups = (n + 8 * BLOCK - 1) / (8 * BLOCK);  // units of 8 * BLOCK codes
  parallel_for(groups, nthreads, [&](int64_t g0, int64_t g1, int) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * 8 * BLOCK, len = std::min(8 * BLOCK, n - start);
      uint8_t* o = out + start / 8 * bits;
      switch (bits) {
        case 1: pack_block<1>(codes + start, len, o); break;
        case 2: pack_block<2>(codes + start, len, o); break;
        case 3: pack_block<3>(codes + start, len, o); break;
        case 4: pack_block<4>(codes + start, len, o); break;
        case 5: pack_block<5>(codes + start, len, o); break;
        case 6: pack_block<6>(codes + start, len, o); break;
        case 7: pack_block<7>(codes + start, len, o); break;
        default: pack_block<8>(codes + start, len, o); break;
      }
    }
  });
  return 0;
}

GC_API int gc_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* out, int nthreads) {
  if (bits < 1 || bits > 8) return -1;
  const int64_t groups = (n + 8 * BLOCK - 1) / (8 * BLOCK);
  parallel_for(groups, nthreads, [&](int64_t g0, int64_t g1, int) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * 8 * BLOCK, len = std::min(8 * BLOCK, n - start);
      const uint8_t* in = packed + start / 8 * bits;
      switch (bits) {
        case 1: unpack_block<1>(in, len, out + start); break;
        case 2: unpack_block<2>(in, len, out + start); break;
        case 3: unpack_block<3>(in, len, out + start); break;
        case 4: unpack_block<4>(in, len, out + start); break;
        case 5: unpack_block<5>(in, len, out + start); break;
        case 6: unpack_block<6>(in, len, out + start); break;
        case 7: unpack_block<7>(in, len, out + start); break;
        default: unpack_block<8>(in, len, out + start); break;
      }
    }
  });
  return 0;
}

// |x| keys at m positions drawn uniformly with replacement from the stream of key.
GC_API void gc_sample_keys(const float* x, int64_t n, int64_t m, uint64_t key, uint32_t* out, int nthreads) {
  parallel_for(m, nthreads, [&](int64_t b, int64_t e, int) {
    for (int64_t j = b; j < e; ++j) {
      const uint64_t h = mix64(key + uint64_t(j + 1) * GOLDEN);
      const uint64_t pos = uint64_t((static_cast<unsigned __int128>(h) * uint64_t(n)) >> 64);
      out[j] = abs_key(x[pos]);
    }
  });
}

// The r-th largest (1-based) of keys[0..m); reorders keys.
GC_API uint32_t gc_kth_largest(uint32_t* keys, int64_t m, int64_t r) {
  std::nth_element(keys, keys + (m - r), keys + m);
  return keys[m - r];
}

GC_API uint32_t gc_abs_key(float v) { return abs_key(v); }

// Collect the ascending indices i with abs_key(x[i]) >= tkey: returns a handle (null on
// allocation failure); gc_collected_size, then gc_collected_finish (copies and frees) or gc_collected_free.
GC_API void* gc_collect(const float* x, int64_t n, uint32_t tkey, int nthreads) {
  Collected* h = nullptr;
  try {
    h = new Collected();
    const int t = int(std::max<int64_t>(1, std::min<int64_t>(nthreads < 1 ? 1 : nthreads, n)));
    h->per_thread.resize(t);
    std::atomic<bool> failed(false);
    parallel_for(n, t, [&](int64_t b, int64_t e, int i) {
      try {
        collect_range(x, b, e, tkey, h->per_thread[i]);
      } catch (const std::bad_alloc&) {
        failed = true;
      }
    });
    if (failed) {
      delete h;
      return nullptr;
    }
    for (auto& chunks : h->per_thread)
      for (auto& c : chunks) h->total += int64_t(c.size());
  } catch (const std::bad_alloc&) {
    delete h;
    return nullptr;
  }
  return h;
}

GC_API int64_t gc_collected_size(void* handle) { return static_cast<Collected*>(handle)->total; }

GC_API void gc_collected_free(void* handle) { delete static_cast<Collected*>(handle); }

GC_API void gc_collected_finish(void* handle, int32_t* out) {
  Collected* h = static_cast<Collected*>(handle);
  int64_t w = 0;
  for (auto& chunks : h->per_thread)
    for (auto& c : chunks) {
      std::memcpy(out + w, c.data(), c.size() * 4);
      w += int64_t(c.size());
    }
  delete h;
}

// Exact top-k by |x| among ascending candidate positions cand[0..c) (all of x when cand is
// null): the k with the largest keys, ties at the k-th key broken by position; out ascending.
// Returns the count written (k), or -1 on allocation failure.
GC_API int64_t gc_select_top(const float* x, const int32_t* cand, int64_t c, int64_t k, int32_t* out) {
  try {
    return select_top(x, cand, c, k, out);
  } catch (const std::bad_alloc&) {
    return -1;
  }
}

// ----------------------------------------------------------------------------- random-k positions
// A keyed pseudo-random permutation of [0, 2^b): the index's high and low halves are each
// XOR-ed RANDK_ROUNDS / 2 times with a hash (SplitMix64's mix of a round key plus the other
// half), alternately, every round a bijection (a Feistel network with unequal halves).
constexpr int RANDK_ROUNDS = 6;

struct Feistel {
  int lo;
  uint64_t mlo, mhi;
  uint64_t keys[RANDK_ROUNDS];
  Feistel(int b, uint64_t key) : lo(b / 2), mlo((uint64_t(1) << (b / 2)) - 1), mhi((uint64_t(1) << (b - b / 2)) - 1) {
    for (int r = 0; r < RANDK_ROUNDS; ++r) keys[r] = mix64(key + uint64_t(r + 1) * GOLDEN);
  }
  inline uint64_t operator()(uint64_t i) const {
    uint64_t hi = i >> lo, low = i & mlo;
    for (int r = 0; r < RANDK_ROUNDS; r += 2) {
      low ^= mix64(keys[r] + hi) & mlo;
      hi ^= mix64(keys[r + 1] + low) & mhi;
    }
    return (hi << lo) | low;
  }
};

// out[0..k) = the first k values below n of the permutation of [0, 2^b) (2^b the least power
// of two >= n, b >= 1) applied to 0, 1, 2, ..., in ascending order: k distinct positions, about
// 2^b / n * k evaluations, done in rounds of ranges split over the threads (kept in order).
GC_API int gc_random_positions(int64_t n, int64_t k, uint64_t key, int64_t* out, int nthreads) {
  int b = 1;
  while ((int64_t(1) << b) < n) ++b;
  const Feistel perm(b, key);
  int64_t w = 0;
  uint64_t start = 0;
  try {
    while (w < k) {
      const int64_t need = k - w;
      const int64_t span = int64_t((static_cast<unsigned __int128>(need) << b) / uint64_t(n)) + need / 64 + 1024;
      const int t = int(std::max<int64_t>(1, std::min<int64_t>(nthreads < 1 ? 1 : nthreads, span / 65536 + 1)));
      std::vector<std::vector<int64_t>> got(t);
      parallel_for(span, t, [&](int64_t lo, int64_t hi, int i) {
        std::vector<int64_t>& g = got[i];
        g.resize(size_t(hi - lo));
        int64_t c = 0;
        uint64_t p[BLOCK];
        for (int64_t j0 = lo; j0 < hi; j0 += BLOCK) {
          const int64_t len = std::min<int64_t>(BLOCK, hi - j0);
          for (int64_t j = 0; j < len; ++j) p[j] = perm(start + uint64_t(j0 + j));  // vectorised
          for (int64_t j = 0; j < len; ++j) {
            g[c] = int64_t(p[j]);
            c += p[j] < uint64_t(n);
          }
        }
        g.resize(size_t(c));
      });
      for (auto& g : got) {
        const int64_t c = std::min<int64_t>(int64_t(g.size()), k - w);
        std::memcpy(out + w, g.data(), size_t(c) * 8);
        w += c;
      }
      start += uint64_t(span);
    }
    // ascending order (a bitmap of [0, n): k bit sets, then one scan), so that gathering and scattering
    // the kept values stream through memory instead of jumping
    std::vector<uint64_t> bits(size_t((n + 63) / 64), 0);
    for (int64_t i = 0; i < k; ++i) bits[size_t(out[i] >> 6)] |= uint64_t(1) << (out[i] & 63);
    int64_t w2 = 0;
    for (size_t word = 0; word < bits.size(); ++word)
      for (uint64_t b = bits[word]; b; b &= b - 1) out[w2++] = int64_t(word * 64 + size_t(__builtin_ctzll(b)));
  } catch (const std::bad_alloc&) {
    return -1;
  }
  return 0;
}
