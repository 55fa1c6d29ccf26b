/* Paged attention on the CPU: every query row of a step in one call.
 *
 * Row t belongs to sequence row_seq[t] and attends to that sequence's first row_len[t]
 * cached keys (its own position included), so one call serves decodes, short prefill
 * chunks and speculative verification rows alike, with causal masking inside a chunk
 * for free. The work is split over (row, kv head) pairs with OpenMP (torch's own
 * runtime: the library is loaded after torch, so the soname resolves to its libgomp and
 * the two share one thread pool). Each pair reads its keys once for the whole group
 * of query heads that share them (GQA). Scores are kept for the whole context, then
 * softmaxed in fp32: two passes over K and V, no per-row allocation beyond a scratch
 * buffer. Each row's result depends on its own inputs only, so a sequence gets the same
 * bits alone or in any batch. With a window (window > 0) a row of n keys sees only its
 * last `window` keys plus the sequence's first `sinks`: the loops walk those two ranges,
 * so blocks wholly outside them (freed, id 0 in the table) are never read.
 *
 * Caches: [num_blocks, block_size, n_kv_heads, head_dim], fp32 or bf16 (bf16 is widened
 * to fp32 on load), or int8 rows of head_dim codes followed by their fp32 scale
 * ([..., head_dim + 4] int8; decoded codes * scale on load). q and out: [T, n_heads,
 * head_dim] fp32.
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define DEFINE_ATTENTION(NAME, CT, LOAD_ROW, EXTRA)                                        \
    int NAME(const float *q, const CT *k_cache, const CT *v_cache,                         \
             const int64_t *block_tables, const int64_t *row_seq, const int64_t *row_len,  \
             float *out, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t BS,         \
             int64_t W, float scale, int64_t window, int64_t sinks) {                      \
        const int64_t G = H / KVH, RS = D + (EXTRA); /* cache row: D values (+ scale) */  \
        int64_t max_len = 0;                                                               \
        for (int64_t t = 0; t < T; t++)                                                    \
            if (row_len[t] > max_len) max_len = row_len[t];                                \
        int failed = 0;                                                                    \
        _Pragma("omp parallel") {                                                          \
            float *scores = malloc(sizeof(float) * (size_t)(G * max_len + G * D + D + G));     \
            if (!scores) {                                                                 \
                _Pragma("omp atomic write") failed = 1;                                    \
            } else {                                                                       \
                float *acc = scores + G * max_len;                                         \
                float *kv = acc + G * D;                                                   \
                float *inv_sum = kv + D;                                                   \
                _Pragma("omp for schedule(dynamic, 1)")                                    \
                for (int64_t task = 0; task < T * KVH; task++) {                           \
                    const int64_t t = task / KVH, h = task % KVH, len = row_len[t];        \
                    /* keys [0, s0) and [lo, len): n of them, key i of the walk is K(i) */ \
                    const int64_t lo = window > 0 && len > window ? len - window : 0;      \
                    const int64_t s0 = sinks < lo ? sinks : lo, n = s0 + len - lo;         \
                    const int64_t *table = block_tables + row_seq[t] * W;                  \
                    const float *qh = q + (t * H + h * G) * D;                             \
                    const CT *kb = k_cache, *vb = v_cache;                                 \
                    for (int64_t i = 0; i < n; i++) {                                      \
                        const int64_t j = i < s0 ? i : lo + i - s0;                        \
                        if (i == 0 || i == s0 || j % BS == 0)                              \
                            kb = k_cache + (table[j / BS] * BS * KVH + h) * RS;            \
                        LOAD_ROW(kv, kb + (j % BS) * KVH * RS, D);                         \
                        for (int64_t g = 0; g < G; g++) {                                  \
                            const float *qg = qh + g * D;                                  \
                            float s = 0.f;                                                 \
                            _Pragma("omp simd reduction(+:s)")                             \
                            for (int64_t d = 0; d < D; d++) s += qg[d] * kv[d];            \
                            scores[g * max_len + i] = s * scale;                           \
                        }                                                                  \
                    }                                                                      \
                    for (int64_t g = 0; g < G; g++) {                                      \
                        float *sg = scores + g * max_len, m = -INFINITY, sum = 0.f;        \
                        for (int64_t j = 0; j < n; j++) m = sg[j] > m ? sg[j] : m;         \
                        for (int64_t j = 0; j < n; j++) {                                  \
                            sg[j] = expf(sg[j] - m);                                       \
                            sum += sg[j];                                                  \
                        }                                                                  \
                        inv_sum[g] = 1.f / sum;                                       \
                        memset(acc + g * D, 0, sizeof(float) * (size_t)D);                 \
                    }                                                                      \
                    for (int64_t i = 0; i < n; i++) {                                      \
                        const int64_t j = i < s0 ? i : lo + i - s0;                        \
                        if (i == 0 || i == s0 || j % BS == 0)                              \
                            vb = v_cache + (table[j / BS] * BS * KVH + h) * RS;            \
                        LOAD_ROW(kv, vb + (j % BS) * KVH * RS, D);                         \
                        for (int64_t g = 0; g < G; g++) {                                  \
                            const float p = scores[g * max_len + i];                       \
                            float *ag = acc + g * D;                                       \
                            _Pragma("omp simd")                                            \
                            for (int64_t d = 0; d < D; d++) ag[d] += p * kv[d];            \
                        }                                                                  \
                    }                                                                      \
                    for (int64_t g = 0; g < G; g++) {                                      \
                        float *o = out + (t * H + h * G + g) * D;                          \
                        const float r = inv_sum[g];                                   \
                        for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * r;         \
                    }                                                                      \
                }                                                                          \
                free(scores);                                                              \
            }                                                                              \
        }                                                                                  \
        return failed;                                                                     \
    }

