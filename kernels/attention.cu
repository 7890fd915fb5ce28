// stepppo's own CUDA kernels over the radix KV pool.
//
// The pool holds, per layer, K and V rows laid out [num_slots, kv_heads, head_dim], in bf16 or
// f32 (every kernel is instantiated for both: `_bf16`, `_f32`). A sequence's context is a list
// of slot indices (its radix-tree path plus private slots), so every kernel here reads K/V
// *through* those indices: no phase gathers a context into a contiguous copy.
//
//   stepppo_kv_scatter_T            new K (or V) rows -> their pool slots
//   stepppo_paged_prefill_T_dD      new tokens attend to cached prefix + themselves
//                                   (causal, bottom-right aligned), GQA
//   stepppo_paged_decode_T_dD       one query per sequence and query head; one block per
//                                   (context split, KV head, sequence) serves the KV head's
//                                   whole query group, so each K/V row is read once
//                                   (flash-decoding); partial results per split
//   stepppo_decode_combine_T_dD     merges the splits' partial softmax states
//
// Numerics: inputs in T, f32 scores, f32 online-softmax state and f32 accumulators.
// Scores: lane j of a warp scores key j of a 32-key tile, reading its K row with 16-byte loads
// (against every query head of the group, in decode). The tile's softmax is merged into the
// running state, then each lane accumulates its head_dim/32 consecutive output dimensions over
// the tile's V rows (one vector load a lane and row, coalesced across the warp).

#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu
#define WARP_SIZE 32
#define DECODE_WARPS 4
#define PREFILL_WARPS 4
// Query heads one decode block serves (a KV head's group; larger groups take several blocks).
#define MAX_GROUP 8

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

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

__device__ __forceinline__ void unpack(uint32_t word, float* out) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
    out[0] = f.x;
    out[1] = f.y;
}

// N consecutive bf16 values (N * 2 bytes, aligned to it) as floats, in the widest loads.
template <int N>
__device__ __forceinline__ void load_vals(const __nv_bfloat16* __restrict__ p, float* out) {
    if constexpr (N % 8 == 0) {
#pragma unroll
        for (int c = 0; c < N / 8; ++c) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + c);
            unpack(raw.x, out + 8 * c);
            unpack(raw.y, out + 8 * c + 2);
            unpack(raw.z, out + 8 * c + 4);
            unpack(raw.w, out + 8 * c + 6);
        }
    } else if constexpr (N == 4) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
        unpack(raw.x, out);
        unpack(raw.y, out + 2);
    } else if constexpr (N == 2) {
        unpack(__ldg(reinterpret_cast<const unsigned int*>(p)), out);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = __bfloat162float(p[i]);
    }
}

// N consecutive f32 values (aligned to their size) as floats, in the widest loads.
template <int N>
__device__ __forceinline__ void load_vals(const float* __restrict__ p, float* out) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(p) + c);
            out[4 * c] = v.x;
            out[4 * c + 1] = v.y;
            out[4 * c + 2] = v.z;
            out[4 * c + 3] = v.w;
        }
    } else if constexpr (N == 2) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(p));
        out[0] = v.x;
        out[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = __ldg(p + i);
    }
}

template <typename T>
__device__ void kv_scatter(const T* __restrict__ rows, const uint32_t* __restrict__ slots, T* __restrict__ pool,
                           int n_tokens, int row_elems) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const size_t dst = (size_t)slots[t] * row_elems;
    const size_t src = (size_t)t * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) pool[dst + i] = rows[src + i];
}

// ---------------------------------------------------------------------------------------------
// Prefill: one warp per (new token, query head).

// Running online-softmax state of one warp for one query row.
template <int D>
struct SoftmaxState {
    float m;                   // running max of scaled scores (same on every lane)
    float l;                   // running sum of exp(score - m) (same on every lane)
    float acc[D / WARP_SIZE];  // lane's output dims lane*(D/32) .. +D/32, scaled by exp(-m)
};

