/* One token of one slot through a Llama-family model (Llama, Qwen2's qkv bias, Qwen3's q/k norm) on
 * the CPU, in float32, in one call: the step the engine's torch forward takes in ~25 ATen ops a layer,
 * each costing more in dispatch and allocation than its arithmetic at these sizes.
 *
 * The math and its rounding points are the torch step's (llama.py): RMSNorm with float32 statistics,
 * the fused QKV projection (+ bias), the heads' q/k norm, the neox rotation by the rope tables' row of
 * the position, the K/V row written into the slot's cache, softmax attention over the slot's keys
 * 0..pos (GQA: each K/V head serves its group of query heads), the output projection (+ bias) into the
 * residual, then SiLU(gate) * up and the down projection into the residual; the final norm last.
 * Only the order of the sums differs from ATen's (float32 throughout).
 *
 * Projections are column-major (layers.column_major: W [N, K] stored as W^T, row k holding column k's
 * N weights), so y = W x is an axpy a k over contiguous rows that the compiler vectorises.
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
            for (int64_t s = 0; s < nkeys; s++) {
                const float *k = kc + s * m->cache_token_stride + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += q[d] * k[d];
                scores[s] = dot * m->scale;
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
        gemv_cm(h, m->w_gate_up[l], NULL, gu, H, 2 * I);
        float *act = gu + 2 * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) act[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
        gemv_cm(act, m->w_down[l], NULL, tmp, I, H);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) x[i] += tmp[i];
    }
    rms_norm(x, m->final_norm, hidden, H, m->eps);
}
