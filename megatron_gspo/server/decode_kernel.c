/* One decode step of the built-in rollout server's model, in plain C (fp32, one thread).

   The same computation as RolloutModel.forward on a batch of one-token chunks (see model.py):
   embedding, per layer RMSNorm -> fused q|k|v (+bias) -> per-head q/k RMSNorm -> rope (from the
   model's table) -> k/v written into the cache -> causal attention over the cached rows -> o_proj
   -> residual; RMSNorm -> top-k router (softmax in fp32, optional renormalisation) and the routed
   experts grouped by expert, or the dense gated MLP -> residual; final RMSNorm and the head.
   At these sizes a step in torch is dominated by per-op dispatch; here a step is one call
   (and one more samples the next tokens, mg_sample). Matmuls read packed copies of the weights
   (kernels.py makes them). Sums run in another order than torch's kernels, so results agree
   with the torch path to float rounding, not bit for bit.

   Built by kernels.py with the system C compiler (no torch headers, so it compiles in about a
   second) and called through ctypes with raw pointers; the tensors stay owned by Python.
   Shape legend as in model.py: T tokens, D hidden, H heads, G kv heads, Dh head dim, E experts,
   F expert (or dense) ffn, V vocab, k top-k. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
static inline v8 select8(vi8 m, v8 a, v8 b) { /* m ? a : b, lane-wise */
    return (v8)(((vi8)a & m) | ((vi8)b & ~m));
}

/* exp on 8 lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial), ~1 ulp. */
static inline v8 exp8(v8 x) {
    x = select8(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    x = select8(x < splat(-88.3762626647949f), splat(-88.3762626647949f), x);
    v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
    v8 fl = __builtin_convertvector(__builtin_convertvector(fx, vi8), v8);
    fl = select8(fl > fx, fl - splat(1.0f), fl); /* floor */
    x = x - fl * splat(0.693359375f) - fl * splat(-2.12194440e-4f);
    v8 z = x * x;
    v8 y = splat(1.9875691500e-4f);
    y = y * x + splat(1.3981999507e-3f);
    y = y * x + splat(8.3334519073e-3f);
    y = y * x + splat(4.1665795894e-2f);
    y = y * x + splat(1.6666665459e-1f);
    y = y * x + splat(5.0000001201e-1f);
    y = y * z + x + splat(1.0f);
    vi8 n = __builtin_convertvector(fl, vi8) + 127; /* 2^fl, fl in [-127, 128] */
    return y * (v8)(n << 23);
}

static inline float exp1(float x) { return exp8(splat(x))[0]; }

/* ---- matmuls: C[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]), with W packed once by kernels.py
   into panels of 16 output columns, [ceil(N / 16), K, 16] zero-padded: a step streams each
   panel contiguously and accumulates 16 columns of C in two registers, no horizontal sums. ---- */

#define R16(n) (((n) + 15) / 16 * 16)

#define KERNEL(MR)                                                                              \
    static void k##MR(const float *A, int64_t lda, const float *B, int64_t K, float *C,         \
                      int64_t ldc, const float *bias) {                                        \
        v8 acc[MR][2];                                                                          \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < 2; j++) acc[i][j] = bias ? ld(bias + 8 * j) : splat(0.0f);     \
        for (int64_t k = 0; k < K; k++) {                                                       \
            v8 b0 = ld(B + k * 16), b1 = ld(B + k * 16 + 8);                                    \
            for (int i = 0; i < MR; i++) {                                                      \
                v8 a = splat(A[i * lda + k]);                                                   \
                acc[i][0] += a * b0, acc[i][1] += a * b1;                                       \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < MR; i++) st(C + i * ldc, acc[i][0]), st(C + i * ldc + 8, acc[i][1]); \
    }

KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)

typedef void (*kernel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                          const float *);
static const kernel_fn KERNELS[7] = {0, k1, k2, k3, k4, k5, k6};