static inline void load_f32(float *dst, const float *row, int64_t D) {
    memcpy(dst, row, sizeof(float) * (size_t)D);
}
static inline void load_bf16(float *dst, const uint16_t *row, int64_t D) {
    for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(row[d]);
}
static inline void load_q8(float *dst, const int8_t *row, int64_t D) {
    float s;
    memcpy(&s, row + D, sizeof s); /* the row's scale, after its codes */
    _Pragma("omp simd")
    for (int64_t d = 0; d < D; d++) dst[d] = (float)row[d] * s;
}
DEFINE_ATTENTION(paged_attention_f32, float, load_f32, 0)
DEFINE_ATTENTION(paged_attention_bf16, uint16_t, load_bf16, 0)
DEFINE_ATTENTION(paged_attention_q8, int8_t, load_q8, 4)

/* Pin thread i of the OpenMP pool (torch's) to cpus[i % n], as vLLM does: the scheduler
 * then never migrates a GEMM's threads between cores mid-step. Returns threads pinned. */
int bind_threads(const int32_t *cpus, int32_t n) {
    int pinned = 0;
    _Pragma("omp parallel reduction(+:pinned)") {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num() % n], &set);
        pinned += sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return pinned;
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for a few rows M (at most LINEAR_MAX_ROWS): the
 * decode of one or a few sequences, where the matmul is a stream over the weights. Each
 * thread streams its own range of weight rows once; each 8-float slice of a weight row is
 * loaded once and multiplied into M accumulators (M independent FMA chains). MKL's sgemv
 * reaches about 14 GB/s of weights on the 2-core AVX2 machine this was written on; this
 * loop runs at its read bandwidth (30-33 GB/s). */
#define LINEAR_MAX_ROWS 8
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void row_dots(const float *x, const float *w,
                                                           float *out, int64_t K, const int M) {
    __m256 acc[LINEAR_MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = _mm256_loadu_ps(w + k);
        for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; m++) {
        float s = hsum256(acc[m]);
        for (int64_t kk = k; kk < K; kk++) s += x[m * K + kk] * w[kk];
        out[m] = s;
    }
}
#define ROW_DOTS(M) case M: row_dots(x0, wr, dots, K, M); break;

/* Two weight rows against 8 input rows: 16 accumulators, each x slice loaded once for
 * both rows and each w slice once for all 8 rows: the loop is bound by FMAs, not loads. */
