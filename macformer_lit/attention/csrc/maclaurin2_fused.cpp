// Bidirectional degree-2 Maclaurin attention's products with the map fused in (docs/maths.md
// §14, fused products): the feature rows are built a tile at a time in a buffer that stays in
// cache and never reach memory. Three primitives, each used once forward and twice backward
// (G groups = batch entries × heads; φ rows of D' = 1 + d + d(d+1)/2 entries; y rows of
// e = d + 1 columns):
//
//   state    S = Σ_l φ(x_l) y_lᵀ                (D' × e)    forward S from (k, [v, 1]);
//                                                            backward ∂S from (q, ∂out)
//   apply    out_l = Sᵀ φ(x_l)                   (e)         forward out from (q, S);
//                                                            backward ∂[v, 1] from (k, ∂S)
//   pullback ∂x_l = J_φ(x_l)ᵀ (S y_l)            (d)         backward ∂q from (q, S, ∂out),
//                                                            ∂k from (k, ∂S, [v, 1])
//
// Everything computes in float32 (the rows are the eager float32 map's, bit for bit: the tile
// is written by forward_rows). The first d columns of y and S go through register-blocked
// loops over GCC/clang vector types of 16 floats (d a multiple of 16: DV = d / 16 vectors a
// row); the last column, one float a row, is vectorised over features instead. The same
// primitives with bfloat16 inputs are in maclaurin2_fused_bf16.h (AVX512-BF16) and
// maclaurin2_fused_amx.h (AMX tiles), parts of this file included below.

#include "maclaurin2.h"

#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include <initializer_list>
#endif

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4), __may_alias__));

inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float s) { return vf{} + s; }
inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

// fn(B, i) for blocks of B = NB entries from i = 0, then one block of what is left (B < NB):
// a remainder in one register block of its own size, not entry by entry.
template <int R, typename F>
inline void last_block(int64_t rem, int64_t i, F& fn) {
    if constexpr (R > 0) {
        if (rem == R)
            fn(std::integral_constant<int, R>{}, i);
        else
            last_block<R - 1>(rem, i, fn);
    }
}

template <int NB, typename F>
inline void in_blocks(int64_t n, F fn) {
    int64_t i = 0;
    for (; i + NB <= n; i += NB) fn(std::integral_constant<int, NB>{}, i);
    last_block<NB - 1>(n - i, i, fn);
}

constexpr int TILE = 32;  // rows of φ built at once: TILE × D' floats (72 KB at d = 32)

inline int64_t up_to(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
static_assert(TILE == LANES, "the pullback hands a tile to backward_block's lanes");

// float rows in and out of the map's templates (function objects: inlined, where a function
// pointer would be an indirect call per entry that stops the loops' vectorisation).
struct Same {
    float operator()(float v) const { return v; }
};

// The map's compiled-in head size for d: its window loops need a power of two (the
// backward's halving sum), other sizes take the plain loops (0).
template <int d>
constexpr int MAP_DT = (d & (d - 1)) == 0 ? d : 0;

// φ rows of x rows [0, n) into tile (row stride D).
template <int d>
inline void map_tile(const float* x, const float* scale, float* tile, int n, int64_t D,
                     float c) {
    forward_rows<MAP_DT<d>>(x, scale, tile, 0, n, d, D, c, Same{});
}

// dot(a, b) over n floats: 16 lanes, one reduction.
inline float dot(const float* a, const float* b, int64_t n) {
    vf acc = vf{};
    int64_t f = 0;
    for (; f + 16 <= n; f += 16) acc += vload(a + f) * vload(b + f);
    float s = hsum(acc);
    for (; f < n; ++f) s += a[f] * b[f];
    return s;
}

// ---- state: S (D' × e) = Σ_l φ(x_l) y_lᵀ for one group ---------------------------------
// S[f][0:d] += Σ_r tile[r][f]·y[r][0:d] for FB features at once, y rows loaded once for them.
template <int DV, int FB>
inline void state_block(const float* tile, int64_t D, const float* y, int e, int n, float* S,
                        int64_t f) {
    vf acc[FB][DV];
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < DV; ++v) acc[j][v] = vload(S + (f + j) * e + 16 * v);
    for (int r = 0; r < n; ++r) {
        vf yv[DV];
        for (int v = 0; v < DV; ++v) yv[v] = vload(y + int64_t(r) * e + 16 * v);
        const float* t = tile + int64_t(r) * D + f;
        for (int j = 0; j < FB; ++j) {
            const vf b = splat(t[j]);
            for (int v = 0; v < DV; ++v) acc[j][v] += b * yv[v];
        }
    }
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < DV; ++v) vstore(S + (f + j) * e + 16 * v, acc[j][v]);
}

