//! The CUDA side of the KV pool (feature `cuda`): K/V storage on the device (bf16 or f32) and
//! the launches of our own kernels (`kernels/attention.cu`, compiled to PTX by `build.rs`,
//! instantiated for both dtypes): scattering new K/V rows into their slots, and attention that
//! reads K/V *through each sequence's slot list* — a prefill kernel (new tokens over cached
//! prefix + themselves, bottom-right causal) and a split-context decode kernel (flash-decoding,
//! one block per KV head serving its whole query group, so each K/V row is read once) with its
//! combine step. No phase gathers a context into a contiguous copy.
//!
//! Slot tables travel to the device once per call (one `u32` per context position); the
//! kernels run on candle's stream, so they order with the surrounding tensor ops. A pool set to
//! [`PrefillAttention::Flash`] runs its prefill calls through `super::flash` instead.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{CpuStorage, CustomOp3, DType, InplaceOp3, Layout, Shape, Tensor};
use half::bf16;
use std::sync::OnceLock;

use super::{PrefillAttention, SeqSlots};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const MODULE: &str = "stepppo_attention";
const WARP: u32 = 32;
const PREFILL_WARPS: u32 = 4;
const DECODE_WARPS: u32 = 4;
/// Query heads one decode block serves (`MAX_GROUP` in the kernel).
const DECODE_MAX_GROUP: usize = 8;
/// Keys per decode split: enough work per block to amortise the combine step.
const DECODE_MIN_CHUNK: usize = 256;
/// Decode blocks aimed for per streaming multiprocessor (a few waves).
const DECODE_BLOCKS_PER_SM: usize = 4;

/// Head dimensions the kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The pool dtypes the kernels are instantiated for.
pub const SUPPORTED_DTYPES: [DType; 2] = [DType::BF16, DType::F32];

/// An element type the kernels are instantiated for, and its suffix in their names.
trait KernelDtype: CudaDType + DeviceRepr {
    const SUFFIX: &'static str;
}

impl KernelDtype for bf16 {
    const SUFFIX: &'static str = "bf16";
}

impl KernelDtype for f32 {
    const SUFFIX: &'static str = "f32";
}

/// Streaming multiprocessors of `dev` (132 on an H100 SXM or H200, 114 on a PCIe H100).
fn multiprocessors(dev: &CudaDevice) -> candle_core::Result<usize> {
    let count = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(count.max(1) as usize)
}

/// Writes `rows` (`[n, kv_heads, head_dim]`, the pool's dtype) into `pool`
/// (`[slots, kv_heads, head_dim]`) at `slots` (`[n]`, u32, on the device), in place.
pub fn scatter_rows(pool: &Tensor, rows: &Tensor, slots: &Tensor) -> candle_core::Result<()> {
    if rows.dtype() != pool.dtype() {
        candle_core::bail!(
            "kv scatter: rows are {:?}, the pool stores {:?}",
            rows.dtype(),
            pool.dtype()
        );
    }
    pool.inplace_op3(&rows.contiguous()?, &slots.contiguous()?, &ScatterRows)
}

struct ScatterRows;

