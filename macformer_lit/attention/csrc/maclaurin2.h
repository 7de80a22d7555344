// The degree-2 Maclaurin map of one row and of blocks of rows, forward and backward
// (docs/maths.md §14), shared by the map's entry points (maclaurin2_map.cpp) and the fused
// attention (maclaurin2_fused.cpp). No torch headers: built by native_map.py with the
// system's C++ compiler.
#pragma once

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

inline uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    // NaN stays a quiet NaN; everything else rounds to nearest even (c10::BFloat16's rule).
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float from_bf16(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The rows' element type: bfloat16 bits or float, with its conversions from and to float.
struct Bf16 {
    using T = uint16_t;
    static uint16_t store(float v) { return to_bf16(v); }
    static float load(uint16_t v) { return from_bf16(v); }
};
struct F32 {
    using T = float;
    static float store(float v) { return v; }
    static float load(float v) { return v; }
};

template <typename Body>
void with_rows_type(int bf16, Body body) {
    if (bf16)
        body(Bf16{});
    else
        body(F32{});
}

// body(lo, hi) over rows [0, rows) in `threads` chunks of ⌈rows / threads⌉ (the same chunks
// whoever runs them, so the results do not depend on the runtime). Built with OpenMP
// (native_map.py builds with -fopenmp where the compiler has it), the chunks run on the
// OpenMP threads torch's own operators use: the library links libgomp by the name torch's
// copy is already loaded under, so they are the same threads, which otherwise spin for a
// while after each torch operator and take cores from threads of ours. Without OpenMP, on
// std::threads started for the call.
template <typename F>
void parallel_rows(int64_t rows, int threads, F body) {
    if (threads <= 1 || rows < 2 * threads) {
        body(int64_t(0), rows);
        return;
    }
    const int64_t step = (rows + threads - 1) / threads;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
        const int64_t lo = t * step, hi = lo + step < rows ? lo + step : rows;
        if (lo < hi) body(lo, hi);
    }
#else
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) {
        int64_t lo = t * step, hi = lo + step < rows ? lo + step : rows;
        if (lo < hi) pool.emplace_back(body, lo, hi);
    }
    body(int64_t(0), step < rows ? step : rows);
    for (auto& th : pool) th.join();
#endif
}

// One row: x (d) -> out (D' = 1 + d + d(d+1)/2) in OutT (float or bf16 bits).
// Row a of the upper triangle (x_a·x_{a..d-1}, d - a entries) starts at off_a; the window
// of d entries that ends where it ends starts at off_a - a, and holds entries of rows < a
// before it. With the head size d fixed at compile time (DT > 0) every loop is d long, the
// compiler unrolls and vectorises them: the forward writes whole windows in decreasing a
// (each window's first a entries are rewritten by the rows < a that follow), the backward
// reads whole windows and zeroes their first a entries. DT = 0: loops over the triangle's
// rows as they are, for any head size up to 1,024.
template <int DT, typename OutT, typename Store>
void forward_rows(const float* x, const float* scale, OutT* out, int64_t lo, int64_t hi,
                  int d_, int64_t D, float c, Store store) {
    const int d = DT > 0 ? DT : d_;
    float xs[1024];
    for (int64_t r = lo; r < hi; ++r) {
        const float* xr = x + r * d;
        OutT* o = out + r * D;
        for (int a = 0; a < d; ++a) xs[a] = xr[a] * c;
        o[0] = store(1.0f * scale[0]);
        for (int a = 0; a < d; ++a) o[1 + a] = store(xs[a] * scale[1 + a]);
        if (DT > 0) {
            for (int a = d - 1; a >= 0; --a) {
                const int64_t w = 1 + d + int64_t(a) * d - int64_t(a) * (a - 1) / 2 - a;
                const float xa = xs[a];
                OutT* oa = o + w;
                const float* sa = scale + w;
                for (int j = 0; j < DT; ++j) oa[j] = store((xa * xs[j]) * sa[j]);
            }
        } else {
            int64_t off = 1 + d;
            for (int a = 0; a < d; ++a) {
                const float xa = xs[a];
                const int n = d - a;
                OutT* oa = o + off;
                const float* sa = scale + off;
                const float* xb = xs + a;
                for (int j = 0; j < n; ++j) oa[j] = store((xa * xb[j]) * sa[j]);
                off += n;
            }
        }
    }
}