static void linear(const float *A, int64_t lda, int64_t M, const float *W, int64_t N, int64_t K,
                   const float *bias, float *C, int64_t ldc) {
    for (int64_t n = 0; n < N; n += 16) {
        const float *panel = W + n * K;
        if (n + 16 <= N) {
            for (int64_t m = 0; m < M; m += 6) {
                int64_t mr = M - m < 6 ? M - m : 6;
                KERNELS[mr](A + m * lda, lda, panel, K, C + m * ldc + n, ldc, bias ? bias + n : 0);
            }
            continue;
        }
        float tmp[6 * 16], b16[16] = {0}; /* the last, partial panel: through a buffer */
        if (bias) memcpy(b16, bias + n, (N - n) * sizeof(float));
        for (int64_t m = 0; m < M; m += 6) {
            int64_t mr = M - m < 6 ? M - m : 6;
            KERNELS[mr](A + m * lda, lda, panel, K, tmp, 16, bias ? b16 : 0);
            for (int64_t i = 0; i < mr; i++)
                memcpy(C + (m + i) * ldc + n, tmp + i * 16, (N - n) * sizeof(float));
        }
    }
}

/* ---- attention over one sequence's cached rows (Dh a multiple of 8) ---- */

/* [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
static inline v8 hadd8(v8 a, v8 b) {
    return __builtin_shuffle(a, b, (vi8){0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(a, b, (vi8){1, 3, 9, 11, 5, 7, 13, 15});
}

/* The lane sums of eight vectors, as one vector. */
static inline v8 reduce8(const v8 *a) {
    v8 x = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));
    v8 y = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
    return __builtin_shuffle(x, y, (vi8){0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(x, y, (vi8){4, 5, 6, 7, 12, 13, 14, 15});
}

/* s[p] = scale * q . K[p] for p < n. */
static void qk_scores(const float *q, const float *Kb, int64_t n, int64_t hd, float scale, float *s) {
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
        v8 a[8];
        for (int j = 0; j < 8; j++) a[j] = splat(0.0f);
        for (int64_t c = 0; c < hd; c += 8) {
            v8 qv = ld(q + c);
            for (int j = 0; j < 8; j++) a[j] += qv * ld(Kb + (p + j) * hd + c);
        }
        st(s + p, reduce8(a) * splat(scale));
    }
    for (; p < n; p++) {
        v8 a = splat(0.0f);
        for (int64_t c = 0; c < hd; c += 8) a += ld(q + c) * ld(Kb + p * hd + c);
        s[p] = hsum(a) * scale;
    }
}

/* o[i] = sum_p w[p] * V[p, i], 32 columns at a time in registers. */
static void attn_av(const float *w, const float *Vb, int64_t n, int64_t hd, float *o) {
    int64_t c = 0;
    for (; c + 32 <= hd; c += 32) {
        v8 a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t p = 0; p < n; p++) {
            const float *v = Vb + p * hd + c;
            v8 wp = splat(w[p]);
            a0 += wp * ld(v), a1 += wp * ld(v + 8), a2 += wp * ld(v + 16), a3 += wp * ld(v + 24);
        }
        st(o + c, a0), st(o + c + 8, a1), st(o + c + 16, a2), st(o + c + 24, a3);
    }
    for (; c < hd; c += 8) {
        v8 a = splat(0.0f);
        for (int64_t p = 0; p < n; p++) a += splat(w[p]) * ld(Vb + p * hd + c);
        st(o + c, a);
    }
}

/* ---- small pieces ---- */

