/*
 * Direct 2-D convolution for the CPU: forward, data gradient and weight gradient.
 *
 * A template: the tuning parameters are compile-time constants given with -D, so every
 * instance is its own shared library and the compiler sees fixed trip counts:
 *
 *   LAYOUT  0 = NCHW tensors (weight K,C,R,S), 1 = NHWC (channels-last; weight K,R,S,C)
 *   KB      output channels computed together (register blocking)
 *   WB      output columns computed together (register blocking, NHWC); in the NHWC weight
 *           gradient, vectors of input channels per register tile (KB x WB accumulators)
 *   CB      input channels per cache block (NHWC forward)
 *   VEC     float32 lanes of the vector type (GCC/Clang vector extension)
 *   UNROLL  unroll factor of the innermost loop
 *   ORDER   parallel loop order of the NHWC forward: 0 = (n, oh, k, ow), 1 = (n, k, oh, ow)
 *   PACK    NHWC forward: 0 = vectors over input channels (C), 1 = vectors over output
 *           channels (K) with the weight packed per call to [K/VEC][R][S][C][VEC]; KB then
 *           counts K vectors, and small C (a 3-channel first layer) still fills the lanes.
 *           With PACK 1 the stride-1 data gradient runs as that forward on the transposed
 *           problem (vectors over C), instead of the per-pixel gather
 *
 * The shape is a run-time argument, so one instance serves every layer. Tensors are
 * float32, dense in the layout above; the caller passes torch's data pointers directly.
 * Bias is added by the caller.
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#ifndef LAYOUT
#define LAYOUT 1
#endif
#ifndef KB
#define KB 4
#endif
#ifndef WB
#define WB 4
#endif
#ifndef CB
#define CB 64
#endif
#ifndef VEC
#define VEC 8
#endif
#ifndef UNROLL
#define UNROLL 1
#endif
#ifndef ORDER
#define ORDER 0
#endif
#ifndef PACK
#define PACK 0
#endif

#define PRAGMA_(x) _Pragma(#x)
#define UNROLL_BY(n) PRAGMA_(GCC unroll n)

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));

typedef struct {
    long N, C, H, W, K, R, S, SH, SW, PH, PW, OH, OW;
} shape_t;

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof(vf)); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof(vf)); }
static inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < VEC; i++) s += v[i]; return s; }
static inline long lmin(long a, long b) { return a < b ? a : b; }
static inline long lmax(long a, long b) { return a > b ? a : b; }

/* first and one-past-last output column whose input column ow*SW-PW+s lies inside [0, W) */
static inline void col_range(const shape_t *d, long s, long *lo, long *hi) {
    long first = d->PW - s > 0 ? (d->PW - s + d->SW - 1) / d->SW : 0;
    long last = (d->W + d->PW - s + d->SW - 1) / d->SW;
    *lo = first;
    *hi = lmin(d->OW, last);
}

#if LAYOUT == 1
/* ------------------------------------------------------------------ NHWC ---------- */

/* xp[b]: input pixel (ih, (ow0 + b) * SW - PW + s) of image n, or the zero row where the tile
   runs past OW (b >= wn) or the pixel lies in the padding */
static inline void input_columns(const float *xp[WB], const float *x, const float *zeros, const shape_t *d,
                                 long n, long ih, long ow0, long s, long wn) {
    for (int b = 0; b < WB; b++) {
        const long iw = (ow0 + b) * d->SW - d->PW + s;
        xp[b] = (b < wn && iw >= 0 && iw < d->W) ? x + ((n * d->H + ih) * d->W + iw) * d->C : zeros;
    }
}

#if PACK == 1
/* y[n,oh,ow0..ow0+WB, k0..k0+KB*VEC] from the packed weight: WB x KB vector accumulators,
   one broadcast input value per column and one weight vector per K vector and c */
