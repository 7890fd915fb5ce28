// stepppo's own CUDA kernels over the radix KV pool.
//
// The pool holds, per layer, K and V as bf16 rows laid out [num_slots, kv_heads, head_dim].
// A sequence's context is a list of slot indices (its radix-tree path plus private slots),
// so every kernel here reads K/V *through* those indices: no phase gathers a context into a
// contiguous copy.
//
//   stepppo_kv_scatter_bf16         new K (or V) rows -> their pool slots
//   stepppo_paged_prefill_bf16_dD   new tokens attend to cached prefix + themselves
//                                   (causal, bottom-right aligned), GQA
//   stepppo_paged_decode_bf16_dD    one query per sequence, context split in chunks
//                                   (flash-decoding); partial results per chunk
//   stepppo_decode_combine_bf16_dD  merges the chunks' partial softmax states
//
// Numerics: bf16 inputs, f32 scores, f32 online-softmax state and f32 accumulators.
// One warp owns one (query token, query head): lane j scores key j of a 32-key tile
// (reading its K row with 16-byte loads), the tile's softmax is merged into the running
// state, then each lane accumulates head_dim/32 output dimensions over the tile's V rows
// (coalesced across lanes).

#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu
#define WARP_SIZE 32
#define DECODE_WARPS 4
#define PREFILL_WARPS 4

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

extern "C" __global__ void stepppo_kv_scatter_bf16(
    const __nv_bfloat16* __restrict__ rows,  // [n_tokens, row_elems]: new K (or V) rows
    const uint32_t* __restrict__ slots,      // [n_tokens]
    __nv_bfloat16* __restrict__ pool,        // [num_slots, row_elems]
    int n_tokens, int row_elems) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const size_t dst = (size_t)slots[t] * row_elems;
    const size_t src = (size_t)t * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) pool[dst + i] = rows[src + i];
}

// Running online-softmax state of one warp for one query row.
template <int D>
struct SoftmaxState {
    float m;                 // running max of scaled scores (same on every lane)
    float l;                 // running sum of exp(score - m) (same on every lane)
    float acc[D / WARP_SIZE];  // lane's output dims: lane + 32*i, scaled by exp(-m)
};

template <int D>
__device__ __forceinline__ void state_init(SoftmaxState<D>& st) {
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < D / WARP_SIZE; ++i) st.acc[i] = 0.f;
}

// Dot product of a query row (f32, shared memory) with one bf16 K row, read as 16-byte vectors.
template <int D>
__device__ __forceinline__ float dot_row(const float* __restrict__ q, const __nv_bfloat16* __restrict__ krow) {
    const uint4* k4 = reinterpret_cast<const uint4*>(krow);
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        uint4 raw = __ldg(k4 + c);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float2 f = __bfloat1622float2(h2[e]);
            dot += q[c * 8 + 2 * e] * f.x + q[c * 8 + 2 * e + 1] * f.y;
        }
    }
    return dot;
}

// Merges a tile of n (<= 32) keys at context indices [kbase, kbase + n) into the state.
template <int D>
__device__ __forceinline__ void attend_tile(
    SoftmaxState<D>& st, const float* __restrict__ q_s, const uint32_t* __restrict__ ctx_slots,
    int kbase, int n, const __nv_bfloat16* __restrict__ k_pool, const __nv_bfloat16* __restrict__ v_pool,
    int kv_heads, int kvh, float scale, int lane) {
    uint32_t slot = 0;
    float s = -INFINITY;
    if (lane < n) {
        slot = ctx_slots[kbase + lane];
        s = dot_row<D>(q_s, k_pool + ((size_t)slot * kv_heads + kvh) * D) * scale;
    }
    const float m_new = fmaxf(st.m, warp_max(s));
    const float p = lane < n ? __expf(s - m_new) : 0.f;
    const float corr = __expf(st.m - m_new);
    st.l = st.l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < D / WARP_SIZE; ++i) st.acc[i] *= corr;
    for (int j = 0; j < n; ++j) {
        const float pj = __shfl_sync(FULL_MASK, p, j);
        const uint32_t sj = __shfl_sync(FULL_MASK, slot, j);
        const __nv_bfloat16* vrow = v_pool + ((size_t)sj * kv_heads + kvh) * D;
#pragma unroll
        for (int i = 0; i < D / WARP_SIZE; ++i) st.acc[i] += pj * __bfloat162float(vrow[lane + WARP_SIZE * i]);
    }
    st.m = m_new;
}