template <int DV>
void state_group(const float* x, const float* y, const float* scale, float* S, float* last,
                 float* tile, int64_t L, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, FB = DV == 1 ? 12 : DV == 2 ? 8 : 4;
    for (int64_t i = 0; i < D * e; ++i) S[i] = 0.0f;
    for (int64_t f = 0; f < D; ++f) last[f] = 0.0f;
    for (int64_t r0 = 0; r0 < L; r0 += TILE) {
        const int n = int(L - r0 < TILE ? L - r0 : TILE);
        const float* yt = y + r0 * e;
        map_tile<d>(x + r0 * d, scale, tile, n, D, c);
        int64_t f = 0;
        for (; f + FB <= D; f += FB) state_block<DV, FB>(tile, D, yt, e, n, S, f);
        for (; f < D; ++f) state_block<DV, 1>(tile, D, yt, e, n, S, f);
        // The last column, vectorised over features: last[f] += Σ_r tile[r][f]·y[r][d].
        for (int r = 0; r < n; ++r) {
            const float* t = tile + int64_t(r) * D;
            const float yl = yt[int64_t(r) * e + d];
            const vf b = splat(yl);
            int64_t g = 0;
            for (; g + 16 <= D; g += 16) vstore(last + g, vload(last + g) + b * vload(t + g));
            for (; g < D; ++g) last[g] += yl * t[g];
        }
    }
    for (int64_t f = 0; f < D; ++f) S[f * e + d] = last[f];
}

// ---- apply: out_l = Sᵀ φ(x_l) ---------------------------------------------------------
// out rows [i, i + NB) of a tile: out[r][0:d] = Σ_f tile[r][f]·S[f][0:d], S rows loaded once
// for NB rows.
template <int DV, int NB>
inline void apply_block(const float* tile, int64_t D, const float* S, int e, float* out) {
    vf acc[NB][DV];
    for (int i = 0; i < NB; ++i)
        for (int v = 0; v < DV; ++v) acc[i][v] = vf{};
    for (int64_t f = 0; f < D; ++f) {
        vf s[DV];
        for (int v = 0; v < DV; ++v) s[v] = vload(S + f * e + 16 * v);
        for (int i = 0; i < NB; ++i) {
            const vf b = splat(tile[int64_t(i) * D + f]);
            for (int v = 0; v < DV; ++v) acc[i][v] += b * s[v];
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int v = 0; v < DV; ++v) vstore(out + int64_t(i) * e + 16 * v, acc[i][v]);
}

template <int DV>
void apply_tile(const float* x, const float* S, const float* last, const float* scale,
                float* out, float* tile, int n, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, NB = DV == 1 ? 12 : DV == 2 ? 6 : 3;
    map_tile<d>(x, scale, tile, n, D, c);
    in_blocks<NB>(n, [&](auto B, int64_t i) {
        apply_block<DV, B>(tile + i * D, D, S, e, out + i * e);
    });
    for (int r = 0; r < n; ++r) out[int64_t(r) * e + d] = dot(tile + int64_t(r) * D, last, D);
}

// ---- pullback: ∂x_l = J_φ(x_l)ᵀ h_l, h_l = S y_l ------------------------------------------
// h of a tile feature-major, hT (D' × TILE): hT[f][r] = Σ_c S[f][c]·y[r][c], TILE rows in the
// vector lanes (yT = the tile of y transposed, zero past its rows), FB features at once.
template <int FB>
inline void pull_block(const float* S, int e, const float* yT, float* hT, int64_t f) {
    constexpr int RV = TILE / 16;
    vf acc[FB][RV];
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < RV; ++v) acc[j][v] = vf{};
    for (int col = 0; col < e; ++col) {
        vf yv[RV];
        for (int v = 0; v < RV; ++v) yv[v] = vload(yT + col * TILE + 16 * v);
        for (int j = 0; j < FB; ++j) {
            const vf b = splat(S[(f + j) * e + col]);
            for (int v = 0; v < RV; ++v) acc[j][v] += b * yv[v];
        }
    }
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < RV; ++v) vstore(hT + (f + j) * TILE + 16 * v, acc[j][v]);
}