static inline void fwd_tile(const float *restrict x, const float *restrict wp, float *restrict y,
                            const float *zeros, const shape_t *d, long n, long oh, long kv0, long ow0) {
    const long C = d->C, K = d->K, wn = lmin(WB, d->OW - ow0), RSC = d->R * d->S * C;
    vf acc[WB][KB];
    for (int b = 0; b < WB; b++)
        for (int j = 0; j < KB; j++) acc[b][j] = (vf){0};
    const long nkv = (K + VEC - 1) / VEC, jn = lmin(KB, nkv - kv0);
    for (long r = 0; r < d->R; r++) {
        const long ih = oh * d->SH - d->PH + r;
        if (ih < 0 || ih >= d->H) continue;
        for (long s = 0; s < d->S; s++) {
            const float *xp[WB];
            const float *wq[KB];
            input_columns(xp, x, zeros, d, n, ih, ow0, s, wn);
            for (int j = 0; j < KB; j++)
                wq[j] = wp + ((kv0 + (j < jn ? j : 0)) * RSC + (r * d->S + s) * C) * VEC;
            UNROLL_BY(UNROLL)
            for (long c = 0; c < C; c++) {
                vf wv[KB];
                for (int j = 0; j < KB; j++) wv[j] = vload(wq[j] + c * VEC);
                for (int b = 0; b < WB; b++) {
                    const vf xv = (vf){0} + xp[b][c];
                    for (int j = 0; j < KB; j++) acc[b][j] += xv * wv[j];
                }
            }
        }
    }
    for (long b = 0; b < wn; b++) {
        float *yp = y + ((n * d->OH + oh) * d->OW + ow0 + b) * K;
        for (long j = 0; j < jn; j++) {
            const long k = (kv0 + j) * VEC;
            if (k + VEC <= K) vstore(yp + k, acc[b][j]);
            else for (long i = 0; k + i < K; i++) yp[k + i] = acc[b][j][i];
        }
    }
}

#else
static inline void fwd_tile(const float *restrict x, const float *restrict w, float *restrict y,
                            const float *zeros, const shape_t *d, long n, long oh, long k0, long ow0) {
    const long C = d->C, kn = lmin(KB, d->K - k0), wn = lmin(WB, d->OW - ow0);
    vf acc[WB][KB];
    float tail[WB][KB];
    for (int b = 0; b < WB; b++)
        for (int j = 0; j < KB; j++) { acc[b][j] = (vf){0}; tail[b][j] = 0.f; }
    for (long c0 = 0; c0 < C; c0 += CB) {
        const long cend = lmin(C, c0 + CB), cvend = c0 + ((cend - c0) / VEC) * VEC;
        for (long r = 0; r < d->R; r++) {
            const long ih = oh * d->SH - d->PH + r;
            if (ih < 0 || ih >= d->H) continue;
            for (long s = 0; s < d->S; s++) {
                const float *xp[WB];
                const float *wp[KB];
                input_columns(xp, x, zeros, d, n, ih, ow0, s, wn);
                for (int j = 0; j < KB; j++)
                    wp[j] = w + (((k0 + (j < kn ? j : 0)) * d->R + r) * d->S + s) * C;
                UNROLL_BY(UNROLL)
                for (long c = c0; c < cvend; c += VEC) {
                    vf xv[WB];
                    for (int b = 0; b < WB; b++) xv[b] = vload(xp[b] + c);
                    for (int j = 0; j < KB; j++) {
                        const vf wv = vload(wp[j] + c);
                        for (int b = 0; b < WB; b++) acc[b][j] += xv[b] * wv;
                    }
                }
                for (long c = cvend; c < cend; c++)
                    for (int b = 0; b < WB; b++)
                        for (int j = 0; j < KB; j++) tail[b][j] += xp[b][c] * wp[j][c];
            }
        }
    }
    for (long b = 0; b < wn; b++)
        for (long j = 0; j < kn; j++)
            y[((n * d->OH + oh) * d->OW + ow0 + b) * d->K + k0 + j] = hsum(acc[b][j]) + tail[b][j];
}
#endif

