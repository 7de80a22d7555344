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
// row); the last column, one float a row, is vectorised over features instead.

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

// ---- bfloat16 inputs (feature_dtype: bfloat16) ---------------------------------------------
// The products' inputs rounded to bfloat16 (to nearest even, as torch), products accumulated in
// float32: the φ rows, y and the state, as the unfused path's bfloat16 GEMMs take them (but
// the state and the results stay float32). With AVX512-BF16, vdpbf16ps multiplies two
// bfloat16 pairs a lane, twice float32's rate: operands are packed as 32-bit words holding
// two bfloat16 values (two rows, two features or two columns, whichever the sum runs over).
// Without it the float32 primitives run instead (the same inputs unrounded: closer to exact).
#if defined(__AVX512BF16__)
constexpr bool HAVE_BF16_DOT = true;

inline uint32_t pack2(float lo, float hi) {
    return uint32_t(to_bf16(lo)) | (uint32_t(to_bf16(hi)) << 16);
}
inline __m512bh words(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh word(uint32_t w) { return (__m512bh)_mm512_set1_epi32(int(w)); }
inline vf dot2(vf acc, __m512bh a, __m512bh b) { return (vf)_mm512_dpbf16_ps((__m512)acc, a, b); }

typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

// 16 floats rounded to bfloat16 (to_bf16's rule, lane by lane): the bits in each lane's low
// half; packed two vectors to a word (lo in the low half); or narrowed to 16 bfloat16.
inline vu bf16_bits(vf f) {
    const vu u = (vu)f;
    const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (vu)((u & 0x7FFFFFFFu) > 0x7F800000u);  // all ones where NaN
    return (r & ~nan) | ((vu{} + 0x7FC0u) & nan);
}
inline vu pack2v(vf lo, vf hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }
inline vh round16(vf f) { return __builtin_convertvector(bf16_bits(f), vh); }

// S[f][0:d] += Σ_pairs P[p][f]·Y[p][0:d], P and Y two rows to a word.
template <int DV, int FB>
inline void state_block_bf16(const uint32_t* P, int64_t D, const uint32_t* Y, int np, float* S,
                             int e, int64_t f) {
    constexpr int d = 16 * DV;
    vf acc[FB][DV];
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < DV; ++v) acc[j][v] = vload(S + (f + j) * e + 16 * v);
    for (int p = 0; p < np; ++p) {
        __m512bh yv[DV];
        for (int v = 0; v < DV; ++v) yv[v] = words(Y + int64_t(p) * d + 16 * v);
        const uint32_t* w = P + int64_t(p) * D + f;
        for (int j = 0; j < FB; ++j) {
            const __m512bh a = word(w[j]);
            for (int v = 0; v < DV; ++v) acc[j][v] = dot2(acc[j][v], a, yv[v]);
        }
    }
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < DV; ++v) vstore(S + (f + j) * e + 16 * v, acc[j][v]);
}

