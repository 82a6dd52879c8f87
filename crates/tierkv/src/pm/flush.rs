//! Cache-line write-back instructions, chosen once from CPUID; and the read-side hint,
//! [`prefetch`], that iterators use to overlap the misses of values scattered in PM.
//!
//! `persist` = write back every 64-byte line of a range with the best instruction the CPU
//! has (CLWB, else CLFLUSHOPT, else CLFLUSH), then SFENCE. On other architectures the
//! region falls back to a sequentially-consistent fence; durability there rests on the
//! page cache (process crash) or `pm_sync` (msync).

use std::sync::OnceLock;

/// Size of a cache line, the unit of persistence.
pub const LINE: u64 = 64;

/// The instruction used to write back a cache line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushInstr {
    /// CLWB: write back, keep the line cached.
    Clwb,
    /// CLFLUSHOPT: write back and evict, weakly ordered.
    ClflushOpt,
    /// CLFLUSH: write back and evict, strongly ordered (no SFENCE needed, one is issued anyway).
    Clflush,
    /// No cache-line flush instruction (non-x86): only a memory fence.
    Fence,
}

impl FlushInstr {
    /// The instruction this CPU supports best, detected once.
    pub fn detect() -> FlushInstr {
        static DETECTED: OnceLock<FlushInstr> = OnceLock::new();
        *DETECTED.get_or_init(detect_uncached)
    }

    /// Lower-case name, for stats and logs.
    pub fn name(self) -> &'static str {
        match self {
            FlushInstr::Clwb => "clwb",
            FlushInstr::ClflushOpt => "clflushopt",
            FlushInstr::Clflush => "clflush",
            FlushInstr::Fence => "fence",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_uncached() -> FlushInstr {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID is available on every x86_64 CPU (safe intrinsics); leaf 0 reports the highest
    // leaf, and leaf 7 is queried only when it exists.
    let max = __cpuid(0).eax;
    let leaf1 = __cpuid(1);
    let leaf7 = if max >= 7 { Some(__cpuid_count(7, 0)) } else { None };
    if let Some(l7) = leaf7 {
        if l7.ebx & (1 << 24) != 0 {
            return FlushInstr::Clwb;
        }
        if l7.ebx & (1 << 23) != 0 {
            return FlushInstr::ClflushOpt;
        }
    }
    if leaf1.edx & (1 << 19) != 0 {
        return FlushInstr::Clflush;
    }
    FlushInstr::Fence
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_uncached() -> FlushInstr {
    FlushInstr::Fence
}

/// Write back the cache line holding `p` with `instr` (no fence).
///
/// # Safety
/// `p` must point into memory mapped in this process (any byte of the line).
#[inline(always)]
pub unsafe fn flush_line(instr: FlushInstr, p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees `p` is mapped; these instructions only write back or
    // evict the line and never fault on a mapped address. They are emitted only when CPUID
    // reported them (see `detect`). Encodings are given as bytes so no assembler feature
    // flag is needed: CLWB = 66 0F AE /6, CLFLUSHOPT = 66 0F AE /7, both with [rax].
    unsafe {
        match instr {
            FlushInstr::Clwb => {
                std::arch::asm!(".byte 0x66, 0x0f, 0xae, 0x30", in("rax") p, options(nostack, preserves_flags))
            }
            FlushInstr::ClflushOpt => {
                std::arch::asm!(".byte 0x66, 0x0f, 0xae, 0x38", in("rax") p, options(nostack, preserves_flags))
            }
            FlushInstr::Clflush => std::arch::x86_64::_mm_clflush(p),
            FlushInstr::Fence => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (instr, p);
    }
}

/// Order all earlier write-backs and stores before later stores (SFENCE).
#[inline(always)]
pub fn sfence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SFENCE has no memory operands and no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Ask the CPU to start loading `bytes` into its caches (a hint: nothing is read).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    prefetch_range(bytes.as_ptr(), bytes.len());
}

/// Ask the CPU to start loading every cache line of `[start, start+len)` (a hint: no byte
/// is read and no reference to them is formed, so they may be bytes other threads write).
#[inline]
pub(crate) fn prefetch_range(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut off = 0;
        while off < len {
            // SAFETY: SSE is part of the x86-64 baseline, and a prefetch is only a hint: it
            // reads nothing observable and never faults, whatever the address (the pointer
            // arithmetic wraps instead of assuming bounds).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(off).cast()) };
            off += 64;
        }
        if len > 0 {
            // The last line, when `start` is not line-aligned.
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(len - 1).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// Ask the CPU to start loading the cache line holding the start of `*value` (a hint:
/// nothing is read, so `value` may be one a pointer chase will reach later).
#[inline]
pub fn prefetch_obj<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: as in `prefetch`: a hint on the address of a live reference.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_every_instruction_the_cpu_has() {
        let buf = vec![7u8; 256];
        let best = FlushInstr::detect();
        let mut usable = vec![FlushInstr::Fence];
        if matches!(best, FlushInstr::Clwb | FlushInstr::ClflushOpt | FlushInstr::Clflush) {
            usable.push(FlushInstr::Clflush);
        }
        if matches!(best, FlushInstr::Clwb | FlushInstr::ClflushOpt) {
            usable.push(FlushInstr::ClflushOpt);
        }
        if best == FlushInstr::Clwb {
            usable.push(FlushInstr::Clwb);
        }
        for instr in usable {
            for off in (0..256).step_by(64) {
                // SAFETY: `buf` is live and `off` is inside it.
                unsafe { flush_line(instr, buf.as_ptr().add(off)) };
            }
            sfence();
        }
        assert!(buf.iter().all(|&b| b == 7), "flushing must not change memory");
    }
}
