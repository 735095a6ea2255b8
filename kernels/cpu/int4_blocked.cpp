// int4 weights in blocks of 16 output rows: the decode-step kernel for wide batches.
//
// quant_linear.cpp's int4 layout keeps each output row's groups together, so a row of x
// against one group is one integer dot over 32 weights, and turning that dot's vector of
// partial sums into a float costs a convert and an FMA per (row of x, output row, group):
// with 8 rows of x that post-processing, not the multiply-adds, bounded the kernel (a 1B
// Llama layer at 8 rows: 15 ms against 3.4 ms at one row). Here the vector lanes are 16
// output rows instead: one multiply-add takes two weights of each of 16 output rows
// against one broadcast pair of x's values, so after a group's 16 multiply-adds each lane
// holds its output row's whole group dot and one convert + FMA scales 16 of them.
//
// Layout, for block b (output rows 16 b .. 16 b + 15), group g (32 input columns), quad t
// (columns 4 t .. 4 t + 3 of the group): 32 bytes at ((b G + g) 8 + t) 32, where
//   byte 2 j     = q[16 b + j, 32 g + 4 t]     | q[16 b + j, 32 g + 4 t + 2] << 4
//   byte 2 j + 1 = q[16 b + j, 32 g + 4 t + 1] | q[16 b + j, 32 g + 4 t + 3] << 4
// so the low nibbles widened to int16 are, lane j, the pair (q[.., 4t], q[.., 4t + 1]) and
// the high nibbles the pair (4t + 2, 4t + 3): what vpdpwssd / madd multiply with the
// broadcast int32 (xq[4t], xq[4t + 1]) and (xq[4t + 2], xq[4t + 3]). Example, block 0,
// group 0, quad 0 with q[j, 0..3] = (1, 2, 3, 4) for every j: byte 2j = 0x31, 2j + 1 = 0x42.
// Scales and mins are float16 [N / 16, G, 16] (lane j of group g = row 16 b + j).
// engine.models.quant.block_int4 builds this layout from quant_linear.cpp's.
//
// Arithmetic (the same as quant_linear.cpp, so the same reference): x is rounded per row
// and group of 32 to int16 with scale dx, and
//   out[m, n] = sum_g scales[n, g] dx[m, g] (q[n, g] . xq[m, g]) + mins[n, g] dx[m, g] sum(xq[m, g])
// Each (m, n) takes the same instructions in the same order whatever the batch: the
// kernel is batch invariant. Reference: kernels.reference.quant_linear_ref.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "group32_activations.h"
#include "spin_pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

namespace {

using namespace pagedserve::group32;  // kGroup, half_to_float, halves, quantize_activations

constexpr int64_t kLanes = 16, kBlockBytesPerGroup = 256;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
inline __m512i pair_dot(__m512i acc, __m512i w, int32_t x_pair) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x_pair));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(x_pair)));
#endif
}

// out[m0 .. m0 + R - 1, 16 b .. 16 b + 15] from one block's bytes.
template <int R>
void block_rows(const uint8_t* block, const uint16_t* scales, const uint16_t* mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const uint8_t* bytes = block + g * kBlockBytesPerGroup;
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * t));
      const __m512i w01 = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low4));
      const __m512i w23 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs =
            reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
        dot[r] = pair_dot(pair_dot(dot[r], w01, pairs[0]), w23, pairs[1]);
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(scales + g * kLanes)));
    const __m512 lowest = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(mins + g * kLanes)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                               _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(lowest, _mm512_set1_ps(a.sums[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * out_stride, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__)
// The same on 256-bit vectors: lanes 0-7 and 8-15 of the block in two registers.
template <int R>
void block_rows(const uint8_t* block, const uint16_t* scales, const uint16_t* mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    const uint8_t* bytes = block + g * kBlockBytesPerGroup;
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * t));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const __m256i w[2][2] = {
          {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)),
           _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi))},
          {_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)),
           _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1))}};
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs =
            reinterpret_cast<const int32_t*>(a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t);
        const __m256i x01 = _mm256_set1_epi32(pairs[0]), x23 = _mm256_set1_epi32(pairs[1]);
        for (int h = 0; h < 2; ++h)
          dot[r][h] = _mm256_add_epi32(
              dot[r][h], _mm256_add_epi32(_mm256_madd_epi16(w[h][0], x01),
                                          _mm256_madd_epi16(w[h][1], x23)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kLanes + 8 * h)));
      const __m256 lowest = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kLanes + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]),
                                    _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(lowest, _mm256_set1_ps(a.sums[at]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (m0 + r) * out_stride + 8 * h, acc[r][h]);
}
#else
template <int R>
void block_rows(const uint8_t* block, const uint16_t* scales, const uint16_t* mins,
                int64_t groups, const QuantizedActivations& a, int64_t cols, int64_t m0, float* out,
                int64_t out_stride) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kLanes; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int t = 0; t < 8; ++t) {
          const uint8_t* b = block + g * kBlockBytesPerGroup + 32 * t + 2 * j;
          const int16_t* x = a.values.data() + (m0 + r) * cols + g * kGroup + 4 * t;
          dot += (b[0] & 15) * x[0] + (b[1] & 15) * x[1] + (b[0] >> 4) * x[2] + (b[1] >> 4) * x[3];
        }
        const int64_t at = (m0 + r) * groups + g;
        const float s = half_to_float(scales[g * kLanes + j]);
        const float mn = half_to_float(mins[g * kLanes + j]);
        acc = std::fma(static_cast<float>(dot), s * a.scales[at], acc);
        acc = std::fma(mn, a.sums[at], acc);
      }
      out[(m0 + r) * out_stride + j] = acc;
    }
}
#endif


}  // namespace

