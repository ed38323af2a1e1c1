/* Skinny matrix products for decoding on a CPU: y[m, o] = res[m, o] + b[o] + sum_i W[o, i] * x'[m, i].
 *
 * Legend: M rows of x (batch x block tokens, 1..~16 while decoding), I input features,
 * O output features, BW outputs per packed block, MR rows per register tile.
 *
 * Decoding streams every weight once per step while M is tiny, so the product is bound by memory
 * bandwidth, and BLAS libraries tuned for big M leave much of it unused (and get ~3x slower from
 * M = 1 to M = 4 on the dev machine). Here W is pre-packed as [O/BW][I][BW]: each thread reads one
 * contiguous stream, every BW-wide weight vector is loaded once and multiplied into MR rows of x
 * held in registers, so M = 8 costs little more than M = 1. For larger M (MoE experts get ~100-500
 * rows) each block's weights stay in cache while all row tiles pass over them: on the dev machine
 * this beats oneDNN on the experts' down projection (K = 1536, N = 576) by ~15 % at M = 128, because
 * the weights stream from memory once, in order, and the prefetchers keep up.
 *
 * The input transform x' and the residual are fused in, saving the small elementwise ops that
 * otherwise cost as much as the attention at this model size:
 *   - norm_eps >= 0: x' = x / sqrt(mean(x^2) + eps), an RMSNorm whose weight the caller folded
 *     into the columns of W (W' = W diag(w));
 *   - act == 1: x is [M, 2I] (gate | up) and x' = silu(gate) * up (the SwiGLU of Llama's MLP);
 *   - res != NULL: the residual stream is added to the output.
 *
 * Weights are float32, or bfloat16 (upper 16 bits of a float32; widened in registers, so the
 * arithmetic stays float32). Written with GCC vector extensions: -march=native maps them to
 * AVX-512, AVX2 or NEON. kernels/packed_gemm.py compiles this file once per machine; the users are
 * the decode linears of specdec/targets/linear.py (oracle: tests/test_llama_target.py) and the CPU
 * expert loop of kernels/grouped_gemm/onednn_backend.py (oracle: tests/test_packed_gemm.py).
 */
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define BW 32 /* two 16-float vectors per block; 2*MR accumulators + 3 fit in 32 zmm registers */
#define MR 12
#else
#define BW 16
#define MR 6
#endif
#define VL 16
/* Prefetch the next block's weights while 2..PREFETCH_MAX_TILES row tiles (up to 192 rows on
 * AVX-512) pass over the current one: +4-5 % at 64-151 rows, -4 % at 512 rows (dev machine). */
#define PREFETCH_MAX_TILES 16
/* Software prefetch distance (bytes) for passes of 2 or more rows (a verify block, a tree, a few
 * tokens per expert): a tile does 2..MR FMAs per weight vector, which slows its loads enough that the
 * hardware prefetchers fall behind the stream. The first row tile of each block prefetches this far
 * ahead in the stream. Measured on a 2-core Zen 5, a pass over SmolLM2-135M's 538 MB of fp32 weights,
 * relative to one row without it: 7 rows 1.14x -> 1.01x, 12 rows 1.26x -> 1.07x; bf16 weights,
 * 7 rows 1.60x -> 0.98x. One row is left to the hardware (4-5 % slower with it). */
static const long prefetch_bytes = 4096;
#define NV (BW / VL)
#define INLINE static inline __attribute__((always_inline))

typedef float v16 __attribute__((vector_size(VL * 4)));
typedef float v16u __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t h16u __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t i16 __attribute__((vector_size(VL * 4)));

typedef uint32_t i16u __attribute__((vector_size(VL * 4), aligned(4)));

INLINE v16 load_f32(const float* p) { return *(const v16u*)p; }
INLINE void store_f32(float* p, v16 v) { *(v16u*)p = v; }

/* One row (BW weights) of a packed block into NV float vectors. */
INLINE void load_row_f32(v16* w, const float* p) {
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) w[v] = load_f32(p + v * VL);
}
#if NV == 2
/* bf16 rows are stored as pairs (o, o + VL) in each 32-bit lane: a bf16 is the upper half of a
 * float32, so a shift and a mask widen a whole row without shuffling across lanes. */
INLINE void load_row_bf16(v16* w, const uint16_t* p) {
    i16 u = *(const i16u*)p;
    w[0] = (v16)(u << 16);
    w[1] = (v16)(u & 0xFFFF0000u);
}
#else
INLINE void load_row_bf16(v16* w, const uint16_t* p) {
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) w[v] =
        (v16)(__builtin_convertvector(*(const h16u*)(p + v * VL), i16) << 16);
}
#endif

