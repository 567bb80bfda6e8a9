/* One token of one slot through a model on the CPU, in float32, in one call: the step the engine's torch
 * forward takes in ~25 ATen ops a layer, each costing more in dispatch and allocation than its arithmetic at
 * these sizes. Two families:
 *
 * cpustep_gqa, the Llama family (Llama, Qwen2's qkv bias, Qwen3's q/k norm; llama.py): RMSNorm with float32
 * statistics, the fused QKV projection (+ bias), the heads' q/k norm, the neox rotation by the rope tables'
 * row of the position, the K/V row written into the slot's cache, softmax attention over the slot's keys
 * 0..pos (GQA: each K/V head serves its group of query heads), the output projection (+ bias) into the
 * residual, then SiLU(gate) * up and the down projection into the residual; the final norm last.
 *
 * cpustep_mla, the DeepSeek-V3 family (deepseek.py, dense attention): q (q LoRA: q_a, its norm, q_b), the
 * latent c and k_pe (kv_a, c's norm), the rope of q_pe and k_pe (adjacent pairs laid out as halves, or the
 * neox halves), the cache row [c, k_pe], the absorbed query q_nope . w_uk attending to the slot's rows 0..pos
 * in the latent space, the latent output lifted by w_uv, wo into the residual; then a dense SwiGLU MLP, or
 * the noaux_tc router (sigmoid scores, + bias for the choice, group-limited), the chosen experts' SwiGLU
 * weighted and summed, plus the shared experts; the final norm last.
 *
 * The math and its rounding points are the torch steps'; only the order of the sums differs from ATen's
 * (float32 throughout).
 *
 * Projections are column-major (layers.column_major: W [N, K] stored as W^T, row k holding column k's
 * N weights; a stacked expert weight [E, N, K] each expert so), so y = W x is an axpy a k over contiguous
 * rows that the compiler vectorises.
 * Built by cpustep.py with the host's compiler (-O3 -march=native); no libraries beyond libm.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, layers;
    int64_t cache_slot_stride, cache_token_stride; /* elements, the same for every layer's K and V view */
    float eps, scale;                              /* RMSNorm epsilon, attention scale (head_dim^-0.5) */
    const float *embed;                            /* [vocab, hidden] */
    const float *final_norm;                       /* [hidden] */
    const float *cos, *sin;                        /* rope tables [max_pos, head_dim / 2] */
    /* per layer (arrays of `layers` pointers; a missing bias / norm is NULL) */
    const float *const *attn_norm, *const *wqkv, *const *bqkv, *const *q_norm, *const *k_norm;
    const float *const *wo, *const *bo, *const *mlp_norm, *const *w_gate_up, *const *w_down;
    float *const *k_cache, *const *v_cache;       /* each layer's [rows, max_tokens, kv_heads, head_dim] */
    float *scratch;                                /* cpustep_scratch_floats(...) floats */
} GqaModel;

int64_t cpustep_scratch_floats(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                               int64_t max_tokens) {
    return 3 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + max_tokens + 3 * inter;
}

/* out may be x (the heads' q/k norm runs in place) */
static void rms_norm(const float *x, const float *restrict w, float *out, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* y[N] = W x (+ bias) over a column-major W (wt: [K, N] row-major). */
static void gemv_cm(const float *restrict x, const float *restrict wt, const float *restrict bias, float *restrict y,
                    int64_t k_dim, int64_t n_dim) {
    if (bias) memcpy(y, bias, (size_t)n_dim * sizeof(float));
    else memset(y, 0, (size_t)n_dim * sizeof(float));
    int64_t k = 0;
    for (; k + 4 <= k_dim; k += 4) {
        const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
        const float *restrict r0 = wt + k * n_dim, *restrict r1 = r0 + n_dim, *restrict r2 = r1 + n_dim,
                    *restrict r3 = r2 + n_dim;
#pragma omp simd
        for (int64_t n = 0; n < n_dim; n++) y[n] += (x0 * r0[n] + x1 * r1[n]) + (x2 * r2[n] + x3 * r3[n]);
    }
    for (; k < k_dim; k++) {
        const float xk = x[k];
        const float *restrict r = wt + k * n_dim;
#pragma omp simd
        for (int64_t n = 0; n < n_dim; n++) y[n] += xk * r[n];
    }
}

/* neox rotation of one head in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rotate(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/* x . each of four rows, n long: four independent sums (one sum's chain of dependent adds bounded a dot of
 * 512 at the adder's latency) */
static void dot4(const float *restrict x, const float *restrict r0, const float *restrict r1,
                 const float *restrict r2, const float *restrict r3, int64_t n, float *restrict out) {
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int64_t i = 0; i < n; i++) {
        const float xi = x[i];
        d0 += xi * r0[i];
        d1 += xi * r1[i];
        d2 += xi * r2[i];
        d3 += xi * r3[i];
    }
    out[0] = d0;
    out[1] = d1;
    out[2] = d2;
    out[3] = d3;
}

