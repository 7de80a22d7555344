// ppSBN's passes over q, k and the attention's output as native loops (ppsbn.py,
// native_sbn; docs/maths.md §10): pre-SBN with batch statistics, forward and backward, and
// post-SBN's signed power, forward and backward. Eager, each is 7 to 12 ATen passes over an
// activation-sized tensor, most of them writing a temporary; here one or two passes read
// the rows and write only what the next step needs.
//
// Layout: x (B, H, L, d) float32, contiguous; a row is (b, h, l). Pre-SBN's input x and its
// gradient gx may have any strides (sb, sh, sl) with d contiguous: q and k arrive as the
// (B, L, H, d) projections' transposed views, and are read and written there without a
// copy. w: the (B, L) weights of
// real positions (1 real, 0 padded), or null when every position is real. Per-channel sums
// accumulate in double, a (b, h) group at a time, then over the batch in order: the same
// bits on any thread count, and within float32's rounding of the float64 sums
// (tests/attention/test_native_sbn.py).
#include <cmath>
#include <cstdint>
#include <vector>

#include "maclaurin2.h"

namespace {

// exp and log of float32 without libm calls, so that the loops vectorise (-O3
// -march=native): Cephes' range reductions and polynomials (the ones SLEEF and Eigen use
// for float32), within 2 ulp of the exact values over the ranges post-SBN reaches: log of
// normal positive numbers (|y| is clamped at the smallest normal), exp of any float
// (below -87.3: 0, above 88.7: inf, as the exact value rounds).
inline float bits_to_float(int32_t i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}

inline int32_t float_to_bits(float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i;
}

inline float exp_f32(float x) {
    const float hi = 88.7228394f, lo = -87.3365479f;
    const float xc = x > hi ? hi : (x < lo ? lo : x);
    // x = n ln 2 + r, |r| ≤ ln 2 / 2, ln 2 split in two parts so that n ln 2 is exact.
    const float n = std::nearbyint(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = (p * r) * r + r + 1.0f;
    // 2^n in two factors, so that n = 128 (x near the top) and n = -126 stay normal.
    const int32_t ni = int32_t(n);
    const float s1 = bits_to_float((ni / 2 + 127) << 23);
    const float s2 = bits_to_float((ni - ni / 2 + 127) << 23);
    const float y = e * s1 * s2;
    return x > hi ? INFINITY : (x < lo ? 0.0f : y);
}

inline float log_f32(float x) {
    // x = m 2^e with m in [√½, √2): log x = e ln 2 + log m.
    const int32_t bits = float_to_bits(x);
    int32_t e = ((bits >> 23) & 0xFF) - 126;
    float m = bits_to_float((bits & 0x007FFFFF) | 0x3F000000);  // in [½, 1)
    const bool small = m < 0.707106781186547524f;
    e = small ? e - 1 : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float p = 7.0376836292e-2f;
    p = p * m - 1.1514610310e-1f;
    p = p * m + 1.1676998740e-1f;
    p = p * m - 1.2420140846e-1f;
    p = p * m + 1.4249322787e-1f;
    p = p * m - 1.6668057665e-1f;
    p = p * m + 2.0000714765e-1f;
    p = p * m - 2.4999993993e-1f;
    p = p * m + 3.3333331174e-1f;
    float y = p * m * z;
    const float ef = float(e);
    y = y + ef * -2.12194440e-4f;
    y = y - 0.5f * z;
    return m + y + ef * 0.693359375f;
}

// Σ a[c]·b[c] over c < d in 16 partial sums (vector lanes; float additions do not
// reassociate without being written so), added pairwise at the end: a fixed order.
inline float dot16(const float* a, const float* b, int d) {
    float part[16] = {0};
    int c = 0;
    for (; c + 16 <= d; c += 16)
        for (int j = 0; j < 16; ++j) part[j] += a[c + j] * b[c + j];
    for (int j = 0; c + j < d; ++j) part[j] += a[c + j] * b[c + j];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) part[j] += part[j + w];
    return part[0];
}

// The (b, h) group of row r (rows of L positions, H heads).
struct Layout {
    int64_t B, H, L, d;
    int64_t sb = H * L * d, sh = L * d, sl = d;  // a strided x's element strides
    int64_t group(int64_t r) const { return r / L; }
    // Where row r starts in the strided x.
    int64_t at(int64_t r) const { return (r / (H * L)) * sb + ((r / L) % H) * sh + (r % L) * sl; }
    int64_t head(int64_t r) const { return (r / L) % H; }
    int64_t position(int64_t r) const { return (r / (H * L)) * L + r % L; }  // index into w
};

// Σ over each group's rows of f(row, acc) into part[group * width ..], groups in parallel.
template <typename F>
void group_sums(const Layout& s, int width, double* part, int threads, F f) {
    parallel_rows(s.B * s.H, threads, [&](int64_t lo, int64_t hi) {
        std::vector<double> acc(width);
        for (int64_t gi = lo; gi < hi; ++gi) {
            for (int c = 0; c < width; ++c) acc[c] = 0.0;
            for (int64_t r = gi * s.L; r < (gi + 1) * s.L; ++r) f(r, acc.data());
            for (int c = 0; c < width; ++c) part[gi * width + c] = acc[c];
        }
    });
}

// out (H, width) = Σ over the batch of part (B, H, width), b = 0, 1, … in order.
void batch_total(const Layout& s, int width, const double* part, double* out) {
    for (int64_t i = 0; i < s.H * width; ++i) out[i] = 0.0;
    for (int64_t b = 0; b < s.B; ++b)
        for (int64_t i = 0; i < s.H * width; ++i) out[i] += part[b * s.H * width + i];
}

}  // namespace