template <int D>
__device__ __forceinline__ void load_query(float* q_s, const __nv_bfloat16* __restrict__ qrow, int lane) {
    for (int d = lane; d < D; d += WARP_SIZE) q_s[d] = __bfloat162float(qrow[d]);
    __syncwarp();
}

// grid (ceil(max_new_tokens / PREFILL_WARPS), q_heads, batch), block PREFILL_WARPS * 32.
// cu_q[b]..cu_q[b+1] are sequence b's rows of q/out; slot_ptr[b]..slot_ptr[b+1] its context
// slots (cached prefix first, then its new tokens, whose K/V were scattered already).
template <int D>
__device__ void paged_prefill(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
    const __nv_bfloat16* __restrict__ v_pool, const uint32_t* __restrict__ slots,
    const int* __restrict__ slot_ptr, const int* __restrict__ cu_q, __nv_bfloat16* __restrict__ out,
    int q_heads, int kv_heads, float scale) {
    __shared__ float q_shared[PREFILL_WARPS][D];
    const int b = blockIdx.z, h = blockIdx.y;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int q0 = cu_q[b], nq = cu_q[b + 1] - q0;
    const int qi = blockIdx.x * PREFILL_WARPS + warp;
    if (qi >= nq) return;  // whole warp leaves; no block-wide barrier follows
    const int ctx0 = slot_ptr[b], ctx_len = slot_ptr[b + 1] - ctx0;
    const int last_visible = ctx_len - nq + qi;  // bottom-right causal alignment
    const int kvh = h / (q_heads / kv_heads);
    float* q_s = q_shared[warp];
    load_query<D>(q_s, q + ((size_t)(q0 + qi) * q_heads + h) * D, lane);
    SoftmaxState<D> st;
    state_init<D>(st);
    for (int kbase = 0; kbase <= last_visible; kbase += WARP_SIZE) {
        const int n = min(WARP_SIZE, last_visible + 1 - kbase);
        attend_tile<D>(st, q_s, slots + ctx0, kbase, n, k_pool, v_pool, kv_heads, kvh, scale, lane);
    }
    __nv_bfloat16* orow = out + ((size_t)(q0 + qi) * q_heads + h) * D;
    const float inv_l = 1.f / st.l;
#pragma unroll
    for (int i = 0; i < D / WARP_SIZE; ++i) orow[lane + WARP_SIZE * i] = __float2bfloat16(st.acc[i] * inv_l);
}