static inline void row_dots_2x8(const float *x, const float *w0, const float *w1, float *d0,
                                float *d1, int64_t K) {
    __m256 a0[8], a1[8];
    for (int m = 0; m < 8; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
        for (int m = 0; m < 8; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * K + k);
            a0[m] = _mm256_fmadd_ps(xv, u, a0[m]);
            a1[m] = _mm256_fmadd_ps(xv, v, a1[m]);
        }
    }
    for (int m = 0; m < 8; m++) {
        float s0 = hsum256(a0[m]), s1 = hsum256(a1[m]);
        for (int64_t kk = k; kk < K; kk++) {
            s0 += x[m * K + kk] * w0[kk];
            s1 += x[m * K + kk] * w1[kk];
        }
        d0[m] = s0;
        d1[m] = s1;
    }
}
#define HAVE_2X8 1
#else
static inline void row_dots_any(const float *x, const float *w, float *out, int64_t K, int M) {
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        _Pragma("omp simd reduction(+:s)")
        for (int64_t k = 0; k < K; k++) s += x[m * K + k] * w[k];
        out[m] = s;
    }
}
#define ROW_DOTS(M) case M: row_dots_any(x0, wr, dots, K, M); break;
#endif

int linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n = 0; n < N; n += 2) {
        const int pair = n + 1 < N;
        const float *wr = w + n * K;  /* read from memory once, then from L1 */
        for (int64_t m0 = 0; m0 < M; m0 += LINEAR_MAX_ROWS) {
            const float *x0 = x + m0 * K;
            const int rows = M - m0 < LINEAR_MAX_ROWS ? (int)(M - m0) : LINEAR_MAX_ROWS;
            float dots[LINEAR_MAX_ROWS], dots1[LINEAR_MAX_ROWS];
#ifdef HAVE_2X8
            if (rows == 8 && pair) {
                row_dots_2x8(x0, wr, wr + K, dots, dots1, K);
            } else
#endif
            {
                for (int r = 0; r <= pair; r++) {
                    const float *wr_ = wr + r * K;
                    float *out = r ? dots1 : dots;
                    { const float *wr = wr_; float *dots = out;
                      switch (rows) { ROW_DOTS(1) ROW_DOTS(2) ROW_DOTS(3) ROW_DOTS(4)
                                      ROW_DOTS(5) ROW_DOTS(6) ROW_DOTS(7) ROW_DOTS(8) } }
                }
            }
            for (int m = 0; m < rows; m++) {
                y[(m0 + m) * N + n] = dots[m] + (bias ? bias[n] : 0.f);
                if (pair) y[(m0 + m) * N + n + 1] = dots1[m] + (bias ? bias[n + 1] : 0.f);
            }
        }
    }
    return 0;
}

/* ---- the elementwise glue between the matmuls, one pass each (fp32) -------------------- */

/* h = x + r; out = w * h / sqrt(mean(h^2) + eps), per row (RMSNorm after a residual add). */
void add_rms_norm_f32(const float *x, const float *r, const float *w, float *h, float *out,
                      int64_t T, int64_t D, float eps) {
    _Pragma("omp parallel for schedule(static) if (T > 1)")
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D, *rt = r + t * D;
        float *ht = h + t * D, *ot = out + t * D;
        float ss = 0.f;
        _Pragma("omp simd reduction(+:ss)")
        for (int64_t d = 0; d < D; d++) {
            ht[d] = xt[d] + rt[d];
            ss += ht[d] * ht[d];
        }
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; d++) ot[d] = w[d] * (ht[d] * inv);
    }
}

/* RoPE (rotate-half) in place on the first `heads` heads of each row of qkv [T, stride]:
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin rows [P, D] of the positions. */
void rope_f32(float *qkv, const float *cos, const float *sin, const int64_t *pos, int64_t T,
              int64_t stride, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    _Pragma("omp parallel for schedule(static) if (T > 1)")
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *x = qkv + t * stride + hd * D;
            _Pragma("omp simd")
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, F + i]: the MLP's gate. */
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t F) {
    _Pragma("omp parallel for schedule(static) if (T > 1)")
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * F, *u = g + F;
        float *o = out + t * F;
        for (int64_t i = 0; i < F; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