extern "C" {

// out (H, d) = Σ over the batch and positions of w·x (mean null) or w·(x − mean)² (mean:
// (H, d) float32, the batch mean as the caller rounded it). x float32, or bfloat16 bits
// (bf16 = 1: read as the float32 it converts to exactly).
int sbn_moment(const void* x, const float* w, const float* mean, double* out, int64_t sb,
               int64_t sh, int64_t sl, int64_t B, int64_t H, int64_t L, int d, int bf16,
               int threads) {
    const Layout s{B, H, L, d, sb, sh, sl};
    std::vector<double> part(B * H * d);
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        const auto* xx = static_cast<const typename E::T*>(x);
        group_sums(s, d, part.data(), threads, [&](int64_t r, double* acc) {
            const auto* xr = xx + s.at(r);
            const double wr = w ? double(w[s.position(r)]) : 1.0;
            if (mean) {
                const float* m = mean + s.head(r) * d;
                for (int c = 0; c < d; ++c) {
                    const double t = double(E::load(xr[c])) - double(m[c]);
                    acc[c] += wr * t * t;
                }
            } else {
                for (int c = 0; c < d; ++c) acc[c] += wr * double(E::load(xr[c]));
            }
        });
    });
    batch_total(s, d, part.data(), out);
    return 0;
}

// y = z/‖z‖ per row with z = shift + x·inv_std ((H, d) each); norm (B, H, L) = ‖z‖ (at
// least 1e-12); with tau ((H,) float32, or null) also y_tau = τ_h·y (the queries' output),
// y kept for the backward. y_tau may be null. x float32 or bfloat16 bits (bf16 = 1).
int sbn_normalise(const void* x, const float* shift, const float* inv_std, const float* tau,
                  float* y, float* y_tau, float* norm, int64_t sb, int64_t sh, int64_t sl,
                  int64_t B, int64_t H, int64_t L, int d, int bf16, int threads) {
    const Layout s{B, H, L, d, sb, sh, sl};
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        const auto* xx = static_cast<const typename E::T*>(x);
        parallel_rows(B * H * L, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t r = lo; r < hi; ++r) {
                const int64_t h = s.head(r);
                const auto* xr = xx + s.at(r);
                const float *sh = shift + h * d, *is = inv_std + h * d;
                float* yr = y + r * d;
                for (int c = 0; c < d; ++c) yr[c] = sh[c] + E::load(xr[c]) * is[c];
                float n = std::sqrt(dot16(yr, yr, d));
                n = n > 1e-12f ? n : 1e-12f;
                if (norm) norm[r] = n;
                for (int c = 0; c < d; ++c) yr[c] = yr[c] / n;
                if (tau && y_tau) {
                    const float t = tau[h];
                    float* yt = y_tau + r * d;
                    for (int c = 0; c < d; ++c) yt[c] = yr[c] * t;
                }
            }
        });
    });
    return 0;
}

// The backward's two per-channel sums over every row (padded ones included), with
// gz = (gy − y⟨y, gy⟩)/‖z‖ and gy = τ_h·g (g itself without tau): sums (2, H, d) =
// [Σ gz, Σ gz·(y‖z‖)]; and with tau, gtau (H,) = Σ ⟨g, y⟩ over the head's rows.
int sbn_backward_sums(const float* y, const float* norm, const float* g, const float* tau,
                      double* sums, double* gtau, int64_t B, int64_t H, int64_t L, int d,
                      int threads) {
    const Layout s{B, H, L, d};
    const int width = 2 * d + 1;
    std::vector<double> part(B * H * width), total(H * width);
    group_sums(s, width, part.data(), threads, [&](int64_t r, double* acc) {
        const float *yr = y + r * d, *gr = g + r * d;
        const float t = tau ? tau[s.head(r)] : 1.0f, n = norm[r];
        const float gdot = dot16(gr, yr, d), dot = gdot * t;
        for (int c = 0; c < d; ++c) {
            const float gz = (gr[c] * t - yr[c] * dot) / n;
            acc[c] += double(gz);
            acc[d + c] += double(gz * (yr[c] * n));
        }
        acc[2 * d] += double(gdot);
    });
    batch_total(s, width, part.data(), total.data());
    for (int64_t h = 0; h < H; ++h) {
        for (int c = 0; c < d; ++c) {
            sums[h * d + c] = total[h * width + c];
            sums[(H + h) * d + c] = total[h * width + d + c];
        }
        if (gtau) gtau[h] = total[h * width + 2 * d];
    }
    return 0;
}