template <int DT, typename InT, typename Load>
void backward_rows(const InT* g, const float* x, const float* scale, float* gx, int64_t lo,
                   int64_t hi, int d_, int64_t D, float c, Load load) {
    const int d = DT > 0 ? DT : d_;
    float xs[1024], acc[1024], gs[1024];
    for (int64_t r = lo; r < hi; ++r) {
        const float* xr = x + r * d;
        const InT* gr = g + r * D;
        for (int a = 0; a < d; ++a) xs[a] = xr[a] * c;
        for (int a = 0; a < d; ++a) acc[a] = load(gr[1 + a]) * scale[1 + a];
        if (DT > 0) {
            for (int a = 0; a < d; ++a) {
                const int64_t w = 1 + d + int64_t(a) * d - int64_t(a) * (a - 1) / 2 - a;
                const InT* ga = gr + w;
                const float* sa = scale + w;
                // g'_ab = g_ab·s_ab for b ≥ a, 0 before: entries of other rows never reach a.
                for (int j = 0; j < DT; ++j) gs[j] = j >= a ? load(ga[j]) * sa[j] : 0.0f;
                // Σ_{b≥a} g'_ab x_b as a tree of halves: vector adds (a running sum is a
                // chain the compiler may not reorder).
                float part[DT > 0 ? DT : 1];
                for (int j = 0; j < DT; ++j) part[j] = gs[j] * xs[j];
                for (int h = DT / 2; h > 0; h /= 2)
                    for (int j = 0; j < h; ++j) part[j] += part[j + h];
                acc[a] += part[0];
                const float xa = xs[a];
                for (int j = 0; j < DT; ++j) acc[j] += gs[j] * xa;      // Σ_{b≤j} g'_bj x_b
            }
        } else {
            int64_t off = 1 + d;
            for (int a = 0; a < d; ++a) {
                const int n = d - a;
                const InT* ga = gr + off;
                const float* sa = scale + off;
                for (int j = 0; j < n; ++j) gs[j] = load(ga[j]) * sa[j];
                float dot = 0.0f;
                for (int j = 0; j < n; ++j) dot += gs[j] * xs[a + j];
                acc[a] += dot;
                const float xa = xs[a];
                for (int j = 0; j < n; ++j) acc[a + j] += gs[j] * xa;
                off += n;
            }
        }
        float* o = gx + r * d;
        for (int a = 0; a < d; ++a) o[a] = acc[a] * c;
    }
}

constexpr int LANES = 32;

// The forward written feature-major, (entries, D', L) contiguous: the layout in which
// φ(k) enters φ(k)ᵀ[v, 1] as a row-major operand. LANES rows side by side, as below.
template <bool FULL, typename OutT, typename Store>
void forward_block(const float* x, const float* scale, OutT* out, int64_t L, int64_t l0,
                   int w, int d, float c, Store store) {
    float xt[1024][LANES];
    const int W = FULL ? LANES : w;
    for (int a = 0; a < d; ++a)
        for (int i = 0; i < LANES; ++i) xt[a][i] = i < W ? x[(l0 + i) * d + a] * c : 0.0f;
    auto put = [&](int64_t f, const float* v) {
        OutT* of = out + f * L + l0;
        if (FULL) {
            for (int i = 0; i < LANES; ++i) of[i] = store(v[i]);
        } else {
            for (int i = 0; i < W; ++i) of[i] = store(v[i]);
        }
    };
    float t[LANES];
    for (int i = 0; i < LANES; ++i) t[i] = 1.0f * scale[0];
    put(0, t);
    for (int a = 0; a < d; ++a) {
        for (int i = 0; i < LANES; ++i) t[i] = xt[a][i] * scale[1 + a];
        put(1 + a, t);
    }
    int64_t f = 1 + d;
    for (int a = 0; a < d; ++a)
        for (int b = a; b < d; ++b, ++f) {
            const float* __restrict__ x_a = xt[a];
            const float* __restrict__ x_b = xt[b];
            const float s = scale[f];
            for (int i = 0; i < LANES; ++i) t[i] = (x_a[i] * x_b[i]) * s;
            put(f, t);
        }
}