/* out[j] = x . rows[j] for `count` rows `stride` apart, four at a time */
static void dots(const float *restrict x, const float *rows, int64_t stride, int64_t count, int64_t n,
                 float *restrict out) {
    int64_t j = 0;
    for (; j + 4 <= count; j += 4)
        dot4(x, rows + j * stride, rows + (j + 1) * stride, rows + (j + 2) * stride, rows + (j + 3) * stride, n,
             out + j);
    for (; j < count; j++) {
        const float *restrict r = rows + j * stride;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < n; i++) d += x[i] * r[i];
        out[j] = d;
    }
}

/* y[H] = down(SiLU(gate(x)) * up(x)), gate and up one [2I, H] weight (column-major: [H, 2I]), down [I, H] */
static void swiglu_cm(const float *restrict x, const float *restrict w_gate_up, const float *restrict w_down,
                      float *restrict y, int64_t hidden, int64_t inter, float *restrict gu) {
    gemv_cm(x, w_gate_up, NULL, gu, hidden, 2 * inter);
    float *act = gu + 2 * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float g = gu[i];
        act[i] = g / (1.0f + expf(-g)) * gu[inter + i];
    }
    gemv_cm(act, w_down, NULL, y, inter, hidden);
}

/* hidden[H] after the final norm for `token` at `pos` of cache row `slot` (its keys 0..pos-1 cached); the
 * caller checks token < vocab, slot < rows and pos < max_tokens (cpustep.py). */