template <int DV>
void state_group_bf16(const float* x, const float* y, const float* scale, float* S, float* last,
                      float* tile, uint32_t* P, uint32_t* Y, int64_t L, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, FB = DV == 1 ? 16 : DV == 2 ? 8 : 6;
    uint32_t yl[TILE / 2];  // the last column of y, two rows to a word
    for (int64_t i = 0; i < D * e; ++i) S[i] = 0.0f;
    for (int64_t f = 0; f < D; ++f) last[f] = 0.0f;
    for (int64_t r0 = 0; r0 < L; r0 += TILE) {
        const int n = int(L - r0 < TILE ? L - r0 : TILE), np = (n + 1) / 2;
        const float* yt = y + r0 * e;
        map_tile<d>(x + r0 * d, scale, tile, n, D, c);
        if (n % 2)
            for (int64_t f = 0; f < D; ++f) tile[int64_t(n) * D + f] = 0.0f;  // the odd row's pair
        for (int p = 0; p < np; ++p) {
            const float *a = tile + int64_t(2 * p) * D, *b = a + D;
            uint32_t* w = P + int64_t(p) * D;
            int64_t f = 0;
            for (; f + 16 <= D; f += 16) {
                const vu packed = pack2v(vload(a + f), vload(b + f));
                std::memcpy(w + f, &packed, sizeof packed);
            }
            for (; f < D; ++f) w[f] = pack2(a[f], b[f]);
            const float* ya = yt + int64_t(2 * p) * e;
            const bool pair = 2 * p + 1 < n;
            for (int col = 0; col < e; ++col) {
                const uint32_t word = pack2(ya[col], pair ? ya[e + col] : 0.0f);
                if (col < d)
                    Y[int64_t(p) * d + col] = word;
                else
                    yl[p] = word;
            }
        }
        int64_t f = 0;
        for (; f + FB <= D; f += FB) state_block_bf16<DV, FB>(P, D, Y, np, S, e, f);
        for (; f < D; ++f) state_block_bf16<DV, 1>(P, D, Y, np, S, e, f);
        // The last column, vectorised over features: last[f] += Σ_p P[p][f]·yl[p].
        f = 0;
        for (; f + 16 <= D; f += 16) {
            vf acc = vload(last + f);
            for (int p = 0; p < np; ++p) acc = dot2(acc, words(P + int64_t(p) * D + f), word(yl[p]));
            vstore(last + f, acc);
        }
        for (; f < D; ++f)
            for (int p = 0; p < np; ++p) {
                const uint32_t w = P[int64_t(p) * D + f], v = yl[p];
                last[f] += from_bf16(uint16_t(w)) * from_bf16(uint16_t(v)) +
                           from_bf16(uint16_t(w >> 16)) * from_bf16(uint16_t(v >> 16));
            }
    }
    for (int64_t f = 0; f < D; ++f) S[f * e + d] = last[f];
}

// out rows [i, i + NB): Σ over feature pairs of (φ[r][2q], φ[r][2q+1])·Sp[q][0:d].
template <int DV, int NB>
inline void apply_block_bf16(const uint16_t* rows, int64_t Dp, const uint32_t* Sp, float* out,
                             int e) {
    constexpr int d = 16 * DV;
    vf acc[NB][DV];
    for (int i = 0; i < NB; ++i)
        for (int v = 0; v < DV; ++v) acc[i][v] = vf{};
    for (int64_t q = 0; q < Dp / 2; ++q) {
        __m512bh s[DV];
        for (int v = 0; v < DV; ++v) s[v] = words(Sp + q * d + 16 * v);
        for (int i = 0; i < NB; ++i) {
            uint32_t w;
            std::memcpy(&w, rows + int64_t(i) * Dp + 2 * q, 4);
            const __m512bh a = word(w);
            for (int v = 0; v < DV; ++v) acc[i][v] = dot2(acc[i][v], a, s[v]);
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int v = 0; v < DV; ++v) vstore(out + int64_t(i) * e + 16 * v, acc[i][v]);
}

// The apply's last column (the denominator's) of n rows of bfloat16 features (row stride
// `stride`): Σ over the W feature pairs of the row's pair · the last column's pair.
inline void last_column_bf16(const uint16_t* rows, int64_t stride, int64_t W,
                             const uint32_t* lastw, float* out, int n, int e, int d) {
    for (int r = 0; r < n; ++r) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(rows + int64_t(r) * stride);
        vf acc = vf{};
        int64_t q = 0;
        for (; q + 16 <= W; q += 16) acc = dot2(acc, words(w + q), words(lastw + q));
        float s = hsum(acc);
        for (; q < W; ++q)
            s += from_bf16(uint16_t(w[q])) * from_bf16(uint16_t(lastw[q])) +
                 from_bf16(uint16_t(w[q] >> 16)) * from_bf16(uint16_t(lastw[q] >> 16));
        out[int64_t(r) * e + d] = s;
    }
}

