// Part of maclaurin2_fused.cpp, included once by it inside its anonymous namespace after the
// float32 primitives whose tiles and map these reuse: the fused products with bfloat16 inputs
// (AVX512-BF16 dot products), and, where the CPU has them, on AMX tiles
// (maclaurin2_fused_amx.h). Defines HAVE_BF16_DOT and HAVE_AMX for the dispatch.

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

#include "maclaurin2_fused_amx.h"
#else
constexpr bool HAVE_BF16_DOT = false;
#define HAVE_AMX 0
#endif
