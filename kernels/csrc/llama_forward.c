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

/* Scratch of one forward: the products' outputs and inputs, per-row scales and group sums. */
typedef struct {
    float *qkv, *att, *gu, *buf, *scale, *xsum, *scores;
    long S;
} Scratch;

/* One product of the team: one thread prepares x' (norm, SwiGLU, group sums), then every thread
 * runs its share of the output blocks. y may be res (the residual stream updated in place). */
static void team_linear(const Linear* l, const float* x, long M, const float* res, float* y, Scratch* s) {
    const float* in = x;
    int t = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single
    {
        float eps = l->norm_w ? l->norm_eps : -1.0f;
        in = prepare_input(x, M, l->I, l->G, l->fmt, eps, l->norm_w, l->act, s->buf, s->scale, s->xsum);
    }
    if (l->act == 1 || l->norm_w) in = s->buf;
    long nb = (l->O + BW - 1) / BW;
    linear_blocks(l->fmt, in, M, l->I, (const uint8_t*)l->w, l->O, l->G, l->bias, l->norm_w ? s->scale : 0,
                  l->fmt == Q4 ? s->xsum : 0, res, y, nb * t / n, nb * (t + 1) / n);
#pragma omp barrier
}

/* RMSNorm over each head's E values (Qwen3's q_norm / k_norm), then RoPE; keys and values to the
 * cache. Rows are split across the team. */
static void rotate_and_store(const Model* m, const Layer* ly, long B, long T, const long* start, const float* cos_e,
                             const float* sin_e, float* kc, float* vc, long L, Scratch* s) {
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
        long b = r / T, slot = start[b] + r % T;
        for (long j = 0; j < J; j++) {
            memcpy(kc + ((b * J + j) * L + slot) * E, row + (H + j) * E, sizeof(float) * E);
            memcpy(vc + ((b * J + j) * L + slot) * E, row + (H + J + j) * E, sizeof(float) * E);
        }
    }
#pragma omp barrier
}

/* softmax(q k^T / sqrt(E)) v over the visible slots, for every (row, query head, token). */
static void attention(const Model* m, long B, long T, const long* start, const float* kc, const float* vc, long L,
                      const uint8_t* mask, Scratch* s) {
    long H = m->H, J = m->J, E = m->E, G = H / J, W = (H + 2 * J) * E, items = B * H * T;
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    float* score = s->scores + (long)t * s->S;
    float inv_sqrt = 1.0f / sqrtf((float)E);
    for (long it = items * t / n; it < items * (t + 1) / n; it++) {
        long b = it / (H * T), h = (it / T) % H, tok = it % T, j = h / G, st = start[b], S = st + T;
        const float* q = s->qkv + (b * T + tok) * W + h * E;
        const float* K = kc + (b * J + j) * L * E;
        const float* V = vc + (b * J + j) * L * E;
        float mx = -INFINITY;
        for (long sl = 0; sl < S; sl++) {
            long u = sl - st;
            int vis = u < 0 || (mask ? mask[tok * T + u] : u <= tok);
            float d = -INFINITY;
            if (vis) {
                d = 0;
                for (long e = 0; e < E; e++) d += q[e] * K[sl * E + e];
                d *= inv_sqrt;
            }
            score[sl] = d;
            mx = d > mx ? d : mx;
        }
        float* out = s->att + (b * T + tok) * H * E + h * E;
        for (long e = 0; e < E; e++) out[e] = 0;
        float sum = 0;
        for (long sl = 0; sl < S; sl++) {
            if (score[sl] == -INFINITY) continue;
            float p = expf(score[sl] - mx);
            sum += p;
            for (long e = 0; e < E; e++) out[e] += p * V[sl * E + e];
        }
        for (long e = 0; e < E; e++) out[e] /= sum;
    }
#pragma omp barrier
}

/* Runs layers[run[0..num_run)] over x ([B T, D], the embeddings in, the last run layer's output out),
 * writing their keys and values; copies the outputs of the layers flagged in capture (aux[k] for
 * the k-th flagged layer, [B T, D]). k_cache / v_cache: [layers][B][J][L][E]. cos_e / sin_e: [B T, E]
 * (sin flipped). mask: [T][T] or NULL (causal). Returns 0, -1 (out of memory) or -2 (bad format). */
int llama_forward(const Model* m, float* x, long B, long T, const long* start, const float* cos_e,
                  const float* sin_e, float* k_cache, float* v_cache, long L, const uint8_t* mask, const long* run,
                  long num_run, const uint8_t* capture, float* aux, int nthreads) {
    long M = B * T, H = m->H, J = m->J, E = m->E, D = m->D, F = m->F, W = (H + 2 * J) * E;
    long widest = D > F ? D : F, S = 0;
    for (long b = 0; b < B; b++) S = start[b] + T > S ? start[b] + T : S;
    for (long i = 0; i < num_run; i++) {
        const Layer* ly = m->layers + run[i];
        const Linear* ls[4] = {&ly->qkv, &ly->o, &ly->gate_up, &ly->down};
        for (int k = 0; k < 4; k++)
            if (bad_format(ls[k]->fmt, ls[k]->I, ls[k]->G)) return -2;
    }
    Scratch s = {malloc(sizeof(float) * M * W), malloc(sizeof(float) * M * H * E), malloc(sizeof(float) * M * 2 * F),
                 malloc(sizeof(float) * M * (widest > H * E ? widest : H * E)), malloc(sizeof(float) * M),
                 malloc(sizeof(float) * M * (widest > H * E ? widest : H * E)), malloc(sizeof(float) * nthreads * S), S};
    int ok = s.qkv && s.att && s.gu && s.buf && s.scale && s.xsum && s.scores;
    if (ok) {
        long layer_stride = B * J * L * E, aux_k = 0;
#pragma omp parallel num_threads(nthreads)
        for (long i = 0; i < num_run; i++) {
            long li = run[i];
            const Layer* ly = m->layers + li;
            float *kc = k_cache + li * layer_stride, *vc = v_cache + li * layer_stride;
            team_linear(&ly->qkv, x, M, 0, s.qkv, &s);
            rotate_and_store(m, ly, B, T, start, cos_e, sin_e, kc, vc, L, &s);
            attention(m, B, T, start, kc, vc, L, mask, &s);
            team_linear(&ly->o, s.att, M, x, x, &s);
            team_linear(&ly->gate_up, x, M, 0, s.gu, &s);
            team_linear(&ly->down, s.gu, M, x, x, &s);
#pragma omp single
            if (capture && capture[li]) memcpy(aux + (aux_k++) * M * D, x, sizeof(float) * M * D);
        }
    }
    free(s.qkv), free(s.att), free(s.gu), free(s.buf), free(s.scale), free(s.xsum), free(s.scores);
    return ok ? 0 : -1;
}