// gx = (gz − w·(mean_g + y‖z‖·mean_gz))·inv_std, gz as above; mean_g, mean_gz (H, d) the
// sums over the real rows' count (all-reduced across ranks by the caller). gx float32, or
// bfloat16 bits (bf16 = 1: rounded to nearest even, as a cast of the float32 gradient).
int sbn_backward_apply(const float* y, const float* norm, const float* g, const float* tau,
                       const float* w, const float* mean_g, const float* mean_gz,
                       const float* inv_std, void* gx, int64_t sb, int64_t sh, int64_t sl,
                       int64_t B, int64_t H, int64_t L, int d, int bf16, int threads) {
    const Layout s{B, H, L, d, sb, sh, sl};
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        auto* gxx = static_cast<typename E::T*>(gx);
        parallel_rows(B * H * L, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t r = lo; r < hi; ++r) {
                const int64_t h = s.head(r);
                const float *yr = y + r * d, *gr = g + r * d;
                const float *mg = mean_g + h * d, *mz = mean_gz + h * d, *is = inv_std + h * d;
                const float t = tau ? tau[h] : 1.0f, n = norm[r];
                const float wr = w ? w[s.position(r)] : 1.0f;
                const float dot = dot16(gr, yr, d) * t;
                auto* o = gxx + s.at(r);
                for (int c = 0; c < d; ++c) {
                    const float gz = (gr[c] * t - yr[c] * dot) / n;
                    const float corr = (mg[c] + (yr[c] * n) * mz[c]) * wr;
                    o[c] = E::store((gz - corr) * is[c]);
                }
            }
        });
    });
    return 0;
}

// Post-SBN: result = y·exp((β − 1)·log|y|) with y = γ·out, γ and β (Hg, d) per head
// (Hg = H) or shared (Hg = 1); log|y| (|y| at least the smallest normal float) kept in
// log_abs for the backward. result has strides (sb, sh, sl) (the heads' merged layout
// (B, L, H, d), which the output projection reads without a copy).
int post_sbn_forward(const float* out, const float* gamma, const float* beta, float* result,
                     float* log_abs, int64_t sb, int64_t sh, int64_t sl, int64_t B, int64_t H,
                     int64_t L, int d, int shared, int threads) {
    const Layout s{B, H, L, d, sb, sh, sl};
    const float tiny = 1.17549435e-38f;
    parallel_rows(B * H * L, threads, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
            const int64_t h = shared ? 0 : s.head(r);
            const float *o = out + r * d, *ga = gamma + h * d, *be = beta + h * d;
            float *res = result + s.at(r), *la = log_abs + r * d;
            for (int c = 0; c < d; ++c) {
                const float y = ga[c] * o[c];
                const float a = std::fabs(y);
                const float l = log_f32(a > tiny ? a : tiny);
                la[c] = l;
                res[c] = y * exp_f32(l * (be[c] - 1.0f));
            }
        }
    });
    return 0;
}

// Its backward: with p = g·|y|^(β−1), ∂out = p·(β·γ); per (head, channel) sums (2, Hg, d)
// of p·out and p·out·log|y| over the batch and positions (γ's and log β's gradients but
// for their factors β and β·γ, applied by the caller). g has strides (sb, sh, sl), as the
// merged heads' gradient arrives.
int post_sbn_backward(const float* g, const float* out, const float* log_abs, const float* gamma,
                      const float* beta, float* g_out, double* sums, int64_t sb, int64_t sh,
                      int64_t sl, int64_t B, int64_t H, int64_t L, int d, int shared,
                      int threads) {
    const Layout s{B, H, L, d, sb, sh, sl};
    const int width = 2 * d;
    std::vector<double> part(B * H * width), total(H * width);
    group_sums(s, width, part.data(), threads, [&](int64_t r, double* acc) {
        const int64_t h = shared ? 0 : s.head(r);
        const float *gr = g + s.at(r), *o = out + r * d, *la = log_abs + r * d;
        const float *ga = gamma + h * d, *be = beta + h * d;
        float* go = g_out + r * d;
        for (int c = 0; c < d; ++c) {
            const float p = exp_f32(la[c] * (be[c] - 1.0f)) * gr[c];
            go[c] = p * (be[c] * ga[c]);
            const float t = p * o[c];
            acc[c] += double(t);
            acc[d + c] += double(t * la[c]);
        }
    });
    batch_total(s, width, part.data(), total.data());
    const int64_t Hg = shared ? 1 : H;
    for (int64_t i = 0; i < 2 * Hg * d; ++i) sums[i] = 0.0;
    for (int64_t h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c) {
            const int64_t to = shared ? 0 : h;
            sums[to * d + c] += total[h * width + c];
            sums[(Hg + to) * d + c] += total[h * width + d + c];
        }
    return 0;
}

}  // extern "C"