/* One packed block (BW outputs) for MM (compile-time) rows. W_T is float or uint16_t (bf16). */
#define DEFINE_BLOCK(NAME, W_T, LOAD)                                                                   \
    INLINE void NAME(const float* restrict x, long I, const W_T* restrict wp, int MM, float* restrict y, \
                     long ldy, const float* bias, const float* scale, const float* res, int o_valid,    \
                     const char* pf, long pf_lines, long ahead) {                                       \
        v16 acc[MR][NV];                                                                                \
        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++)                                           \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] = (v16){0};                   \
        for (long i = 0; i < I; i++) {                                                                  \
            if (i < pf_lines) __builtin_prefetch(pf + 64 * i, 0, 2);                                    \
            if (ahead) {                                                                                \
                /* an address past the array is fine for a prefetch (it never faults), but not for \
                 * pointer arithmetic: compute it as an integer */                                  \
                const char* q = (const char*)((uintptr_t)(wp + i * BW) + ahead * sizeof(W_T));       \
                __builtin_prefetch(q, 0, 3);                                                            \
                if (BW * sizeof(W_T) > 64) __builtin_prefetch(q + 64, 0, 3);                            \
            }                                                                                           \
            v16 w[NV];                                                                                  \
            LOAD(w, wp + i * BW);                                                                       \
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                                     \
                float xs = x[m * I + i];                                                                \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] += xs * w[v];             \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) {                                         \
            if (scale)                                                                                  \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] *= scale[m];              \
            if (bias)                                                                                   \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] += load_f32(bias + v * VL); \
            float tmp[BW];                                                                              \
            float* out = o_valid >= BW ? y + m * ldy : tmp;                                             \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) store_f32(out + v * VL, acc[m][v]);     \
            if (o_valid < BW) memcpy(y + m * ldy, tmp, sizeof(float) * o_valid);                        \
            if (res)                                                                                    \
                for (int o = 0; o < o_valid; o++) y[m * ldy + o] += res[m * ldy + o];                   \
        }                                                                                               \
    }

DEFINE_BLOCK(block_f32, float, load_row_f32)
DEFINE_BLOCK(block_bf16, uint16_t, load_row_bf16)

/* rows_<dtype>_<MM>: blocks [b0, b1) for MM rows; one instance per MM so the tile stays in registers. */
#define DEFINE_ROWS(SUFFIX, W_T, MM)                                                                    \
    static void rows_##SUFFIX##_##MM(const float* x, long I, const W_T* wp, float* y, long O,          \
                                     const float* bias, const float* scale, const float* res, long b0,  \
                                     long b1, const char* pf, long pf_lines, long ahead) {              \
        for (long b = b0; b < b1; b++) {                                                                \
            long o0 = b * BW;                                                                           \
            int ov = O - o0 < BW ? (int)(O - o0) : BW;                                                  \
            block_##SUFFIX(x, I, wp + b * I * BW, MM, y + o0, O, bias ? bias + o0 : 0, scale,           \
                           res ? res + o0 : 0, ov, pf, pf_lines, ahead);                                \
        }                                                                                               \
    }
#define DEFINE_ALL_ROWS(SUFFIX, W_T)                                                                    \
    DEFINE_ROWS(SUFFIX, W_T, 1) DEFINE_ROWS(SUFFIX, W_T, 2) DEFINE_ROWS(SUFFIX, W_T, 3)                 \
    DEFINE_ROWS(SUFFIX, W_T, 4) DEFINE_ROWS(SUFFIX, W_T, 5) DEFINE_ROWS(SUFFIX, W_T, 6)                 \
    DEFINE_ROWS(SUFFIX, W_T, 7) DEFINE_ROWS(SUFFIX, W_T, 8) DEFINE_ROWS(SUFFIX, W_T, 9)                 \
    DEFINE_ROWS(SUFFIX, W_T, 10) DEFINE_ROWS(SUFFIX, W_T, 11) DEFINE_ROWS(SUFFIX, W_T, 12)              \
    typedef void (*rows_##SUFFIX##_fn)(const float*, long, const W_T*, float*, long, const float*,     \
                                       const float*, const float*, long, long, const char*, long, long); \
    static const rows_##SUFFIX##_fn ROWS_##SUFFIX[13] = {                                               \
        0, rows_##SUFFIX##_1, rows_##SUFFIX##_2, rows_##SUFFIX##_3, rows_##SUFFIX##_4,                  \
        rows_##SUFFIX##_5, rows_##SUFFIX##_6, rows_##SUFFIX##_7, rows_##SUFFIX##_8, rows_##SUFFIX##_9,  \
        rows_##SUFFIX##_10, rows_##SUFFIX##_11, rows_##SUFFIX##_12};

DEFINE_ALL_ROWS(f32, float)
DEFINE_ALL_ROWS(bf16, uint16_t)

