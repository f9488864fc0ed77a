//! Host memory accounting: a counting global allocator with a resettable high-water mark.
//!
//! Memory the heap does not serve, the page-locked buffers CUDA copies through
//! ([`crate::ops::transfer`]), is counted with it by [`external_grew`] and [`external_shrank`],
//! so a trial's host peak is all the memory it pins or allocates.
//!
//! The binary installs [`CountingAlloc`] as its global allocator. Trials reset the peak before a
//! trial and read it after, which measures the trial's real heap use (tensors on the CPU device,
//! host copies for checkpoints, optimizer state in host memory) to the byte.
//!
//! A budget is enforced softly: an allocation that takes the heap over the limit still succeeds
//! (failing it would abort the process, since Rust cannot recover from allocation failure) but
//! raises a flag that the prober checks after each step and turns into an out-of-memory outcome.
//! The overshoot is therefore bounded by one step's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static EXCEEDED: AtomicBool = AtomicBool::new(false);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes.
pub struct CountingAlloc;

#[allow(unsafe_code)]
// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counters
// are only bookkeeping and never influence the returned memory.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System`'s shares.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`: the caller's contract is `System`'s.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, i.e. from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator, i.e. from `System`, with `layout`; the caller
        // upholds `realloc`'s contract on `new_size`.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        new
    }
}

/// Counts `bytes` allocated outside the heap (page-locked memory) as live.
pub fn external_grew(bytes: usize) {
    count(bytes);
}

/// Counts `bytes` allocated outside the heap as freed.
pub fn external_shrank(bytes: usize) {
    CURRENT.fetch_sub(bytes, Ordering::Relaxed);
}

fn grew(bytes: usize) {
    ACTIVE.store(true, Ordering::Relaxed);
    count(bytes);
}

fn count(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
    if now > LIMIT.load(Ordering::Relaxed) {
        EXCEEDED.store(true, Ordering::Relaxed);
    }
}

/// Whether the counting allocator is installed (some allocation has been counted).
pub fn is_counting() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Live heap bytes now.
pub fn current_bytes() -> u64 {
    CURRENT.load(Ordering::Relaxed) as u64
}

/// Heap high-water mark since the last [`reset_peak`].
pub fn peak_bytes() -> u64 {
    PEAK.load(Ordering::Relaxed) as u64
}

/// Starts a new high-water mark at the current live bytes and clears the exceeded flag.
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    EXCEEDED.store(false, Ordering::Relaxed);
}

/// Sets (or with `None` clears) the soft heap limit in bytes.
pub fn set_soft_limit(limit: Option<u64>) {
    let limit = limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
    LIMIT.store(limit, Ordering::Relaxed);
    EXCEEDED.store(false, Ordering::Relaxed);
}

/// Whether the heap went over the soft limit since it was set or the peak was reset.
pub fn limit_exceeded() -> bool {
    EXCEEDED.load(Ordering::Relaxed)
}
