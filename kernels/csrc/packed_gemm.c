/* Skinny matrix products for decoding on a CPU, on weights packed once in a layout per ISA path:
 *
 *     y[m, o] = res[m, o] + bias[o] + s[m] * sum_i W[o, i] * x'[m, i]
 *
 * Legend: M rows of x (batch x block tokens, 1..~16 while decoding; up to ~1000 for MoE experts),
 * I input features, O output features, G inputs per quantisation group, VL floats per vector,
 * BW = 2 VL outputs per packed block, MR rows per register tile, U partial sums per row.
 *
 * Weight formats (the element type of W), dequantised in registers, arithmetic in float32:
 *   F32   W[o, i]                         4 bytes a weight
 *   BF16  the upper half of a float32     2 bytes
 *   Q8    d[o, g] * q            q int8, d float16 per G inputs (GGUF Q8_0 with G = 32; per-channel
 *                                int8 with G = I)
 *   Q4    d[o, g] * q + m[o, g]  q 0..15, d and m float16 per G inputs (GGUF Q4_1; Q4_0 with
 *                                m = -8 d; group-wise int4 with scales and zero points)
 *
 * Packed layout: outputs in blocks of BW, each block's weights in input order, so every thread reads
 * one contiguous stream and each loaded weight vector serves every row of a register tile:
 *   F32/BF16  [O/BW][I][BW] (BF16 lanes hold the pairs (o, o + VL), so a shift and a mask widen them)
 *   Q8        [O/BW][I/G]{ q [G][BW] int8, d [BW] f16 }
 *   Q4        [O/BW][I/G]{ q [G][BW/2] bytes: byte j = q[o=j] | q[o=j+VL] << 4, d [BW] f16, m [BW] f16 }
 * Q4's min term is m * sum_{i in g} x'[m, i], one product per group with the row sums of x'.
 *
 * Q8A8 / Q4A8 (q8_gemm.c, included below): the Q8 / Q4 weights in a layout for integer dot products,
 * with x' quantised per row to 8 bits in blocks of 32 (llama.cpp's Q8_0 / Q8_1 activations): int32
 * sums within a block, one float multiply-add per block, and batch invariant (a row's output does
 * not depend on M or the other rows).
 *
 * Input transform x' (fused, saving the small elementwise ops that cost as much as attention at
 * this model size): act == 1 takes x = [gate | up] ([M, 2I]) and x' = silu(gate) * up (Llama's
 * SwiGLU); norm_eps >= 0 is an RMSNorm: s[m] = 1 / sqrt(mean(x'^2) + eps), and x' is multiplied by
 * norm_w (when given) elementwise. res != NULL adds the residual stream.
 *
 * ISA paths (kernels/native.py builds this file once per path; the -vnni paths differ only in
 * q8_gemm.c's dot products): AVX-512 (VL 16, MR 12: 2 MR
 * accumulators + weights fit in 32 zmm), AVX2 (VL 8, MR 7: 14 accumulators, a weight vector and a
 * broadcast in 16 ymm, so a 7-token verify block is one tile), generic (VL 4: SSE2 / NEON).
 * Dependency chains: one row is latency-bound on its accumulators (an FMA waits 4-5 cycles), so
 * every row sums a group's inputs in U = 4 partial sums (inputs i = u mod U), combined in one fixed
 * order: a single row runs the 4 chains at once, a tile of several rows one after another. The
 * order of every addition is then the same whatever the tile, so a row's output does not depend on
 * M or on its neighbours (batch invariance, which exact speculative decoding under load needs).
 *
 * Oracle: the plain-PyTorch dequantisation in kernels/packed_gemm.py (``PackedWeight.dequantize``)
 * and ``F.linear``; tests/test_packed_gemm.py checks every format on every ISA path this CPU runs.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define MR 12
#define ISA_NAME "avx512"
#elif defined(__AVX2__)
#define VL 8
#define MR 7
#define ISA_NAME "avx2"
#elif defined(__aarch64__)
#define VL 4
#define MR 8
#define ISA_NAME "generic"
#else
#define VL 4
#define MR 4
#define ISA_NAME "generic"
#endif
#define NV 2
#define BW (NV * VL)
#define INLINE static inline __attribute__((always_inline))

enum { F32 = 0, BF16 = 1, Q8 = 2, Q4 = 3, Q8A8 = 4, Q4A8 = 5 }; /* *A8: 8-bit activations, q8_gemm.c */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint32_t vuu __attribute__((vector_size(VL * 4), aligned(1)));
typedef uint8_t vb __attribute__((vector_size(VL), aligned(1)));
typedef int8_t vsb __attribute__((vector_size(VL), aligned(1)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(1)));