// The map's backward then reads hT in place, rows side by side in the lanes (backward_block,
// maclaurin2.h), as the native map's backward reads a feature-major gradient.
template <int DV>
void pullback_tile(const float* x, const float* y, const float* S, const float* scale,
                   float* gx, float* hT, float* yT, int n, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, FB = 8;
    for (int col = 0; col < e; ++col)
        for (int i = 0; i < TILE; ++i) yT[col * TILE + i] = i < n ? y[int64_t(i) * e + col] : 0.0f;
    int64_t f = 0;
    for (; f + FB <= D; f += FB) pull_block<FB>(S, e, yT, hT, f);
    for (; f < D; ++f) pull_block<1>(S, e, yT, hT, f);
    if (n == TILE)
        backward_block<true>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
    else
        backward_block<false>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
}

#include "maclaurin2_fused_bf16.h"

template <int DV>
void state_all(const float* x, const float* y, const float* scale, float* S, int64_t G,
               int64_t L, int64_t D, float c, bool bf16, int threads) {
    constexpr int d = 16 * DV, e = d + 1;
#if HAVE_AMX
    if (bf16 && use_amx()) {
        const int64_t Dq = up_to(D, 16);
        parallel_rows(G, threads, [&](int64_t lo, int64_t hi) {
            Tiles tiles({4, 7});
            std::vector<float> tile(TILE * D), ST(e * Dq);
            std::vector<uint32_t> P(NPC * Dq), YT(e * NPC), Yw(TILE / 2 * e);
            for (int64_t g = lo; g < hi; ++g)
                state_group_amx<DV>(x + g * L * d, y + g * L * e, scale, S + g * D * e,
                                    ST.data(), tile.data(), P.data(), YT.data(), Yw.data(), L,
                                    D, Dq, c);
        });
        return;
    }
#endif
    parallel_rows(G, threads, [&](int64_t lo, int64_t hi) {
        std::vector<float> tile(TILE * D), last(D);
#if defined(__AVX512BF16__)
        std::vector<uint32_t> P(bf16 ? TILE / 2 * D : 0), Y(bf16 ? TILE / 2 * d : 0);
#endif
        for (int64_t g = lo; g < hi; ++g) {
            const float *xg = x + g * L * d, *yg = y + g * L * e;
#if defined(__AVX512BF16__)
            if (bf16) {
                state_group_bf16<DV>(xg, yg, scale, S + g * D * e, last.data(), tile.data(),
                                     P.data(), Y.data(), L, D, c);
                continue;
            }
#endif
            state_group<DV>(xg, yg, scale, S + g * D * e, last.data(), tile.data(), L, D, c);
        }
    });
}