template <typename OutT, typename Store>
void forward_lanes(const float* x, const float* scale, OutT* out, int64_t lo, int64_t hi,
                   int64_t L, int d, int64_t D, float c, Store store) {
    const int64_t per_entry = (L + LANES - 1) / LANES;
    for (int64_t item = lo; item < hi; ++item) {
        const int64_t e = item / per_entry, l0 = (item % per_entry) * LANES;
        const int w = int(L - l0 < LANES ? L - l0 : LANES);
        const float* xe = x + e * L * d;
        OutT* oe = out + e * D * L;
        if (w == LANES)
            forward_block<true>(xe, scale, oe, L, l0, w, d, c, store);
        else
            forward_block<false>(xe, scale, oe, L, l0, w, d, c, store);
    }
}

// The backward for a gradient stored feature-major, (entries, D', L) contiguous, as the
// product φ(k)ᵀ[v, 1] returns φ(k)'s: LANES consecutive rows of an entry side by side, so
// every operation is the same on each lane and the compiler vectorises across rows. x is
// (entries, L, d) row-major; each block of rows is transposed into xt (d × LANES) first.

template <bool FULL, typename InT, typename Load>
void backward_block(const InT* g, const float* x, const float* scale, float* gx, int64_t L,
                    int64_t l0, int w, int d, int64_t D, float c, Load load) {
    float xt[1024][LANES], acc[1024][LANES], t[LANES];
    const int W = FULL ? LANES : w;
    for (int a = 0; a < d; ++a)
        for (int i = 0; i < LANES; ++i) {
            xt[a][i] = i < W ? x[(l0 + i) * d + a] * c : 0.0f;
            acc[a][i] = 0.0f;
        }
    auto row = [&](int64_t f, float* out) {
        const InT* gf = g + f * L + l0;
        if (FULL) {
            for (int i = 0; i < LANES; ++i) out[i] = load(gf[i]) * scale[f];
        } else {
            for (int i = 0; i < LANES; ++i) out[i] = i < W ? load(gf[i]) * scale[f] : 0.0f;
        }
    };
    for (int a = 0; a < d; ++a) {
        row(1 + a, t);
        for (int i = 0; i < LANES; ++i) acc[a][i] += t[i];
    }
    int64_t f = 1 + d;
    for (int a = 0; a < d; ++a) {
        float* __restrict__ acc_a = acc[a];
        const float* __restrict__ x_a = xt[a];
        row(f++, t);  // the diagonal g'_aa: 2·g'_aa·x_a
        for (int i = 0; i < LANES; ++i) acc_a[i] += 2.0f * t[i] * x_a[i];
        for (int b = a + 1; b < d; ++b) {
            float* __restrict__ acc_b = acc[b];
            const float* __restrict__ x_b = xt[b];
            row(f++, t);  // g'_ab on every lane
            for (int i = 0; i < LANES; ++i) {
                acc_a[i] += t[i] * x_b[i];
                acc_b[i] += t[i] * x_a[i];
            }
        }
    }
    for (int i = 0; i < W; ++i)
        for (int a = 0; a < d; ++a) gx[(l0 + i) * d + a] = acc[a][i] * c;
}

template <typename InT, typename Load>
void backward_lanes(const InT* g, const float* x, const float* scale, float* gx, int64_t lo,
                    int64_t hi, int64_t L, int d, int64_t D, float c, Load load) {
    // Work items: blocks of LANES rows, numbered over all entries.
    const int64_t per_entry = (L + LANES - 1) / LANES;
    for (int64_t item = lo; item < hi; ++item) {
        const int64_t e = item / per_entry, l0 = (item % per_entry) * LANES;
        const int w = int(L - l0 < LANES ? L - l0 : LANES);
        const InT* ge = g + e * D * L;
        const float* xe = x + e * L * d;
        float* gxe = gx + e * L * d;
        if (w == LANES)
            backward_block<true>(ge, xe, scale, gxe, L, l0, w, d, D, c, load);
        else
            backward_block<false>(ge, xe, scale, gxe, L, l0, w, d, D, c, load);
    }
}

}  // namespace