bool is_blocked_int4(const at::Tensor& packed) { return packed.dim() == 3; }

at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockBytesPerGroup,
              "blocked int4 weights must be a contiguous uint8 [N / 16, K / 32, 256] tensor");
  const int64_t blocks = packed.size(0), groups = packed.size(1), cols = groups * kGroup;
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == blocks && t->size(1) == groups && t->size(2) == kLanes,
                "blocked int4 scales and mins must be contiguous float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weight ", cols);
  const int64_t rows = x.size(0), num_out = blocks * kLanes;
  const QuantizedActivations a = quantize_activations(x.data_ptr<float>(), rows, cols,
                                                      /*pairs=*/false, /*transposed=*/false);
  at::Tensor out = at::empty({rows, num_out}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* s = halves(scales);
  const uint16_t* mn = halves(mins);
  pagedserve::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = w + b * groups * kBlockBytesPerGroup;
      const uint16_t* bs = s + b * groups * kLanes;
      const uint16_t* bm = mn + b * groups * kLanes;
      float* o = op + b * kLanes;
      int64_t m0 = 0;
      for (; m0 + 8 <= rows; m0 += 8) block_rows<8>(block, bs, bm, groups, a, cols, m0, o, num_out);
      for (; m0 + 4 <= rows; m0 += 4) block_rows<4>(block, bs, bm, groups, a, cols, m0, o, num_out);
      for (; m0 < rows; ++m0) block_rows<1>(block, bs, bm, groups, a, cols, m0, o, num_out);
    }
  });
  return out;
}

// Block `block`'s 16 rows as float32 [16, K] (the tiled path's weights). For each group
// and quad, the low and high nibbles interleaved by 16-bit units are, per 128-bit lane,
// 4 rows x their 4 values in column order: [j v0 v1 v2 v3, j+1 v0 .. v3, ...].
void decode_blocked_int4(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst) {
  const int64_t groups = packed.size(1), cols = groups * kGroup;
  const uint8_t* bytes = packed.data_ptr<uint8_t>() + block * groups * kBlockBytesPerGroup;
  const c10::Half* s = scales.data_ptr<c10::Half>() + block * groups * kLanes;
  const c10::Half* mn = mins.data_ptr<c10::Half>() + block * groups * kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    float scale[kLanes], lowest[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      scale[j] = s[g * kLanes + j];
      lowest[j] = mn[g * kLanes + j];
    }
#if defined(__AVX512F__)
    // Per 4 rows j .. j + 3: 16 floats [scale[j] x 4, scale[j + 1] x 4, ...], once a group.
    const __m512i repeat4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 scale4[4], lowest4[4];
    for (int i = 0; i < 4; ++i) {
      scale4[i] = _mm512_permutexvar_ps(repeat4, _mm512_castps128_ps512(_mm_loadu_ps(scale + 4 * i)));
      lowest4[i] = _mm512_permutexvar_ps(repeat4, _mm512_castps128_ps512(_mm_loadu_ps(lowest + 4 * i)));
    }
#endif
    for (int t = 0; t < 8; ++t) {
      const uint8_t* p = bytes + g * kBlockBytesPerGroup + 32 * t;
#if defined(__AVX2__)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      // 128-bit lane 0: rows 0-3 (unpacklo) and 4-7 (unpackhi); lane 1: rows 8-11, 12-15.
      const __m256i quads[2] = {_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi)};
      for (int half = 0; half < 2; ++half)
        for (int lane = 0; lane < 2; ++lane) {
          const __m128i rows4 = lane == 0 ? _mm256_castsi256_si128(quads[half])
                                          : _mm256_extracti128_si256(quads[half], 1);
          const int j0 = 8 * lane + 4 * half;
          float* y = dst + j0 * cols + g * kGroup + 4 * t;
#if defined(__AVX512F__)
          const __m512 values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(rows4)),
                                                scale4[j0 / 4], lowest4[j0 / 4]);
          _mm_storeu_ps(y, _mm512_extractf32x4_ps(values, 0));
          _mm_storeu_ps(y + cols, _mm512_extractf32x4_ps(values, 1));
          _mm_storeu_ps(y + 2 * cols, _mm512_extractf32x4_ps(values, 2));
          _mm_storeu_ps(y + 3 * cols, _mm512_extractf32x4_ps(values, 3));
#else
          for (int i = 0; i < 4; i += 2) {  // rows j0 + i, j0 + i + 1: bytes 4 i .. 4 i + 7
            const int j = j0 + i;
            const __m256 q = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(i == 0 ? rows4 : _mm_srli_si128(rows4, 8)));
            const __m256 values = _mm256_fmadd_ps(
                q, _mm256_set_m128(_mm_set1_ps(scale[j + 1]), _mm_set1_ps(scale[j])),
                _mm256_set_m128(_mm_set1_ps(lowest[j + 1]), _mm_set1_ps(lowest[j])));
            _mm_storeu_ps(y + i * cols, _mm256_castps256_ps128(values));
            _mm_storeu_ps(y + (i + 1) * cols, _mm256_extractf128_ps(values, 1));
          }
#endif
        }
#else
      for (int j = 0; j < kLanes; ++j) {
        float* y = dst + j * cols + g * kGroup + 4 * t;
        y[0] = lowest[j] + scale[j] * static_cast<float>(p[2 * j] & 15);
        y[1] = lowest[j] + scale[j] * static_cast<float>(p[2 * j + 1] & 15);
        y[2] = lowest[j] + scale[j] * static_cast<float>(p[2 * j] >> 4);
        y[3] = lowest[j] + scale[j] * static_cast<float>(p[2 * j + 1] >> 4);
      }
#endif
    }
  }
}
