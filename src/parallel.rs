//! Elementwise work spread over the host's cores: buffers cut into one chunk per thread, each
//! chunk on its own scoped thread. Chunks smaller than `MIN_CHUNK` elements are not worth a
//! thread, so small buffers run on the calling thread.

/// Fewest elements per thread: below this, spawning costs more than the work.
const MIN_CHUNK: usize = 1 << 16;

/// Threads to spread a pass over: every core the process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Chunk length for `len` elements over `threads` threads.
pub fn chunk_len(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1)).max(MIN_CHUNK)
}

/// Runs `f` on every item, one scoped thread per item except the last, which runs here.
pub fn run_parallel<I, F>(items: I, f: F)
where
    I: Iterator,
    I::Item: Send,
    F: Fn(I::Item) + Sync,
{
    let f = &f;
    std::thread::scope(|scope| {
        let mut pending = None;
        for item in items {
            if let Some(previous) = pending.replace(item) {
                scope.spawn(move || f(previous));
            }
        }
        if let Some(last) = pending {
            f(last);
        }
    });
}

/// `len` zeros whose pages are mapped now, by `threads` threads at once. A zeroed allocation
/// is only reserved until first written, and the first pass that writes it then faults its
/// pages in one by one: the first offloaded Adam pass over fresh moments ran at a tenth of
/// its later speed.
pub fn touched_zeros(len: usize, threads: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; len];
    let chunk = chunk_len(len, threads);
    // `black_box`: a zero written into zeroed memory may otherwise be optimised away.
    run_parallel(v.chunks_mut(chunk), |c| c.fill(std::hint::black_box(0.0)));
    v
}

/// Copies `src` into `dst` (of the same length) with `threads` threads.
pub fn copy_parallel(dst: &mut [f32], src: &[f32], threads: usize) {
    assert_eq!(dst.len(), src.len(), "copy lengths");
    let chunk = chunk_len(dst.len(), threads);
    run_parallel(dst.chunks_mut(chunk).zip(src.chunks(chunk)), |(d, s)| {
        d.copy_from_slice(s)
    });
}