template <int DV>
void apply_all(const float* x, const float* S, const float* scale, float* out, int64_t G,
               int64_t L, int64_t D, float c, bool bf16, int threads) {
    constexpr int d = 16 * DV, e = d + 1;
    std::vector<float> last(G * D);  // S's last column of every group, contiguous
    for (int64_t g = 0; g < G; ++g)
        for (int64_t f = 0; f < D; ++f) last[g * D + f] = S[(g * D + f) * e + d];
    const int64_t tiles = (L + TILE - 1) / TILE;
#if defined(__AVX512BF16__)
    if (bf16) {
        // S rounded: two features to a word for the first d columns, W pairs a group (on AMX
        // whole K blocks of 32 features, zeros past D'); the last column.
        const int64_t Dp = D + D % 2, Dk = up_to(D, 32), W = use_amx() ? Dk / 2 : Dp / 2;
        std::vector<uint32_t> Sp(G * W * d, 0u);
        parallel_rows(G, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t g = lo; g < hi; ++g) {
                const float* Sg = S + g * D * e;
                for (int64_t q = 0; q < Dp / 2; ++q)
                    for (int col = 0; col < d; ++col)
                        Sp[(g * W + q) * d + col] = pack2(
                            Sg[2 * q * e + col], 2 * q + 1 < D ? Sg[(2 * q + 1) * e + col] : 0.0f);
            }
        });
        std::vector<uint32_t> lastw(G * (Dp / 2));  // the last column, two features to a word
        for (int64_t g = 0; g < G; ++g)
            for (int64_t q = 0; q < Dp / 2; ++q)
                lastw[g * (Dp / 2) + q] =
                    pack2(last[g * D + 2 * q], 2 * q + 1 < D ? last[g * D + 2 * q + 1] : 0.0f);
#if HAVE_AMX
        if (use_amx()) {
            parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
                Tiles amx;
                std::vector<float> tile(TILE * D), ob(TILE * d);
                std::vector<uint16_t> rows(TILE * Dk);
                for (int64_t item = lo; item < hi; ++item) {
                    const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
                    const int n = int(L - r0 < TILE ? L - r0 : TILE);
                    apply_tile_amx<DV>(x + (g * L + r0) * d, Sp.data() + g * W * d,
                                       lastw.data() + g * (Dp / 2), scale, out + (g * L + r0) * e,
                                       tile.data(), rows.data(), ob.data(), n, D, Dk, c);
                }
            });
            return;
        }
#endif
        parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
            std::vector<float> tile(TILE * D);
            std::vector<uint16_t> rows(TILE * Dp);
            for (int64_t item = lo; item < hi; ++item) {
                const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
                const int n = int(L - r0 < TILE ? L - r0 : TILE);
                apply_tile_bf16<DV>(x + (g * L + r0) * d, Sp.data() + g * W * d,
                                    lastw.data() + g * (Dp / 2), scale,
                                    out + (g * L + r0) * e, tile.data(), rows.data(), n, D, c);
            }
        });
        return;
    }
#endif
    parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
        std::vector<float> tile(TILE * D);
        for (int64_t item = lo; item < hi; ++item) {
            const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
            const int n = int(L - r0 < TILE ? L - r0 : TILE);
            apply_tile<DV>(x + (g * L + r0) * d, S + g * D * e, last.data() + g * D, scale,
                           out + (g * L + r0) * e, tile.data(), n, D, c);
        }
    });
}

template <int DV>
void pullback_all(const float* x, const float* S, const float* y, const float* scale, float* gx,
                  int64_t G, int64_t L, int64_t D, float c, bool bf16, int threads) {
    constexpr int d = 16 * DV, e = d + 1;
    const int64_t tiles = (L + TILE - 1) / TILE;
#if defined(__AVX512BF16__)
    if (bf16) {
        // S rounded, two columns to a word: Sw (G, Dq, Qp) of Q = ⌈e/2⌉ pairs a row; on AMX
        // whole tiles, Dq features and Qp pairs (zeros past D' and past e).
        constexpr int Q = (e + 1) / 2;
        const bool amx = use_amx();
        const int64_t Dq = amx ? up_to(D, 16) : D;
        const int Qp = amx ? (Q + 15) / 16 * 16 : Q;
        std::vector<uint32_t> Sw(G * Dq * Qp, 0u);
        parallel_rows(G * D, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t gf = lo; gf < hi; ++gf) {
                uint32_t* w = Sw.data() + ((gf / D) * Dq + gf % D) * Qp;
                for (int q = 0; q < Q; ++q)
                    w[q] = pack2(S[gf * e + 2 * q], 2 * q + 1 < e ? S[gf * e + 2 * q + 1] : 0.0f);
            }
        });
