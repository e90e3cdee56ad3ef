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
 *   ALGO    NHWC: 0 = direct; 1 = Winograd F(2x2,3x3) for 3x3 stride-1 layers (other shapes
 *           fall back to the direct kernels): the forward (KB then counts K vectors and WB tiles
 *           per register block), the data gradient as the forward of the transposed problem,
 *           and the weight gradient as 16 GEMMs summed over tiles (KB kernels x WB vectors of C
 *           per register block, as in the direct weight gradient)
 *   TB      2x2 output tiles per cache block of the Winograd passes
 *
 * The shape is a run-time argument, so one instance serves every layer. Tensors are
 * float32, dense in the layout above; the caller passes torch's data pointers directly.
 * Bias is added by the caller. Dilation (DH, DW: filter taps that far apart) is run-time too,
 * in every layout (the Winograd kernels and the data gradient as a transposed forward take
 * dilation 1 and fall back to the direct kernels otherwise). Groups (G: each of K/G filters of
 * a group reads C/G input channels, weight K,C/G,R,S) are computed by the NCHW kernels only:
 * the entry points return 0, or 1 (nothing computed) for an NHWC instance given G != 1.
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
#ifndef ALGO
#define ALGO 0
#endif
#ifndef TB
#define TB 16
#endif
#if ALGO == 1 && LAYOUT != 1
#error "ALGO 1 (Winograd) is an NHWC forward: it needs LAYOUT 1"
#endif

#define PRAGMA_(x) _Pragma(#x)
#define UNROLL_BY(n) PRAGMA_(GCC unroll n)

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));

typedef struct {
    long N, C, H, W, K, R, S, SH, SW, PH, PW, OH, OW, G, DH, DW;
} shape_t;

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof(vf)); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof(vf)); }
static inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < VEC; i++) s += v[i]; return s; }
static inline long lmin(long a, long b) { return a < b ? a : b; }
/* every lane s: s - 0 is s for every float (also -0), so the compiler folds it into one broadcast
   (from memory: no shuffle, which would compete with the FMAs), where 0 + s costs an add first */
static inline vf splat(float s) { return s - (vf){0}; }
/* the first cn lanes from p, zeros after them */
static inline vf load_c(const float *p, long cn) {
    if (cn >= VEC) return vload(p);
    vf v = (vf){0};
    for (long i = 0; i < cn; i++) v[i] = p[i];
    return v;
}

/* first and one-past-last output column whose input column ow*SW-PW+s lies inside [0, W)
   (s: the column offset of a filter tap, its index times DW) */
static inline void col_range(const shape_t *d, long s, long *lo, long *hi) {
    long first = d->PW - s > 0 ? (d->PW - s + d->SW - 1) / d->SW : 0;
    long last = (d->W + d->PW - s + d->SW - 1) / d->SW;
    *lo = first;
    *hi = lmin(d->OW, last);
}

#if LAYOUT == 1
/* ------------------------------------------------------------------ NHWC ---------- */

/* xp[b]: input pixel (ih, (ow0 + b) * SW - PW + s * DW) of image n, or the zero row where the tile
   runs past OW (b >= wn) or the pixel lies in the padding */