impl ScatterRows {
    fn launch<T: KernelDtype>(
        pool: &mut CudaStorage,
        pool_l: &Layout,
        rows: &CudaStorage,
        rows_l: &Layout,
        slots: &CudaStorage,
        slots_l: &Layout,
    ) -> candle_core::Result<()> {
        let dev = pool.device().clone();
        let (n, row_elems) = rows_l.shape().dims3().map(|(n, h, d)| (n, h * d))?;
        let func =
            dev.get_or_load_custom_func(&format!("stepppo_kv_scatter_{}", T::SUFFIX), MODULE, PTX)?;
        let rows = rows.as_cuda_slice::<T>()?.slice(rows_l.start_offset()..);
        let slots = slots
            .as_cuda_slice::<u32>()?
            .slice(slots_l.start_offset()..);
        let pool = pool.as_cuda_slice_mut::<T>()?;
        let mut pool = pool.slice_mut(pool_l.start_offset()..);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (row_elems.clamp(32, 256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, row_elems) = (n as i32, row_elems as i32);
        let mut b = func.builder();
        b.arg(&rows)
            .arg(&slots)
            .arg(&mut pool)
            .arg(&n)
            .arg(&row_elems);
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

impl InplaceOp3 for ScatterRows {
    fn name(&self) -> &'static str {
        "stepppo-kv-scatter"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!(
            "stepppo-kv-scatter runs on CUDA only; the CPU pool writes rows directly"
        )
    }

    fn cuda_fwd(
        &self,
        pool: &mut CudaStorage,
        pool_l: &Layout,
        rows: &CudaStorage,
        rows_l: &Layout,
        slots: &CudaStorage,
        slots_l: &Layout,
    ) -> candle_core::Result<()> {
        match pool.dtype() {
            DType::BF16 => Self::launch::<bf16>(pool, pool_l, rows, rows_l, slots, slots_l),
            DType::F32 => Self::launch::<f32>(pool, pool_l, rows, rows_l, slots, slots_l),
            other => candle_core::bail!("kv scatter: a {other:?} pool (kernels take bf16 or f32)"),
        }
    }
}

/// The attention kernel of one incremental forward over a CUDA pool: decode (every sequence
/// brings one token) always runs ours; prefill runs the pool's [`PrefillAttention`].
pub enum DeviceAttention {
    /// Our kernel over every sequence's slot list (decode, and prefill with `paged`).
    Paged(Box<PagedAttention>),
    /// candle-flash-attn over the gathered context rows (prefill with `flash`).
    #[cfg(feature = "flash-attn")]
    Flash(super::flash::FlashPrefill),
}

impl DeviceAttention {
    /// The kernel for `seqs`: ours whenever every sequence brings one token (decode) or the
    /// prefill kernel is `paged`, flash-attention's prefill otherwise; slot tables uploaded once.
    #[cfg_attr(not(feature = "flash-attn"), allow(unused_variables))]
    pub fn new(
        seqs: &[SeqSlots],
        scale: f32,
        prefill: PrefillAttention,
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        #[cfg(feature = "flash-attn")]
        if prefill == PrefillAttention::Flash && seqs.iter().any(|s| s.num_new != 1) {
            return Ok(Self::Flash(super::flash::FlashPrefill::new(
                seqs, scale, device,
            )?));
        }
        Ok(Self::Paged(Box::new(PagedAttention::new(seqs, scale))))
    }

    /// Causal attention of every sequence's new tokens over its slots (see
    /// [`PagedAttention::apply`]).
    pub fn apply(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
    ) -> candle_core::Result<Tensor> {
        match self {
            Self::Paged(op) => op.apply(q, k_pool, v_pool),
            #[cfg(feature = "flash-attn")]
            Self::Flash(op) => op.apply(q, k_pool, v_pool),
        }
    }
}

/// One incremental forward's attention over the pool: the concatenated slot lists and offsets
/// of its sequences, uploaded to the device on first use and reused by every layer.
pub struct PagedAttention {
    slots: Vec<u32>,
    /// `slot_ptr[b]..slot_ptr[b+1]` are sequence b's context slots.
    slot_ptr: Vec<i32>,
    /// `cu_q[b]..cu_q[b+1]` are sequence b's rows of `q`.
    cu_q: Vec<i32>,
    max_new: usize,
    max_ctx: usize,
    scale: f32,
    device_tables: OnceLock<DeviceTables>,
}

/// Device copies of a plan's slot tables.
struct DeviceTables {
    slots: DeviceSlice<u32>,
    slot_ptr: DeviceSlice<i32>,
    cu_q: DeviceSlice<i32>,
}

impl PagedAttention {
    /// Builds the per-call slot tables of `seqs` (uploaded on first use) for softmax scale `scale`.
    pub fn new(seqs: &[SeqSlots], scale: f32) -> Self {
        let mut slot_ptr = vec![0i32];
        let mut cu_q = vec![0i32];
        let mut slots = Vec::new();
        for s in seqs {
            slots.extend_from_slice(s.slots);
            slot_ptr.push(slots.len() as i32);
            cu_q.push(cu_q.last().copied().unwrap_or(0) + s.num_new as i32);
        }
        Self {
            slots,
            slot_ptr,
            cu_q,
            max_new: seqs.iter().map(|s| s.num_new).max().unwrap_or(0),
            max_ctx: seqs.iter().map(|s| s.slots.len()).max().unwrap_or(0),
            scale,
            device_tables: OnceLock::new(),
        }
    }

    /// Causal attention of every sequence's new tokens over its slots: `q` is
    /// `[n_new, q_heads, head_dim]` (sequences in batch order), pools are
    /// `[slots, kv_heads, head_dim]`, all three bf16 or all f32. Returns
    /// `[n_new, q_heads, head_dim]` in their dtype.
    pub fn apply(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
    ) -> candle_core::Result<Tensor> {
        q.contiguous()?.apply_op3_no_bwd(k_pool, v_pool, self)
    }

    fn tables(&self, dev: &CudaDevice) -> candle_core::Result<&DeviceTables> {
        if let Some(t) = self.device_tables.get() {
            return Ok(t);
        }
        let tables = DeviceTables {
            slots: dev.clone_htod(&self.slots)?,
            slot_ptr: dev.clone_htod(&self.slot_ptr)?,
            cu_q: dev.clone_htod(&self.cu_q)?,
        };
        Ok(self.device_tables.get_or_init(|| tables))
    }

    fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    /// Decode when every sequence brings exactly one new token.
    fn is_decode(&self) -> bool {
        self.max_new == 1 && self.cu_q.last().copied() == Some(self.batch() as i32)
    }

    /// Context splits of the decode grid: enough blocks (`head_blocks` per sequence and split)
    /// for a few waves of the device's multiprocessors, each split at least
    /// `DECODE_MIN_CHUNK` keys.
    fn decode_splits(&self, head_blocks: usize, multiprocessors: usize) -> usize {
        let by_length = self.max_ctx.div_ceil(DECODE_MIN_CHUNK).max(1);
        let target = DECODE_BLOCKS_PER_SM * multiprocessors;
        let by_occupancy = target.div_ceil(self.batch() * head_blocks).max(1);
        by_length.min(by_occupancy)
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "stepppo-paged-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "stepppo-paged-attention runs on CUDA only; the CPU pool has its own kernel"
        )
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (_, q_heads, head_dim) = q_l.shape().dims3()?;
        let (_, kv_heads, _) = k_l.shape().dims3()?;
        if !SUPPORTED_HEAD_DIMS.contains(&head_dim) || q_heads % kv_heads != 0 {
            candle_core::bail!(
                "paged attention: head_dim {head_dim} (supported {SUPPORTED_HEAD_DIMS:?}), {q_heads} query heads over {kv_heads} kv heads"
            );
        }
        let dtype = k.dtype();
        for (dt, what) in [(q.dtype(), "q"), (v.dtype(), "v pool")] {
            if dt != dtype {
                candle_core::bail!("paged attention: {what} is {dt:?}, the k pool {dtype:?}");
            }
        }
        let inputs = (q, q_l, k, k_l, v, v_l);
        match dtype {
            DType::BF16 => self.run::<bf16>(inputs, q_heads, kv_heads, head_dim),
            DType::F32 => self.run::<f32>(inputs, q_heads, kv_heads, head_dim),
            other => candle_core::bail!(
                "paged attention: {other:?} inputs (kernels take {SUPPORTED_DTYPES:?})"
            ),
        }
    }
}

type DeviceView<'a, T> = candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>;
type DeviceSlice<T> = candle_core::cuda_backend::cudarc::driver::CudaSlice<T>;
type OpInputs<'a> = (
    &'a CudaStorage,
    &'a Layout,
    &'a CudaStorage,
    &'a Layout,
    &'a CudaStorage,
    &'a Layout,
);

