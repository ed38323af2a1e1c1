/* Products with 8-bit activations: integer dot products on quantised weights (included by packed_gemm.c,
 * whose vector types, ISA macros and scale loads it uses; not a library of its own).
 *
 * Legend as in packed_gemm.c (M rows, I inputs, O outputs, G inputs per weight group, VL int32 lanes
 * per vector, BW = 2 VL outputs per packed block, MR rows per tile), plus QB = 32 inputs per
 * activation block and QC = 4 inputs per int32 lane of a dot product (a chunk).
 *
 * Arithmetic (llama.cpp's Q8_0 / Q8_1 activations against Q8_0 / Q4_0 / Q4_1 weights):
 *
 *   x'[m] in blocks b of QB:  dx[m, b] = max|x'| / 127,  qx = round-half-even(x' * (1 / dx)) in -127..127
 *   Q8A8  W[o, i] = dw[o, g] * qw                      qw int8 in -127..127
 *   Q4A8  W[o, i] = dw[o, g] * qw + mw[o, g]           qw 0..15
 *   y[m, o] = sum_g ( sum_{b in g} (dw[o, g] * dx[m, b]) * isum[m, o, b]  +  mw[o, g] * sx[m, g] )
 *
 * where isum = sum_{i in b} qw * qx is exact in int32 and sx[m, g] = sum_{b in g} dx[m, b] * sum(qx)
 * (Q8_1's block sum: Q4's min term costs one multiply-add per group). That is the product of the
 * dequantised weight with the dequantised activations, in float32: per block one multiply (the
 * scales) and one FMA.
 *
 * Batch invariance: a row's output never depends on M, on the tile it sits in or on the other rows.
 * The integer sums are exact, and the float terms of a row are added in one fixed order (groups in
 * order, blocks in order, explicit FMAs) by code that is the same for every tile size; the activations
 * of a row are quantised from that row alone. So a token's logits are bitwise the same at T = 1, in a
 * 7-token verify block and beside any other rows (tests/test_q8_kernels.py checks it).
 *
 * Packed layout (kernels/packed_gemm.py pack_q8 / pack_q4 with act8): outputs in blocks of BW, each
 * group's quantised weights in chunks of QC inputs with the QC bytes of one output adjacent (the
 * operand layout of vpdpbusd / vpmaddubsw), then the group's scales:
 *   Q8A8  [O/BW][I/G]{ q [G/QC][BW][QC] int8, dw [BW] f16 }
 *   Q4A8  [O/BW][I/G]{ q [G/QC][VL][QC] bytes: low nibble output j, high nibble output VL + j,
 *                      dw [BW] f16, mw [BW] f16 }
 * (the same bytes per group as Q8 / Q4, in another order).
 *
 * Dot products per ISA path (u8 x s8 -> int32 over 4 bytes per lane):
 *   AVX-512 VNNI / AVX-VNNI  vpdpbusd. Q4: weights are the unsigned operand. Q8: activations
 *            biased by 128 (x ^ 0x80) are the unsigned one and 128 * sum(qw), a vpdpbusd of the
 *            weights with ones shared by every row, is subtracted per block.
 *   AVX-512 / AVX2           vpmaddubsw + vpmaddwd. Q4: int16 partial sums over the 8 chunks of a
 *            block (at most 8 * 2 * 15 * 127 = 30480, no saturation), widened once. Q8: |qx| and
 *            the sign of qx moved onto qw (at most 2 * 127 * 127 = 32258 per int16 lane).
 *   generic  plain C.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define QB 32
#define QC 4
#define MAX_TILE 12 /* the largest tile instantiated (MR on AVX-512); arrays live in registers */