static inline void input_columns(const float *xp[WB], const float *x, const float *zeros, const shape_t *d,
                                 long n, long ih, long ow0, long s, long wn) {
    for (int b = 0; b < WB; b++) {
        const long iw = (ow0 + b) * d->SW - d->PW + s * d->DW;
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
        const long ih = oh * d->SH - d->PH + r * d->DH;
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
            const long ih = oh * d->SH - d->PH + r * d->DH;
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
static void direct_fwd(const float *x, const float *w, float *y, const shape_t *d) {
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
static void direct_fwd(const float *x, const float *w, float *y, const shape_t *d) {
    const long nkb = (d->K + KB - 1) / KB, nwb = (d->OW + WB - 1) / WB;
    float *zeros = calloc((size_t)(d->C + VEC), sizeof(float));
    fwd_tiles(x, w, y, zeros, d, nkb, nwb);
    free(zeros);
}
#endif

#if ALGO == 1
/* Winograd F(2x2, 3x3) forward (Lavin & Gray): every 2x2 output tile is A^T [(G g G^T) . (B^T d B)] A
   for its 4x4 input patch d. Blocks of TB tiles (flat over image, tile row, tile column) are one job:
   the input transform of the block's patches (vectors over C) into v[16][TB][CP], 16 GEMMs
   (tiles x C) x (C x K) against the weight transformed once per call, u[16][C][KP] (vectors over K),
   into m[16][TB][KP], and the output transform of m straight into y. CP, KP: C, K rounded up to VEC.
   The 16 planes of v and m lie plane_stride() floats apart: a power of two there (TB * CP = 1024)
   put the 16 vectors that one tile's transform reads or writes into one set of the 8-way L1
   (32 channels, TB 32: 4x slower) */

static inline long round_up(long a, long b) { return (a + b - 1) / b * b; }
/* floats between two planes of TB rows of n floats: one cache line more than a multiple of 64 floats */
static inline long plane_stride(long n) { return round_up(TB * n, 64) + 16; }

/* e[i * 4 + j] = (G g G^T)[i][j], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1] */
static inline void g_transform(const vf g[3][3], vf e[16]) {
    vf t[4][3];
    for (int s = 0; s < 3; s++) {
        t[0][s] = g[0][s];
        t[1][s] = 0.5f * (g[0][s] + g[1][s] + g[2][s]);
        t[2][s] = 0.5f * (g[0][s] - g[1][s] + g[2][s]);
        t[3][s] = g[2][s];
    }
    for (int i = 0; i < 4; i++) {
        e[i * 4 + 0] = t[i][0];
        e[i * 4 + 1] = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
        e[i * 4 + 2] = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
        e[i * 4 + 3] = t[i][2];
    }
}

/* u[p][c][k] = (G g G^T)[p] of the 3x3 filter g of input channel c and output channel k, lanes
   k >= K zero. flip 0: g = w[k, :, :, c] (w is K x 3 x 3 x C); transformed in VEC x VEC blocks of
   (k, c), vectors over c, and written transposed. flip 1 (the data gradient's transposed problem):
   g = w[c, 2 - r, 2 - s, k] of the forward weight (C x 3 x 3 x K), vectors over k, no transpose */
static void wino_weight(const float *w, float *u, long C, long K, long KP, int flip) {
    if (flip) {
        #pragma omp parallel for collapse(2) schedule(static)
        for (long c = 0; c < C; c++)
            for (long k = 0; k < KP; k += VEC) {
                vf g[3][3], e[16];
                for (int r = 0; r < 3; r++)
                    for (int s = 0; s < 3; s++) g[r][s] = load_c(w + ((c * 3 + 2 - r) * 3 + 2 - s) * K + k, K - k);
                g_transform(g, e);
                for (int p = 0; p < 16; p++) vstore(u + (p * C + c) * KP + k, e[p]);
            }
        return;
    }
    #pragma omp parallel for collapse(2) schedule(static)
    for (long k0 = 0; k0 < KP; k0 += VEC)
        for (long c0 = 0; c0 < C; c0 += VEC) {
            const long kn = lmin(VEC, K - k0), cn = lmin(VEC, C - c0);
            float blk[16][VEC][VEC];  /* [p][k - k0][c - c0] */
            for (long kk = 0; kk < VEC; kk++) {
                vf g[3][3], e[16];
                for (int r = 0; r < 3; r++)
                    for (int s = 0; s < 3; s++)
                        g[r][s] = kk < kn ? load_c(w + (((k0 + kk) * 3 + r) * 3 + s) * C + c0, cn) : (vf){0};
                g_transform(g, e);
                for (int p = 0; p < 16; p++) vstore(blk[p][kk], e[p]);
            }
            for (int p = 0; p < 16; p++)
                for (long cc = 0; cc < cn; cc++) {
                    vf col;
                    for (int kk = 0; kk < VEC; kk++) col[kk] = blk[p][kk][cc];
                    vstore(u + (p * C + c0 + cc) * KP + k0, col);
                }
        }
}

/* 4-point transforms along one axis: B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1] and
   A^T = [1 1 1 0; 0 1 -1 -1] */
static inline void bt4(vf o[4], vf a, vf b, vf c, vf e) { o[0] = a - c; o[1] = b + c; o[2] = c - b; o[3] = b - e; }
static inline void at4(vf o[2], vf a, vf b, vf c, vf e) { o[0] = a + b + c; o[1] = b - c - e; }

/* the tile's output corner: image n, output row 2 * th, column 2 * tw */
static inline void tile_origin(const shape_t *d, long tile, long *n, long *oh, long *ow) {
    const long nth = (d->OH + 1) / 2, ntw = (d->OW + 1) / 2;
    *n = tile / (nth * ntw);
    *oh = tile / ntw % nth * 2;
    *ow = tile % ntw * 2;
}

/* v[p][c..c+VEC] = (B^T p B)[p], the planes vs floats apart */
static inline void bt_patch(const vf p[4][4], float *restrict v, long vs) {
    vf q[4][4];
    for (int j = 0; j < 4; j++) {
        vf o[4];
        bt4(o, p[0][j], p[1][j], p[2][j], p[3][j]);
        for (int i = 0; i < 4; i++) q[i][j] = o[i];
    }
    for (int i = 0; i < 4; i++) {
        vf o[4];
        bt4(o, q[i][0], q[i][1], q[i][2], q[i][3]);
        for (int j = 0; j < 4; j++) vstore(v + (i * 4 + j) * vs, o[j]);
    }
}

/* v[p][b][c] = (B^T d B)[p] of the 4x4 input patch of tile t0 + b (zero outside the image), b < tn;
   a patch inside the image with whole vectors of C takes plain loads */
static void wino_input(const float *restrict x, float *restrict v, const shape_t *d, long t0, long tn, long CP) {
    const long C = d->C, W = d->W, vs = plane_stride(CP);
    for (long b = 0; b < tn; b++) {
        long n, oh, ow;
        tile_origin(d, t0 + b, &n, &oh, &ow);
        const long ih0 = oh - d->PH, iw0 = ow - d->PW;
        float *vb = v + b * CP;
        if (C == CP && ih0 >= 0 && ih0 + 4 <= d->H && iw0 >= 0 && iw0 + 4 <= W) {
            const float *xb = x + ((n * d->H + ih0) * W + iw0) * C;
            for (long c = 0; c < C; c += VEC) {
                vf p[4][4];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) p[i][j] = vload(xb + (i * W + j) * C + c);
                bt_patch(p, vb + c, vs);
            }
            continue;
        }
        const float *px[4][4];
        long lanes[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) {
                const long ih = ih0 + i, iw = iw0 + j, in = ih >= 0 && ih < d->H && iw >= 0 && iw < W;
                px[i][j] = in ? x + ((n * d->H + ih) * W + iw) * C : x;
                lanes[i][j] = in ? VEC : 0;
            }
        for (long c = 0; c < CP; c += VEC) {
            const long cn = lmin(VEC, C - c);
            vf p[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) p[i][j] = load_c(px[i][j] + c, lmin(lanes[i][j], cn));
            bt_patch(p, vb + c, vs);
        }
    }
}

/* m[b][k0..k0+KB*VEC] = sum_c v[b][c] u[c][k0..] for tiles b0..b0+WB of one of the 16 products:
   WB x KB vector accumulators, one broadcast v per tile and one u vector per K vector and c */
static inline void wino_gemm_tile(const float *restrict v, const float *restrict u, float *restrict m,
                                  long C, long CP, long KP, long b0, long tn, long k0) {
    const long jn = lmin(KB, (KP - k0) / VEC), bn = lmin(WB, tn - b0);
    const float *vr[WB];
    const float *uq[KB];
    for (int b = 0; b < WB; b++) vr[b] = v + (b0 + (b < bn ? b : 0)) * CP;
    for (int j = 0; j < KB; j++) uq[j] = u + k0 + (j < jn ? j : 0) * VEC;
    vf acc[WB][KB];
    for (int b = 0; b < WB; b++)
        for (int j = 0; j < KB; j++) acc[b][j] = (vf){0};
    UNROLL_BY(UNROLL)
    for (long c = 0; c < C; c++) {
        vf uv[KB];
        for (int j = 0; j < KB; j++) uv[j] = vload(uq[j] + c * KP);
        for (int b = 0; b < WB; b++) {
            const vf xv = splat(vr[b][c]);
            for (int j = 0; j < KB; j++) acc[b][j] += xv * uv[j];
        }
    }
    for (long b = 0; b < bn; b++)
        for (long j = 0; j < jn; j++) vstore(m + (b0 + b) * KP + k0 + j * VEC, acc[b][j]);
}

/* y of tile t0 + b = A^T m[.][b] A for b < tn, only the rows and columns inside OH x OW, k < K */
static void wino_output(const float *restrict m, float *restrict y, const shape_t *d, long t0, long tn, long KP) {
    const long K = d->K, ms = plane_stride(KP);
    for (long b = 0; b < tn; b++) {
        long n, oh, ow;
        tile_origin(d, t0 + b, &n, &oh, &ow);
        const long rows = lmin(2, d->OH - oh), cols = lmin(2, d->OW - ow);
        for (long k = 0; k < KP; k += VEC) {
            vf q[4][2], o[2][2];  /* q[j]: rows 0 and 1 of A^T m, column j */
            for (int j = 0; j < 4; j++) {
                const float *mp = m + j * ms + b * KP + k;
                at4(q[j], vload(mp), vload(mp + 4 * ms), vload(mp + 8 * ms), vload(mp + 12 * ms));
            }
            for (int i = 0; i < 2; i++) at4(o[i], q[0][i], q[1][i], q[2][i], q[3][i]);
            const long kn = lmin(VEC, K - k);
            for (long i = 0; i < rows; i++)
                for (long j = 0; j < cols; j++) {
                    float *yp = y + ((n * d->OH + oh + i) * d->OW + ow + j) * K + k;
                    if (kn == VEC) vstore(yp, o[i][j]);
                    else for (long l = 0; l < kn; l++) yp[l] = o[i][j][l];
                }
        }
    }
}

/* the Winograd forward for 3x3 stride-1 shapes; returns 0 (nothing done) for the others.
   flip: w is the weight of the problem this one transposes (see wino_weight) */
static int winograd_fwd(const float *x, const float *w, float *y, const shape_t *d, int flip) {
    if (d->R != 3 || d->S != 3 || d->SH != 1 || d->SW != 1 || d->DH != 1 || d->DW != 1) return 0;
    const long C = d->C, K = d->K, CP = round_up(C, VEC), KP = round_up(K, VEC);
    const long tiles = d->N * ((d->OH + 1) / 2) * ((d->OW + 1) / 2), blocks = (tiles + TB - 1) / TB;
    const long vs = plane_stride(CP), ms = plane_stride(KP);
    float *u = aligned_alloc(64, (size_t)(16 * C * KP) * sizeof(float));
    wino_weight(w, u, C, K, KP, flip);
    #pragma omp parallel
    {
        float *v = aligned_alloc(64, (size_t)(16 * vs) * sizeof(float));
        float *m = aligned_alloc(64, (size_t)(16 * ms) * sizeof(float));
        #pragma omp for schedule(static)
        for (long blk = 0; blk < blocks; blk++) {
            const long t0 = blk * TB, tn = lmin(TB, tiles - t0);
            wino_input(x, v, d, t0, tn, CP);
            for (int p = 0; p < 16; p++)
                for (long k0 = 0; k0 < KP; k0 += KB * VEC)
                    for (long b0 = 0; b0 < tn; b0 += WB)
                        wino_gemm_tile(v + p * vs, u + p * C * KP, m + p * ms, C, CP, KP, b0, tn, k0);
            wino_output(m, y, d, t0, tn, KP);
        }
        free(v);
        free(m);
    }
    free(u);
    return 1;
}

/* Weight gradient: with U = G g G^T, V = B^T d B, M = U . V and y = A^T M A per tile,
   dL/dg = G^T (sum over tiles of (A gy A^T) . V) G. Per block of TB tiles: the input transform as
   in the forward, the transform of the tiles' output gradients (zero outside OH x OW) into
   e[16][TB][KP] (vectors over K), and 16 GEMMs (K x tiles) x (tiles x C) summed into the thread's
   own s[16][KP][CP]; the copies are added and transformed back (G^T s G) at the end */

/* A = [1 0; 1 1; 1 -1; 0 -1]: a 2-point column to 4 points */
static inline void a4(vf o[4], vf a, vf b) { o[0] = a; o[1] = a + b; o[2] = a - b; o[3] = -b; }

/* e[p][b][k] = (A gy A^T)[p] of the 2x2 output gradient of tile t0 + b, b < tn */
static void wino_grad_output(const float *restrict gy, float *restrict e, const shape_t *d, long t0, long tn, long KP) {
    const long K = d->K, es = plane_stride(KP);
    for (long b = 0; b < tn; b++) {
        long n, oh, ow;
        tile_origin(d, t0 + b, &n, &oh, &ow);
        const long rows = lmin(2, d->OH - oh), cols = lmin(2, d->OW - ow);
        const float *gp = gy + ((n * d->OH + oh) * d->OW + ow) * K;
        for (long k = 0; k < KP; k += VEC) {
            vf g[2][2], t[4][2];
            for (long i = 0; i < 2; i++)
                for (long j = 0; j < 2; j++)
                    g[i][j] = i < rows && j < cols ? load_c(gp + (i * d->OW + j) * K + k, K - k) : (vf){0};
            for (int j = 0; j < 2; j++) {
                vf o[4];
                a4(o, g[0][j], g[1][j]);
                for (int i = 0; i < 4; i++) t[i][j] = o[i];
            }
            for (int i = 0; i < 4; i++) {
                vf o[4];
                a4(o, t[i][0], t[i][1]);
                for (int j = 0; j < 4; j++) vstore(e + (i * 4 + j) * es + b * KP + k, o[j]);
            }
        }
    }
}

/* s[k0..k0+KB][c0..c0+WB*VEC] += sum_b e[b][k] v[b][c] over the block's tiles, for one of the 16
   products: KB x WB vector accumulators, KB broadcast e values times WB vectors of v per tile */
static inline void wino_wgrad_tile(const float *restrict e, const float *restrict v, float *restrict s,
                                   long CP, long KP, long tn, long k0, long c0) {
    vf acc[KB][WB];
    for (int j = 0; j < KB; j++)
        for (int b = 0; b < WB; b++) acc[j][b] = (vf){0};
    for (long t = 0; t < tn; t++) {
        vf xv[WB];
        for (int b = 0; b < WB; b++) xv[b] = vload(v + t * CP + c0 + b * VEC);
        for (int j = 0; j < KB; j++) {
            const vf g = splat(e[t * KP + k0 + j]);
            for (int b = 0; b < WB; b++) acc[j][b] += g * xv[b];
        }
    }
    for (int j = 0; j < KB; j++)
        for (int b = 0; b < WB; b++) {
            float *o = s + (k0 + j) * CP + c0 + b * VEC;
            vstore(o, vload(o) + acc[j][b]);
        }
}

/* the Winograd weight gradient for 3x3 stride-1 shapes; returns 0 (nothing done) for the others.
   C is padded with zeros to whole register tiles (CP: WB vectors), K to KP >= a multiple of KB */
static int winograd_bwd_weight(const float *x, const float *gy, float *gw, const shape_t *d) {
    if (d->R != 3 || d->S != 3 || d->SH != 1 || d->SW != 1 || d->DH != 1 || d->DW != 1) return 0;
    const long C = d->C, K = d->K, CP = round_up(C, WB * VEC), KP = round_up(round_up(K, KB), VEC);
    const long tiles = d->N * ((d->OH + 1) / 2) * ((d->OW + 1) / 2), blocks = (tiles + TB - 1) / TB;
    const long vs = plane_stride(CP), es = plane_stride(KP), size = 16 * KP * CP;
    const int nt = omp_get_max_threads();
    float *sums = aligned_alloc(64, (size_t)(nt * size) * sizeof(float));
    #pragma omp parallel
    {
        float *s = sums + omp_get_thread_num() * size;
        float *v = aligned_alloc(64, (size_t)(16 * vs) * sizeof(float));
        float *e = aligned_alloc(64, (size_t)(16 * es) * sizeof(float));
        memset(s, 0, (size_t)size * sizeof(float));
        #pragma omp for schedule(static)
        for (long blk = 0; blk < blocks; blk++) {
            const long t0 = blk * TB, tn = lmin(TB, tiles - t0);
            wino_input(x, v, d, t0, tn, CP);
            wino_grad_output(gy, e, d, t0, tn, KP);
            for (int p = 0; p < 16; p++)
                for (long k0 = 0; k0 < K; k0 += KB)
                    for (long c0 = 0; c0 < CP; c0 += WB * VEC)
                        wino_wgrad_tile(e + p * es, v + p * vs, s + p * KP * CP, CP, KP, tn, k0, c0);
        }
        free(v);
        free(e);
    }
    /* gw[k][r][s][c] = (G^T s[.][k][c] G)[r][s], G^T = [1 .5 .5 0; 0 .5 -.5 0; 0 .5 .5 1] */
    #pragma omp parallel for schedule(static)
    for (long k = 0; k < K; k++)
        for (long c = 0; c < CP; c += VEC) {
            vf m[4][4], t[3][4];
            for (int p = 0; p < 16; p++) {
                vf sum = (vf){0};
                for (int th = 0; th < nt; th++) sum += vload(sums + th * size + (p * KP + k) * CP + c);
                m[p / 4][p % 4] = sum;
            }
            for (int j = 0; j < 4; j++) {
                t[0][j] = m[0][j] + 0.5f * (m[1][j] + m[2][j]);
                t[1][j] = 0.5f * (m[1][j] - m[2][j]);
                t[2][j] = 0.5f * (m[1][j] + m[2][j]) + m[3][j];
            }
            const long cn = lmin(VEC, C - c);
            for (int r = 0; r < 3; r++) {
                const vf o[3] = {t[r][0] + 0.5f * (t[r][1] + t[r][2]), 0.5f * (t[r][1] - t[r][2]),
                                 0.5f * (t[r][1] + t[r][2]) + t[r][3]};
                for (int q = 0; q < 3; q++) {
                    float *out = gw + ((k * 3 + r) * 3 + q) * C + c;
                    if (cn == VEC) vstore(out, o[q]);
                    else for (long i = 0; i < cn; i++) out[i] = o[q][i];
                }
            }
        }
    free(sums);
    return 1;
}
#endif

static void conv_fwd_impl(const float *x, const float *w, float *y, const shape_t *d) {
#if ALGO == 1
    if (winograd_fwd(x, w, y, d, 0)) return;
#endif
    direct_fwd(x, w, y, d);
}

#if PACK == 1 || ALGO == 1
/* stride 1: the data gradient is the forward of the transposed problem, gy (K channels, padded
   by R-1-PH, S-1-PW) convolved with the flipped weight wt[c][r][s][k] = w[k][R-1-r][S-1-s][c];
   returns 0 (nothing done) for the shapes it does not cover */
static int bwd_data_as_forward(const float *gy, const float *w, float *gx, const shape_t *d) {
    const long C = d->C, K = d->K, R = d->R, S = d->S;
    if (d->SH != 1 || d->SW != 1 || d->DH != 1 || d->DW != 1 || d->PH > R - 1 || d->PW > S - 1) return 0;
    const shape_t t = {d->N, K, d->OH, d->OW, C, R, S, 1, 1, R - 1 - d->PH, S - 1 - d->PW, d->H, d->W, 1, 1, 1};
#if ALGO == 1
    if (winograd_fwd(gy, w, gx, &t, 1)) return 1;  /* flips and transposes w while transforming it */
#endif
    float *wt = malloc((size_t)(C * R * S * K) * sizeof(float));
    #pragma omp parallel for schedule(static)
    for (long c = 0; c < C; c++)
        for (long r = 0; r < R; r++)
            for (long s = 0; s < S; s++)
                for (long k = 0; k < K; k++)
                    wt[((c * R + r) * S + s) * K + k] = w[((k * R + R - 1 - r) * S + S - 1 - s) * C + c];
    conv_fwd_impl(gy, wt, gx, &t);
    free(wt);
    return 1;
}
#endif

/* data gradient, gathered per input pixel: gx[n,ih,iw,c] = sum_{k,r,s} gy[n,oh,ow,k] w[k,r,s,c] */
static void conv_bwd_data_impl(const float *gy, const float *w, float *gx, const shape_t *d) {
    const long C = d->C, K = d->K, RSC = d->R * d->S * C;
#if PACK == 1 || ALGO == 1
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
                        const long t = ih + d->PH - r * d->DH;
                        if (t < 0 || t % d->SH) continue;
                        const long oh = t / d->SH;
                        if (oh >= d->OH) continue;
                        for (long s = 0; s < d->S; s++) {
                            const long u = iw + d->PW - s * d->DW;
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
                        const long t = ih + d->PH - r * d->DH;
                        if (t < 0 || t % d->SH) continue;
                        const long oh = t / d->SH;
                        if (oh >= d->OH) continue;
                        for (long s = 0; s < d->S; s++) {
                            const long u = iw + d->PW - s * d->DW;
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
/* one KB x WB tile of gw[k0.., r, s, c0..] summed over the pixels of output rows oh0..oh1 of image
   n; FULL (a constant after inlining) when the tile has KB kernels and WB whole vectors: no tail code */
static inline __attribute__((always_inline)) void bwd_weight_tile(
        const float *restrict x, const float *restrict gy, float *restrict out, const shape_t *d,
        long n, long oh0, long oh1, long r, long s, long k0, long c0, const int full) {
    const long C = d->C, K = d->K, RSC = d->R * d->S * C, kn = lmin(KB, K - k0);
    long lo, hi;
    col_range(d, s * d->DW, &lo, &hi);
    vf acc[KB][WB];
    for (int j = 0; j < KB; j++)
        for (int b = 0; b < WB; b++) acc[j][b] = (vf){0};
    for (long oh = oh0; oh < oh1; oh++) {
        const long ih = oh * d->SH - d->PH + r * d->DH;
        if (ih < 0 || ih >= d->H) continue;
        const float *xrow = x + ((n * d->H + ih) * d->W - d->PW + s * d->DW) * C + c0;
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
#if ALGO == 1
    if (winograd_bwd_weight(x, gy, gw, d)) return;
#endif
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
/* Groups: output channel k reads input channels (k / KG) * CG .. + CG (CG = C / G, KG = K / G);
   the weight is w[k][c][r][s] with c < CG. A register block of KB output channels lies in one group
   (else its channels run one at a time). */

/* y[n, k0..k0+kn, :, :]; the block's channels share the group of k0 */
static inline void fwd_rows(const float *restrict x, const float *restrict w, float *restrict y,
                            const shape_t *d, long n, long k0, long kn) {
    const long OW = d->OW, CG = d->C / d->G, c_in = (k0 / (d->K / d->G)) * CG;
    for (long oh = 0; oh < d->OH; oh++) {
        float *yr[KB];
        for (long j = 0; j < KB; j++) {
            yr[j] = y + ((n * d->K + k0 + (j < kn ? j : 0)) * d->OH + oh) * OW;
            if (j < kn) memset(yr[j], 0, sizeof(float) * OW);
        }
        for (long c = 0; c < CG; c++)
            for (long r = 0; r < d->R; r++) {
                const long ih = oh * d->SH - d->PH + r * d->DH;
                if (ih < 0 || ih >= d->H) continue;
                const float *xr = x + ((n * d->C + c_in + c) * d->H + ih) * d->W;
                for (long s = 0; s < d->S; s++) {
                    long lo, hi;
                    col_range(d, s * d->DW, &lo, &hi);
                    float wv[KB];
                    for (long j = 0; j < KB; j++)
                        wv[j] = j < kn ? w[(((k0 + j) * CG + c) * d->R + r) * d->S + s] : 0.f;
                    const float *xs = xr + s * d->DW - d->PW;
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
    const long nkb = (d->K + KB - 1) / KB, KG = d->K / d->G;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long kb = 0; kb < nkb; kb++) {
            const long k0 = kb * KB, kn = lmin(KB, d->K - k0);
            if (kn == KB && k0 / KG == (k0 + KB - 1) / KG) {
                /* full block in one group: rows of every lane are distinct */
                fwd_rows(x, w, y, d, n, k0, KB);
            } else {
                for (long j = 0; j < kn; j++) fwd_rows(x, w, y, d, n, k0 + j, 1);
            }
        }
}

static void conv_bwd_data_impl(const float *gy, const float *w, float *gx, const shape_t *d) {
    const long CG = d->C / d->G, KG = d->K / d->G;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long n = 0; n < d->N; n++)
        for (long c = 0; c < d->C; c++) {
            const long k_first = (c / CG) * KG, cg = c % CG;
            float *gp = gx + (n * d->C + c) * d->H * d->W;
            memset(gp, 0, sizeof(float) * d->H * d->W);
            for (long k = k_first; k < k_first + KG; k++)
                for (long r = 0; r < d->R; r++)
                    for (long oh = 0; oh < d->OH; oh++) {
                        const long ih = oh * d->SH - d->PH + r * d->DH;
                        if (ih < 0 || ih >= d->H) continue;
                        const float *gyr = gy + ((n * d->K + k) * d->OH + oh) * d->OW;
                        for (long s = 0; s < d->S; s++) {
                            long lo, hi;
                            col_range(d, s * d->DW, &lo, &hi);
                            const float wv = w[((k * CG + cg) * d->R + r) * d->S + s];
                            float *gs = gp + ih * d->W + s * d->DW - d->PW;
                            UNROLL_BY(UNROLL)
                            for (long ow = lo; ow < hi; ow++) gs[ow * d->SW] += wv * gyr[ow];
                        }
                    }
        }
}

static void conv_bwd_weight_impl(const float *x, const float *gy, float *gw, const shape_t *d) {
    const long CG = d->C / d->G, KG = d->K / d->G;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long k = 0; k < d->K; k++)
        for (long c = 0; c < CG; c++)
            for (long r = 0; r < d->R; r++)
                for (long s = 0; s < d->S; s++) {
                    const long c_in = (k / KG) * CG + c;
                    long lo, hi;
                    col_range(d, s * d->DW, &lo, &hi);
                    float acc = 0.f;
                    for (long n = 0; n < d->N; n++)
                        for (long oh = 0; oh < d->OH; oh++) {
                            const long ih = oh * d->SH - d->PH + r * d->DH;
                            if (ih < 0 || ih >= d->H) continue;
                            const float *xs = x + ((n * d->C + c_in) * d->H + ih) * d->W + s * d->DW - d->PW;
                            const float *gyr = gy + ((n * d->K + k) * d->OH + oh) * d->OW;
                            #pragma omp simd reduction(+ : acc)
                            for (long ow = lo; ow < hi; ow++) acc += gyr[ow] * xs[ow * d->SW];
                        }
                    gw[((k * CG + c) * d->R + r) * d->S + s] = acc;
                }
}
#endif

/* ------------------------------------------------------------ exported entry points */

/* each returns 0, or 1 when this instance does not compute the shape (NHWC with groups) */
#define SHAPE_ARGS long N, long C, long H, long W, long K, long R, long S, long SH, long SW, long PH, long PW, \
                   long G, long DH, long DW, int threads
#define MAKE_SHAPE shape_t d = {N, C, H, W, K, R, S, SH, SW, PH, PW, (H + 2 * PH - DH * (R - 1) - 1) / SH + 1, \
                                (W + 2 * PW - DW * (S - 1) - 1) / SW + 1, G, DH, DW}

int conv_fwd(const float *x, const float *w, float *y, SHAPE_ARGS) {
    MAKE_SHAPE;
    if (LAYOUT == 1 && G != 1) return 1;
    omp_set_num_threads(threads);
    conv_fwd_impl(x, w, y, &d);
    return 0;
}

int conv_bwd_data(const float *gy, const float *w, float *gx, SHAPE_ARGS) {
    MAKE_SHAPE;
    if (LAYOUT == 1 && G != 1) return 1;
    omp_set_num_threads(threads);
    conv_bwd_data_impl(gy, w, gx, &d);
    return 0;
}

int conv_bwd_weight(const float *x, const float *gy, float *gw, SHAPE_ARGS) {
    MAKE_SHAPE;
    if (LAYOUT == 1 && G != 1) return 1;
    omp_set_num_threads(threads);
    conv_bwd_weight_impl(x, gy, gw, &d);
    return 0;
}
