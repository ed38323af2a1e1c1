/* A Llama-family decoder forward for decode and verify blocks (a few tokens per row), in one call.
 *
 * Legend: B rows, T block tokens, M = B T, D model dim, F MLP size, H query heads, J key/value heads,
 * E head dim, L cache slots, S attended slots.
 *
 * At decode sizes a small model's layer is four skinny products and a dozen small ops; from Python
 * each op costs microseconds of dispatch, which at 30 layers is as much as the products themselves.
 * Here every layer of the block runs in one OpenMP team, the products on the packed kernels of
 * packed_gemm.c (included below: the same tiles and formats), the rest in plain loops:
 *
 *   h    = x + o(attention(rope(q), rope(k), v))       q|k|v = qkv(RMSNorm(x)) (+ qk RMSNorm, Qwen3)
 *   x'   = h + down(silu(gate) * up)                   gate|up = gate_up(RMSNorm(h))
 *
 * Attention: token t of row b sits at cache slot start[b] + t (its keys and values are written there
 * first), and attends every slot before start[b] plus the block slots its mask allows: the causal
 * prefix of a chain, or the ancestors of a tree node (mask[t][u]). RoPE angles come per token
 * (cos and the flipped sin of specdec/targets/rope.py), so a tree's depths set the positions.
 *
 * The oracle is the PyTorch path of specdec/targets/llama.py (LlamaTarget with the same packed
 * linears, scaled_dot_product_attention); tests/test_llama_target.py compares them.
 */
#include "packed_gemm.c"

typedef struct {
    int fmt, act; /* act 1: the input is [gate | up] and x' = silu(gate) * up */
    long O, I, G;
    const void* w;
    const float* bias;   /* [O] or NULL */
    const float* norm_w; /* [I] RMSNorm weight, or NULL (no norm) */
    float norm_eps;
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const float* qk_norm; /* [H + J, E] per-head RMSNorm weights of q and k (Qwen3), or NULL */
} Layer;

typedef struct {
    long H, J, E, D, F;
    float eps; /* of the qk RMSNorm */
    const Layer* layers;
} Model;

/* Scratch of one forward: the products' outputs and inputs, per-row scales and group sums, and
 * the 8-bit activations of the *A8 formats. */
typedef struct {
    float *qkv, *att, *gu, *buf, *scale, *xsum, *scores;
    long S;
    Act8 a8;
} Scratch;

/* One product of the team: every thread prepares x' for its share of the rows (norm, SwiGLU, group
 * sums, 8-bit activations), then runs its share of the output blocks. y may be res (the residual
 * stream updated in place). */
static void team_linear(const Linear* l, const float* x, long M, const float* res, float* y, Scratch* s) {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    float eps = l->norm_w ? l->norm_eps : -1.0f;
    prepare_input(x, M * t / n, M * (t + 1) / n, l->I, l->G, l->fmt, eps, l->norm_w, l->act, s->buf, s->scale,
                  s->xsum, s->a8);
    const float* in = l->act == 1 || l->norm_w ? s->buf : x;
#pragma omp barrier
    long nb = (l->O + BW - 1) / BW;
    linear_blocks(l->fmt, in, M, l->I, (const uint8_t*)l->w, l->O, l->G, l->bias, l->norm_w ? s->scale : 0,
                  l->fmt == Q4 || is_a8(l->fmt) ? s->xsum : 0, s->a8, res, y, nb * t / n, nb * (t + 1) / n);
#pragma omp barrier
}

/* RMSNorm over each head's E values (Qwen3's q_norm / k_norm), then RoPE; keys and values to the
 * cache. Rows are split across the team. */
