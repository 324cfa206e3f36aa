/* A decode step of a few tokens through every decoder layer in one call: the operations mdcli's own
 * forward (mdcli.backends.llama) runs between its products, in C, around the same product and
 * attention kernels, which this file is handed as function pointers (gguf_blocks.c's <kind>_gemm,
 * attention.c's attention). A one-branch step of the embedded model spent about 5 of its 20 ms in
 * Python and torch's dispatch between the kernels (some twenty small operations a layer, each a few
 * microseconds whatever its rows): notebook/gguf-blocks.md, "A step's layers in one call".
 *
 * Per layer, for the M rows `hidden` [M][hidden] (row m the token at cache slot `slot` + m):
 *   x = RMSNorm(hidden) * norm_in;  qkv = x W_qkv^T (+ bias);  q, k rotated (rotate_half's rule);
 *   k and v written into the layer's cache at their slots;  a = attention(q, keys 0 .. slot + M - 1,
 *   values; the step's mask, or none where a lone token sees them all);  hidden += a W_o^T (+ bias);
 *   x = RMSNorm(hidden) * norm_post;  g, u = x W_gate_up^T (+ bias);  hidden += (silu(g) * u) W_down^T
 *   (+ bias).
 *
 * Built with -ffp-contract=off: each multiply and add rounds as torch's separate operations do, so
 * the rotary embedding, the residual adds and the products with the norms' weights are torch's
 * numbers bit for bit. The norm's sum of squares runs in another order than torch's reduction and
 * exp is a polynomial (Cephes' expf, within 2 ulp), so a step agrees with the Python forward to
 * float32 rounding (tests/test_native_step.py).
 *
 * Plain C: the loops vectorize as the compiler can, on any CPU the kernels it calls build on. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*product_fn)(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y, int64_t ldy,
                           float *scratch);
typedef void (*attention_fn)(const float *q, int64_t q_head, int64_t q_query, int64_t H, int64_t M, int64_t G,
                             int64_t D, const float *k, const float *v, int64_t n, int64_t group_stride,
                             const float *mask_t, float scale, float *out, float *scratch, const int64_t *slots);

#define MAX_PARTS 4 /* a fused projection's parts, each in its own block kind (q, k, v: Q4_K, Q4_K, Q6_K) */

/* One projection: its parts' products, each filling its run of the output's columns, and a bias or NULL. */
struct projection {
    int64_t parts;
    product_fn fn[MAX_PARTS];
    const uint8_t *blocks[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    const float *bias;
};

struct layer {
    const float *norm_in, *norm_post; /* [hidden] */
    float eps_in, eps_post;
    struct projection qkv, o, gate_up, down;
};

struct shape {
    int64_t hidden, heads, kv_heads, dim, inter;
    float scale;
    attention_fn attention;
};

/* Floats of `work` a step of M rows needs. */
int64_t step_work_floats(int64_t M, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter) {
    return M * (hidden + (heads + 2 * kv_heads) * dim + (2 * heads + kv_heads) * dim + hidden + 3 * inter);
}

/* x * (1 / sqrt(mean(x^2) + eps)) * weight, as torch's rms_norm: the squares summed 16 lanes wide. */
static void rms_norm(const float *x, const float *weight, float eps, int64_t n, float *out) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++)
            lanes[j] += x[i + j] * x[i + j];
    for (; i < n; i++)
        lanes[i % 16] += x[i] * x[i];
    for (int width = 8; width >= 1; width /= 2) /* a tree, as a vector's lanes are added */
        for (int j = 0; j < width; j++)
            lanes[j] += lanes[j + width];
    const float inverse = 1.0f / sqrtf(lanes[0] / (float)n + eps);
    for (i = 0; i < n; i++)
        out[i] = x[i] * inverse * weight[i];
}

/* Outputs of a projection: the sum of its parts' rows. */
static int64_t width_of(const struct projection *p) {
    int64_t width = 0;
    for (int64_t part = 0; part < p->parts; part++)
        width += p->rows[part];
    return width;
}

/* x [M][n] times a projection's weights: out [M][width] (+ bias), each part into its columns. */
static void project(const struct projection *p, const float *x, int64_t M, int64_t n, float *out, float *scratch) {
    const int64_t width = width_of(p);
    int64_t start = 0;
    for (int64_t part = 0; part < p->parts; part++) {
        p->fn[part](x, M, n, p->blocks[part], p->rows[part], out + start, width, scratch);
        start += p->rows[part];
    }
    if (p->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < width; i++)
                out[m * width + i] += p->bias[i];
}

