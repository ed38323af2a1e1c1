// llama-perplexity-min: perplexity() of llama.cpp's tools/perplexity/perplexity.cpp over libllama alone
// (no libcommon), for a build that has libllama but not the tool: the same tokenisation (add_special,
// no parse_special), chunks, BOS replacement, n_seq = n_batch / n_ctx, context parameters (libllama's
// defaults: f16 KV cache, flash attention auto, n_ubatch 512), second half scored, log_softmax, final
// estimate and --kl-divergence-base file. Flags: -m -f -c -t -b --chunks --kl-divergence-base
// -nr/--no-repack, -ctk/-ctv f16|f32, -fa on|off|auto (as llama-perplexity's). Build (LLAMA = llama.cpp's source, BUILD its CMake build):
//   g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include llama_perplexity_min.cpp \
//       -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o llama-perplexity-min
#include "llama.h"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <algorithm>
#include <chrono>

static void log_cb(ggml_log_level, const char * text, void *) { fputs(text, stderr); }

int main(int argc, char ** argv) {
    std::string model, file, logits_file;
    int n_ctx = 512, n_chunks = -1, n_threads = 1, n_batch = 2048;
    bool no_repack = false;
    std::string ctk = "f16", ctv = "f16", fa = "auto";
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "-m") model = argv[++i];
        else if (a == "-f") file = argv[++i];
        else if (a == "-c") n_ctx = atoi(argv[++i]);
        else if (a == "-t") n_threads = atoi(argv[++i]);
        else if (a == "-b") n_batch = atoi(argv[++i]);
        else if (a == "--chunks") n_chunks = atoi(argv[++i]);
        else if (a == "--kl-divergence-base") logits_file = argv[++i];
        else if (a == "-nr" || a == "--no-repack") no_repack = true;
        else if (a == "-ctk" || a == "--cache-type-k") ctk = argv[++i];
        else if (a == "-ctv" || a == "--cache-type-v") ctv = argv[++i];
        else if (a == "-fa" || a == "--flash-attn") fa = argv[++i];
        else { fprintf(stderr, "unknown argument %s\n", a.c_str()); return 1; }
    }
    std::ifstream in(file, std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::string prompt = ss.str();
    if (!prompt.empty() && prompt.back() == '\n') prompt.pop_back();
    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    auto mparams = llama_model_default_params();
    mparams.use_extra_bufts = !no_repack;
    llama_model * mdl = llama_model_load_from_file(model.c_str(), mparams);
    if (!mdl) { fprintf(stderr, "unable to load model\n"); return 1; }
    const int n_seq = std::max(1, n_batch / n_ctx);
    auto cparams = llama_context_default_params();
    cparams.n_ctx = n_seq * n_ctx;
    cparams.n_seq_max = n_seq;
    cparams.n_batch = std::min(n_batch, (int) cparams.n_ctx);
    cparams.n_outputs_max = 0;
    cparams.n_outputs_max_per_seq = 0;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.type_k = ctk == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cparams.type_v = ctv == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cparams.flash_attn_type = fa == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                            : fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
    llama_context * ctx = llama_init_from_model(mdl, cparams);
    if (!ctx) { fprintf(stderr, "failed to create context\n"); return 1; }
    n_batch = cparams.n_batch;
    const llama_vocab * vocab = llama_model_get_vocab(mdl);
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    std::vector<llama_token> tokens(prompt.size() + 16);
    int n = llama_tokenize(vocab, prompt.c_str(), prompt.size(), tokens.data(), tokens.size(), true, false);
    if (n < 0) { tokens.resize(-n); n = llama_tokenize(vocab, prompt.c_str(), prompt.size(), tokens.data(), tokens.size(), true, false); }
    tokens.resize(n);
    fprintf(stderr, "perplexity: tokenized %d tokens, add_bos=%d\n", n, (int) add_bos);
    if (n < 2 * n_ctx) { fprintf(stderr, "perplexity: the data file you provided tokenizes to only %d tokens\n", n); return 1; }
    const int n_chunk_max = n / n_ctx;
    const int n_chunk = n_chunks < 0 ? n_chunk_max : std::min(n_chunks, n_chunk_max);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int first = n_ctx / 2;
    const int nv = 2 * ((n_vocab + 1) / 2) + 4;
    std::ofstream out;
    std::vector<uint16_t> log_probs;
    if (!logits_file.empty()) {
        out.open(logits_file, std::ios::binary);
        out.write("_logits_", 8);
        out.write((const char *) &n_ctx, sizeof(n_ctx));
        out.write((const char *) &n_vocab, sizeof(n_vocab));
        out.write((const char *) &n_chunk, sizeof(n_chunk));
        out.write((const char *) tokens.data(), size_t(n_chunk) * n_ctx * sizeof(tokens[0]));
        log_probs.resize(size_t(n_ctx) * nv);
    }
    fprintf(stderr, "perplexity: calculating perplexity over %d chunks, n_ctx=%d, batch_size=%d, n_seq=%d\n", n_chunk, n_ctx, n_batch, n_seq);
    const int num_batches = (n_ctx + n_batch - 1) / n_batch;
    llama_batch batch = llama_batch_init(std::max(n_batch, n_ctx), 0, 1);
    double nll = 0, nll2 = 0; int count = 0;
    std::vector<float> logits;
    for (int i = 0; i < n_chunk; i += n_seq) {
        const int start = i * n_ctx, end = start + n_ctx;
        const int n_seq_batch = std::min(n_seq, n_chunk - i);
        auto t0 = std::chrono::high_resolution_clock::now();
        llama_memory_clear(llama_get_memory(ctx), true);
        for (int j = 0; j < num_batches; ++j) {
            const int batch_start = start + j * n_batch;
            const int batch_size = std::min(end - batch_start, n_batch);
            batch.n_tokens = 0;
            int n_outputs = 0;
            for (int seq = 0; seq < n_seq_batch; seq++) {
                int seq_start = batch_start + seq * n_ctx;
                const auto token_org = tokens[seq_start];
                if (add_bos && j == 0) tokens[seq_start] = llama_vocab_bos(vocab);
                for (int k = 0; k < batch_size; ++k) {
                    const int idx = batch.n_tokens++;
                    const int pos = j * n_batch + k;
                    batch.token[idx] = tokens[seq_start + k];
                    batch.pos[idx] = pos;
                    batch.n_seq_id[idx] = 1;
                    batch.seq_id[idx][0] = seq;
                    batch.logits[idx] = pos >= first;
                    n_outputs += pos >= first;
                }
                tokens[seq_start] = token_org;
            }
            if (llama_decode(ctx, batch)) { fprintf(stderr, "failed to decode\n"); return 1; }
            if (num_batches > 1 && n_outputs > 0) {
                const float * bl = llama_get_logits(ctx);
                logits.insert(logits.end(), bl, bl + size_t(n_outputs) * n_vocab);
            }
        }
        if (i == 0) {
            const float t = std::chrono::duration<float>(std::chrono::high_resolution_clock::now() - t0).count();
            fprintf(stderr, "perplexity: %.2f seconds per pass - ETA %.2f minutes\n", t, t * n_chunk / n_seq / 60.0);
        }
        for (int seq = 0; seq < n_seq_batch; seq++) {
            const float * all_logits = num_batches > 1 ? logits.data() : llama_get_logits_ith(ctx, seq * n_ctx + first);
            const llama_token * tok = tokens.data() + start + seq * n_ctx + first;
            for (int r = 0; r < n_ctx - 1 - first; r++) {
                const float * lg = all_logits + size_t(r) * n_vocab;
                float max_logit = lg[0], min_logit = lg[0];
                for (int v = 1; v < n_vocab; v++) { max_logit = std::max(max_logit, lg[v]); min_logit = std::min(min_logit, lg[v]); }
                double sum_exp = 0;
                for (int v = 0; v < n_vocab; v++) sum_exp += expf(lg[v] - max_logit);
                const double val = max_logit + log(sum_exp) - lg[tok[r + 1]];
                nll += val; nll2 += val * val;
                if (out.is_open()) {
                    min_logit = std::max(min_logit, max_logit - 16);
                    const float log_sum_exp = log(sum_exp);
                    const float min_log_prob = min_logit - max_logit - log_sum_exp;
                    const float scale = (max_logit - min_logit) / 65535.f;
                    uint16_t * lp = log_probs.data() + size_t(r) * nv;
                    float * d = (float *) lp; d[0] = scale; d[1] = min_log_prob; lp += 4;
                    for (int v = 0; v < n_vocab; v++) {
                        float x = scale ? (lg[v] > min_logit ? (1 / scale) * (lg[v] - min_logit) : 0.f) : 0.f;
                        lp[v] = (uint16_t) lrintf(x);
                    }
                }
            }
            if (out.is_open()) out.write((const char *) log_probs.data(), size_t(n_ctx - 1 - first) * nv * sizeof(uint16_t));
            count += n_ctx - first - 1;
            printf("[%d]%.4lf,", i + seq + 1, std::exp(nll / count));
            fflush(stdout);
        }
        logits.clear();
    }
    printf("\n");
    nll2 /= count; nll /= count;
    const double ppl = exp(nll);
    nll2 -= nll * nll;
    if (nll2 > 0) { nll2 = sqrt(nll2 / (count - 1)); fprintf(stderr, "Final estimate: PPL = %.4lf +/- %.5lf\n", ppl, nll2 * ppl); }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(mdl);
    return 0;
}