/* every output tile of the forward, in the loop order ORDER gives; w as fwd_tile reads it */
static void fwd_tiles(const float *x, const float *w, float *y, const float *zeros, const shape_t *d, long nkb, long nwb) {
#if ORDER == 0
    #pragma omp parallel for collapse(3) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long oh = 0; oh < d->OH; oh++)
            for (long kb = 0; kb < nkb; kb++)
                for (long wb = 0; wb < nwb; wb++)
                    fwd_tile(x, w, y, zeros, d, n, oh, kb * KB, wb * WB);
#else
    #pragma omp parallel for collapse(3) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long kb = 0; kb < nkb; kb++)
            for (long oh = 0; oh < d->OH; oh++)
                for (long wb = 0; wb < nwb; wb++)
                    fwd_tile(x, w, y, zeros, d, n, oh, kb * KB, wb * WB);
#endif
}

#if PACK == 1
static void conv_fwd_impl(const float *x, const float *w, float *y, const shape_t *d) {
    const long C = d->C, K = d->K, RSC = d->R * d->S * C, nkv = (K + VEC - 1) / VEC;
    const long nkb = (nkv + KB - 1) / KB, nwb = (d->OW + WB - 1) / WB;
    float *zeros = calloc((size_t)(C + VEC), sizeof(float));
    float *wp = calloc((size_t)(nkv * RSC * VEC), sizeof(float));
    #pragma omp parallel for schedule(static)
    for (long k = 0; k < K; k++)  /* w[k][r][s][c] -> wp[k / VEC][r][s][c][k % VEC] */
        for (long q = 0; q < RSC; q++) wp[((k / VEC) * RSC + q) * VEC + k % VEC] = w[k * RSC + q];
    fwd_tiles(x, wp, y, zeros, d, nkb, nwb);
    free(wp);
    free(zeros);
}
#else
static void conv_fwd_impl(const float *x, const float *w, float *y, const shape_t *d) {
    const long nkb = (d->K + KB - 1) / KB, nwb = (d->OW + WB - 1) / WB;
    float *zeros = calloc((size_t)(d->C + VEC), sizeof(float));
    fwd_tiles(x, w, y, zeros, d, nkb, nwb);
    free(zeros);
}
#endif

#if PACK == 1
/* stride 1: the data gradient is the forward of the transposed problem, gy (K channels, padded
   by R-1-PH, S-1-PW) convolved with the flipped weight wt[c][r][s][k] = w[k][R-1-r][S-1-s][c];
   returns 0 (nothing done) for the shapes it does not cover */
static int bwd_data_as_forward(const float *gy, const float *w, float *gx, const shape_t *d) {
    const long C = d->C, K = d->K, R = d->R, S = d->S;
    if (d->SH != 1 || d->SW != 1 || d->PH > R - 1 || d->PW > S - 1) return 0;
    float *wt = malloc((size_t)(C * R * S * K) * sizeof(float));
    #pragma omp parallel for schedule(static)
    for (long c = 0; c < C; c++)
        for (long r = 0; r < R; r++)
            for (long s = 0; s < S; s++)
                for (long k = 0; k < K; k++)
                    wt[((c * R + r) * S + s) * K + k] = w[((k * R + R - 1 - r) * S + S - 1 - s) * C + c];
    const shape_t t = {d->N, K, d->OH, d->OW, C, R, S, 1, 1, R - 1 - d->PH, S - 1 - d->PW, d->H, d->W};
    conv_fwd_impl(gy, wt, gx, &t);
    free(wt);
    return 1;
}
#endif