/* x * cos + rotate_half(x) * sin for `heads` heads of `dim` (rotate_half(x) = [-x2, x1]), into out. */
static void rotate(const float *x, int64_t heads, int64_t dim, const float *cos, const float *sin, float *out) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, x += dim, out += dim)
        for (int64_t d = 0; d < dim; d++) {
            const float turned = d < half ? -x[d + half] : x[d - half];
            out[d] = x[d] * cos[d] + turned * sin[d];
        }
}

/* exp(x), Cephes' expf: x = n ln2 + r, exp(r) by a degree-6 polynomial, times 2^n; x clamped to
 * float32's range. Branch-free, so the loop calling it vectorizes. */
static inline float exp_of(float x) {
    x = x < -87.33654f ? -87.33654f : x > 88.72283f ? 88.72283f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out = silu(gate) * up (torch's silu: g / (1 + exp(-g))). */
static void gated(const float *gate, const float *up, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = gate[i] / (1.0f + exp_of(-gate[i])) * up[i];
}

static void add_into(float *hidden, const float *projected, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        hidden[i] = hidden[i] + projected[i];
}

/* M tokens through every layer: hidden [M][hidden] in and out; cos, sin [M][dim] (each row's
 * position, from the model's rotary module); keys[l], values[l]: layer l's cache buffers, group g's
 * slot p at + g * group_stride[l] + p * dim, slots 0 .. slot - 1 filled, row m's written at slot + m;
 * mask_t: attention.c's [slot + M][R] additive mask of the step (fused.step_mask), or NULL for a
 * lone token seeing every slot; work: step_work_floats; scratch: the products' (gguf_blocks.c's
 * scratch_floats of the widest input); attention_scratch: attention.c's attention_scratch_floats for
 * slot + M keys and M queries. */
void step(const struct shape *s, const struct layer *layers, int64_t n_layers, int64_t M, float *hidden,
          const float *cos, const float *sin, float *const *keys, float *const *values, const int64_t *group_stride,
          int64_t slot, const float *mask_t, float *work, float *scratch, float *attention_scratch) {
    const int64_t H = s->heads, G = s->kv_heads, D = s->dim, I = s->inter, n = s->hidden, QKV = (H + 2 * G) * D;
    float *x = work, *qkv = x + M * n, *turned = qkv + M * QKV, *attended = turned + M * (H + G) * D;
    float *projected = attended + M * H * D, *gate_up = projected + M * n, *mixed = gate_up + M * 2 * I;
    for (int64_t l = 0; l < n_layers; l++) {
        const struct layer *L = &layers[l];
        for (int64_t m = 0; m < M; m++)
            rms_norm(hidden + m * n, L->norm_in, L->eps_in, n, x + m * n);
        project(&L->qkv, x, M, n, qkv, scratch);
        for (int64_t m = 0; m < M; m++) { /* turned [M][H + G][D]: each row's queries, then its keys */
            float *row = turned + m * (H + G) * D;
            rotate(qkv + m * QKV, H + G, D, cos + m * D, sin + m * D, row);
            for (int64_t g = 0; g < G; g++) {
                memcpy(keys[l] + g * group_stride[l] + (slot + m) * D, row + (H + g) * D, D * sizeof(float));
                memcpy(values[l] + g * group_stride[l] + (slot + m) * D, qkv + m * QKV + (H + G + g) * D,
                       D * sizeof(float));
            }
        }
        s->attention(turned, D, (H + G) * D, H, M, G, D, keys[l], values[l], slot + M, group_stride[l], mask_t,
                     s->scale, attended, attention_scratch, NULL);
        project(&L->o, attended, M, H * D, projected, scratch);
        add_into(hidden, projected, M * n);
        for (int64_t m = 0; m < M; m++)
            rms_norm(hidden + m * n, L->norm_post, L->eps_post, n, x + m * n);
        project(&L->gate_up, x, M, n, gate_up, scratch);
        for (int64_t m = 0; m < M; m++)
            gated(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, mixed + m * I);
        project(&L->down, mixed, M, I, projected, scratch);
        add_into(hidden, projected, M * n);
    }
}
