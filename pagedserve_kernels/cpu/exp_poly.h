// The constants of the attention kernels' e^x (paged_attention.cpp's exp8,
// prefill_attention.cpp's exp512): x = n ln 2 + r with |r| <= ln 2 / 2, ln 2 split into a
// part with few mantissa bits (n * kLn2High is exact) and the rest, and e^r by the degree-6
// polynomial ((((kE6 r + kE5) r + kE4) r + kE3) r + kE2) r + kE1 times r^2, plus r + 1.
#pragma once

namespace pagedserve::exp_poly {

constexpr float kLog2E = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;  // ln 2 = kLn2High + kLn2Low
constexpr float kE6 = 1.9875691500e-4f, kE5 = 1.3981999507e-3f, kE4 = 8.3334519073e-3f,
                kE3 = 4.1665795894e-2f, kE2 = 1.6666665459e-1f, kE1 = 5.0000001201e-1f;

}  // namespace pagedserve::exp_poly
