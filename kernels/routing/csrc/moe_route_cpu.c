/* Fused CPU routing for MoE inference: top-k routing, counting sort by expert, gather, weighted combine.
 *
 * Legend: T tokens, E experts, K slots per token (top_k), D model dim, M = T*K slots (dropless).
 * A slot is the flat index t*K + k of token t's k-th choice; "expert order" lists the slots grouped by
 * expert, ascending slot index within an expert (a stable counting sort).
 *
 * Why: at the batch sizes of decoding and verification (T = 1..16) the layer's routing is ~15 small
 * PyTorch ops (softmax, sort, gather, bincount, cumsum, index_put, ...), each ~3-50 us of dispatch and
 * threading overhead around a few hundred bytes of work; at T = 512 the sorts and the combine's copies
 * still cost ~0.5 ms. Here each stage is one call and one pass over its data.
 *
 * The semantics are those of kernels/routing/reference.py (the oracle in tests/test_routing_cpu.py):
 *   moe_route_topk  scores = softmax or sigmoid of the logits; choose the top-K experts per token by
 *                   logit (no bias) or by score + bias_E; ties go to the lower expert index; weights are
 *                   the chosen (unbiased) scores, divided by their sum when renorm, times scale;
 *                   then the counting sort: group_sizes_E, sorted_slots_M, token_of_row_M (= slot / K)
 *                   row_of_slot_S (the inverse permutation) and offsets_E (each expert's first row).
 *   moe_gather      x_MD[m] = x_TD[token_of_row_M[m]]
 *   moe_combine     out_TD[t] = sum_k weights_TK[t, k] * y[row of slot t*K + k], where the row lives in
 *                   the output block of its expert: y_blocks_E[e] + (row - offsets_E[e]) * D.
 * The caller validates shapes and dtypes (float32 values, int64 indices, contiguous rows).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many floats moved, a parallel region costs more than it saves. */
#define PARALLEL_MIN_FLOATS (1L << 15)

int moe_route_topk(const float* logits_TE, long T, int E, int K, int sigmoid_scoring, const float* bias_E,
                   int renorm, float scale, int64_t* experts_TK, float* weights_TK, int64_t* group_sizes_E,
                   int64_t* sorted_slots_M, int64_t* token_of_row_M, int64_t* row_of_slot_S,
                   int64_t* offsets_E) {
    if (K < 1 || K > E || E > 4096) return -1;
    float scores[4096];
    float select[4096];
    unsigned char taken[4096];
    for (int e = 0; e < E; e++) group_sizes_E[e] = 0;
    for (long t = 0; t < T; t++) {
        const float* l = logits_TE + t * E;
        if (sigmoid_scoring) {
            for (int e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-l[e]));
        } else {
            float m = l[0];
            for (int e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
            float s = 0.0f;
            for (int e = 0; e < E; e++) {
                scores[e] = expf(l[e] - m);
                s += scores[e];
            }
            for (int e = 0; e < E; e++) scores[e] /= s;
        }
        for (int e = 0; e < E; e++) {
            select[e] = bias_E ? scores[e] + bias_E[e] : l[e];
            taken[e] = 0;
        }
        float total = 0.0f;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) /* strict >: the lower index wins a tie */
                if (!taken[e] && (best < 0 || select[e] > select[best])) best = e;
            taken[best] = 1;
            experts_TK[t * K + k] = best;
            weights_TK[t * K + k] = scores[best];
            total += scores[best];
            group_sizes_E[best]++;
        }
        if (renorm)
            for (int k = 0; k < K; k++) weights_TK[t * K + k] /= total;
        if (scale != 1.0f)
            for (int k = 0; k < K; k++) weights_TK[t * K + k] *= scale;
    }
    /* Counting sort: the next free row of each expert, then the slots in ascending order. */
    int64_t next[4096];
    int64_t offset = 0;
    for (int e = 0; e < E; e++) {
        next[e] = offsets_E[e] = offset;
        offset += group_sizes_E[e];
    }
    long M = T * K;
    for (long s = 0; s < M; s++) {
        int64_t row = next[experts_TK[s]]++;
        sorted_slots_M[row] = s;
        token_of_row_M[row] = s / K;
        row_of_slot_S[s] = row;
    }
    return 0;
}

void moe_gather(const float* x_TD, const int64_t* token_of_row_M, long M, long D, float* x_MD, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * D >= PARALLEL_MIN_FLOATS)
    for (long m = 0; m < M; m++) memcpy(x_MD + m * D, x_TD + token_of_row_M[m] * D, (size_t)D * sizeof(float));
}

void moe_combine(const float* const* y_blocks_E, const int64_t* offsets_E, const int64_t* experts_TK,
                 const int64_t* row_of_slot_S, const float* weights_TK, long T, int K, long D, float* out_TD,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * K * D >= PARALLEL_MIN_FLOATS)
    for (long t = 0; t < T; t++) {
        float* out = out_TD + t * D;
        for (int k = 0; k < K; k++) {
            long s = t * K + k;
            int64_t e = experts_TK[s];
            const float* y = y_blocks_E[e] + (row_of_slot_S[s] - offsets_E[e]) * D;
            float w = weights_TK[s];
            if (k == 0)
                for (long d = 0; d < D; d++) out[d] = w * y[d];
            else
                for (long d = 0; d < D; d++) out[d] += w * y[d];
        }
    }
}