template <int D>
__device__ __forceinline__ void state_init(SoftmaxState<D>& st) {
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < D / WARP_SIZE; ++i) st.acc[i] = 0.f;
}

// Dot product of a query row (f32, shared memory) with one K row.
template <typename T, int D>
__device__ __forceinline__ float dot_row(const float* __restrict__ q, const T* __restrict__ krow) {
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        float k[8];
        load_vals<8>(krow + 8 * c, k);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += q[8 * c + e] * k[e];
    }
    return dot;
}

// Merges a tile of n (<= 32) keys at context indices [kbase, kbase + n) into the state.
template <typename T, int D>
__device__ __forceinline__ void attend_tile(SoftmaxState<D>& st, const float* __restrict__ q_s,
                                            const uint32_t* __restrict__ ctx_slots, int kbase, int n,
                                            const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                                            int kv_heads, int kvh, float scale, int lane) {
    constexpr int VPL = D / WARP_SIZE;
    uint32_t slot = 0;
    float s = -INFINITY;
    if (lane < n) {
        slot = ctx_slots[kbase + lane];
        s = dot_row<T, D>(q_s, k_pool + ((size_t)slot * kv_heads + kvh) * D) * scale;
    }
    const float m_new = fmaxf(st.m, warp_max(s));
    const float p = lane < n ? __expf(s - m_new) : 0.f;
    const float corr = __expf(st.m - m_new);
    st.l = st.l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < VPL; ++i) st.acc[i] *= corr;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
        const float pj = __shfl_sync(FULL_MASK, p, j);
        const uint32_t sj = __shfl_sync(FULL_MASK, slot, j);
        float v[VPL];
        load_vals<VPL>(v_pool + ((size_t)sj * kv_heads + kvh) * D + lane * VPL, v);
#pragma unroll
        for (int i = 0; i < VPL; ++i) st.acc[i] += pj * v[i];
    }
    st.m = m_new;
}

// grid (ceil(max_new_tokens / PREFILL_WARPS), q_heads, batch), block PREFILL_WARPS * 32.
// cu_q[b]..cu_q[b+1] are sequence b's rows of q/out; slot_ptr[b]..slot_ptr[b+1] its context
// slots (cached prefix first, then its new tokens, whose K/V were scattered already).
template <typename T, int D>
__device__ void paged_prefill(const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                              const uint32_t* __restrict__ slots, const int* __restrict__ slot_ptr,
                              const int* __restrict__ cu_q, T* __restrict__ out, int q_heads, int kv_heads,
                              float scale) {
    constexpr int VPL = D / WARP_SIZE;
    __shared__ __align__(16) float q_shared[PREFILL_WARPS][D];
    const int b = blockIdx.z, h = blockIdx.y;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int q0 = cu_q[b], nq = cu_q[b + 1] - q0;
    const int qi = blockIdx.x * PREFILL_WARPS + warp;
    if (qi >= nq) return;  // whole warp leaves; no block-wide barrier follows
    const int ctx0 = slot_ptr[b], ctx_len = slot_ptr[b + 1] - ctx0;
    const int last_visible = ctx_len - nq + qi;  // bottom-right causal alignment
    const int kvh = h / (q_heads / kv_heads);
    float* q_s = q_shared[warp];
    const T* qrow = q + ((size_t)(q0 + qi) * q_heads + h) * D;
    for (int d = lane; d < D; d += WARP_SIZE) q_s[d] = to_float(qrow[d]);
    __syncwarp();
    SoftmaxState<D> st;
    state_init<D>(st);
    for (int kbase = 0; kbase <= last_visible; kbase += WARP_SIZE) {
        const int n = min(WARP_SIZE, last_visible + 1 - kbase);
        attend_tile<T, D>(st, q_s, slots + ctx0, kbase, n, k_pool, v_pool, kv_heads, kvh, scale, lane);
    }
    T* orow = out + ((size_t)(q0 + qi) * q_heads + h) * D;
    const float inv_l = 1.f / st.l;
#pragma unroll
    for (int i = 0; i < VPL; ++i) orow[lane * VPL + i] = from_float<T>(st.acc[i] * inv_l);
}