#if defined(__AVX512F__)
typedef __m512i vq;
INLINE vq q_load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
INLINE vq q_bcast(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
INLINE vq q_zero(void) { return _mm512_setzero_si512(); }
INLINE vq q_lo(vq w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
INLINE vq q_hi(vq w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
INLINE vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
INLINE vf splat(float s) { return (vf)_mm512_set1_ps(s); }
#if defined(__AVX512VNNI__)
#define A8_VNNI 1
INLINE vq dot_us(vq acc, vq u, vq s) { return _mm512_dpbusd_epi32(acc, u, s); }
INLINE vq q_bias(vq x) { return _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)); }
INLINE vq q_sub_bias(vq acc, vq wsum) { return _mm512_sub_epi32(acc, _mm512_slli_epi32(wsum, 7)); }
INLINE vq q_ones8(void) { return _mm512_set1_epi8(1); }
#else
INLINE vq add16_us(vq acc, vq u, vq s) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s)); }
INLINE vq widen16(vq acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
INLINE vq dot_ss(vq acc, vq w, vq x) {
    vq ws = _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
    vq p = _mm512_maddubs_epi16(_mm512_abs_epi8(x), ws);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
#endif
#elif defined(__AVX2__)
typedef __m256i vq;
INLINE vq q_load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
INLINE vq q_bcast(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
INLINE vq q_zero(void) { return _mm256_setzero_si256(); }
INLINE vq q_lo(vq w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
INLINE vq q_hi(vq w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
INLINE vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
INLINE vf splat(float s) { return (vf)_mm256_set1_ps(s); }
#if defined(__AVXVNNI__)
#define A8_VNNI 1
INLINE vq dot_us(vq acc, vq u, vq s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
INLINE vq q_bias(vq x) { return _mm256_xor_si256(x, _mm256_set1_epi8((char)0x80)); }
INLINE vq q_sub_bias(vq acc, vq wsum) { return _mm256_sub_epi32(acc, _mm256_slli_epi32(wsum, 7)); }
INLINE vq q_ones8(void) { return _mm256_set1_epi8(1); }
#else
INLINE vq add16_us(vq acc, vq u, vq s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
INLINE vq widen16(vq acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
INLINE vq dot_ss(vq acc, vq w, vq x) {
    vq p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif
#else
#define A8_GENERIC 1
INLINE vf fmadd(vf a, vf b, vf c) { return a * b + c; }
INLINE vf splat(float s) { return (vf){0} + s; }
#endif

/* Prefetch the bytes [p + ahead, p + ahead + n) of the weight stream (one line per 64 bytes). */
INLINE void prefetch_span(const uint8_t* p, long n, long ahead) {
    for (long o = 0; o < n; o += 64) __builtin_prefetch((const void*)((uintptr_t)(p + o) + ahead), 0, 3);
}

/* The exact int32 dot products of one activation block (QB inputs) with BW outputs' weights, for
 * MM rows: out[m][v] lane j = sum over the block of qw[o = v VL + j] * qx[m]. w: the block's
 * QB / QC chunks; x: row 0's QB activations (rows I apart). */
INLINE void block_dot(int fmt, int MM, const uint8_t* restrict w, const int8_t* restrict x, long I,
                      vi out[][NV], const uint8_t* pf, long ahead) {
    const long cb = fmt == Q8A8 ? BW * QC : VL * QC; /* bytes of one chunk */
#if defined(A8_GENERIC)
    (void)pf, (void)ahead;
    for (int m = 0; m < MM; m++)
        for (int o = 0; o < BW; o++) {
            int32_t s = 0;
            for (int c = 0; c < QB / QC; c++)
                for (int k = 0; k < QC; k++) {
                    int qw = fmt == Q8A8 ? (int8_t)w[c * cb + o * QC + k]
                                         : (w[c * cb + (o % VL) * QC + k] >> (o < VL ? 0 : 4)) & 15;
                    s += qw * x[m * I + c * QC + k];
                }
            out[m][o / VL][o % VL] = s;
        }
#else
    vq acc[MAX_TILE][NV];
    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = q_zero();
#if defined(A8_VNNI)
    vq wsum[NV] = {q_zero(), q_zero()};
#endif
    _Pragma("GCC unroll 8") for (int c = 0; c < QB / QC; c++) {
        const uint8_t* p = w + c * cb;
        if (pf) prefetch_span(pf + c * cb, cb, 0);
        if (ahead) prefetch_span(p, cb, ahead);
        vq wv[NV];
        if (fmt == Q4A8) {
            vq raw = q_load(p);
            wv[0] = q_lo(raw);
            wv[1] = q_hi(raw);
        } else {
            wv[0] = q_load(p);
            wv[1] = q_load(p + VL * QC);
#if defined(A8_VNNI)
            wsum[0] = dot_us(wsum[0], q_ones8(), wv[0]);
            wsum[1] = dot_us(wsum[1], q_ones8(), wv[1]);
#endif
        }
        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {
            vq xb = q_bcast(x + m * I + c * QC);
#if defined(A8_VNNI)
            if (fmt == Q4A8) {
                acc[m][0] = dot_us(acc[m][0], wv[0], xb);
                acc[m][1] = dot_us(acc[m][1], wv[1], xb);
            } else {
                vq xu = q_bias(xb);
                acc[m][0] = dot_us(acc[m][0], xu, wv[0]);
                acc[m][1] = dot_us(acc[m][1], xu, wv[1]);
            }
#else
            if (fmt == Q4A8) {
                acc[m][0] = add16_us(acc[m][0], wv[0], xb);
                acc[m][1] = add16_us(acc[m][1], wv[1], xb);
            } else {
                acc[m][0] = dot_ss(acc[m][0], wv[0], xb);
                acc[m][1] = dot_ss(acc[m][1], wv[1], xb);
            }
#endif
        }
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {
        _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
#if defined(A8_VNNI)
            out[m][v] = (vi)(fmt == Q4A8 ? acc[m][v] : q_sub_bias(acc[m][v], wsum[v]));
#else
            out[m][v] = (vi)(fmt == Q4A8 ? widen16(acc[m][v]) : acc[m][v]);
#endif
        }
    }
#endif
}

/* One block (BW outputs) for a tile of MM rows into acc ([MM][BW] floats). xq: the tile's quantised
 * rows (stride I), dx: their block scales (stride I / QB), sx: their group sums (stride I / G; Q4A8).
 * The per-row float work is the same code for every MM, so a row's result does not depend on it. */
INLINE void a8_tile(int fmt, int MM, const int8_t* restrict xq, const float* restrict dx,
                    const float* restrict sx, long I, long G, const uint8_t* restrict wb, float* restrict acc,
                    const uint8_t* pf, long ahead) {
    const long nG = I / G, nB = I / QB, bpg = G / QB, gb = packed_gemm_group_bytes(fmt, G);
    const long blk = (fmt == Q8A8 ? BW : VL) * QB; /* bytes of one activation block's weights */
    vf facc[MAX_TILE][NV];
    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) facc[m][0] = facc[m][1] = splat(0.0f);
    for (long g = 0; g < nG; g++) {
        const uint8_t* gp = wb + g * gb;
        const uint8_t* sp = gp + G * row_bytes(fmt);
        vf dw[NV] = {load_half(sp), load_half(sp + VL * 2)};
        for (long j = 0; j < bpg; j++) {
            vi isum[MAX_TILE][NV];
            long b = g * bpg + j;
            block_dot(fmt, MM, gp + j * blk, xq + b * QB, I, isum, pf ? pf + g * gb + j * blk : 0, ahead);
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {
                vf s = splat(dx[m * nB + b]);
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++)
                    facc[m][v] = fmadd(__builtin_convertvector(isum[m][v], vf), dw[v] * s, facc[m][v]);
            }
        }
        if (fmt == Q4A8) {
            vf mw[NV] = {load_half(sp + BW * 2), load_half(sp + BW * 2 + VL * 2)};
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {
                vf s = splat(sx[m * nG + g]);
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) facc[m][v] = fmadd(mw[v], s, facc[m][v]);
            }
        }
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {
        *(vfu*)(acc + m * BW) = facc[m][0];
        *(vfu*)(acc + m * BW + VL) = facc[m][1];
    }
}

typedef void (*a8_tile_fn)(const int8_t*, const float*, const float*, long, long, const uint8_t*, float*,
                           const uint8_t*, long);
#define DEFINE_A8_TILE(FMT, MM)                                                                          \
    static void a8_tile_##FMT##_##MM(const int8_t* xq, const float* dx, const float* sx, long I, long G, \
                                     const uint8_t* wb, float* acc, const uint8_t* pf, long ahead) {     \
        a8_tile(FMT, MM, xq, dx, sx, I, G, wb, acc, pf, ahead);                                          \
    }
/* Tiles of 1..MR rows (only those: each is a large unrolled function). */
#define A8_T(FMT, MM) a8_tile_##FMT##_##MM
#define DEFINE_A8_TILES_4(FMT) DEFINE_A8_TILE(FMT, 1) DEFINE_A8_TILE(FMT, 2) DEFINE_A8_TILE(FMT, 3) DEFINE_A8_TILE(FMT, 4)
#define A8_TABLE_4(FMT) 0, A8_T(FMT, 1), A8_T(FMT, 2), A8_T(FMT, 3), A8_T(FMT, 4)
#if MR > 4
#define DEFINE_A8_TILES_8(FMT)                                                                            \
    DEFINE_A8_TILES_4(FMT) DEFINE_A8_TILE(FMT, 5) DEFINE_A8_TILE(FMT, 6) DEFINE_A8_TILE(FMT, 7) DEFINE_A8_TILE(FMT, 8)
#define A8_TABLE_8(FMT) A8_TABLE_4(FMT), A8_T(FMT, 5), A8_T(FMT, 6), A8_T(FMT, 7), A8_T(FMT, 8)
#endif
#if MR > 8
#define DEFINE_A8_FORMAT(FMT)                                                                             \
    DEFINE_A8_TILES_8(FMT) DEFINE_A8_TILE(FMT, 9) DEFINE_A8_TILE(FMT, 10) DEFINE_A8_TILE(FMT, 11)         \
    DEFINE_A8_TILE(FMT, 12)                                                                               \
    static const a8_tile_fn A8_TILES_##FMT[13] = {A8_TABLE_8(FMT), A8_T(FMT, 9), A8_T(FMT, 10),       \
                                                      A8_T(FMT, 11), A8_T(FMT, 12)};
#elif MR > 4
#define DEFINE_A8_FORMAT(FMT) DEFINE_A8_TILES_8(FMT) static const a8_tile_fn A8_TILES_##FMT[9] = {A8_TABLE_8(FMT)};
#else
#define DEFINE_A8_FORMAT(FMT) DEFINE_A8_TILES_4(FMT) static const a8_tile_fn A8_TILES_##FMT[5] = {A8_TABLE_4(FMT)};
#endif
_Static_assert(MR <= MAX_TILE, "a8 tiles go up to MAX_TILE rows");
DEFINE_A8_FORMAT(Q8A8)
DEFINE_A8_FORMAT(Q4A8)

/* round-half-even(v) for |v| <= 127.x: the rounding of cvtps2dq (the default MXCSR mode) and of
 * torch.round. */
INLINE int32_t round_even(float v) {
#if defined(__x86_64__) || defined(__i386__)
    return _mm_cvtss_si32(_mm_set_ss(v));
#else
    return (int32_t)nearbyintf(v);
#endif
}

/* max |x| over one block of QB values (exact in any order; NaN inputs are not supported). */
INLINE float block_amax(const float* x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16))));
#elif defined(__AVX2__)
    __m256 sign = _mm256_set1_ps(-0.0f), m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int k = 1; k < 4; k++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
#else
    float amax = 0;
    for (int k = 0; k < QB; k++) {
        float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

/* One block of QB values to 8 bits: q = round(x * id) clamped to +-127; returns sum(q). The vector
 * versions do the same operations lane by lane (IEEE multiply, cvtps2dq), so they agree bit for bit
 * with the scalar one and with kernels/q8_reference.py. */
INLINE int32_t quantize_block(const float* restrict x, float id, int8_t* restrict q) {
#if defined(__AVX512F__)
    __m512 s = _mm512_set1_ps(id);
    __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), s));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), s));
    q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
    q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
    __m256 s = _mm256_set1_ps(id);
    __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), v[4], sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), s));
        v[k] = _mm256_min_epi32(_mm256_max_epi32(v[k], lo), hi);
        sum = _mm256_add_epi32(sum, v[k]);
    }
    /* int32 -> int8 (packs work within 128-bit lanes: the permute restores the order) */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
    int32_t sum = 0;
    for (int k = 0; k < QB; k++) {
        int32_t r = round_even(x[k] * id);
        r = r > 127 ? 127 : (r < -127 ? -127 : r);
        q[k] = (int8_t)r;
        sum += r;
    }
    return sum;