const char* packed_gemm_isa(void) { return ISA_NAME; }
int packed_gemm_block_width(void) { return BW; }
int packed_gemm_vector_width(void) { return VL; }

/* Bytes of one input's weights in a block, and of a group's scales (per format). */
INLINE int is_a8(int fmt) { return fmt == Q8A8 || fmt == Q4A8; }
INLINE long row_bytes(int fmt) {
    return fmt == F32 ? BW * 4 : fmt == BF16 ? BW * 2 : (fmt == Q8 || fmt == Q8A8) ? BW : BW / 2;
}
INLINE long scale_bytes(int fmt) { return (fmt == Q8 || fmt == Q8A8) ? BW * 2 : fmt == F32 || fmt == BF16 ? 0 : BW * 4; }
long packed_gemm_group_bytes(int fmt, long G) { return G * row_bytes(fmt) + scale_bytes(fmt); }

/* Widening loads, VL lanes at a time: bytes zero- or sign-extended to int32, float16 to float32.
 * AVX-512 and AVX2 use their single-instruction widening loads (vpmovzxbd, vpmovsxbd, vcvtph2ps);
 * the generic path converts with portable vector code. */
#if defined(__AVX512F__)
#include <immintrin.h>
INLINE vi load_u8(const uint8_t* p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
INLINE vi load_s8(const uint8_t* p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
INLINE vf load_half(const uint8_t* p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
INLINE vi load_u8(const uint8_t* p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
INLINE vi load_s8(const uint8_t* p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
INLINE vf load_half(const uint8_t* p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
INLINE vi load_u8(const uint8_t* p) { return __builtin_convertvector(*(const vb*)p, vi); }
INLINE vi load_s8(const uint8_t* p) { return __builtin_convertvector(*(const vsb*)p, vi); }
/* float16 -> float32 (normals and subnormals; the scales are never inf or NaN). */
INLINE vf load_half(const uint8_t* p) {
    vu u = __builtin_convertvector(*(const vh*)p, vu);
    vf f = (vf)((u & 0x7fffu) << 13) * 0x1p112f;
    return (vf)((vu)f | ((u & 0x8000u) << 16));
}
#endif

/* One input's BW weights (unscaled for Q8 / Q4) into NV float vectors. */
INLINE void load_w(int fmt, vf* w, const uint8_t* p) {
    if (fmt == F32) {
        w[0] = *(const vfu*)p;
        w[1] = *(const vfu*)(p + VL * 4);
    } else if (fmt == BF16) {
        vu u = *(const vuu*)p;
        w[0] = (vf)(u << 16);
        w[1] = (vf)(u & 0xFFFF0000u);
    } else if (fmt == Q8) {
        w[0] = __builtin_convertvector(load_s8(p), vf);
        w[1] = __builtin_convertvector(load_s8(p + VL), vf);
    } else {
        vi b = load_u8(p);
        w[0] = __builtin_convertvector(b & 15, vf);
        w[1] = __builtin_convertvector(b >> 4, vf);
    }
}

/* One block (BW outputs) for a tile of MM rows (compile-time), accumulated over the groups into acc.
 * x: the tile's rows (stride I), xsum: their group sums (stride nG; Q4 only). */
/* Batch invariance: every row's sums are added in one order whatever the tile's MM (so a row's
 * output never depends on M or on the rows beside it). Within a group, inputs i = u (mod U) go to
 * partial sum u in input order, the tail (i >= G - G % U) to partial 0 after them, then
 * ((p0 + p1) + p2) + p3. A single row runs the U chains interleaved (U independent FMA chains); a
 * tile of MM >= 2 rows runs them one after another (MM x NV chains at a time, no extra registers,
 * the same arithmetic per input), the group's weights staying in L1 between the U passes. */
#define U 4
#define DEFINE_TILE(FMT, MM)                                                                              \
    static void tile_##FMT##_##MM(const float* restrict x, long I, long G, const uint8_t* restrict wb,   \
                                  const float* restrict xsum, float* restrict acc, const uint8_t* pf,    \
                                  long ahead) {                                                         \
        const long rb = row_bytes(FMT), gb = packed_gemm_group_bytes(FMT, G), nG = I / G;               \
        const long GU = G - G % U;                                                                      \
        /* the running sums live in acc (memory, updated once per group), so the registers hold    \
         * only the group's partial sums, one weight vector and a broadcast */                        \
        memset(acc, 0, sizeof(float) * MM * BW);                                                        \
        for (long g = 0; g < nG; g++) {                                                                 \
            const uint8_t* gp = wb + g * gb;                                                            \
            const float* xg = x + g * G;                                                                \
            vf fin[MM][NV];                                                                             \
            if (MM == 1) {                                                                              \
                vf part[U][NV];                                                                         \
                _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) part[u][0] = part[u][1] = (vf){0};  \
                for (long i = 0; i < GU; i += U) {                                                      \
                    if (pf) __builtin_prefetch(pf + g * gb + i * rb, 0, 1);                             \
                    if (ahead) __builtin_prefetch((const void*)((uintptr_t)(gp + i * rb) + ahead), 0, 3); \
                    _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                               \
                        vf w[NV];                                                                       \
                        load_w(FMT, w, gp + (i + u) * rb);                                              \
                        part[u][0] += xg[i + u] * w[0];                                                 \
                        part[u][1] += xg[i + u] * w[1];                                                 \
                    }                                                                                   \
                }                                                                                       \
                for (long i = GU; i < G; i++) {                                                         \
                    vf w[NV];                                                                           \
                    load_w(FMT, w, gp + i * rb);                                                        \
                    part[0][0] += xg[i] * w[0];                                                         \
                    part[0][1] += xg[i] * w[1];                                                         \
                }                                                                                       \
                _Pragma("GCC unroll 4") for (int u = 1; u < U; u++) {                                   \
                    part[0][0] += part[u][0];                                                           \
                    part[0][1] += part[u][1];                                                           \
                }                                                                                       \
                fin[0][0] = part[0][0];                                                                 \
                fin[0][1] = part[0][1];                                                                 \
            } else {                                                                                    \
                for (int u = 0; u < U; u++) {                                                           \
                    vf part[MM][NV];                                                                    \
                    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) part[m][0] = part[m][1] = (vf){0}; \
                    for (long i = u; i < GU; i += U) {                                                  \
                        if (u == 0 && pf) __builtin_prefetch(pf + g * gb + i * rb, 0, 1);               \
                        if (u == 0 && ahead)                                                            \
                            __builtin_prefetch((const void*)((uintptr_t)(gp + i * rb) + ahead), 0, 3);  \
                        vf w[NV];                                                                       \
                        load_w(FMT, w, gp + i * rb);                                                    \
                        /* one weight vector through every row, then the other: 2 MM accumulators, \
                         * one weight and one broadcast live, so AVX2's 16 registers hold 7 rows */     \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++)                           \
                            part[m][0] += xg[m * I + i] * w[0];                                         \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++)                           \
                            part[m][1] += xg[m * I + i] * w[1];                                         \
                    }                                                                                   \
                    if (u == 0) {                                                                       \
                        for (long i = GU; i < G; i++) {                                                 \
                            vf w[NV];                                                                   \
                            load_w(FMT, w, gp + i * rb);                                                \
                            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                     \
                                float xs = xg[m * I + i];                                               \
                                part[m][0] += xs * w[0];                                                \
                                part[m][1] += xs * w[1];                                                \
                            }                                                                           \
                        }                                                                               \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                         \
                            fin[m][0] = part[m][0];                                                     \
                            fin[m][1] = part[m][1];                                                     \
                        }                                                                               \
                    } else {                                                                            \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                         \
                            fin[m][0] += part[m][0];                                                    \
                            fin[m][1] += part[m][1];                                                    \
                        }                                                                               \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            if (FMT == Q8 || FMT == Q4) {                                                               \
                const uint8_t* sp = gp + G * rb;                                                        \
                vf d0 = load_half(sp), d1 = load_half(sp + VL * 2);                                     \
                vf m0 = {0}, m1 = {0};                                                                  \
                if (FMT == Q4) {                                                                        \
                    m0 = load_half(sp + BW * 2);                                                        \
                    m1 = load_half(sp + BW * 2 + VL * 2);                                               \
                }                                                                                       \
                _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                                 \
                    vf s0 = d0 * fin[m][0], s1 = d1 * fin[m][1];                                \
                    if (FMT == Q4) {                                                                    \
                        float s = xsum[m * nG + g];                                                     \
                        s0 += m0 * s;                                                                   \
                        s1 += m1 * s;                                                                   \
                    }                                                                                   \
                    *(vfu*)(acc + m * BW) += s0;                                                        \
                    *(vfu*)(acc + m * BW + VL) += s1;                                                   \
                }                                                                                       \
            } else {                                                                                    \
                _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                                 \
                    *(vfu*)(acc + m * BW) += fin[m][0];                                             \
                    *(vfu*)(acc + m * BW + VL) += fin[m][1];                                        \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

typedef void (*tile_fn)(const float*, long, long, const uint8_t*, const float*, float*, const uint8_t*, long);

#define DEFINE_FORMAT(FMT)                                                                                \
    DEFINE_TILE(FMT, 1) DEFINE_TILE(FMT, 2) DEFINE_TILE(FMT, 3) DEFINE_TILE(FMT, 4) DEFINE_TILE(FMT, 5)  \
    DEFINE_TILE(FMT, 6) DEFINE_TILE(FMT, 7) DEFINE_TILE(FMT, 8) DEFINE_TILE(FMT, 9) DEFINE_TILE(FMT, 10) \
    DEFINE_TILE(FMT, 11) DEFINE_TILE(FMT, 12)                                                           \
    static const tile_fn TILES_##FMT[13] = {0, tile_##FMT##_1, tile_##FMT##_2, tile_##FMT##_3,          \
        tile_##FMT##_4, tile_##FMT##_5, tile_##FMT##_6, tile_##FMT##_7, tile_##FMT##_8, tile_##FMT##_9,  \
        tile_##FMT##_10, tile_##FMT##_11, tile_##FMT##_12};

DEFINE_FORMAT(F32)
DEFINE_FORMAT(BF16)
DEFINE_FORMAT(Q8)
DEFINE_FORMAT(Q4)

static const tile_fn* const TILES[4] = {TILES_F32, TILES_BF16, TILES_Q8, TILES_Q4};

#include "q8_gemm.c"

/* e^x, Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, x clamped to
 * [-87.3, 88.3] so 2^n stays a normal float): relative error below 2e-7, written so that GCC
 * vectorizes loops over it (no libm call; glibc's scalar expf made a 7-token SwiGLU cost 0.6 ms). */
INLINE float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x; /* comparisons, not fminf/fmaxf: those keep the loop scalar */
    x = x > 88.3f ? 88.3f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* a = silu(g) * u over n floats (a separate function so the loop vectorizes inside OpenMP regions). */
static void swiglu_row(const float* restrict g, const float* restrict u, float* restrict a, long n) {
    for (long i = 0; i < n; i++) a[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}

static void scale_row(const float* restrict in, const float* restrict w, float* restrict out, long n) {
    for (long i = 0; i < n; i++) out[i] = in[i] * w[i];
}

/* 8-bit activations of a product's rows (*A8 formats, q8_gemm.c): q [M, I] and the block scales
 * dx [M, I / QB]; their group sums go to xsum. */
typedef struct {
    int8_t* q;
    float* dx;
} Act8;

/* For rows [m0, m1): x' into buf (when it differs from x), the RMSNorm row scales, and Q4's group
 * sums (or, for the *A8 formats, x' quantised to a8 with its group sums); returns x'. Each row on its
 * own, so the rows can be split across threads. */
static const float* prepare_input(const float* x, long m0, long m1, long I, long G, int fmt, float norm_eps,
                                  const float* norm_w, int act, float* buf, float* scale, float* xsum, Act8 a8) {
    const float* in = x;
    if (act == 1) {
        for (long m = m0; m < m1; m++) swiglu_row(x + m * 2 * I, x + m * 2 * I + I, buf + m * I, I);
        in = buf;
    }
    if (norm_eps >= 0)
        for (long m = m0; m < m1; m++) {
            float ss = 0;
            for (long i = 0; i < I; i++) ss += in[m * I + i] * in[m * I + i];
            scale[m] = 1.0f / sqrtf(ss / (float)I + norm_eps);
        }
    if (norm_w) {
        for (long m = m0; m < m1; m++) scale_row(in + m * I, norm_w, buf + m * I, I);
        in = buf;
    }
    long nG = I / G;
    if (fmt == Q4) {
        for (long m = m0; m < m1; m++)
            for (long g = 0; g < nG; g++) {
                float s = 0;
                for (long i = 0; i < G; i++) s += in[m * I + g * G + i];
                xsum[m * nG + g] = s;
            }
    } else if (is_a8(fmt)) {
        for (long m = m0; m < m1; m++)
            quantize_row_a8(in + m * I, I, G, a8.q + m * I, a8.dx + m * (I / QB), xsum + m * nG);
    }
    return in;
}

/* Store one block's tile: y = s * acc + bias + res for the valid outputs. */
static void store(float* y, long ldy, const float* acc, int MM, int o_valid, const float* bias,
                  const float* scale, const float* res) {
    for (int m = 0; m < MM; m++)
        for (int o = 0; o < o_valid; o++) {
            float v = acc[m * BW + o];
            if (scale) v *= scale[m];
            if (bias) v += bias[o];
            if (res) v += res[m * ldy + o];
            y[m * ldy + o] = v;
        }
}

/* Software prefetch (bytes ahead in the weight stream) for a single tile of 2..MR rows (a verify
 * block, a tree): its FMAs per weight vector slow its loads enough that the hardware prefetchers fall
 * behind the stream. One row is left to the hardware, except for the *A8 formats, whose single row
 * streamed 1.1x (AVX-512 VNNI) to 1.6x (AVX2) faster with it (interleaved A/B, 59 MB weight). */
#define PREFETCH_AHEAD 4096

/* Blocks [b0, b1) of one product for every row: one thread's share. Rows go in tiles of MR, so a
 * block's weights stay in cache while every tile passes over them and the weights stream from memory
 * once per call whatever M is; with several tiles the first prefetches the next block. */
static void linear_blocks(int fmt, const float* in, long M, long I, const uint8_t* wp, long O, long G,
                          const float* bias, const float* scale, const float* xsum, Act8 a8, const float* res,
                          float* y, long b0, long b1) {
    long nG = I / G, block = nG * packed_gemm_group_bytes(fmt, G);
    const tile_fn* tiles = is_a8(fmt) ? 0 : TILES[fmt];
    const a8_tile_fn* a8_tiles = fmt == Q8A8 ? A8_TILES_Q8A8 : A8_TILES_Q4A8;
    float acc[MR * BW];
    for (long b = b0; b < b1; b++) {
        const uint8_t* wb = wp + b * block;
        const uint8_t* next = b + 1 < b1 ? wb + block : 0;
        int ov = O - b * BW < BW ? (int)(O - b * BW) : BW;
        for (long m0 = 0; m0 < M; m0 += MR) {
            int mm = M - m0 < MR ? (int)(M - m0) : MR;
            const uint8_t* pf = m0 == 0 && M > MR ? next : 0;
            long ahead = (M > 1 || is_a8(fmt)) && M <= MR ? PREFETCH_AHEAD : 0;
            if (tiles)
                tiles[mm](in + m0 * I, I, G, wb, xsum ? xsum + m0 * nG : 0, acc, pf, ahead);
            else
                a8_tiles[mm](a8.q + m0 * I, a8.dx + m0 * (I / QB), xsum + m0 * nG, I, G, wb, acc, pf, ahead);
            store(y + m0 * O + b * BW, O, acc, mm, ov, bias ? bias + b * BW : 0, scale ? scale + m0 : 0,
                  res ? res + m0 * O + b * BW : 0);
        }
    }
}

static int bad_format(int fmt, long I, long G) {
    return fmt < F32 || fmt > Q4A8 || G < 1 || I % G || (fmt < Q8 && G != I) || (is_a8(fmt) && G % QB);
}

/* Threads split the O/BW blocks evenly (contiguous weight ranges). Returns 0, -1 (out of memory)
 * or -2 (bad arguments). */
int packed_linear(int fmt, const float* x, long M, long I, const void* w, long O, long G, const float* bias,
                  const float* norm_w, float norm_eps, int act, const float* res, float* y, int nthreads) {
    if (bad_format(fmt, I, G)) return -2;
    long nG = I / G;
    int sums = fmt == Q4 || is_a8(fmt);
    float* buf = (act == 1 || norm_w) ? malloc(sizeof(float) * M * I) : 0;
    float* scale = norm_eps >= 0 ? malloc(sizeof(float) * M) : 0;
    float* xsum = sums ? malloc(sizeof(float) * M * nG) : 0;
    Act8 a8 = {is_a8(fmt) ? malloc(M * I) : 0, is_a8(fmt) ? malloc(sizeof(float) * M * (I / QB)) : 0};
    if (((act == 1 || norm_w) && !buf) || (norm_eps >= 0 && !scale) || (sums && !xsum) ||
        (is_a8(fmt) && (!a8.q || !a8.dx))) {
        free(buf), free(scale), free(xsum), free(a8.q), free(a8.dx);
        return -1;
    }
    const float* in = prepare_input(x, 0, M, I, G, fmt, norm_eps, norm_w, act, buf, scale, xsum, a8);
    long nb = (O + BW - 1) / BW;
    if (nthreads > nb) nthreads = (int)nb;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        linear_blocks(fmt, in, M, I, (const uint8_t*)w, O, G, bias, scale, xsum, a8, res, y, nb * t / n,
                      nb * (t + 1) / n);
    }
    free(buf), free(scale), free(xsum), free(a8.q), free(a8.dx);
    return 0;
}