static void rotate_and_store(const Model* m, const Layer* ly, long B, long T, const long* start, const float* cos_e,
                             const float* sin_e, float* kc, float* vc, long L, const long* rows, Scratch* s) {
    long H = m->H, J = m->J, E = m->E, half = E / 2, M = B * T, W = (H + 2 * J) * E;
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    for (long r = M * t / n; r < M * (t + 1) / n; r++) {
        float* row = s->qkv + r * W;
        const float *c = cos_e + r * E, *fs = sin_e + r * E;
        for (long h = 0; h < H + J; h++) {
            float* x = row + h * E;
            if (ly->qk_norm) {
                float ss = 0;
                for (long e = 0; e < E; e++) ss += x[e] * x[e];
                float inv = 1.0f / sqrtf(ss / (float)E + m->eps);
                for (long e = 0; e < E; e++) x[e] = ly->qk_norm[h * E + e] * (x[e] * inv);
            }
            float tmp[E];
            for (long e = 0; e < E; e++) tmp[e] = x[e] * c[e] + x[e < half ? e + half : e - half] * fs[e];
            memcpy(x, tmp, sizeof(float) * E);
        }
        long b = r / T, slot = start[b] + r % T, cb = rows ? rows[b] : b;
        for (long j = 0; j < J; j++) {
            memcpy(kc + ((cb * J + j) * L + slot) * E, row + (H + j) * E, sizeof(float) * E);
            memcpy(vc + ((cb * J + j) * L + slot) * E, row + (H + J + j) * E, sizeof(float) * E);
        }
    }
#pragma omp barrier
}

/* The sum of a vector's lanes in a fixed order (a tree on AVX-512 / AVX2, lane after lane otherwise). */
INLINE float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
    float d = 0;
    for (int l = 0; l < VL; l++) d += v[l];
    return d;
#endif
}

/* q . k over E floats: VL lanes of FMAs, then hsum (the same operations whatever the block). */
INLINE float dot_e(const float* q, const float* k, long E) {
    vf acc = splat(0.0f);
    long e = 0;
    for (; e + VL <= E; e += VL) acc = fmadd(*(const vfu*)(q + e), *(const vfu*)(k + e), acc);
    float d = hsum(acc);
    for (; e < E; e++) d += q[e] * k[e];
    return d;
}

/* score[sl] = q . K[sl] for sl in [0, S): four slots at a time (independent chains), each slot by
 * the same operations as dot_e, so a slot's score does not depend on its neighbours. */
static void scores(float* restrict score, const float* restrict q, const float* restrict K, long S, long E) {
    long sl = 0;
    if (E % VL == 0)
        for (; sl + 4 <= S; sl += 4) {
            const float* k = K + sl * E;
            vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
            for (long e = 0; e < E; e += VL) {
                vf qv = *(const vfu*)(q + e);
                a0 = fmadd(qv, *(const vfu*)(k + e), a0);
                a1 = fmadd(qv, *(const vfu*)(k + E + e), a1);
                a2 = fmadd(qv, *(const vfu*)(k + 2 * E + e), a2);
                a3 = fmadd(qv, *(const vfu*)(k + 3 * E + e), a3);
            }
            score[sl] = hsum(a0), score[sl + 1] = hsum(a1), score[sl + 2] = hsum(a2), score[sl + 3] = hsum(a3);
        }
    for (; sl < S; sl++) score[sl] = dot_e(q, K + sl * E, E);
}

/* max of x [n] (exact in any order: four running maxima). */
static float slot_max(const float* restrict x, long n) {
    float m0 = -INFINITY, m1 = m0, m2 = m0, m3 = m0;
    long i = 0;
    for (; i + 4 <= n; i += 4) {
        m0 = x[i] > m0 ? x[i] : m0, m1 = x[i + 1] > m1 ? x[i + 1] : m1;
        m2 = x[i + 2] > m2 ? x[i + 2] : m2, m3 = x[i + 3] > m3 ? x[i + 3] : m3;
    }
    for (; i < n; i++) m0 = x[i] > m0 ? x[i] : m0;
    m0 = m1 > m0 ? m1 : m0, m2 = m3 > m2 ? m3 : m2;
    return m2 > m0 ? m2 : m0;
}

/* sum of p [n]: four partial sums by slot number mod 4, then (s0 + s1) + (s2 + s3). Hidden slots
 * hold exact zeros, so a token's sum is the same whatever the block around it. */
static float slot_sum(const float* restrict p, long n) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    long i = 0;
    for (; i + 4 <= n; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
    if (i < n) s0 += p[i];
    if (i + 1 < n) s1 += p[i + 1];
    if (i + 2 < n) s2 += p[i + 2];
    return (s0 + s1) + (s2 + s3);
}

/* slot_sum of a tree node's path decoded as a chain: the cached slots [0, st) by slot number, then
 * the visible block slots (vis, the node's ancestors and itself, in block order) each by the position
 * it stands for (st + its index among them), not by the slot it sits in. Bit for bit the chain's sum. */