/* data gradient, gathered per input pixel: gx[n,ih,iw,c] = sum_{k,r,s} gy[n,oh,ow,k] w[k,r,s,c] */
static void conv_bwd_data_impl(const float *gy, const float *w, float *gx, const shape_t *d) {
    const long C = d->C, K = d->K, RSC = d->R * d->S * C;
#if PACK == 1
    if (bwd_data_as_forward(gy, w, gx, d)) return;
#endif
    #pragma omp parallel for collapse(2) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long ih = 0; ih < d->H; ih++)
            for (long iw = 0; iw < d->W; iw++) {
                float *g = gx + ((n * d->H + ih) * d->W + iw) * C;
                long c0 = 0;
                for (; c0 + VEC <= C; c0 += VEC) {
                    vf acc = (vf){0};
                    for (long r = 0; r < d->R; r++) {
                        const long t = ih + d->PH - r;
                        if (t < 0 || t % d->SH) continue;
                        const long oh = t / d->SH;
                        if (oh >= d->OH) continue;
                        for (long s = 0; s < d->S; s++) {
                            const long u = iw + d->PW - s;
                            if (u < 0 || u % d->SW) continue;
                            const long ow = u / d->SW;
                            if (ow >= d->OW) continue;
                            const float *gyp = gy + ((n * d->OH + oh) * d->OW + ow) * K;
                            const float *wp = w + (r * d->S + s) * C + c0;
                            UNROLL_BY(UNROLL)
                            for (long k = 0; k < K; k++) acc += ((vf){0} + gyp[k]) * vload(wp + k * RSC);
                        }
                    }
                    vstore(g + c0, acc);
                }
                for (long c = c0; c < C; c++) {
                    float acc = 0.f;
                    for (long r = 0; r < d->R; r++) {
                        const long t = ih + d->PH - r;
                        if (t < 0 || t % d->SH) continue;
                        const long oh = t / d->SH;
                        if (oh >= d->OH) continue;
                        for (long s = 0; s < d->S; s++) {
                            const long u = iw + d->PW - s;
                            if (u < 0 || u % d->SW) continue;
                            const long ow = u / d->SW;
                            if (ow >= d->OW) continue;
                            const float *gyp = gy + ((n * d->OH + oh) * d->OW + ow) * K;
                            for (long k = 0; k < K; k++) acc += gyp[k] * w[((k * d->R + r) * d->S + s) * C + c];
                        }
                    }
                    g[c] = acc;
                }
            }
}

/* weight gradient, blocked over pixels: gw[k,r,s,c] = sum_{n,oh,ow} gy[n,oh,ow,k] x[n,ih,iw,c].
   Each thread sums its share of output rows (n, oh) into its own copy of gw (which stays in cache),
   with KB x WB register tiles (KB broadcast gy values times WB vectors of c) over a row's pixels;
   the copies are added at the end */
static inline vf load_c(const float *p, long cn) {
    if (cn >= VEC) return vload(p);
    vf v = (vf){0};
    for (long i = 0; i < cn; i++) v[i] = p[i];
    return v;
}

/* one KB x WB tile of gw[k0.., r, s, c0..] summed over the pixels of output rows oh0..oh1 of image
   n; FULL (a constant after inlining) when the tile has KB kernels and WB whole vectors: no tail code */
static inline __attribute__((always_inline)) void bwd_weight_tile(
        const float *restrict x, const float *restrict gy, float *restrict out, const shape_t *d,
        long n, long oh0, long oh1, long r, long s, long k0, long c0, const int full) {
    const long C = d->C, K = d->K, RSC = d->R * d->S * C, kn = lmin(KB, K - k0);
    long lo, hi;
    col_range(d, s, &lo, &hi);
    vf acc[KB][WB];
    for (int j = 0; j < KB; j++)
        for (int b = 0; b < WB; b++) acc[j][b] = (vf){0};
    for (long oh = oh0; oh < oh1; oh++) {
        const long ih = oh * d->SH - d->PH + r;
        if (ih < 0 || ih >= d->H) continue;
        const float *xrow = x + ((n * d->H + ih) * d->W - d->PW + s) * C + c0;
        const float *gyrow = gy + (n * d->OH + oh) * d->OW * K + k0;
        for (long ow = lo; ow < hi; ow++) {
            const float *xp = xrow + ow * d->SW * C;
            const float *gyp = gyrow + ow * K;
            vf xv[WB];
            for (int b = 0; b < WB; b++) xv[b] = full ? vload(xp + b * VEC) : load_c(xp + b * VEC, C - c0 - b * VEC);
            for (int j = 0; j < KB; j++) {
                const vf g = (vf){0} + gyp[full || j < kn ? j : 0];
                for (int b = 0; b < WB; b++) acc[j][b] += g * xv[b];
            }
        }
    }
    for (long j = 0; j < (full ? KB : kn); j++)
        for (int b = 0; b < WB; b++) {
            float *o = out + j * RSC + b * VEC;
            const long cn = full ? VEC : lmin(VEC, C - c0 - b * VEC);
            if (cn == VEC) vstore(o, vload(o) + acc[j][b]);
            else for (long i = 0; i < cn; i++) o[i] += acc[j][b][i];
        }
}