/* y = w * (x / sqrt(mean(x^2) + eps)), HF's RMSNorm in fp32; y may be x. */
static void rms(const float *x, const float *w, int64_t n, float eps, float *y) {
    v8 acc = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 v = ld(x + i);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static void add_to(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* In place: x[i] = exp(x[i] - max) / sum over i < n (a softmax row). */
static void softmax(float *x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    v8 acc = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 e = exp8(ld(x + i) - splat(mx));
        st(x + i, e);
        acc += e;
    }
    float s = hsum(acc);
    for (; i < n; i++) s += (x[i] = exp1(x[i] - mx));
    float inv = 1.0f / s;
    for (i = 0; i < n; i++) x[i] *= inv;
}

/* out[i] = silu(gu[i]) * gu[F + i] for each of n rows of gu [n, 2F]; out [n, F]. */
static void silu_mul(const float *gu, int64_t n, int64_t F, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        float *o = out + r * F;
        int64_t i = 0;
        for (; i + 8 <= F; i += 8) {
            v8 gv = ld(g + i);
            st(o + i, gv / (splat(1.0f) + exp8(-gv)) * ld(u + i));
        }
        for (; i < F; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* rope(x) = x * cos + swap_halves(x) * sin, with the table row [2, Dh] of the position. */
static void rope(float *x, const float *cs, int64_t hd) {
    float tmp[1024];
    int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) tmp[i] = x[i < half ? i + half : i - half];
    for (int64_t i = 0; i < hd; i++) x[i] = x[i] * cs[i] + tmp[i] * cs[hd + i];
}

/* ---- the step ---- */

enum { C_D, C_H, C_G, C_HD, C_E, C_FM, C_FD, C_TOPK, C_NORM_TOPK, C_QK_NORM, C_L, C_V, C_N };
enum { P_IN_NORM, P_POST_NORM, P_QKV, P_QKV_B, P_O, P_Q_NORM, P_K_NORM, P_ROUTER, P_GATE_UP,
       P_DOWN, P_N };

#define PTR(l, i) ((const float *)(intptr_t)layers[(l) * P_N + (i)])

int64_t mg_layer_fields(void) { return P_N; }
int64_t mg_config_fields(void) { return C_N; }

/* Returns 0, or -1 when scratch memory could not be allocated (nothing was written then). */
int64_t mg_decode(const int64_t *cfg, double eps_d, const int64_t *layers, const float *embed,
                  const float *final_norm, const float *head, const float *rope_tab,
                  const int64_t *kv, int64_t cap, int64_t T, const int64_t *ids,
                  const int64_t *pos, const int64_t *slots, float *logits, int32_t *routed) {
    const int64_t D = cfg[C_D], H = cfg[C_H], G = cfg[C_G], hd = cfg[C_HD], E = cfg[C_E];
    const int64_t topk = cfg[C_TOPK], L = cfg[C_L], V = cfg[C_V];
    const int64_t F = cfg[C_FM] > cfg[C_FD] ? cfg[C_FM] : cfg[C_FD];
    const int64_t QKV = (H + 2 * G) * hd, rep = H / G;
    const float eps = (float)eps_d, scale = 1.0f / sqrtf((float)hd);
    int64_t K = 0, n_moe = 0;
    for (int64_t t = 0; t < T; t++) K = pos[t] + 1 > K ? pos[t] + 1 : K;
    for (int64_t l = 0; l < L; l++) n_moe += PTR(l, P_ROUTER) != 0;

    size_t nf = (size_t)(T * D * 5 + T * QKV + T * H * hd + rep * K + T * (E > 0 ? E : 1) +
                         T * 2 * F + T * F + T * topk);
    size_t ni = (size_t)(T * topk * 2 + (E > 0 ? E : 1) + 1);
    float *buf = malloc(nf * sizeof(float) + ni * sizeof(int64_t));
    if (!buf) return -1;
    float *x = buf, *h = x + T * D, *mo = h + T * D, *xe = mo + T * D, *ye = xe + T * D;
    float *qkv = ye + T * D, *att = qkv + T * QKV, *sc = att + T * H * hd, *rl = sc + rep * K;
    float *gu = rl + T * (E > 0 ? E : 1), *act = gu + T * 2 * F, *wk = act + T * F;
    int64_t *ek = (int64_t *)(wk + T * topk), *order = ek + T * topk, *start = order + T * topk;

    for (int64_t t = 0; t < T; t++) memcpy(x + t * D, embed + ids[t] * D, D * sizeof(float));
    int64_t moe_i = 0;
    for (int64_t l = 0; l < L; l++) {
        float *kc = (float *)(intptr_t)kv[2 * l], *vc = (float *)(intptr_t)kv[2 * l + 1];
        /* attention */
        for (int64_t t = 0; t < T; t++) rms(x + t * D, PTR(l, P_IN_NORM), D, eps, h + t * D);
        linear(h, D, T, PTR(l, P_QKV), QKV, D, PTR(l, P_QKV_B), qkv, QKV);
        for (int64_t t = 0; t < T; t++) {
            float *q = qkv + t * QKV, *k = q + H * hd, *v = k + G * hd;
            if (PTR(l, P_Q_NORM)) {
                for (int64_t j = 0; j < H; j++) rms(q + j * hd, PTR(l, P_Q_NORM), hd, eps, q + j * hd);
                for (int64_t j = 0; j < G; j++) rms(k + j * hd, PTR(l, P_K_NORM), hd, eps, k + j * hd);
            }
            const float *cs = rope_tab + pos[t] * 2 * hd;
            for (int64_t j = 0; j < H + G; j++) rope(q + j * hd, cs, hd);
            for (int64_t g = 0; g < G; g++) {
                int64_t row = ((slots[t] * G + g) * cap + pos[t]) * hd;
                memcpy(kc + row, k + g * hd, hd * sizeof(float));
                memcpy(vc + row, v + g * hd, hd * sizeof(float));
            }
            int64_t n = pos[t] + 1;
            for (int64_t g = 0; g < G; g++) {
                const float *kb = kc + (slots[t] * G + g) * cap * hd;
                const float *vb = vc + (slots[t] * G + g) * cap * hd;
                for (int64_t j = 0; j < rep; j++) {
                    float *o = att + t * H * hd + (g * rep + j) * hd;
                    qk_scores(q + (g * rep + j) * hd, kb, n, hd, scale, sc);
                    softmax(sc, n);
                    attn_av(sc, vb, n, hd, o);
                }
            }
        }
        linear(att, H * hd, T, PTR(l, P_O), D, H * hd, 0, h, D);
        add_to(x, h, T * D);
        /* mlp */
        for (int64_t t = 0; t < T; t++) rms(x + t * D, PTR(l, P_POST_NORM), D, eps, h + t * D);
        if (!PTR(l, P_ROUTER)) {
            const int64_t Fd = cfg[C_FD];
            linear(h, D, T, PTR(l, P_GATE_UP), 2 * Fd, D, 0, gu, 2 * Fd);
            silu_mul(gu, T, Fd, act);
            linear(act, Fd, T, PTR(l, P_DOWN), D, Fd, 0, h, D);
            add_to(x, h, T * D);
            continue;
        }
        const int64_t Fm = cfg[C_FM];
        linear(h, D, T, PTR(l, P_ROUTER), E, D, 0, rl, E);
        memset(start, 0, (E + 1) * sizeof(int64_t));
        for (int64_t t = 0; t < T; t++) { /* softmax, top-k (descending), renormalise */
            float *p = rl + t * E, sum = 0.0f;
            softmax(p, E);
            for (int64_t j = 0; j < topk; j++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    int taken = 0;
                    for (int64_t i = 0; i < j; i++) taken |= ek[t * topk + i] == e;
                    if (!taken && (best < 0 || p[e] > p[best])) best = e;
                }
                ek[t * topk + j] = best;
                wk[t * topk + j] = p[best];
                sum += p[best];
                start[best + 1]++;
                if (routed) routed[(t * n_moe + moe_i) * topk + j] = (int32_t)best;
            }
            if (cfg[C_NORM_TOPK])
                for (int64_t j = 0; j < topk; j++) wk[t * topk + j] /= sum;
        }
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        { /* (token, choice) pairs sorted by expert, stably: a counting sort */
            int64_t fill[E];
            memcpy(fill, start, E * sizeof(int64_t));
            for (int64_t i = 0; i < T * topk; i++) order[fill[ek[i]]++] = i;
        }
        memset(mo, 0, T * D * sizeof(float));
        for (int64_t e = 0; e < E; e++) {
            int64_t n = start[e + 1] - start[e];
            if (!n) continue;
            const int64_t *ord = order + start[e];
            for (int64_t i = 0; i < n; i++)
                memcpy(xe + i * D, h + (ord[i] / topk) * D, D * sizeof(float));
            linear(xe, D, n, PTR(l, P_GATE_UP) + e * R16(2 * Fm) * D, 2 * Fm, D, 0, gu, 2 * Fm);
            silu_mul(gu, n, Fm, act);
            linear(act, Fm, n, PTR(l, P_DOWN) + e * R16(D) * Fm, D, Fm, 0, ye, D);
            for (int64_t i = 0; i < n; i++) {
                float *o = mo + (ord[i] / topk) * D;
                const float w = wk[ord[i]], *y = ye + i * D;
                for (int64_t c = 0; c < D; c++) o[c] += y[c] * w;
            }
        }
        add_to(x, mo, T * D);
        moe_i++;
    }
    for (int64_t t = 0; t < T; t++) rms(x + t * D, final_norm, D, eps, h + t * D);
    linear(h, D, T, head, V, D, 0, logits, V);
    free(buf);
    return 0;
}

/* ---- sampling: the next token of each row of fp32 logits [B, V], as sampling.sample_batch
   computes it for rows without top-k/top-p/min-p filters. temp[b] <= 0: greedy (the first
   largest logit, log-prob from the unscaled distribution); else inverse-CDF sampling of
   softmax(logits / temp) with the uniform draw u[b] (the first token whose cumulative
   probability exceeds u times the total; the likeliest token where rounding leaves none).
   Cumulative sums in double, as torch's cumsum accumulates floats. ---- */
void mg_sample(const float *logits, int64_t B, int64_t V, const float *temp, const float *u,
               int64_t *tokens, float *logprobs, float *scratch /* [V] */) {
    for (int64_t b = 0; b < B; b++) {
        const float *x = logits + b * V;
        const int sampled = temp[b] > 0.0f;
        float *z = scratch;
        int64_t i = 0;
        v8 mx8 = splat(-INFINITY);
        if (sampled) { /* z = x / temp, as torch divides */
            for (; i + 8 <= V; i += 8) st(z + i, ld(x + i) / splat(temp[b]));
            for (; i < V; i++) z[i] = x[i] / temp[b];
        } else {
            memcpy(z, x, V * sizeof(float));
        }
        for (i = 0; i + 8 <= V; i += 8) {
            v8 v = ld(z + i);
            mx8 = select8(v > mx8, v, mx8);
        }
        float mx = -INFINITY;
        for (int j = 0; j < 8; j++) mx = mx8[j] > mx ? mx8[j] : mx;
        for (; i < V; i++) mx = z[i] > mx ? z[i] : mx;
        int64_t best = 0; /* the first largest */
        while (best < V - 1 && !(z[best] >= mx)) best++;
        v8 acc = splat(0.0f);
        for (i = 0; i + 8 <= V; i += 8) acc += exp8(ld(z + i) - splat(mx));
        float s = hsum(acc);
        for (; i < V; i++) s += exp1(z[i] - mx);
        const float lse = mx + logf(s);
        int64_t tok = best;
        if (sampled) { /* z becomes the cdf: exp(z - lse) summed in double, stored as float */
            for (i = 0; i + 8 <= V; i += 8) st(z + i, exp8(ld(z + i) - splat(lse)));
            for (; i < V; i++) z[i] = exp1(z[i] - lse);
            double c = 0.0;
            for (i = 0; i < V; i++) z[i] = (float)(c += z[i]);
            const float target = u[b] * z[V - 1];
            int64_t lo = 0, hi = V; /* the first index whose cdf exceeds the target */
            while (lo < hi) {
                int64_t mid = (lo + hi) / 2;
                if (z[mid] > target) hi = mid;
                else lo = mid + 1;
            }
            tok = lo < V ? lo : best;
            logprobs[b] = x[tok] / temp[b] - lse;
        } else {
            logprobs[b] = x[tok] - lse;
        }
        tokens[b] = tok;
    }
}