static float path_sum(const float* restrict p, long st, long T, const uint8_t* restrict vis) {
    float s[4] = {0, 0, 0, 0};
    for (long i = 0; i < st; i++) s[i & 3] += p[i];
    for (long u = 0, pos = st; u < T; u++)
        if (vis[u]) s[pos++ & 3] += p[st + u];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* p[i] = e^(p[i] - mx), 0 where p[i] is -inf (a hidden slot; a visible one gives >= e^-87.3 > 0). */
static void softmax_exp(float* restrict p, long n, float mx) {
    for (long i = 0; i < n; i++) {
        float e = exp_approx(p[i] - mx);
        p[i] = p[i] == -INFINITY ? 0.0f : e;
    }
}

/* One tile of ns slots (starting at an even slot) into the running sums of p[sl] * V[sl]: acc_e over
 * the even slots and acc_o over the odd ones ([E] each), each an FMA chain in slot order; hidden slots
 * (p == 0) are skipped. Four vectors of each stay in registers across the tile. A query's chains are
 * the same whatever the block around it, so its output is too. */
static void pv_tile(float* restrict acc_e, float* restrict acc_o, const float* restrict p, const float* restrict V,
                    long ns, long E) {
    long e0 = 0;
    for (; e0 + 4 * VL <= E; e0 += 4 * VL) {
        vf a0 = *(vfu*)(acc_e + e0), a1 = *(vfu*)(acc_e + e0 + VL), a2 = *(vfu*)(acc_e + e0 + 2 * VL),
           a3 = *(vfu*)(acc_e + e0 + 3 * VL), b0 = *(vfu*)(acc_o + e0), b1 = *(vfu*)(acc_o + e0 + VL),
           b2 = *(vfu*)(acc_o + e0 + 2 * VL), b3 = *(vfu*)(acc_o + e0 + 3 * VL);
        for (long i = 0; i < ns; i += 2) {
            if (p[i] != 0.0f) {
                vf w = splat(p[i]);
                const float* v = V + i * E + e0;
                a0 = fmadd(w, *(const vfu*)v, a0), a1 = fmadd(w, *(const vfu*)(v + VL), a1);
                a2 = fmadd(w, *(const vfu*)(v + 2 * VL), a2), a3 = fmadd(w, *(const vfu*)(v + 3 * VL), a3);
            }
            if (i + 1 < ns && p[i + 1] != 0.0f) {
                vf w = splat(p[i + 1]);
                const float* v = V + (i + 1) * E + e0;
                b0 = fmadd(w, *(const vfu*)v, b0), b1 = fmadd(w, *(const vfu*)(v + VL), b1);
                b2 = fmadd(w, *(const vfu*)(v + 2 * VL), b2), b3 = fmadd(w, *(const vfu*)(v + 3 * VL), b3);
            }
        }
        *(vfu*)(acc_e + e0) = a0, *(vfu*)(acc_e + e0 + VL) = a1, *(vfu*)(acc_e + e0 + 2 * VL) = a2;
        *(vfu*)(acc_e + e0 + 3 * VL) = a3, *(vfu*)(acc_o + e0) = b0, *(vfu*)(acc_o + e0 + VL) = b1;
        *(vfu*)(acc_o + e0 + 2 * VL) = b2, *(vfu*)(acc_o + e0 + 3 * VL) = b3;
    }
    for (; e0 < E; e0++) /* E not a multiple of 4 VL: the rest one float at a time, same chains */
        for (long i = 0; i < ns; i++)
            if (p[i] != 0.0f) {
                float* a = i & 1 ? acc_o + e0 : acc_e + e0;
                *a = p[i] * V[i * E + e0] + *a;
            }
}

#define QCH 8        /* queries of one key/value head that share its keys and values (attention) */
#define SLOT_TILE 32 /* slots whose keys or values stay in L1 while every query of a chunk reads them */

/* softmax(q k^T / sqrt(E)) v over the visible slots, for every (row, query head, token). The work
 * goes in items of up to QCH queries (query heads x tokens) of one key/value head, slot tile by slot
 * tile, so each key and value is read from memory once per item rather than once per query. A
 * query's arithmetic does not depend on the item, the tiles or the block around it (its slots in
 * order, fixed-order sums; hidden slots add exact zeros), so its output is the same at T = 1 and
 * inside any block: the batch invariance of the *A8 formats. With a mask (a tree), a node's visible
 * block slots go into the sums by the position they stand for (path_sum, one pv_tile per slot into
 * the even or odd chain of that position), so a node's output is that of its path run as a chain:
 * tree verification is exact too. Scratch per thread: QCH (S + 2 E). */
static void attention(const Model* m, long B, long T, const long* start, const float* kc, const float* vc, long L,
                      const long* rows, const uint8_t* mask, Scratch* s) {
    long H = m->H, J = m->J, E = m->E, G = H / J, W = (H + 2 * J) * E;
    long per_head = G * T, chunks = (per_head + QCH - 1) / QCH, items = B * J * chunks;
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    float* score = s->scores + (long)t * QCH * (s->S + 2 * E);
    float* acc = score + QCH * s->S; /* [QCH][2][E]: even- and odd-slot sums */
    float inv_sqrt = 1.0f / sqrtf((float)E);
    for (long it = items * t / n; it < items * (t + 1) / n; it++) {
        long b = it / (J * chunks), j = (it / chunks) % J, q0 = (it % chunks) * QCH;
        long nq = per_head - q0 < QCH ? per_head - q0 : QCH, st = start[b], S = st + T;
        long cb = rows ? rows[b] : b; /* the block row's cache row (its slot) */
        const float* K = kc + (cb * J + j) * L * E;
        const float* V = vc + (cb * J + j) * L * E;
        const float* q[QCH];
        long tok[QCH], h[QCH];
        for (long k = 0; k < nq; k++) {
            h[k] = j * G + (q0 + k) / T, tok[k] = (q0 + k) % T;
            q[k] = s->qkv + (b * T + tok[k]) * W + h[k] * E;
        }
        for (long s0 = 0; s0 < S; s0 += SLOT_TILE) {
            long ns = S - s0 < SLOT_TILE ? S - s0 : SLOT_TILE;
            for (long k = 0; k < nq; k++) scores(score + k * S + s0, q[k], K + s0 * E, ns, E);
        }
        float sum[QCH];
        for (long k = 0; k < nq; k++) {
            float* p = score + k * S;
            for (long sl = 0; sl < st; sl++) p[sl] *= inv_sqrt; /* the cached slots: all visible */
            for (long sl = st; sl < S; sl++) {
                long u = sl - st;
                int vis = mask ? mask[tok[k] * T + u] : u <= tok[k];
                p[sl] = vis ? p[sl] * inv_sqrt : -INFINITY;
            }
            softmax_exp(p, S, slot_max(p, S));
            sum[k] = mask ? path_sum(p, st, T, mask + tok[k] * T) : slot_sum(p, S);
            memset(acc + k * 2 * E, 0, sizeof(float) * 2 * E);
        }
        long tiled = mask ? st : S; /* a tree's block slots follow one by one, by position */
        for (long s0 = 0; s0 < tiled; s0 += SLOT_TILE) {
            long ns = tiled - s0 < SLOT_TILE ? tiled - s0 : SLOT_TILE;
            for (long k = 0; k < nq; k++)
                pv_tile(acc + k * 2 * E, acc + k * 2 * E + E, score + k * S + s0, V + s0 * E, ns, E);
        }
        if (mask)
            for (long k = 0; k < nq; k++) {
                float *a = acc + k * 2 * E, *p = score + k * S;
                for (long u = 0, pos = st; u < T; u++)
                    if (mask[tok[k] * T + u]) { /* the even or odd chain of its position, as a chain's */
                        int odd = pos++ & 1;
                        pv_tile(odd ? a + E : a, odd ? a : a + E, p + st + u, V + (st + u) * E, 1, E);
                    }
            }
        for (long k = 0; k < nq; k++) {
            float* out = s->att + (b * T + tok[k]) * H * E + h[k] * E;
            const float* a = acc + k * 2 * E;
            for (long e = 0; e < E; e++) out[e] = (a[e] + a[E + e]) / sum[k];
        }
    }
#pragma omp barrier
}

/* 1 unless a layer's products have the sizes the model's dims give them: the scratch buffers are
 * sized by H, J, E, D and F, so a product of other sizes would read or write out of bounds. */
static int bad_sizes(const Model* m, const Layer* ly) {
    long H = m->H, J = m->J, E = m->E, D = m->D, F = m->F;
    if (H < 1 || J < 1 || E < 1 || D < 1 || F < 1 || H % J) return 1;
    return ly->qkv.O != (H + 2 * J) * E || ly->qkv.I != D || ly->qkv.act || ly->o.O != D || ly->o.I != H * E ||
           ly->o.act || ly->gate_up.O != 2 * F || ly->gate_up.I != D || ly->gate_up.act || ly->down.O != D ||
           ly->down.I != F || ly->down.act != 1;
}

/* Runs layers[run[0..num_run)] over x ([B T, D], the embeddings in, the last run layer's output out),
 * writing their keys and values; copies the outputs of the layers flagged in capture (aux[k] for
 * the k-th flagged layer, [B T, D]). k_cache / v_cache: [layers][cache_rows][J][L][E]; block row b uses
 * cache row rows[b] (rows NULL: row b). cos_e / sin_e: [B T, E]
 * (sin flipped). mask: [T][T] or NULL (causal). Returns 0, -1 (out of memory), -2 (bad format) or -3 (a
 * product's sizes do not match the model's dims). */
int llama_forward(const Model* m, float* x, long B, long T, const long* start, const float* cos_e,
                  const float* sin_e, float* k_cache, float* v_cache, long L, const long* rows, long cache_rows,
                  const uint8_t* mask, const long* run,
                  long num_run, const uint8_t* capture, float* aux, int nthreads) {
    long M = B * T, H = m->H, J = m->J, E = m->E, D = m->D, F = m->F, W = (H + 2 * J) * E;
    long widest = D > F ? D : F, S = 0;
    for (long b = 0; b < B; b++) S = start[b] + T > S ? start[b] + T : S;
    for (long i = 0; i < num_run; i++) {
        const Layer* ly = m->layers + run[i];
        const Linear* ls[4] = {&ly->qkv, &ly->o, &ly->gate_up, &ly->down};
        for (int k = 0; k < 4; k++)
            if (bad_format(ls[k]->fmt, ls[k]->I, ls[k]->G)) return -2;
        if (bad_sizes(m, ly)) return -3;
    }
    long wide = widest > H * E ? widest : H * E; /* the widest product input */
    Scratch s = {malloc(sizeof(float) * M * W), malloc(sizeof(float) * M * H * E), malloc(sizeof(float) * M * 2 * F),
                 malloc(sizeof(float) * M * wide), malloc(sizeof(float) * M), malloc(sizeof(float) * M * wide),
                 malloc(sizeof(float) * nthreads * QCH * (S + 2 * E)), S, {malloc(M * wide), malloc(sizeof(float) * M * (wide / QB + 1))}};
    int ok = s.qkv && s.att && s.gu && s.buf && s.scale && s.xsum && s.scores && s.a8.q && s.a8.dx;
    if (ok) {
        long layer_stride = cache_rows * J * L * E, aux_k = 0;
#pragma omp parallel num_threads(nthreads)
        for (long i = 0; i < num_run; i++) {
            long li = run[i];
            const Layer* ly = m->layers + li;
            float *kc = k_cache + li * layer_stride, *vc = v_cache + li * layer_stride;
            team_linear(&ly->qkv, x, M, 0, s.qkv, &s);
            rotate_and_store(m, ly, B, T, start, cos_e, sin_e, kc, vc, L, rows, &s);
            attention(m, B, T, start, kc, vc, L, rows, mask, &s);
            team_linear(&ly->o, s.att, M, x, x, &s);
            team_linear(&ly->gate_up, x, M, 0, s.gu, &s);
            team_linear(&ly->down, s.gu, M, x, x, &s);
#pragma omp single
            if (capture && capture[li]) memcpy(aux + (aux_k++) * M * D, x, sizeof(float) * M * D);
        }
    }
    free(s.qkv), free(s.att), free(s.gu), free(s.buf), free(s.scale), free(s.xsum), free(s.scores);
    free(s.a8.q), free(s.a8.dx);
    return ok ? 0 : -1;
}
