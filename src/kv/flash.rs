//! Prefill attention through candle-flash-attn (feature `flash-attn`), the alternative to our
//! paged prefill kernel that `cache.prefill_attention: flash` selects: the context K/V rows of
//! every sequence are gathered from the pool by slot into contiguous tensors, then
//! flash-attention v2's variable-length kernel attends each sequence's new tokens over them
//! (bottom-right causal, so new tokens see the cached prefix and the new tokens before them;
//! grouped-query heads read their shared K/V head). bf16 pools only; decode stays on our kernel.

use candle_core::{Device, Tensor};

use super::SeqSlots;

/// One incremental forward's flash prefill: the sequences' context slots and cumulative
/// lengths on the device, built once per call and reused by every layer.
pub struct FlashPrefill {
    /// Every sequence's context slots, concatenated in batch order (`u32`).
    context_slots: Tensor,
    /// `[0, n_1, n_1 + n_2, …]`: each sequence's new tokens, cumulative (`u32`).
    cu_new: Tensor,
    /// `[0, c_1, c_1 + c_2, …]`: each sequence's whole context, cumulative (`u32`).
    cu_context: Tensor,
    max_new: usize,
    max_context: usize,
    scale: f32,
}

impl FlashPrefill {
    /// Uploads the slot lists and cumulative lengths of `seqs` to `device` for softmax scale `scale`.
    pub fn new(seqs: &[SeqSlots], scale: f32, device: &Device) -> candle_core::Result<Self> {
        let mut slots = Vec::new();
        let (mut cu_new, mut cu_context) = (vec![0u32], vec![0u32]);
        for s in seqs {
            slots.extend_from_slice(s.slots);
            cu_new.push(cu_new[cu_new.len() - 1] + s.num_new as u32);
            cu_context.push(slots.len() as u32);
        }
        Ok(Self {
            context_slots: Tensor::new(slots.as_slice(), device)?,
            cu_new: Tensor::new(cu_new.as_slice(), device)?,
            cu_context: Tensor::new(cu_context.as_slice(), device)?,
            max_new: seqs.iter().map(|s| s.num_new).max().unwrap_or(0),
            max_context: seqs.iter().map(|s| s.slots.len()).max().unwrap_or(0),
            scale,
        })
    }

    /// Causal attention of every sequence's new tokens over its slots: `q` is
    /// `[n_new, q_heads, head_dim]`, pools `[slots, kv_heads, head_dim]`, all bf16 (the pool
    /// refuses this kernel on other storage; candle-flash-attn refuses other inputs).
    pub fn apply(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let k = k_pool.index_select(&self.context_slots, 0)?;
        let v = v_pool.index_select(&self.context_slots, 0)?;
        candle_flash_attn::flash_attn_varlen(
            &q.contiguous()?,
            &k,
            &v,
            &self.cu_new,
            &self.cu_context,
            self.max_new,
            self.max_context,
            self.scale,
            true,
        )
    }
}