// ---------------------------------------------------------------------------------------------
// Decode: one block per (context split, KV head and a group of up to MAX_GROUP of its query
// heads, sequence); each warp walks 32-key tiles of the split and reads every K and V row once
// for all the group's query heads.

// grid (num_splits, kv_heads * ceil(group / MAX_GROUP), batch), block DECODE_WARPS * 32, where
// group = q_heads / kv_heads. One query row per sequence (q, out: [batch, q_heads, D]); split s
// covers context keys [s*chunk, min((s+1)*chunk, len)). Writes the split's unnormalised state:
// part_m/part_l [batch, q_heads, num_splits] and part_acc [batch, q_heads, num_splits, D].
template <typename T, int D>
__device__ void paged_decode(const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                             const uint32_t* __restrict__ slots, const int* __restrict__ slot_ptr,
                             float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                             int q_heads, int kv_heads, int chunk, float scale) {
    constexpr int VPL = D / WARP_SIZE;
    __shared__ __align__(16) float q_s[MAX_GROUP][D];
    __shared__ float warp_m[DECODE_WARPS][MAX_GROUP], warp_l[DECODE_WARPS][MAX_GROUP];
    __shared__ __align__(16) float warp_acc[DECODE_WARPS][MAX_GROUP][D];
    const int b = blockIdx.z, split = blockIdx.x, num_splits = gridDim.x;
    const int group = q_heads / kv_heads;
    const int blocks_per_kv = (group + MAX_GROUP - 1) / MAX_GROUP;
    const int kvh = blockIdx.y / blocks_per_kv;
    const int g0 = (blockIdx.y % blocks_per_kv) * MAX_GROUP;
    const int g_count = min(MAX_GROUP, group - g0);
    const int h0 = kvh * group + g0;  // first query head served
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int ctx0 = slot_ptr[b], ctx_len = slot_ptr[b + 1] - ctx0;
    const int begin = split * chunk, end = min(ctx_len, begin + chunk);
    // The queries, pre-scaled: a score is then a plain dot product.
    for (int i = threadIdx.x; i < g_count * D; i += blockDim.x) {
        q_s[i / D][i % D] = to_float(q[((size_t)b * q_heads + h0) * D + i]) * scale;
    }
    __syncthreads();

    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][VPL];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < VPL; ++i) acc[g][i] = 0.f;
    }
    for (int kbase = begin + warp * WARP_SIZE; kbase < end; kbase += DECODE_WARPS * WARP_SIZE) {
        const int n = min(WARP_SIZE, end - kbase);
        // Scores of this lane's key against every query head of the group.
        float s[MAX_GROUP];
        uint32_t slot = 0;
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) s[g] = lane < n ? 0.f : -INFINITY;
        if (lane < n) {
            slot = slots[ctx0 + kbase + lane];
            const T* krow = k_pool + ((size_t)slot * kv_heads + kvh) * D;
#pragma unroll
            for (int c = 0; c < D / 8; ++c) {
                float k[8];
                load_vals<8>(krow + 8 * c, k);
#pragma unroll
                for (int g = 0; g < MAX_GROUP; ++g) {
                    if (g < g_count) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) s[g] += q_s[g][8 * c + e] * k[e];
                    }
                }
            }
        }
        // Merge the tile into each head's running state (g_count is uniform across the warp).
        float p[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            p[g] = 0.f;
            if (g < g_count) {
                const float m_new = fmaxf(m[g], warp_max(s[g]));
                p[g] = lane < n ? __expf(s[g] - m_new) : 0.f;
                const float corr = __expf(m[g] - m_new);
                l[g] = l[g] * corr + warp_sum(p[g]);
#pragma unroll
                for (int i = 0; i < VPL; ++i) acc[g][i] *= corr;
                m[g] = m_new;
            }
        }
        // V rows: each read once, by the whole warp, for every head of the group.
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
            const uint32_t sj = __shfl_sync(FULL_MASK, slot, j);
            float v[VPL];
            load_vals<VPL>(v_pool + ((size_t)sj * kv_heads + kvh) * D + lane * VPL, v);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g < g_count) {
                    const float pj = __shfl_sync(FULL_MASK, p[g], j);
#pragma unroll
                    for (int i = 0; i < VPL; ++i) acc[g][i] += pj * v[i];
                }
            }
        }
    }

    // Merge the warps' states, then write the split's state of every head served.
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g < g_count) {
            if (lane == 0) {
                warp_m[warp][g] = m[g];
                warp_l[warp][g] = l[g];
            }
#pragma unroll
            for (int i = 0; i < VPL; ++i) warp_acc[warp][g][lane * VPL + i] = acc[g][i];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < g_count * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) mx = fmaxf(mx, warp_m[w][g]);
        float a = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            if (warp_m[w][g] == -INFINITY) continue;
            const float wgt = __expf(warp_m[w][g] - mx);
            a += warp_acc[w][g][d] * wgt;
            sum += warp_l[w][g] * wgt;
        }
        const size_t row = ((size_t)b * q_heads + h0 + g) * num_splits + split;
        part_acc[row * D + d] = a;
        if (d == 0) {
            part_m[row] = mx;
            part_l[row] = sum;
        }
    }
}