#endif
}

/* One row x' [I] to 8 bits (see the top of this file): q [I], dx [I / QB], and per weight group of G
 * inputs sx [I / G] (the sum of the dequantised activations: d times the block's integer sum, added
 * block after block). kernels/q8_reference.py quantize_activations is the same arithmetic, bit for
 * bit: no FMA contraction here (a fused d * sum + sx would round differently). */
__attribute__((optimize("fp-contract=off"))) static void quantize_row_a8(const float* restrict x, long I, long G,
                                                                         int8_t* restrict q, float* restrict dx,
                                                                         float* restrict sx) {
    long bpg = G / QB;
    for (long b = 0; b < I / QB; b++) {
        const float* xb = x + b * QB;
        float d = block_amax(xb) / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
        int32_t sum = quantize_block(xb, id, q + b * QB);
        dx[b] = d;
        float bs = d * (float)sum;
        sx[b / bpg] = b % bpg ? sx[b / bpg] + bs : bs;
    }
}

/* Exported for the tests: M rows through quantize_row_a8. */
void packed_gemm_quantize_a8(const float* x, long M, long I, long G, int8_t* q, float* dx, float* sx) {
    for (long m = 0; m < M; m++) quantize_row_a8(x + m * I, I, G, q + m * I, dx + m * (I / QB), sx + m * (I / G));
}