int packed_gemm_block_width(void) { return BW; }
/* 1 when bf16 blocks interleave outputs (o, o + BW/2) in 32-bit lanes (see load_row_bf16). */
int packed_gemm_bf16_pairs(void) { return NV == 2; }

/* e^x, Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, x clamped to
 * [-87.3, 88.3] so 2^n stays a normal float): relative error below 2e-7, and written so that GCC
 * vectorizes loops over it (no libm call); glibc's scalar expf was ~20 ns per call, which made the
 * SwiGLU of a 7-token verify block cost 0.6 ms per forward of SmolLM2-135M. */
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

/* x' = silu(gate) * up for x = [M, 2I] (act == 1), or x / rms(x) row scales (norm_eps >= 0).
 * Returns the buffer holding x' (x itself when there is no activation). */
static const float* prepare_input(const float* x, long M, long I, float norm_eps, int act, float* buf,
                                  float* scale, int nthreads) {
    const float* in = x;
    if (act == 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * I >= (1L << 14))
        for (long m = 0; m < M; m++) swiglu_row(x + m * 2 * I, x + m * 2 * I + I, buf + m * I, I);
        in = buf;
    }
    if (norm_eps >= 0)
        for (long m = 0; m < M; m++) {
            float ss = 0;
            for (long i = 0; i < I; i++) ss += in[m * I + i] * in[m * I + i];
            scale[m] = 1.0f / sqrtf(ss / (float)I + norm_eps);
        }
    return in;
}

/* Threads split the O blocks evenly (contiguous weight ranges); within a block, rows go in tiles of MR. */
#define DEFINE_GEMM(SUFFIX, W_T)                                                                        \
    int packed_gemm_##SUFFIX(const float* x, long M, long I, const W_T* wp, long O, const float* bias,  \
                             float* y, int nthreads, float norm_eps, int act, const float* res) {       \
        float* buf = act == 1 ? malloc(sizeof(float) * M * I) : 0;                                      \
        float* scale = norm_eps >= 0 ? malloc(sizeof(float) * M) : 0;                                   \
        if ((act == 1 && !buf) || (norm_eps >= 0 && !scale)) {                                          \
            free(buf);                                                                                  \
            free(scale);                                                                                \
            return -1;                                                                                  \
        }                                                                                               \
        const float* in = prepare_input(x, M, I, norm_eps, act, buf, scale, nthreads);                  \
        long nb = (O + BW - 1) / BW;                                                                    \
        if (nthreads > nb) nthreads = (int)nb;                                                          \
        _Pragma("omp parallel num_threads(nthreads)") {                                                 \
            int t = omp_get_thread_num(), n = omp_get_num_threads();                                    \
            long b0 = nb * t / n, b1 = nb * (t + 1) / n;                                                \
            /* One block's weights [I, BW] stay in L1/L2 while every row tile passes over them, so  \
             * the weights stream from memory once per call whatever M is. With several tiles, each   \
             * tile also prefetches its share of the next block's weights into L2, so the first tile  \
             * of a block does not wait on memory (one tile, the decode case, relies on the hardware  \
             * prefetchers alone; past PREFETCH_MAX_TILES the rows of x no longer fit in L2 beside    \
             * the weights, and prefetching measured slower). */                                     \
            long tiles = (M + MR - 1) / MR;                                                             \
            long lines = (long)(I * BW * sizeof(W_T) + 63) / 64, share = (lines + tiles - 1) / tiles;   \
            if (tiles < 2 || tiles > PREFETCH_MAX_TILES || share > I) share = 0;                         \
            long ahead = M >= 2 && tiles <= PREFETCH_MAX_TILES ? prefetch_bytes / (long)sizeof(W_T) : 0; \
            for (long b = b0; b < b1; b++) {                                                            \
                const char* next = b + 1 < b1 ? (const char*)(wp + (b + 1) * I * BW) : 0;              \
                for (long m0 = 0, tile = 0; m0 < M; m0 += MR, tile++) {                                 \
                    long mm = M - m0 < MR ? M - m0 : MR;                                                \
                    long first = tile * share, n = next ? lines - first : 0;                            \
                    n = n < share ? (n > 0 ? n : 0) : share;                                            \
                    ROWS_##SUFFIX[mm](in + m0 * I, I, wp, y + m0 * O, O, bias, scale ? scale + m0 : 0,  \
                                      res ? res + m0 * O : 0, b, b + 1, n ? next + 64 * first : 0, n,   \
                                      tile == 0 ? ahead : 0);                                           \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        free(buf);                                                                                      \
        free(scale);                                                                                    \
        return 0;                                                                                       \
    }

DEFINE_GEMM(f32, float)
DEFINE_GEMM(bf16, uint16_t)