#define WGRAD_ROWS 8  /* output rows summed per register tile (their x and gy rows stay in cache) */

static void conv_bwd_weight_impl(const float *x, const float *gy, float *gw, const shape_t *d) {
    const long C = d->C, K = d->K, size = K * d->R * d->S * C;
    const long chunks = (d->OH + WGRAD_ROWS - 1) / WGRAD_ROWS;
    const int nt = omp_get_max_threads();
    float *parts = calloc((size_t)(nt * size), sizeof(float));
    #pragma omp parallel
    {
        float *part = parts + omp_get_thread_num() * size;
        #pragma omp for schedule(static)
        for (long job = 0; job < d->N * chunks; job++) {
            const long n = job / chunks, oh0 = (job % chunks) * WGRAD_ROWS, oh1 = lmin(d->OH, oh0 + WGRAD_ROWS);
            for (long r = 0; r < d->R; r++)
                for (long s = 0; s < d->S; s++)
                    for (long k0 = 0; k0 < K; k0 += KB)
                        for (long c0 = 0; c0 < C; c0 += WB * VEC) {
                            float *out = part + ((k0 * d->R + r) * d->S + s) * C + c0;
                            if (k0 + KB <= K && c0 + WB * VEC <= C) bwd_weight_tile(x, gy, out, d, n, oh0, oh1, r, s, k0, c0, 1);
                            else bwd_weight_tile(x, gy, out, d, n, oh0, oh1, r, s, k0, c0, 0);
                        }
        }
    }
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < size; i++) {
        float sum = 0.f;
        for (int t = 0; t < nt; t++) sum += parts[t * size + i];
        gw[i] = sum;
    }
    free(parts);
}

#else
/* ------------------------------------------------------------------ NCHW ---------- */

static inline void fwd_rows(const float *restrict x, const float *restrict w, float *restrict y,
                            const shape_t *d, long n, long k0, long kn) {
    const long OW = d->OW;
    for (long oh = 0; oh < d->OH; oh++) {
        float *yr[KB];
        for (long j = 0; j < KB; j++) {
            yr[j] = y + ((n * d->K + k0 + (j < kn ? j : 0)) * d->OH + oh) * OW;
            if (j < kn) memset(yr[j], 0, sizeof(float) * OW);
        }
        for (long c = 0; c < d->C; c++)
            for (long r = 0; r < d->R; r++) {
                const long ih = oh * d->SH - d->PH + r;
                if (ih < 0 || ih >= d->H) continue;
                const float *xr = x + ((n * d->C + c) * d->H + ih) * d->W;
                for (long s = 0; s < d->S; s++) {
                    long lo, hi;
                    col_range(d, s, &lo, &hi);
                    float wv[KB];
                    for (long j = 0; j < KB; j++)
                        wv[j] = j < kn ? w[(((k0 + j) * d->C + c) * d->R + r) * d->S + s] : 0.f;
                    const float *xs = xr + s - d->PW;
                    UNROLL_BY(UNROLL)
                    for (long ow = lo; ow < hi; ow++) {
                        const float xv = xs[ow * d->SW];
                        for (long j = 0; j < KB; j++) yr[j][ow] += wv[j] * xv;
                    }
                }
            }
    }
}