#if HAVE_AMX
        if (amx) {
            parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
                Tiles amx;
                std::vector<float> hT(Dq * TILE);
                std::vector<uint32_t> yT2(Qp * TILE);
                for (int64_t item = lo; item < hi; ++item) {
                    const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
                    const int n = int(L - r0 < TILE ? L - r0 : TILE);
                    pullback_tile_amx<DV>(x + (g * L + r0) * d, y + (g * L + r0) * e,
                                          Sw.data() + g * Dq * Qp, scale, gx + (g * L + r0) * d,
                                          hT.data(), yT2.data(), n, D, Dq, Qp, c);
                }
            });
            return;
        }
#endif
        parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
            std::vector<float> hT(D * TILE);
            std::vector<uint32_t> yT2(Q * TILE);
            for (int64_t item = lo; item < hi; ++item) {
                const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
                const int n = int(L - r0 < TILE ? L - r0 : TILE);
                pullback_tile_bf16<DV>(x + (g * L + r0) * d, y + (g * L + r0) * e,
                                       Sw.data() + g * D * Q, scale, gx + (g * L + r0) * d,
                                       hT.data(), yT2.data(), n, D, c);
            }
        });
        return;
    }
#endif
    parallel_rows(G * tiles, threads, [&](int64_t lo, int64_t hi) {
        std::vector<float> hT(D * TILE), yT(e * TILE);
        for (int64_t item = lo; item < hi; ++item) {
            const int64_t g = item / tiles, r0 = (item % tiles) * TILE;
            const int n = int(L - r0 < TILE ? L - r0 : TILE);
            pullback_tile<DV>(x + (g * L + r0) * d, y + (g * L + r0) * e, S + g * D * e, scale,
                              gx + (g * L + r0) * d, hT.data(), yT.data(), n, D, c);
        }
    });
}

}  // namespace

#define DISPATCH_DV(fn, ...)                                     \
    switch (d) {                                                 \
        case 16: fn<1>(__VA_ARGS__); break;                      \
        case 32: fn<2>(__VA_ARGS__); break;                      \
        case 48: fn<3>(__VA_ARGS__); break;                      \
        case 64: fn<4>(__VA_ARGS__); break;                      \
        default: return 1;                                       \
    }

#define FUSED_SIZES                                              \
    const int64_t D = 1 + d + int64_t(d) * (d + 1) / 2;          \
    const float c = float(__builtin_pow(double(d), -0.25));

extern "C" {

// Whether bf16 != 0 below rounds the products' inputs to bfloat16 (AVX512-BF16 dot products);
// without the instruction the float32 primitives run.
int maclaurin2_bf16_dot() { return HAVE_BF16_DOT ? 1 : 0; }

// Whether the bfloat16 products run on AMX tiles (built for them, and the tiles granted by
// the kernel); want = 0 or 1 turns them off or on first (the vdpbf16ps loops run when off),
// want < 0 only asks.
int maclaurin2_amx(int want) {
#if HAVE_AMX
    if (want >= 0) amx_wanted = want;
    return use_amx() ? 1 : 0;
#else
    (void)want;
    return 0;
#endif
}

// x (G, L, d), y (G, L, d + 1) -> S (G, D', d + 1); d in {16, 32, 48, 64}, else returns 1.
int maclaurin2_state(const float* x, const float* y, const float* scale, float* S, int64_t G,
                     int64_t L, int d, int bf16, int threads) {
    FUSED_SIZES
    DISPATCH_DV(state_all, x, y, scale, S, G, L, D, c, bf16 != 0, threads);
    return 0;
}

// x (G, L, d), S (G, D', d + 1) -> out (G, L, d + 1).
int maclaurin2_apply(const float* x, const float* S, const float* scale, float* out, int64_t G,
                     int64_t L, int d, int bf16, int threads) {
    FUSED_SIZES
    DISPATCH_DV(apply_all, x, S, scale, out, G, L, D, c, bf16 != 0, threads);
    return 0;
}

// x (G, L, d), S (G, D', d + 1), y (G, L, d + 1) -> gx (G, L, d).
int maclaurin2_pullback(const float* x, const float* S, const float* y, const float* scale,
                        float* gx, int64_t G, int64_t L, int d, int bf16, int threads) {
    FUSED_SIZES
    DISPATCH_DV(pullback_all, x, S, y, scale, gx, G, L, D, c, bf16 != 0, threads);
    return 0;
}

}