// grid (q_heads, batch), block D threads: merges the splits of one (sequence, head).
template <typename T, int D>
__device__ void decode_combine(const float* __restrict__ part_m, const float* __restrict__ part_l,
                               const float* __restrict__ part_acc, T* __restrict__ out, int q_heads,
                               int num_splits) {
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
    out[((size_t)b * q_heads + h) * D + d] = from_float<T>(a / l);
}

#define STEPPPO_INSTANTIATE(T, NAME, D)                                                                        \
    extern "C" __global__ void stepppo_paged_prefill_##NAME##_d##D(                                            \
        const T* q, const T* k_pool, const T* v_pool, const uint32_t* slots, const int* slot_ptr,              \
        const int* cu_q, T* out, int q_heads, int kv_heads, float scale) {                                     \
        paged_prefill<T, D>(q, k_pool, v_pool, slots, slot_ptr, cu_q, out, q_heads, kv_heads, scale);          \
    }                                                                                                          \
    extern "C" __global__ void stepppo_paged_decode_##NAME##_d##D(                                             \
        const T* q, const T* k_pool, const T* v_pool, const uint32_t* slots, const int* slot_ptr,              \
        float* part_m, float* part_l, float* part_acc, int q_heads, int kv_heads, int chunk, float scale) {    \
        paged_decode<T, D>(q, k_pool, v_pool, slots, slot_ptr, part_m, part_l, part_acc, q_heads, kv_heads,    \
                           chunk, scale);                                                                      \
    }                                                                                                          \
    extern "C" __global__ void stepppo_decode_combine_##NAME##_d##D(                                           \
        const float* part_m, const float* part_l, const float* part_acc, T* out, int q_heads, int num_splits) { \
        decode_combine<T, D>(part_m, part_l, part_acc, out, q_heads, num_splits);                              \
    }

#define STEPPPO_INSTANTIATE_DTYPE(T, NAME)                                                              \
    extern "C" __global__ void stepppo_kv_scatter_##NAME(const T* rows, const uint32_t* slots, T* pool, \
                                                        int n_tokens, int row_elems) {                  \
        kv_scatter<T>(rows, slots, pool, n_tokens, row_elems);                                          \
    }                                                                                                   \
    STEPPPO_INSTANTIATE(T, NAME, 32)                                                                    \
    STEPPPO_INSTANTIATE(T, NAME, 64)                                                                    \
    STEPPPO_INSTANTIATE(T, NAME, 128)

STEPPPO_INSTANTIATE_DTYPE(__nv_bfloat16, bf16)
STEPPPO_INSTANTIATE_DTYPE(float, f32)