static void conv_fwd_impl(const float *x, const float *w, float *y, const shape_t *d) {
    const long nkb = (d->K + KB - 1) / KB;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long kb = 0; kb < nkb; kb++) {
            const long k0 = kb * KB, kn = lmin(KB, d->K - k0);
            if (kn == KB) {
                /* full block: rows of every lane are distinct */
                fwd_rows(x, w, y, d, n, k0, KB);
            } else {
                for (long j = 0; j < kn; j++) fwd_rows(x, w, y, d, n, k0 + j, 1);
            }
        }
}

static void conv_bwd_data_impl(const float *gy, const float *w, float *gx, const shape_t *d) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long c = 0; c < d->C; c++) {
            float *gp = gx + (n * d->C + c) * d->H * d->W;
            memset(gp, 0, sizeof(float) * d->H * d->W);
            for (long k = 0; k < d->K; k++)
                for (long r = 0; r < d->R; r++)
                    for (long oh = 0; oh < d->OH; oh++) {
                        const long ih = oh * d->SH - d->PH + r;
                        if (ih < 0 || ih >= d->H) continue;
                        const float *gyr = gy + ((n * d->K + k) * d->OH + oh) * d->OW;
                        for (long s = 0; s < d->S; s++) {
                            long lo, hi;
                            col_range(d, s, &lo, &hi);
                            const float wv = w[((k * d->C + c) * d->R + r) * d->S + s];
                            float *gs = gp + ih * d->W + s - d->PW;
                            UNROLL_BY(UNROLL)
                            for (long ow = lo; ow < hi; ow++) gs[ow * d->SW] += wv * gyr[ow];
                        }
                    }
        }
}

static void conv_bwd_weight_impl(const float *x, const float *gy, float *gw, const shape_t *d) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (long k = 0; k < d->K; k++)
        for (long c = 0; c < d->C; c++)
            for (long r = 0; r < d->R; r++)
                for (long s = 0; s < d->S; s++) {
                    long lo, hi;
                    col_range(d, s, &lo, &hi);
                    float acc = 0.f;
                    for (long n = 0; n < d->N; n++)
                        for (long oh = 0; oh < d->OH; oh++) {
                            const long ih = oh * d->SH - d->PH + r;
                            if (ih < 0 || ih >= d->H) continue;
                            const float *xs = x + ((n * d->C + c) * d->H + ih) * d->W + s - d->PW;
                            const float *gyr = gy + ((n * d->K + k) * d->OH + oh) * d->OW;
                            #pragma omp simd reduction(+ : acc)
                            for (long ow = lo; ow < hi; ow++) acc += gyr[ow] * xs[ow * d->SW];
                        }
                    gw[((k * d->C + c) * d->R + r) * d->S + s] = acc;
                }
}
#endif

/* ------------------------------------------------------------ exported entry points */

#define SHAPE_ARGS long N, long C, long H, long W, long K, long R, long S, long SH, long SW, long PH, long PW, int threads
#define MAKE_SHAPE shape_t d = {N, C, H, W, K, R, S, SH, SW, PH, PW, (H + 2 * PH - R) / SH + 1, (W + 2 * PW - S) / SW + 1}

void conv_fwd(const float *x, const float *w, float *y, SHAPE_ARGS) {
    MAKE_SHAPE;
    omp_set_num_threads(threads);
    conv_fwd_impl(x, w, y, &d);
}

void conv_bwd_data(const float *gy, const float *w, float *gx, SHAPE_ARGS) {
    MAKE_SHAPE;
    omp_set_num_threads(threads);
    conv_bwd_data_impl(gy, w, gx, &d);
}

void conv_bwd_weight(const float *x, const float *gy, float *gw, SHAPE_ARGS) {
    MAKE_SHAPE;
    omp_set_num_threads(threads);
    conv_bwd_weight_impl(x, gy, gw, &d);
}