void cpustep_gqa(const GqaModel *m, int64_t token, int64_t slot, int64_t pos, float *restrict hidden) {
    const int64_t H = m->hidden, D = m->head_dim, nq = m->heads, nkv = m->kv_heads, I = m->inter;
    const int64_t half = D / 2, group = nq / nkv, nkeys = pos + 1;
    float *x = m->scratch, *h = x + H, *tmp = h + H, *qkv = tmp + H, *att = qkv + (nq + 2 * nkv) * D,
          *scores = att + nq * D, *gu = scores + nkeys;
    const float *cos = m->cos + pos * half, *sin = m->sin + pos * half;
    memcpy(x, m->embed + token * H, (size_t)H * sizeof(float));
    for (int64_t l = 0; l < m->layers; l++) {
        rms_norm(x, m->attn_norm[l], h, H, m->eps);
        gemv_cm(h, m->wqkv[l], m->bqkv[l], qkv, H, (nq + 2 * nkv) * D);
        for (int64_t j = 0; j < nq + nkv; j++) { /* the q heads, then the K heads */
            float *head = qkv + j * D;
            if (m->q_norm[l]) rms_norm(head, j < nq ? m->q_norm[l] : m->k_norm[l], head, D, m->eps);
            rotate(head, cos, sin, half);
        }
        float *kc = m->k_cache[l] + slot * m->cache_slot_stride, *vc = m->v_cache[l] + slot * m->cache_slot_stride;
        memcpy(kc + pos * m->cache_token_stride, qkv + nq * D, (size_t)(nkv * D) * sizeof(float));
        memcpy(vc + pos * m->cache_token_stride, qkv + (nq + nkv) * D, (size_t)(nkv * D) * sizeof(float));
        for (int64_t hq = 0; hq < nq; hq++) {
            const float *q = qkv + hq * D;
            const int64_t g = hq / group;
            float mx = -INFINITY;
            dots(q, kc + g * D, m->cache_token_stride, nkeys, D, scores);
            for (int64_t s = 0; s < nkeys; s++) {
                scores[s] *= m->scale;
                mx = scores[s] > mx ? scores[s] : mx;
            }
            float sum = 0.0f;
            for (int64_t s = 0; s < nkeys; s++) {
                scores[s] = expf(scores[s] - mx);
                sum += scores[s];
            }
            float *o = att + hq * D;
            memset(o, 0, (size_t)D * sizeof(float));
            for (int64_t s = 0; s < nkeys; s++) {
                const float p = scores[s];
                const float *v = vc + s * m->cache_token_stride + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
        gemv_cm(att, m->wo[l], m->bo[l], tmp, nq * D, H);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
        rms_norm(x, m->mlp_norm[l], h, H, m->eps);
        swiglu_cm(h, m->w_gate_up[l], m->w_down[l], tmp, H, I, gu);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
    }
    rms_norm(x, m->final_norm, hidden, H, m->eps);
}

/* ------------------------------------------------------------------------------------------------ MLA */

enum { MAX_GROUPS = 64, MAX_TOP_K = 64 }; /* cpustep.py refuses models beyond them */

typedef struct {
    int64_t hidden, heads, nope, rope, v_dim, kv_rank, q_rank, layers; /* q_rank 0: no q LoRA */
    int64_t experts, top_k, n_group, topk_group, moe_inter, shared_inter, dense_inter, interleave, norm_topk;
    int64_t cache_slot_stride, cache_token_stride; /* elements, the same for every layer's latent view */
    float eps, scale, routed_scale;                /* RMSNorm epsilon, attention scale, routed_scaling_factor */
    const float *embed, *final_norm, *cos, *sin;   /* rope tables [max_pos, rope / 2] */
    int64_t mtp_layers;                            /* MTP layers after the main ones (their blocks' weights
                                                    * and caches at index layers + j of the arrays below) */
    const float *const *mtp_embed, *const *enorm, *const *hnorm, *const *eh_proj, *const *head_norm;
    /* per block, the main model's then the MTP layers' (arrays of `layers + mtp_layers` pointers; what a block
     * lacks is NULL: wq or wq_a/q_a_norm/wq_b; the dense MLP's w_gate_up/w_down or the router's and experts'
     * weights; shared experts) */
    const float *const *attn_norm, *const *wq, *const *wq_a, *const *q_a_norm, *const *wq_b, *const *wkv_a;
    const float *const *kv_a_norm, *const *w_uk, *const *w_uv, *const *wo, *const *mlp_norm;
    const float *const *w_gate_up, *const *w_down, *const *router, *const *router_bias;
    const float *const *experts_gate_up, *const *experts_down, *const *shared_gate_up, *const *shared_down;
    float *const *kv_cache; /* each block's [rows, max_tokens, kv_rank + rope] */
    float *scratch;         /* cpustep_mla_scratch_floats(...) floats */
} MlaModel;

int64_t cpustep_mla_scratch_floats(int64_t hidden, int64_t heads, int64_t nope, int64_t rope, int64_t v_dim,
                                   int64_t kv_rank, int64_t q_rank, int64_t experts, int64_t max_inter,
                                   int64_t max_tokens) {
    return 6 * hidden + q_rank + heads * (nope + rope) + kv_rank + rope + 2 * heads * kv_rank + heads * v_dim +
           (heads + 1) * max_tokens + 2 * experts + 3 * max_inter;
}

/* rotate one rope part in place (tables' row cos/sin [half]); interleave: adjacent pairs, laid out as the
 * rotated evens then the rotated odds (rope.rotate) */
static void rotate_rope(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t half,
                        int64_t interleave, float *restrict tmp) {
    if (interleave) {
        for (int64_t i = 0; i < half; i++) {
            tmp[i] = x[2 * i];
            tmp[half + i] = x[2 * i + 1];
        }
        memcpy(x, tmp, (size_t)(2 * half) * sizeof(float));
    }
    rotate(x, cos, sin, half);
}

/* the routed experts' weighted sum (deepseek.route's noaux_tc choice) plus the shared experts, into out[H] */
static void moe(const MlaModel *m, int64_t l, const float *restrict h, float *restrict out, float *restrict scores,
                float *restrict choice, float *restrict gu, float *restrict y) {
    const int64_t H = m->hidden, E = m->experts, I = m->moe_inter;
    gemv_cm(h, m->router[l], NULL, scores, H, E);
    const float *bias = m->router_bias[l];
    for (int64_t e = 0; e < E; e++) {
        scores[e] = 1.0f / (1.0f + expf(-scores[e]));
        choice[e] = scores[e] + bias[e];
    }
    if (m->n_group > 1 && m->topk_group < m->n_group) { /* a group scores the sum of its two best choices */
        const int64_t gs = E / m->n_group;
        float gscore[MAX_GROUPS];
        int keep[MAX_GROUPS];
        for (int64_t g = 0; g < m->n_group; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; e++) {
                if (choice[e] > b1) { b2 = b1; b1 = choice[e]; }
                else if (choice[e] > b2) b2 = choice[e];
            }
            gscore[g] = b1 + b2;
            keep[g] = 0;
        }
        for (int64_t j = 0; j < m->topk_group; j++) {
            int64_t best = -1;
            for (int64_t g = 0; g < m->n_group; g++)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / gs]) choice[e] = -INFINITY;
    }
    int64_t ids[MAX_TOP_K];
    float wts[MAX_TOP_K], total = 0.0f;
    for (int64_t j = 0; j < m->top_k; j++) { /* the top_k best choices (cpustep.py: the kept groups hold as many) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (choice[e] > -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        ids[j] = best;
        wts[j] = scores[best];
        total += wts[j];
        choice[best] = -INFINITY;
    }
    memset(out, 0, (size_t)H * sizeof(float));
    const int64_t gu_size = 2 * I * H, down_size = H * I;
    for (int64_t j = 0; j < m->top_k; j++) {
        const float w = (m->norm_topk ? wts[j] / (total + 1e-20f) : wts[j]) * m->routed_scale;
        swiglu_cm(h, m->experts_gate_up[l] + ids[j] * gu_size, m->experts_down[l] + ids[j] * down_size, y, H, I, gu);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[i] += y[i] * w;
    }
    if (m->shared_gate_up[l]) {
        swiglu_cm(h, m->shared_gate_up[l], m->shared_down[l], y, H, m->shared_inter, gu);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[i] += y[i];
    }
}

/* block l (a main layer, or layers + j: MTP layer j's) of one token at `pos` of cache row `slot`: x[H] += its
 * attention, then += its MLP */
static void mla_block(const MlaModel *m, int64_t l, float *restrict x, int64_t slot, int64_t pos) {
    const int64_t H = m->hidden, nh = m->heads, nope = m->nope, rp = m->rope, R = m->kv_rank, V = m->v_dim;
    const int64_t qk = nope + rp, half = rp / 2, nkeys = pos + 1, row = R + rp;
    /* the scratch's first 3H are the callers' (x, an MTP layer's input) */
    float *h = m->scratch + 3 * H, *tmp = h + H, *y = tmp + H, *qa = y + H, *q = qa + m->q_rank, *kva = q + nh * qk,
          *qc = kva + row, *olat = qc + nh * R, *ov = olat + nh * R, *scores = ov + nh * V,
          *rs = scores + (nh + 1) * nkeys, *rc = rs + m->experts, *gu = rc + m->experts;
    const float *cos = m->cos + pos * half, *sin = m->sin + pos * half;
    rms_norm(x, m->attn_norm[l], h, H, m->eps);
    if (m->q_rank) {
        gemv_cm(h, m->wq_a[l], NULL, qa, H, m->q_rank);
        rms_norm(qa, m->q_a_norm[l], qa, m->q_rank, m->eps);
        gemv_cm(qa, m->wq_b[l], NULL, q, m->q_rank, nh * qk);
    } else {
        gemv_cm(h, m->wq[l], NULL, q, H, nh * qk);
    }
    gemv_cm(h, m->wkv_a[l], NULL, kva, H, row);
    rms_norm(kva, m->kv_a_norm[l], kva, R, m->eps);
    rotate_rope(kva + R, cos, sin, half, m->interleave, tmp);
    float *cache = m->kv_cache[l] + slot * m->cache_slot_stride;
    memcpy(cache + pos * m->cache_token_stride, kva, (size_t)row * sizeof(float));
    for (int64_t hq = 0; hq < nh; hq++) { /* q_pe roped; the absorbed query q_nope . w_uk[hq] ([nope, R]) */
        float *qh = q + hq * qk, *c = qc + hq * R;
        rotate_rope(qh + nope, cos, sin, half, m->interleave, tmp);
        memset(c, 0, (size_t)R * sizeof(float));
        const float *wk = m->w_uk[l] + hq * nope * R;
        for (int64_t n = 0; n < nope; n++) {
            const float qn = qh[n];
            const float *restrict wr = wk + n * R;
#pragma omp simd
            for (int64_t r = 0; r < R; r++) c[r] += qn * wr[r];
        }
    }
    for (int64_t hq = 0; hq < nh; hq++) { /* every head's scores over the slot's rows 0..pos */
        float *sc = scores + hq * nkeys, *pe = scores + nh * nkeys; /* pe: the rope parts' products */
        dots(qc + hq * R, cache, m->cache_token_stride, nkeys, R, sc);
        dots(q + hq * qk + nope, cache + R, m->cache_token_stride, nkeys, rp, pe);
        for (int64_t s = 0; s < nkeys; s++) sc[s] = (sc[s] + pe[s]) * m->scale;
    }
    for (int64_t hq = 0; hq < nh; hq++) { /* softmax: the probabilities, normalised */
        float *sc = scores + hq * nkeys, mx = -INFINITY, sum = 0.0f;
        for (int64_t s = 0; s < nkeys; s++) mx = sc[s] > mx ? sc[s] : mx;
        for (int64_t s = 0; s < nkeys; s++) {
            sc[s] = expf(sc[s] - mx);
            sum += sc[s];
        }
        const float inv = 1.0f / sum;
        for (int64_t s = 0; s < nkeys; s++) sc[s] *= inv;
    }
    memset(olat, 0, (size_t)(nh * R) * sizeof(float));
    for (int64_t s = 0; s < nkeys; s++) { /* the latent outputs sum_s p_s c_s, each row read once for all heads */
        const float *restrict kv = cache + s * m->cache_token_stride;
        for (int64_t hq = 0; hq < nh; hq++) {
            const float p = scores[hq * nkeys + s];
            float *restrict o = olat + hq * R;
#pragma omp simd
            for (int64_t r = 0; r < R; r++) o[r] += p * kv[r];
        }
    }
    for (int64_t hq = 0; hq < nh; hq++) /* lifted by w_uv[hq] ([V, R]) */
        dots(olat + hq * R, m->w_uv[l] + hq * V * R, R, V, R, ov + hq * V);
    gemv_cm(ov, m->wo[l], NULL, tmp, nh * V, H);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
    rms_norm(x, m->mlp_norm[l], h, H, m->eps);
    if (m->router[l]) moe(m, l, h, tmp, rs, rc, gu, y);
    else swiglu_cm(h, m->w_gate_up[l], m->w_down[l], tmp, H, m->dense_inter, gu);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
}

/* hidden[H] after the final norm for `token` at `pos` of cache row `slot` (its rows 0..pos-1 cached); the
 * caller checks token < vocab, slot < rows and pos < max_tokens (cpustep.py). */
void cpustep_mla(const MlaModel *m, int64_t token, int64_t slot, int64_t pos, float *restrict hidden) {
    const int64_t H = m->hidden;
    float *x = m->scratch;
    memcpy(x, m->embed + token * H, (size_t)H * sizeof(float));
    for (int64_t l = 0; l < m->layers; l++) mla_block(m, l, x, slot, pos);
    rms_norm(x, m->final_norm, hidden, H, m->eps);
}

/* MTP layer j for `token` at `pos`, given the hidden before it (the main model's there, or a recycled one):
 * prev[H]; hidden[H] is its output after the head norm (deepseek.mtp_forward: the token's embedding is zero at
 * position 0). The caller checks j < mtp_layers too. */
void cpustep_mla_mtp(const MlaModel *m, int64_t j, int64_t token, int64_t slot, int64_t pos,
                     const float *restrict prev, float *restrict hidden) {
    const int64_t H = m->hidden;
    float *x = m->scratch, *cat = x + H; /* [enorm(e), hnorm(prev)]: 2H */
    if (pos == 0) memset(cat, 0, (size_t)H * sizeof(float));
    else rms_norm(m->mtp_embed[j] + token * H, m->enorm[j], cat, H, m->eps);
    rms_norm(prev, m->hnorm[j], cat + H, H, m->eps);
    gemv_cm(cat, m->eh_proj[j], NULL, x, 2 * H, H);
    mla_block(m, m->layers + j, x, slot, pos);
    rms_norm(x, m->head_norm[j], hidden, H, m->eps);
}