// grid (num_splits, q_heads, batch), block DECODE_WARPS * 32. One query row per sequence
// (q, out: [batch, q_heads, D]); split s covers context keys [s*chunk, min((s+1)*chunk, len)).
// Writes the split's unnormalised state: part_m/part_l [batch, q_heads, num_splits] and
// part_acc [batch, q_heads, num_splits, D].
template <int D>
__device__ void paged_decode(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
    const __nv_bfloat16* __restrict__ v_pool, const uint32_t* __restrict__ slots,
    const int* __restrict__ slot_ptr, float* __restrict__ part_m, float* __restrict__ part_l,
    float* __restrict__ part_acc, int q_heads, int kv_heads, int chunk, float scale) {
    __shared__ float q_s[D];
    __shared__ float warp_m[DECODE_WARPS], warp_l[DECODE_WARPS];
    __shared__ float warp_acc[DECODE_WARPS][D];
    const int b = blockIdx.z, h = blockIdx.y, split = blockIdx.x, num_splits = gridDim.x;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int ctx0 = slot_ptr[b], ctx_len = slot_ptr[b + 1] - ctx0;
    const int begin = split * chunk, end = min(ctx_len, begin + chunk);
    const int kvh = h / (q_heads / kv_heads);
    for (int d = threadIdx.x; d < D; d += blockDim.x) q_s[d] = __bfloat162float(q[((size_t)b * q_heads + h) * D + d]);
    __syncthreads();
    SoftmaxState<D> st;
    state_init<D>(st);
    for (int kbase = begin + warp * WARP_SIZE; kbase < end; kbase += DECODE_WARPS * WARP_SIZE) {
        attend_tile<D>(st, q_s, slots + ctx0, kbase, min(WARP_SIZE, end - kbase), k_pool, v_pool, kv_heads, kvh, scale, lane);
    }
    if (lane == 0) {
        warp_m[warp] = st.m;
        warp_l[warp] = st.l;
    }
#pragma unroll
    for (int i = 0; i < D / WARP_SIZE; ++i) warp_acc[warp][lane + WARP_SIZE * i] = st.acc[i];
    __syncthreads();
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m = fmaxf(m, warp_m[w]);
    const size_t row = ((size_t)b * q_heads + h) * num_splits + split;
    if (threadIdx.x == 0) {
        float l = 0.f;
        for (int w = 0; w < DECODE_WARPS; ++w) l += warp_m[w] == -INFINITY ? 0.f : warp_l[w] * __expf(warp_m[w] - m);
        part_m[row] = m;
        part_l[row] = l;
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < DECODE_WARPS; ++w) a += warp_m[w] == -INFINITY ? 0.f : warp_acc[w][d] * __expf(warp_m[w] - m);
        part_acc[row * D + d] = a;
    }
}

// grid (q_heads, batch), block D threads: merges the splits of one (sequence, head).
template <int D>
__device__ void decode_combine(
    const float* __restrict__ part_m, const float* __restrict__ part_l, const float* __restrict__ part_acc,
    __nv_bfloat16* __restrict__ out, int q_heads, int num_splits) {
    const int b = blockIdx.y, h = blockIdx.x, d = threadIdx.x;
    const size_t base = ((size_t)b * q_heads + h) * num_splits;
    float m = -INFINITY;
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, part_m[base + s]);
    float l = 0.f, a = 0.f;
    for (int s = 0; s < num_splits; ++s) {
        const float ms = part_m[base + s];
        if (ms == -INFINITY) continue;
        const float w = __expf(ms - m);
        l += part_l[base + s] * w;
        a += part_acc[(base + s) * D + d] * w;
    }
    out[((size_t)b * q_heads + h) * D + d] = __float2bfloat16(a / l);
}

#define STEPPPO_INSTANTIATE(D)                                                                              \
    extern "C" __global__ void stepppo_paged_prefill_bf16_d##D(                                            \
        const __nv_bfloat16* q, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,                 \
        const uint32_t* slots, const int* slot_ptr, const int* cu_q, __nv_bfloat16* out, int q_heads,     \
        int kv_heads, float scale) {                                                                       \
        paged_prefill<D>(q, k_pool, v_pool, slots, slot_ptr, cu_q, out, q_heads, kv_heads, scale);        \
    }                                                                                                      \
    extern "C" __global__ void stepppo_paged_decode_bf16_d##D(                                             \
        const __nv_bfloat16* q, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,                 \
        const uint32_t* slots, const int* slot_ptr, float* part_m, float* part_l, float* part_acc,        \
        int q_heads, int kv_heads, int chunk, float scale) {                                               \
        paged_decode<D>(q, k_pool, v_pool, slots, slot_ptr, part_m, part_l, part_acc, q_heads, kv_heads,  \
                        chunk, scale);                                                                     \
    }                                                                                                      \
    extern "C" __global__ void stepppo_decode_combine_bf16_d##D(                                           \
        const float* part_m, const float* part_l, const float* part_acc, __nv_bfloat16* out, int q_heads, \
        int num_splits) {                                                                                  \
        decode_combine<D>(part_m, part_l, part_acc, out, q_heads, num_splits);                             \
    }

STEPPPO_INSTANTIATE(32)
STEPPPO_INSTANTIATE(64)
STEPPPO_INSTANTIATE(128)
