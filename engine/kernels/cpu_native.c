/* Small fused CPU loops that PyTorch runs as many tiny ops (engine/kernels/cpu_native.py builds and loads
 * this file). float32 throughout; every pointer is to contiguous memory in the layout its comment gives.
 * No reassociation: loops over K and V keep one accumulation order whatever T is, so a sequence's outputs
 * are bit-identical whether its tokens come one per call (decode) or several (speculative verify). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* KDA's recurrent form (K3_SPEC 3): for each sequence n and head h, with S the [K, V] state, for every step t
 *   S = diag(exp(g_t)) S;  u = beta_t (v_t - k_t^T S);  S = S + k_t u^T;  o_t = q_t^T S
 * Inputs are strided by token (x = n * steps + t) and head, unit stride inside a row: q, k, g [.., K] share
 * qkg_x / qkg_h (each its own pointer), v [.., V] has v_x / v_h, beta (one value) beta_x / beta_h.
 * state: [N, H, K, V] contiguous, the start state in, the final state out; out: [N, T, H, V] contiguous;
 * snap (or NULL): the state after every step at snap + n * snap_n + t * snap_t + h * K * V. */
void pdserve_kda_recurrent(int64_t n_seq, int64_t steps, int64_t heads, int64_t kd, int64_t vd,
                           const float *q, const float *k, const float *g, int64_t qkg_x, int64_t qkg_h,
                           const float *v, int64_t v_x, int64_t v_h, const float *beta, int64_t beta_x,
                           int64_t beta_h, float *state, float *out, float *snap, int64_t snap_n, int64_t snap_t) {
    float ks[vd > 0 ? vd : 1];
    for (int64_t n = 0; n < n_seq; ++n) {
        for (int64_t h = 0; h < heads; ++h) {
            float *s = state + (n * heads + h) * kd * vd;
            for (int64_t t = 0; t < steps; ++t) {
                const int64_t x = n * steps + t, at = x * qkg_x + h * qkg_h;
                const float *gt = g + at, *kt = k + at, *qt = q + at, *vt = v + x * v_x + h * v_h;
                const float b = beta[x * beta_x + h * beta_h];
                for (int64_t j = 0; j < vd; ++j) ks[j] = 0.0f;
                for (int64_t i = 0; i < kd; ++i) {
                    const float decay = expf(gt[i]), ki = kt[i];
                    float *si = s + i * vd;
                    for (int64_t j = 0; j < vd; ++j) {
                        si[j] *= decay;
                        ks[j] += ki * si[j];
                    }
                }
                for (int64_t j = 0; j < vd; ++j) ks[j] = (vt[j] - ks[j]) * b; /* u */
                float *ot = out + (x * heads + h) * vd;
                for (int64_t j = 0; j < vd; ++j) ot[j] = 0.0f;
                for (int64_t i = 0; i < kd; ++i) {
                    const float ki = kt[i], qi = qt[i];
                    float *si = s + i * vd;
                    for (int64_t j = 0; j < vd; ++j) {
                        si[j] += ki * ks[j];
                        ot[j] += qi * si[j];
                    }
                }
                if (snap != NULL)
                    memcpy(snap + n * snap_n + t * snap_t + h * kd * vd, s, (size_t)(kd * vd) * sizeof(float));
            }
        }
    }
}

/* DSpark's greedy draft chain with the vanilla Markov head (K3_SPEC 5.3): for each sequence, slot by slot,
 *   token_k = argmax_j (base[k, j] + sum_r w1[prev, r] * w2t[r, j]),  prev_0 = last, prev_{k+1} = token_k
 * base: [N, slots, V]; last: [N]; w1: [rows, R] (rows >= V); w2t: [R, V] (W2 transposed); scratch: [V];
 * tokens: [N, slots] out. Ties go to the lowest index, NaN wins (torch.argmax). Returns 0, or -1 (nothing
 * written past the bad sequence) when a last token is outside w1's rows. */
int pdserve_markov_greedy(int64_t n_seq, int64_t slots, int64_t vocab, int64_t rank, int64_t rows,
                          const float *base, const int64_t *last, const float *w1, const float *w2t,
                          float *scratch, int64_t *tokens) {
    for (int64_t n = 0; n < n_seq; ++n) {
        int64_t prev = last[n];
        if (prev < 0 || prev >= rows) return -1;
        for (int64_t slot = 0; slot < slots; ++slot) {
            const float *row = base + (n * slots + slot) * vocab, *e = w1 + prev * rank;
            memcpy(scratch, row, (size_t)vocab * sizeof(float));
            for (int64_t r = 0; r < rank; ++r) {
                const float er = e[r], *wr = w2t + r * vocab;
                for (int64_t j = 0; j < vocab; ++j) scratch[j] += er * wr[j];
            }
            int64_t best = 0;
            float top = scratch[0];
            for (int64_t j = 1; j < vocab && !isnan(top); ++j) {
                if (scratch[j] > top || isnan(scratch[j])) {
                    top = scratch[j];
                    best = j;
                }
            }
            tokens[n * slots + slot] = best;
            prev = best;
        }
    }
    return 0;
}