struct Tensors<'a, T> {
    q: DeviceView<'a, T>,
    k: DeviceView<'a, T>,
    v: DeviceView<'a, T>,
}

impl PagedAttention {
    fn run<T: KernelDtype>(
        &self,
        (q, q_l, k, k_l, v, v_l): OpInputs,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = q.device().clone();
        let tensors = Tensors {
            q: q.as_cuda_slice::<T>()?.slice(q_l.start_offset()..),
            k: k.as_cuda_slice::<T>()?.slice(k_l.start_offset()..),
            v: v.as_cuda_slice::<T>()?.slice(v_l.start_offset()..),
        };
        let shape = q_l.shape().clone();
        let out = if self.is_decode() {
            self.launch_decode(&dev, &tensors, q_heads, kv_heads, head_dim)?
        } else {
            self.launch_prefill(&dev, &tensors, q_heads, kv_heads, head_dim)?
        };
        Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
    }

    fn launch_prefill<T: KernelDtype>(
        &self,
        dev: &CudaDevice,
        t: &Tensors<T>,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> candle_core::Result<DeviceSlice<T>> {
        let n = *self.cu_q.last().unwrap_or(&0) as usize;
        let func = dev.get_or_load_custom_func(
            &format!("stepppo_paged_prefill_{}_d{head_dim}", T::SUFFIX),
            MODULE,
            PTX,
        )?;
        let tables = self.tables(dev)?;
        let mut out = unsafe { dev.alloc::<T>(n * q_heads * head_dim)? };
        let cfg = LaunchConfig {
            grid_dim: (
                (self.max_new as u32).div_ceil(PREFILL_WARPS).max(1),
                q_heads as u32,
                self.batch() as u32,
            ),
            block_dim: (PREFILL_WARPS * WARP, 1, 1),
            shared_mem_bytes: 0,
        };
        let (qh, kvh, scale) = (q_heads as i32, kv_heads as i32, self.scale);
        let mut b = func.builder();
        b.arg(&t.q)
            .arg(&t.k)
            .arg(&t.v)
            .arg(&tables.slots)
            .arg(&tables.slot_ptr)
            .arg(&tables.cu_q);
        b.arg(&mut out).arg(&qh).arg(&kvh).arg(&scale);
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }

    /// One block per (split, KV head × group part, sequence): `ceil(group / 8)` blocks per KV
    /// head, each reading the head's K/V rows once for up to 8 query heads.
    fn launch_decode<T: KernelDtype>(
        &self,
        dev: &CudaDevice,
        t: &Tensors<T>,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> candle_core::Result<DeviceSlice<T>> {
        let batch = self.batch();
        let head_blocks = kv_heads * (q_heads / kv_heads).div_ceil(DECODE_MAX_GROUP);
        let splits = self.decode_splits(head_blocks, multiprocessors(dev)?);
        let chunk = self.max_ctx.div_ceil(splits).max(1);
        let decode = dev.get_or_load_custom_func(
            &format!("stepppo_paged_decode_{}_d{head_dim}", T::SUFFIX),
            MODULE,
            PTX,
        )?;
        let combine = dev.get_or_load_custom_func(
            &format!("stepppo_decode_combine_{}_d{head_dim}", T::SUFFIX),
            MODULE,
            PTX,
        )?;
        let tables = self.tables(dev)?;
        let rows = batch * q_heads * splits;
        let mut part_m = unsafe { dev.alloc::<f32>(rows)? };
        let mut part_l = unsafe { dev.alloc::<f32>(rows)? };
        let mut part_acc = unsafe { dev.alloc::<f32>(rows * head_dim)? };
        let mut out = unsafe { dev.alloc::<T>(batch * q_heads * head_dim)? };
        let (qh, kvh, chunk_i, splits_i, scale) = (
            q_heads as i32,
            kv_heads as i32,
            chunk as i32,
            splits as i32,
            self.scale,
        );
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, head_blocks as u32, batch as u32),
            block_dim: (DECODE_WARPS * WARP, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = decode.builder();
        b.arg(&t.q)
            .arg(&t.k)
            .arg(&t.v)
            .arg(&tables.slots)
            .arg(&tables.slot_ptr);
        b.arg(&mut part_m)
            .arg(&mut part_l)
            .arg(&mut part_acc)
            .arg(&qh)
            .arg(&kvh)
            .arg(&chunk_i)
            .arg(&scale);
        unsafe { b.launch(cfg) }.w()?;
        let cfg = LaunchConfig {
            grid_dim: (q_heads as u32, batch as u32, 1),
            block_dim: (head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = combine.builder();
        b.arg(&part_m)
            .arg(&part_l)
            .arg(&part_acc)
            .arg(&mut out)
            .arg(&qh)
            .arg(&splits_i);
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
}