template <int DV>
void apply_tile_bf16(const float* x, const uint32_t* Sp, const uint32_t* lastw, const float* scale,
                     float* out, float* tile, uint16_t* rows, int n, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, NB = DV == 1 ? 16 : DV == 2 ? 12 : 6;
    const int64_t Dp = D + D % 2;  // rows padded to whole feature pairs
    map_tile<d>(x, scale, tile, n, D, c);
    for (int r = 0; r < n; ++r) {
        const float* t = tile + int64_t(r) * D;
        uint16_t* o = rows + int64_t(r) * Dp;
        int64_t f = 0;
        for (; f + 16 <= D; f += 16) {
            const vh h = round16(vload(t + f));
            std::memcpy(o + f, &h, sizeof h);
        }
        for (; f < D; ++f) o[f] = to_bf16(t[f]);
        if (Dp > D) o[D] = 0;
    }
    in_blocks<NB>(n, [&](auto B, int64_t i) {
        apply_block_bf16<DV, B>(rows + i * Dp, Dp, Sp, out + i * e, e);
    });
    last_column_bf16(rows, Dp, Dp / 2, lastw, out, n, e, d);
}

// hT[f][r] = Σ over column pairs of (S[f][2q], S[f][2q+1])·(y[r][2q], y[r][2q+1]), rows in
// the lanes; Sw: S two columns to a word, (D', Q) with Q = ⌈e/2⌉; yT2: (Q, TILE).
template <int FB>
inline void pull_block_bf16(const uint32_t* Sw, int Q, const uint32_t* yT2, float* hT,
                            int64_t f) {
    constexpr int RV = TILE / 16;
    vf acc[FB][RV];
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < RV; ++v) acc[j][v] = vf{};
    for (int q = 0; q < Q; ++q) {
        __m512bh yv[RV];
        for (int v = 0; v < RV; ++v) yv[v] = words(yT2 + q * TILE + 16 * v);
        for (int j = 0; j < FB; ++j) {
            const __m512bh a = word(Sw[(f + j) * Q + q]);
            for (int v = 0; v < RV; ++v) acc[j][v] = dot2(acc[j][v], a, yv[v]);
        }
    }
    for (int j = 0; j < FB; ++j)
        for (int v = 0; v < RV; ++v) vstore(hT + (f + j) * TILE + 16 * v, acc[j][v]);
}

template <int DV>
void pullback_tile_bf16(const float* x, const float* y, const uint32_t* Sw, const float* scale,
                        float* gx, float* hT, uint32_t* yT2, int n, int64_t D, float c) {
    constexpr int d = 16 * DV, e = d + 1, Q = (e + 1) / 2, FB = 12;
    for (int q = 0; q < Q; ++q)
        for (int i = 0; i < TILE; ++i) {
            const float* yi = y + int64_t(i) * e;
            yT2[q * TILE + i] =
                i < n ? pack2(yi[2 * q], 2 * q + 1 < e ? yi[2 * q + 1] : 0.0f) : 0u;
        }
    int64_t f = 0;
    for (; f + FB <= D; f += FB) pull_block_bf16<FB>(Sw, Q, yT2, hT, f);
    for (; f < D; ++f) pull_block_bf16<1>(Sw, Q, yT2, hT, f);
    if (n == TILE)
        backward_block<true>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
    else
        backward_block<false>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
}

// ---- AMX tiles (Intel Sapphire Rapids and later) ---------------------------------------------
// The same bfloat16 products as tile dot products: TDPBF16PS multiplies a 16 × 32 bfloat16 tile
// by a 32 × 16 one stored two rows to a word (the packing above) into a 16 × 16 float32
// accumulator, 256 times the multiply-adds of one vdpbf16ps. The inputs are rounded to
// bfloat16 as above (by vcvtneps2bf16: the same bits but for subnormals, flushed to zero, which
// both dot products treat as zero anyway), so the results differ from the vdpbf16ps loops'
// only in the order of the float32 sums. Operands are padded with zeros to whole tiles
// (features to 16 or 32, rows to 32). Linux (only) gives a process the tiles' state when it
// asks (arch_prctl ARCH_REQ_XCOMP_PERM); each thread loads its tile configuration before its
// tiles and releases them after. maclaurin2_amx() turns them off (the vdpbf16ps loops then
// run), for tests and comparisons.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1

