// The map's entry points: rows stored row-major or feature-major, forward and backward.
#include "maclaurin2.h"

#define DISPATCH(fn, ...)                                        \
    switch (d) {                                                 \
        case 16: fn<16>(__VA_ARGS__); break;                     \
        case 32: fn<32>(__VA_ARGS__); break;                     \
        case 64: fn<64>(__VA_ARGS__); break;                     \
        default: fn<0>(__VA_ARGS__);                             \
    }

extern "C" {

// d^(-1/4) in float32, as x * d ** -0.25 multiplies by the double rounded to float.
#define SIZES                                                    \
    if (d > 1024) return 1;                                      \
    const int64_t D = 1 + d + int64_t(d) * (d + 1) / 2;          \
    const float c = float(__builtin_pow(double(d), -0.25));

int maclaurin2_forward(const float* x, const float* scale, void* out, int64_t rows, int d,
                       int bf16, int threads) {
    SIZES
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        auto* o = static_cast<typename E::T*>(out);
        auto store = [](float v) { return E::store(v); };
        parallel_rows(rows, threads, [&](int64_t lo, int64_t hi) {
            DISPATCH(forward_rows, x, scale, o, lo, hi, d, D, c, store);
        });
    });
    return 0;
}

int maclaurin2_forward_lanes(const float* x, const float* scale, void* out, int64_t entries,
                             int64_t L, int d, int bf16, int threads) {
    SIZES
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        auto* o = static_cast<typename E::T*>(out);
        auto store = [](float v) { return E::store(v); };
        parallel_rows(entries * ((L + LANES - 1) / LANES), threads, [&](int64_t lo, int64_t hi) {
            forward_lanes(x, scale, o, lo, hi, L, d, D, c, store);
        });
    });
    return 0;
}

int maclaurin2_backward(const void* g, const float* x, const float* scale, float* gx,
                        int64_t rows, int d, int bf16, int threads) {
    SIZES
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        auto* gg = static_cast<const typename E::T*>(g);
        auto load = [](typename E::T v) { return E::load(v); };
        parallel_rows(rows, threads, [&](int64_t lo, int64_t hi) {
            DISPATCH(backward_rows, gg, x, scale, gx, lo, hi, d, D, c, load);
        });
    });
    return 0;
}

int maclaurin2_backward_lanes(const void* g, const float* x, const float* scale, float* gx,
                              int64_t entries, int64_t L, int d, int bf16, int threads) {
    SIZES
    with_rows_type(bf16, [&](auto e) {
        using E = decltype(e);
        auto* gg = static_cast<const typename E::T*>(g);
        auto load = [](typename E::T v) { return E::load(v); };
        parallel_rows(entries * ((L + LANES - 1) / LANES), threads, [&](int64_t lo, int64_t hi) {
            backward_lanes(gg, x, scale, gx, lo, hi, L, d, D, c, load);
        });
    });
    return 0;
}

// Whether this build runs its threads on OpenMP's (parallel_rows, maclaurin2.h).
int maclaurin2_openmp() {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

}
