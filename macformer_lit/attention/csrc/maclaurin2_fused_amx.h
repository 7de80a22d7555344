// Part of maclaurin2_fused.cpp, included by maclaurin2_fused_bf16.h inside the anonymous
// namespace, where the AVX512-BF16 packing it shares is defined.

// ---- AMX tiles (Intel Sapphire Rapids and later) ---------------------------------------------
// The same bfloat16 products as tile dot products: TDPBF16PS multiplies a 16 × 32 bfloat16 tile
// by a 32 × 16 one stored two rows to a word (maclaurin2_fused_bf16.h's packing) into a 16 × 16 float32
// accumulator, 256 times the multiply-adds of one vdpbf16ps. The inputs are rounded to
// bfloat16 as there (by vcvtneps2bf16: the same bits but for subnormals, flushed to zero, which
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