int amx_wanted = 1;

inline bool amx_permitted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
inline bool use_amx() { return amx_wanted != 0 && amx_permitted(); }

// bf16_bits' rounding by the CPU's conversion (vcvtneps2bf16): the same bits except that
// subnormal inputs become zero (which the dot products make of them anyway) and a NaN keeps
// its payload's top bits (still a NaN).
inline vh round16_cvt(vf f) { return (vh)(__m256i)_mm512_cvtneps_pbh((__m512)f); }
inline vu pack2v_cvt(vf lo, vf hi) {
    // Both rounded by one vcvtne2ps2bf16 (lo's 16 values in the low half), then interleaved
    // by one vpermw: word i = (lo_i, hi_i).
    static const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
    return (vu)_mm512_permutexvar_epi16(interleave, both);
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-7 of 16 rows of 64 bytes, except those named in `one_row` (1 row).
struct Tiles {
    explicit Tiles(std::initializer_list<int> one_row = {}) {
        TileConfig config;
        for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
        for (int t : one_row) config.rows[t] = 1;
        _tile_loadconfig(&config);
    }
    ~Tiles() { _tile_release(); }
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
};

// The state's rows KT tiles at a time (128 rows, 64 row pairs): the accumulators are loaded
// and stored once for every KT tiles, not for every tile (fewer where the rows end).
constexpr int KT = 4, NPC = KT * TILE / 2;

// Sᵀ's column block j (tile j) += y's columns 16j.. as 16 rows of the K block's 16 row pairs
// (tile 6) · φ's row pairs (tile 5); a macro: the intrinsics take tile numbers as literals.
#define STATE_DP_AMX(j)                                                  \
    do {                                                                 \
        _tile_loadd(6, YT + int64_t(16 * (j)) * NPC + 16 * kt, NPC * 4); \
        _tile_dpbf16ps(j, 6, 5);                                         \
    } while (0)

// One group's S through Sᵀ (e × Dq, Dq = D' up to 16) in ST: Sᵀ = Σ yᵀ φ over the rows, KT
// tiles of 32 rows at a time. Tiles, for 16 features at a time: 0 to
// DV - 1 Sᵀ's column blocks, 4 its last column (one row); 5 φ's row pairs; 6 y's columns as
// rows, 7 its last column (one row).
template <int DV>
void state_group_amx(const float* x, const float* y, const float* scale, float* S, float* ST,
                     float* tile, uint32_t* P, uint32_t* YT, uint32_t* Yw, int64_t L, int64_t D,
                     int64_t Dq, float c) {
    constexpr int d = 16 * DV, e = d + 1, NP = TILE / 2;
    std::memset(ST, 0, sizeof(float) * e * Dq);
    for (int64_t c0 = 0; c0 < L; c0 += KT * TILE) {
        const int tiles = int((L - c0 + TILE - 1) / TILE < KT ? (L - c0 + TILE - 1) / TILE : KT);
        for (int kt = 0; kt < tiles; ++kt) {
            const int64_t r0 = c0 + kt * TILE;
            const int n = int(L - r0 < TILE ? L - r0 : TILE), np = (n + 1) / 2;
            const float* yt = y + r0 * e;
            map_tile<d>(x + r0 * d, scale, tile, n, D, c);
            if (n % 2)
                for (int64_t f = 0; f < D; ++f) tile[int64_t(n) * D + f] = 0.0f;  // odd row's pair
            for (int p = 0; p < NP; ++p) {
                uint32_t* w = P + int64_t(kt * NP + p) * Dq;
                uint32_t* yw = Yw + p * e;
                if (p >= np) {
                    std::memset(w, 0, sizeof(uint32_t) * Dq);
                    std::memset(yw, 0, sizeof(uint32_t) * e);
                    continue;
                }
                const float *a = tile + int64_t(2 * p) * D, *b = a + D;
                int64_t f = 0;
                for (; f + 16 <= D; f += 16) {
                    const vu packed = pack2v_cvt(vload(a + f), vload(b + f));
                    std::memcpy(w + f, &packed, sizeof packed);
                }
                for (; f < D; ++f) w[f] = pack2(a[f], b[f]);
                for (; f < Dq; ++f) w[f] = 0u;
                // y's rows 2p and 2p + 1, two to a word (the second zero past n).
                const float* ya = yt + int64_t(2 * p) * e;
                const bool pair = 2 * p + 1 < n;
                for (int v = 0; v < DV; ++v) {
                    const vf hi = pair ? vload(ya + e + 16 * v) : vf{};
                    const vu packed = pack2v_cvt(vload(ya + 16 * v), hi);
                    std::memcpy(yw + 16 * v, &packed, sizeof packed);
                }
                yw[d] = pack2(ya[d], pair ? ya[e + d] : 0.0f);
            }
            for (int col = 0; col < e; ++col)
                for (int p = 0; p < NP; ++p) YT[col * NPC + kt * NP + p] = Yw[p * e + col];
        }
        const int64_t stride = Dq * 4;
        for (int64_t f = 0; f < Dq; f += 16) {
            float* block = ST + f;
            _tile_loadd(0, block, stride);
            if constexpr (DV > 1) _tile_loadd(1, block + 16 * Dq, stride);
            if constexpr (DV > 2) _tile_loadd(2, block + 32 * Dq, stride);
            if constexpr (DV > 3) _tile_loadd(3, block + 48 * Dq, stride);
            _tile_loadd(4, block + d * Dq, stride);
            for (int kt = 0; kt < tiles; ++kt) {
                _tile_loadd(5, P + int64_t(kt * NP) * Dq + f, stride);
                STATE_DP_AMX(0);
                if constexpr (DV > 1) STATE_DP_AMX(1);
                if constexpr (DV > 2) STATE_DP_AMX(2);
                if constexpr (DV > 3) STATE_DP_AMX(3);
                _tile_loadd(7, YT + int64_t(d) * NPC + 16 * kt, NPC * 4);
                _tile_dpbf16ps(4, 7, 5);
            }
            _tile_stored(0, block, stride);
            if constexpr (DV > 1) _tile_stored(1, block + 16 * Dq, stride);
            if constexpr (DV > 2) _tile_stored(2, block + 32 * Dq, stride);
            if constexpr (DV > 3) _tile_stored(3, block + 48 * Dq, stride);
            _tile_stored(4, block + d * Dq, stride);
        }
    }
    for (int64_t f = 0; f < D; ++f)
        for (int col = 0; col < e; ++col) S[f * e + col] = ST[col * Dq + f];
}

// out rows of a tile, columns [16 jb, 16 jb + 32) (or 16 if only one block is left), into ob
// (TILE × d): Σ over K blocks of 32 features of rows (tiles 4, 5: rows 0-15, 16-31) · S's
// feature pairs (tiles 6, 7: two column blocks), accumulated in tiles 0-3.
template <bool two>
inline void apply_blocks_amx(const uint16_t* rows, int64_t Dk, const uint32_t* Sp, int d,
                             float* ob, int jb) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < Dk / 32; ++kb) {
        _tile_loadd(4, rows + 32 * kb, Dk * 2);
        _tile_loadd(5, rows + 16 * Dk + 32 * kb, Dk * 2);
        const uint32_t* s = Sp + 16 * kb * d + 16 * jb;
        _tile_loadd(6, s, d * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if constexpr (two) {
            _tile_loadd(7, s + 16, d * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, ob + 16 * jb, d * 4);
    _tile_stored(1, ob + 16 * d + 16 * jb, d * 4);
    if constexpr (two) {
        _tile_stored(2, ob + 16 * jb + 16, d * 4);
        _tile_stored(3, ob + 16 * d + 16 * jb + 16, d * 4);
    }
}

// As apply_tile_bf16, the first d columns by tiles: rows (TILE × Dk, Dk = D' up to 32, zeros
// past D' and past row n), Sp (Dk / 2 feature pairs × d).
template <int DV>
void apply_tile_amx(const float* x, const uint32_t* Sp, const uint32_t* lastw, const float* scale,
                    float* out, float* tile, uint16_t* rows, float* ob, int n, int64_t D,
                    int64_t Dk, float c) {
    constexpr int d = 16 * DV, e = d + 1;
    const int64_t Dp = D + D % 2;
    map_tile<d>(x, scale, tile, n, D, c);
    for (int r = 0; r < TILE; ++r) {
        uint16_t* o = rows + int64_t(r) * Dk;
        if (r >= n) {
            std::memset(o, 0, sizeof(uint16_t) * Dk);
            continue;
        }
        const float* t = tile + int64_t(r) * D;
        int64_t f = 0;
        for (; f + 16 <= D; f += 16) {
            const vh h = round16_cvt(vload(t + f));
            std::memcpy(o + f, &h, sizeof h);
        }
        for (; f < D; ++f) o[f] = to_bf16(t[f]);
        for (; f < Dk; ++f) o[f] = 0;
    }
    for (int jb = 0; jb < DV; jb += 2) {
        if (jb + 1 < DV)
            apply_blocks_amx<true>(rows, Dk, Sp, d, ob, jb);
        else
            apply_blocks_amx<false>(rows, Dk, Sp, d, ob, jb);
    }
    for (int r = 0; r < n; ++r) std::memcpy(out + int64_t(r) * e, ob + int64_t(r) * d, d * 4);
    last_column_bf16(rows, Dk, Dp / 2, lastw, out, n, e, d);
}

// As pullback_tile_bf16, hT by tiles: hT (Dq × TILE) = Sw (Dq × Qp column pairs, zeros past
// D' and past e) · yT2 (Qp × TILE, zeros past e and past row n). Tiles 0, 1 hT's rows 0-15 and
// 16-31, 2 S's pairs, 3, 4 y's pairs.
template <int DV>
void pullback_tile_amx(const float* x, const float* y, const uint32_t* Sw, const float* scale,
                       float* gx, float* hT, uint32_t* yT2, int n, int64_t D, int64_t Dq, int Qp,
                       float c) {
    constexpr int d = 16 * DV, e = d + 1;
    // Row i's columns rounded in order are its column pairs, two to a word; then transposed.
    uint16_t row[2 * 48];
    for (int i = 0; i < TILE; ++i) {
        std::memset(row, 0, sizeof row);
        if (i < n) {
            const float* yi = y + int64_t(i) * e;
            for (int v = 0; v < DV; ++v) {
                const vh h = round16_cvt(vload(yi + 16 * v));
                std::memcpy(row + 16 * v, &h, sizeof h);
            }
            row[d] = to_bf16(yi[d]);
        }
        uint32_t w[48];
        std::memcpy(w, row, sizeof w);
        for (int q = 0; q < Qp; ++q) yT2[q * TILE + i] = w[q];
    }
    for (int64_t f = 0; f < Dq; f += 16) {
        _tile_zero(0);
        _tile_zero(1);
        for (int kb = 0; kb < Qp / 16; ++kb) {
            _tile_loadd(2, Sw + f * Qp + 16 * kb, Qp * 4);
            _tile_loadd(3, yT2 + 16 * kb * TILE, TILE * 4);
            _tile_loadd(4, yT2 + 16 * kb * TILE + 16, TILE * 4);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, hT + f * TILE, TILE * 4);
        _tile_stored(1, hT + f * TILE + 16, TILE * 4);
    }
    if (n == TILE)
        backward_block<true>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
    else
        backward_block<false>(hT, x, scale, gx, TILE, 0, n, d, D, c, Same{});
}
#else
#define HAVE_AMX 0
inline bool use_amx() { return false; }
#endif
#else
constexpr bool HAVE_BF16_DOT = false;
#define HAVE_AMX 0
#endif

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
